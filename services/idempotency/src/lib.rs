//! Idempotency keys in atomic phases, for a tonic service's unary methods.
//!
//! A retried call must not do its work twice. A client sends a key with each call (the
//! same key with every retry of it); this crate makes the service run the call once per
//! key and replay the first outcome to every retry:
//!
//! 1. **Claim** ([`Persistence::claim`]): the key is inserted, bound to the request's
//!    fingerprint and its caller's scope, as *started* under a short lease — one statement,
//!    committed on its own. A retry with another request under the key is refused in every
//!    state ([`Error::Reused`]).
//! 2. **The work** ([`Step`]): whatever the call does outside the database (a payment
//!    processor, another service), with no transaction open and no connection held, under
//!    a step key saved with the claim — so that a resumed key repeats the same downstream
//!    call, which the downstream deduplicates. The lease is renewed meanwhile.
//! 3. **Record** ([`Persistence::finish`]): the effect and the reply, together, only while
//!    the lease is still this request's. Or, if the work was refused for good, the error
//!    ([`Persistence::fail`]), replayed to every retry; if it failed for now, the lease is
//!    released so the retry resumes at once.
//!
//! A request that finds its key running waits for it, holding no connection, and replays
//! its outcome (or takes the key over once its owner's lease passes: a crash, a freeze);
//! [`Phases::complete_abandoned`] finishes the keys nobody came back for. The decision at
//! the heart of it, [`judge`], is a pure function, tested by a table of every state a key
//! can be in against every request that can find it.
//!
//! The phases are Brandur Leach's "atomic phases and recovery points"; the in-progress
//! expiry and payload validation are as in AWS Lambda Powertools' idempotency utility.
//!
//! Where keys are kept is a [`Persistence`]: [`postgres::PgKeys`] keeps them in a table of
//! their own with the reply as bytes, running the service's own effect inside phase 2's
//! transaction; a service may implement the trait over its own tables instead (the
//! retrychain ledger writes its balance, its charge row and the reply in one statement).

mod decide;
mod key_locks;
mod persistence;
mod phases;
pub mod postgres;

pub use decide::{Outcome, Record, Refusal, SavedError, State, Verdict, judge, refused_for_good};
pub use key_locks::{KeyLocks, KeyTurn};
pub use persistence::{Abandoned, Claim, Failure, KeyId, KeyRecord, Look, Persistence, TakeOver};
pub use phases::{Error, InFlight, Phases, Policy, Request, Step};
