//! The ledger: the bottom of the chain, where "exactly once" is made true.
//!
//! # Layout
//!
//! - [`store`]: [`KeyStore`] — a charge in atomic phases (the key claimed, the processor
//!   called with nothing held, the effect and the reply recorded), the key's state machine,
//!   resuming, the completer, replays, retention purges.
//! - [`pool`]: the store's connections — nothing sent when one is taken or given back,
//!   checked only while suspect, closed whenever their state is in doubt.
//! - [`primary`]: which host of a replicated Postgres accepts writes, followed across a
//!   failover (libpq's multi-host `DATABASE_URL`).
//! - [`key_locks`]: same-key requests queue in memory, not on a database connection.
//! - [`processor`]: the simulated payment processor whose calls are the bottom calls; it
//!   deduplicates by processor key, as a provider does.
//! - [`service`]: [`Ledger`], the `Payments` service, and the mapping of store errors to
//!   statuses.

pub mod key_locks;
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
