//! The values a retrychain request carries, parsed once where they enter a service and
//! never checked again: a value of these types is valid by construction. Apart from the
//! server stack (`retrychain-node`), so that what only needs the values — the ledger's key
//! store, the test harness, the load generators — does not depend on how a service serves.
//!
//! - [`values`]: [`IdempotencyKey`], [`AccountId`], [`AmountCents`], [`Caller`].
//! - [`metadata`]: the contract's metadata read from and written to a request:
//!   [`RetryMode`], W3C [`TraceContext`], the key and the caller.

pub mod metadata;
pub mod values;

pub use metadata::{RetryMode, TraceContext};
pub use values::{AccountId, AmountCents, Caller, IdempotencyKey, InvalidCaller, InvalidInput};
