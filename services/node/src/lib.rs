//! What every retrychain service shares, whatever its role.
//!
//! # Layout
//!
//! - [`domain`]: `IdempotencyKey`, `AccountId`, `AmountCents` — parsed, never re-checked.
//! - [`metadata`]: the contract's metadata keys, [`RetryMode`], W3C [`TraceContext`].
//! - [`stats`]: [`Counters`], which are also the retry loops' observer.
//! - [`metrics`]: the same counters (and a few gauges) as Prometheus metrics on the admin
//!   port's `/metrics`.
//! - [`faults`]: [`FaultSwitch`], the fault knobs on a service's downstream call.
//! - [`control`]: the `Control` gRPC service over a [`Node`].
//! - [`limits`]: what a port facing untrusted clients bounds below gRPC: connections,
//!   silent connections, metadata size.
//! - [`rpc`]: [`RpcScope`], the first and last thing every Payments handler does.
//! - [`server`]: [`serve`], the one server stack all five services run, on a public and
//!   an admin port.
//! - [`telemetry`]: log set-up.

use std::{sync::Arc, time::Duration};

use resilience::{RetryObserver, Throttle};
use retrychain_proto::v1::Stats;

pub mod control;
pub mod domain;
pub mod faults;
pub mod limits;
pub mod metadata;
pub mod metrics;
pub mod rpc;
pub mod server;
pub mod stats;
pub mod telemetry;

pub use domain::{AccountId, AmountCents, IdempotencyKey, InvalidInput};
pub use faults::FaultSwitch;
pub use metadata::{RetryMode, TraceContext};
pub use rpc::RpcScope;
pub use server::{
    DRAIN_GRACE, Listeners, READY_PREFIX, ReadyAddrs, ServeError, default_admin_addr, serve,
    shutdown_signal,
};
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
    /// The longest deadline honoured; a longer incoming `grpc-timeout` is cut to this.
    pub max_deadline: Duration,
    /// Whether an incoming `x-retry-mode` is honoured (and passed on). Off by default on
    /// every service: every-layer retries multiply load, so no caller may switch them on
    /// unless the operator allowed it — at the edge and at every service behind it, since a
    /// caller who reaches hop2 directly must not bypass the edge's gate.
    pub allow_retry_mode_override: bool,
    /// This service's retry throttle, when its retries are limited by one.
    pub budget: Option<Arc<dyn Throttle>>,
    /// The ledger's database gauges for `/metrics`, once it has connected.
    pub database: std::sync::OnceLock<Arc<dyn metrics::DatabaseGauges>>,
    /// Bounds on the public port's connections.
    pub connection_limits: limits::ConnectionLimits,
}

/// How a [`Node`] is set up; the rest of its state starts empty.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// See [`Node::name`].
    pub name: String,
    /// See [`Node::fault_injection`].
    pub fault_injection: bool,
    /// See [`Node::default_deadline`].
    pub default_deadline: Duration,
    /// See [`Node::max_deadline`].
    pub max_deadline: Duration,
    /// See [`Node::allow_retry_mode_override`].
    pub allow_retry_mode_override: bool,
    /// See [`Node::budget`].
    pub budget: Option<Arc<dyn Throttle>>,
    /// See [`Node::connection_limits`].
    pub connection_limits: limits::ConnectionLimits,
}

impl Node {
    /// A node with zeroed counters and no faults.
    pub fn new(config: NodeConfig) -> Self {
        Self {
            name: config.name,
            counters: Counters::default(),
            faults: FaultSwitch::default(),
            fault_injection: config.fault_injection,
            default_deadline: config.default_deadline,
            max_deadline: config.max_deadline,
            allow_retry_mode_override: config.allow_retry_mode_override,
            budget: config.budget,
            database: std::sync::OnceLock::new(),
            connection_limits: config.connection_limits,
        }
    }

    /// The request's `x-retry-mode` if this node honours it: `None` when absent or not
    /// allowed (then the header is also not passed on); INVALID_ARGUMENT when malformed.
    pub fn requested_retry_mode(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Option<RetryMode>, tonic::Status> {
        if self.allow_retry_mode_override {
            metadata::retry_mode(metadata)
        } else {
            Ok(None)
        }
    }

    /// The counters as `Control.GetStats` returns them.
    pub fn stats(&self) -> Stats {
        self.counters.snapshot(&self.name, self.budget.as_ref())
    }

    /// The headers of a request that its handler's downstream calls carry on
    /// (`resilience::propagate`): the idempotency key, and `x-retry-mode` only where the
    /// override is allowed — a service without it neither reads nor passes it on.
    pub fn carried_headers(&self) -> Vec<http::HeaderName> {
        let mut names = vec![http::HeaderName::from_static(metadata::IDEMPOTENCY_KEY)];
        if self.allow_retry_mode_override {
            names.push(http::HeaderName::from_static(metadata::RETRY_MODE));
        }
        names
    }
}

/// A node observes its downstream calls into its counters and its log, so a client stack
/// can report to it (`Arc<Node>` as the retry layer's observer): each retry and each
/// refused attempt is a line in the request's span.
impl RetryObserver for Node {
    fn attempt(&self, path: &str, attempt: &resilience::AttemptInfo) {
        RetryObserver::attempt(&self.counters, path, attempt);
        if attempt.previous > 0 {
            tracing::info!(
                attempt = attempt.previous + 1,
                retry_of = ?attempt.retry_of,
                timeout_ms = attempt.timeout.map(|t| t.as_millis() as u64),
                "retrying"
            );
        }
    }

    fn refused(&self, path: &str, reason: resilience::Refusal) {
        RetryObserver::refused(&self.counters, path, reason);
        tracing::info!(reason = reason.as_str(), "downstream attempt refused");
    }

    fn call_finished(&self, path: &str, attempts: u32) {
        RetryObserver::call_finished(&self.counters, path, attempts);
    }
}
