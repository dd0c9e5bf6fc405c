//! The ledger: the bottom of the chain, where "exactly once" is made true.
//!
//! # Layout
//!
//! - [`store`]: [`KeyStore`] — where the ledger keeps its keys, charges and balances: the
//!   `idempotency` library's persistence for a charge (its statements, one per atomic
//!   phase), the connections' bounds and classification, retention purges. The protocol
//!   itself (claim, the processor call with nothing held, the effect and the reply
//!   recorded; waiting, resuming, the completer) is the library's.
//! - [`pool`]: the store's connections — nothing sent when one is taken or given back,
//!   checked only while suspect, closed whenever their state is in doubt.
//! - [`primary`]: which host of a replicated Postgres accepts writes, followed across a
//!   failover (libpq's multi-host `DATABASE_URL`).
//! - [`processor`]: the simulated payment processor whose calls are the bottom calls; it
//!   deduplicates by processor key, as a provider does.
//! - [`service`]: [`Ledger`], the `Payments` service, and the mapping of store errors to
//!   statuses.

pub mod database;
mod migrations;
pub mod pool;
pub mod primary;
pub mod processor;
pub mod service;
pub mod store;

pub use service::{Ledger, run_completer, run_retention};
pub use store::{
    ChargeOutcome, InFlight, KeyStore, KeyedCharge, PHASE_TWO_PATIENCE, ProcessorCharge,
    SavedReply, StoreError, StoreOptions,
};
