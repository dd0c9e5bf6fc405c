//! What [`Phases`](crate::Phases) asks of the place keys are kept: one method per atomic
//! phase or look, each its own transaction. [`crate::postgres::PgKeys`] is one, for any
//! service whose reply is bytes; a service whose effect is better written as one statement
//! (the retrychain ledger: the balance, the charge row and the reply in one `WITH`)
//! implements it over its own tables.

use std::{future::Future, time::Duration};

use tokio::time::Instant;
use uuid::Uuid;

use crate::decide::Record;

/// Which key: the caller's scope (an account, a customer, a tenant) and the client's key
/// within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId<'a> {
    /// The scope keys are unique in.
    pub scope: &'a str,
    /// The client's idempotency key.
    pub key: &'a str,
}

/// Phase 1, and every later look at a key by a request: claim it if it is new, take it
/// over if its lease passed (and the fingerprint matches), else return it as it is.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a, F> {
    /// Which key.
    pub id: KeyId<'a>,
    /// Who asks. A persistence refuses a key that belongs to another caller (or a whole
    /// scope, where scopes have owners) by returning no record: one caller can neither
    /// claim another's key nor be replayed its reply.
    pub caller: &'a str,
    /// The request's fingerprint, bound to the key by the claim that inserts it.
    pub fingerprint: &'a F,
    /// This request's name on the lease.
    pub owner: Uuid,
    /// How long the lease lasts unless renewed.
    pub lease: Duration,
    /// The key the work is to call its downstream under, saved with a fresh claim.
    pub step_key: &'a str,
    /// When the caller stops waiting.
    pub deadline: Instant,
}

/// A look at a key another request runs, writing nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Look {
    /// Gone (purged, or deleted by hand): claim it again.
    Gone,
    /// Settled: claim again to be replayed its outcome.
    Settled,
    /// Still started: `expired` once its lease passed (claim again to take it over).
    Started {
        /// Whether its lease passed.
        expired: bool,
    },
}

impl Look {
    /// Whether a waiting request should claim again.
    pub fn changed(self) -> bool {
        !matches!(self, Look::Started { expired: false })
    }
}

/// Which abandoned keys the completer takes over, and under what lease.
#[derive(Debug, Clone, Copy)]
pub struct TakeOver {
    /// The completer's name on the leases it takes.
    pub owner: Uuid,
    /// The lease it takes them under.
    pub lease: Duration,
    /// A key whose owner vanished holding it is due this long after its lease passed.
    pub abandoned_after: Duration,
    /// A key its owner released after a transient failure (the caller was answered, and
    /// may retry) is due this long after, doubled for every earlier take-over (at most 2⁸
    /// times): a downstream outage gets a trickle of calls from the completer, not a storm.
    pub released_after: Duration,
    /// At most this many.
    pub batch: i64,
}

/// A key the completer took over: what it needs to redo the work.
#[derive(Debug, Clone)]
pub struct Abandoned<F> {
    /// The scope.
    pub scope: String,
    /// The key.
    pub key: String,
    /// The first request's fingerprint.
    pub fingerprint: F,
    /// The step key saved with the claim.
    pub step_key: Option<String>,
}

/// How a persistence's error is to be treated by the phases.
pub trait Failure: std::fmt::Display + std::fmt::Debug {
    /// Whether trying the same statement again soon may succeed (the database restarting,
    /// failing over, busy). Phase 2 is tried again, briefly, on such an error: the work
    /// was done, and is to be recorded now rather than resumed later.
    fn is_transient(&self) -> bool;

    /// The status to fail the key with, for good, when recording the effect failed because
    /// of the request itself (an overflowing balance, a constraint the effect broke).
    fn fails_key(&self) -> Option<tonic::Status> {
        None
    }
}

/// A key's record as a persistence returns it.
pub type KeyRecord<P> = Record<<P as Persistence>::Fingerprint, <P as Persistence>::Reply>;

/// Where keys are kept. Each method is one atomic phase or look, and commits on its own;
/// none is called with another open.
///
/// Every write after the claim is guarded by the lease: it changes the key only while
/// `owner` still holds it, and says so (`None` or `false` otherwise), so a frozen owner
/// that wakes after its key was taken over writes nothing.
pub trait Persistence: Sync {
    /// What binds a key to its request (the amount of a charge, the encoded request).
    type Fingerprint: Clone + PartialEq + Send + Sync;
    /// The saved reply.
    type Reply: Send;
    /// What the work hands phase 2 to record with the reply.
    type Effect: Send + Sync;
    /// Why a statement failed.
    type Error: Failure + Send;

    /// Phase 1, or a later look at the key: see [`Claim`]. `None` when the scope is not the
    /// caller's.
    fn claim(
        &self,
        claim: Claim<'_, Self::Fingerprint>,
    ) -> impl Future<Output = Result<Option<KeyRecord<Self>>, Self::Error>> + Send;

    /// Phase 2: the effect and the reply recorded together, while `owner` holds the key;
    /// `None` when it no longer does (nothing written).
    fn finish(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        effect: &Self::Effect,
        deadline: Instant,
    ) -> impl Future<Output = Result<Option<Self::Reply>, Self::Error>> + Send;

    /// Phase 2 when the work was refused for good: the error saved, while `owner` holds the
    /// key; `false` when it no longer does.
    fn fail(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        error: &tonic::Status,
        deadline: Instant,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// The owner's lease goes on for `lease`; `false` when the key was taken from it.
    fn renew(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        lease: Duration,
        deadline: Instant,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// After a transient failure the caller is told of: the lease ends now and has no
    /// owner, so the caller's retry resumes at once, and the completer knows the caller was
    /// answered ([`TakeOver::released_after`]).
    fn release(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        deadline: Instant,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// A look at a key another request runs.
    fn look(
        &self,
        id: KeyId<'_>,
        deadline: Instant,
    ) -> impl Future<Output = Result<Look, Self::Error>> + Send;

    /// The completer's step: keys nobody came back for, oldest first, taken over.
    fn take_over(
        &self,
        take: TakeOver,
        deadline: Instant,
    ) -> impl Future<Output = Result<Vec<Abandoned<Self::Fingerprint>>, Self::Error>> + Send;
}
