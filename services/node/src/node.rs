//! [`Node`]: what one service shares between its Payments handler, its Control service,
//! its client stack and its metrics. A module of its own (not the crate root), so that the
//! modules that use it and the ones it uses form no loop.

use std::{sync::Arc, time::Duration};

use resilience::{AdmissionSettings, ConcurrencyLimit, RetryObserver, ServiceConfig, Throttle};
use retrychain_proto::v1::Stats;

use retrychain_domain::metadata::{self, RetryMode};

use crate::{
    faults::FaultSwitch,
    limits,
    stats::{Counters, DatabaseGauges},
};

/// The state one service shares between its Payments handler and its Control service.
#[derive(Debug)]
pub struct Node {
    /// edge, hop2, hop3, hop4 or ledger: in logs and `Stats.service`.
    pub name: String,
    /// The counters `GetStats` reports.
    pub counters: Counters,
    /// The faults in force on the downstream call (shared with the fault layer).
    pub faults: Arc<FaultSwitch>,
    /// Whether `SetFaults` is allowed (a demo setting; production leaves it off).
    pub fault_injection: bool,
    /// The deadline applied to requests that carry none.
    pub default_deadline: Duration,
    /// The longest deadline honoured; a longer incoming timeout is cut to this.
    pub max_deadline: Duration,
    /// Whether an incoming `x-retry-mode` is honoured (and passed on). Off by default on
    /// every service: every-layer retries multiply load, so no caller may switch them on
    /// unless the operator allowed it — at the edge and at every service behind it, since a
    /// caller who reaches hop2 directly must not bypass the edge's gate.
    pub allow_retry_mode_override: bool,
    /// This service's retry throttle, when its retries are limited by one.
    pub budget: Option<Arc<dyn Throttle>>,
    /// How this service's calls are retried or hedged, per method: the service config from
    /// `--service-config`, or built from the flags, parsed once and shared by every layer.
    pub policy: Arc<ServiceConfig>,
    /// The ledger's database gauges for `/metrics` (its store, connected before the node
    /// is built); `None` elsewhere.
    pub database: Option<Arc<dyn DatabaseGauges>>,
    /// A hop's replicas below, for their per-endpoint calls, failures and ejections in
    /// `/metrics` (its balancer, started before the node is built); `None` at the ledger.
    pub downstream: Option<resilience::Balancer>,
    /// Bounds on the public port's connections.
    pub connection_limits: limits::ConnectionLimits,
    /// Admission of Payments calls (`resilience::admission`): by deadline at the edge, by
    /// the memory bound behind it.
    pub admission: Arc<ConcurrencyLimit>,
    /// The public port's TLS and who may call; `None`: plaintext.
    pub tls: Option<crate::authz::ServerTls>,
    /// The edge's callers: who each call is from, and each one's limit
    /// ([`crate::callers`]); `None` below the edge, where the caller is the edge's word
    /// (`x-caller`).
    pub callers: Option<Arc<crate::callers::Callers>>,
    /// Whether this service signs its calls' callers or checks the statement that names
    /// them ([`crate::statement`]).
    pub statements: Statements,
    /// The limit's refusals (first attempts, retries) at the last `ResetStats`.
    shed_baseline: std::sync::Mutex<(u64, u64)>,
}

/// How a [`Node`] is set up, with everything it holds already made: a node is complete
/// when it is built, and nothing is filled in later. The rest of its state (counters,
/// faults, the admission limit) starts empty.
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
    /// See [`Node::policy`].
    pub policy: Arc<ServiceConfig>,
    /// See [`Node::connection_limits`].
    pub connection_limits: limits::ConnectionLimits,
    /// How [`Node::admission`] moves.
    pub admission: AdmissionSettings,
    /// See [`Node::tls`].
    pub tls: Option<crate::authz::ServerTls>,
    /// See [`Node::callers`].
    pub callers: Option<crate::callers::CallersSettings>,
    /// See [`Node::statements`].
    pub statements: Statements,
    /// See [`Node::database`].
    pub database: Option<Arc<dyn DatabaseGauges>>,
    /// See [`Node::downstream`].
    pub downstream: Option<resilience::Balancer>,
}

/// What a service does with the signed statement of each call's caller
/// ([`crate::statement`]). Both need the service's TLS ([`Node::tls`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Statements {
    /// Neither signs nor checks one: a relay passes it on, a plaintext chain has none (and
    /// the ledger believes `x-caller`).
    Off,
    /// The edge: signs each call's caller with its identity key.
    Sign,
    /// The ledger: takes each call's caller only from a statement this identity signed.
    Check(retrychain_tls::Identity),
}

impl Node {
    /// A node with zeroed counters and no faults.
    pub fn new(config: NodeConfig) -> Self {
        let counters = Counters::default();
        Self {
            name: config.name,
            faults: Arc::default(),
            fault_injection: config.fault_injection,
            default_deadline: config.default_deadline,
            max_deadline: config.max_deadline,
            allow_retry_mode_override: config.allow_retry_mode_override,
            budget: config.budget,
            policy: config.policy,
            database: config.database,
            downstream: config.downstream,
            connection_limits: config.connection_limits,
            admission: Arc::new(ConcurrencyLimit::new(config.admission).observing_refusals({
                let shed_seconds = counters.shed_seconds.clone();
                move |took| shed_seconds.observe(took.as_secs_f64())
            })),
            counters,
            tls: config.tls,
            callers: config
                .callers
                .map(|settings| Arc::new(crate::callers::Callers::new(settings))),
            statements: config.statements,
            shed_baseline: std::sync::Mutex::new((0, 0)),
        }
    }

    /// At the edge ([`Statements::Sign`]), signs the statement that `caller` makes `call`
    /// into `metadata`, valid for the call's `timeout`; elsewhere does nothing.
    pub fn state_caller(
        &self,
        caller: &retrychain_domain::Caller,
        call: &crate::statement::Call<'_>,
        timeout: std::time::Duration,
        metadata: &mut tonic::metadata::MetadataMap,
    ) -> Result<(), tonic::Status> {
        match (&self.statements, &self.tls) {
            (Statements::Sign, Some(server)) => {
                let expires = std::time::SystemTime::now() + timeout;
                crate::statement::sign(&server.tls, caller, call, expires, metadata)
            }
            _ => Ok(()),
        }
    }

    /// The caller of `call`: at the ledger ([`Statements::Check`]) from the statement the
    /// edge signed, else from `x-caller` (see [`retrychain_domain::metadata::caller`]).
    pub fn caller_of(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        call: &crate::statement::Call<'_>,
    ) -> Result<retrychain_domain::Caller, tonic::Status> {
        match (&self.statements, &self.tls) {
            (Statements::Check(signer), Some(server)) => crate::statement::verify(
                &server.tls,
                signer,
                metadata,
                call,
                std::time::SystemTime::now(),
            ),
            (Statements::Check(_), None) => Err(tonic::Status::internal(
                "this service checks caller statements but has no TLS material to check them with",
            )),
            _ => metadata::caller(metadata),
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
        let mut stats = self.counters.snapshot(&self.name, self.budget.as_ref());
        let (first, retries) = self.admission.shed();
        let (first_then, retries_then) =
            *self.shed_baseline.lock().unwrap_or_else(|p| p.into_inner());
        let retries = retries.saturating_sub(retries_then);
        stats.shed = first.saturating_sub(first_then) + retries;
        stats.shed_retries = retries;
        stats.concurrency_limit = self.admission.limit() as u64;
        if let Some(db) = &self.database {
            (stats.resumed, stats.stale_owner_refusals) = db.takeovers();
        }
        stats.in_flight = self.admission.in_flight() as u64;
        stats
    }

    /// Zeroes the Stats counters (`Control.ResetStats`); the Prometheus totals go on, and
    /// the retry budget and the concurrency limit are protection, not statistics.
    pub fn reset_stats(&self) {
        self.counters.reset();
        *self.shed_baseline.lock().unwrap_or_else(|p| p.into_inner()) = self.admission.shed();
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
