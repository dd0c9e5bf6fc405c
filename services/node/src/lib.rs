//! What every retrychain service shares, whatever its role.
//!
//! # Layout
//!
//! - [`domain`]: `IdempotencyKey`, `AccountId`, `AmountCents` — parsed, never re-checked.
//! - [`metadata`]: the contract's metadata keys, [`RetryMode`], W3C [`TraceContext`].
//! - [`stats`]: [`Counters`], which are also the retry executor's observer.
//! - [`faults`]: [`FaultSwitch`], the fault knobs on a service's downstream call.
//! - [`control`]: the `Control` gRPC service over a [`Node`].
//! - [`rpc`]: [`RpcScope`], the first and last thing every Payments handler does.
//! - [`server`]: [`serve`], the one server stack all five services run.
//! - [`telemetry`]: log set-up.

use std::{sync::Arc, time::Duration};

use resilience::RetryBudget;
use retrychain_proto::v1::Stats;

pub mod control;
pub mod domain;
pub mod faults;
pub mod metadata;
pub mod rpc;
pub mod server;
pub mod stats;
pub mod telemetry;

pub use domain::{AccountId, AmountCents, IdempotencyKey, InvalidInput};
pub use faults::FaultSwitch;
pub use metadata::{RetryMode, TraceContext};
pub use rpc::RpcScope;
pub use server::{READY_PREFIX, ServeError, serve};
pub use stats::Counters;

/// The state one service shares between its Payments handler and its Control service.
#[derive(Debug)]
pub struct Node {
    /// edge, hop2, hop3, hop4 or ledger: in logs and `Stats.service`.
    pub name: String,
    /// The counters `GetStats` reports.
    pub counters: Counters,
    /// The faults in force on the downstream call.
    pub faults: FaultSwitch,
    /// Whether `SetFaults` is allowed (a demo setting; production leaves it off).
    pub fault_injection: bool,
    /// The deadline applied to requests that carry none.
    pub default_deadline: Duration,
    /// This service's retry budget, when its retries are budgeted.
    pub budget: Option<Arc<RetryBudget>>,
}

impl Node {
    /// A node with zeroed counters and no faults.
    pub fn new(
        name: impl Into<String>,
        fault_injection: bool,
        default_deadline: Duration,
        budget: Option<Arc<RetryBudget>>,
    ) -> Self {
        Self {
            name: name.into(),
            counters: Counters::default(),
            faults: FaultSwitch::default(),
            fault_injection,
            default_deadline,
            budget,
        }
    }

    /// The counters as `Control.GetStats` returns them.
    pub fn stats(&self) -> Stats {
        self.counters.snapshot(&self.name, self.budget.as_ref())
    }
}
