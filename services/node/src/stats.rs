//! What a service counts: the `Control.GetStats` counters and the Prometheus metrics, from
//! one set of atomics so the two always agree.
//!
//! Prometheus counters must only go up (a reset would break `rate()`), while `ResetStats`
//! zeroes the Stats counters for a measurement. So each [`Count`] keeps its total, which
//! `/metrics` exports, and a baseline taken at the last reset; Stats shows total − baseline.
//! Since process start, with no reset, they are equal.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
};
use resilience::{AttemptInfo, Refusal, RetryObserver, Throttle};
use retrychain_proto::v1::Stats;

/// A monotonic count with a resettable baseline; see the module docs.
#[derive(Debug, Default)]
pub struct Count {
    /// Since the process started.
    total: AtomicU64,
    /// `total` at the last `ResetStats`.
    baseline: AtomicU64,
}

impl Count {
    /// Adds one.
    pub fn inc(&self) {
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    /// Since the process started (what Prometheus sees).
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Since the last reset (what Stats shows).
    pub fn since_reset(&self) -> u64 {
        self.total()
            .saturating_sub(self.baseline.load(Ordering::Relaxed))
    }

    fn reset(&self) {
        self.baseline.store(self.total(), Ordering::Relaxed);
    }
}

/// Labels of a finished Payments call.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CallLabels {
    /// `Charge` or `GetAccount`.
    pub method: &'static str,
    /// The gRPC code name answered, `OK` included.
    pub code: &'static str,
}

/// Labels of a latency observation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct MethodLabels {
    /// `Charge` or `GetAccount`.
    pub method: &'static str,
}

/// Labels of a retry: the code of the failure that caused it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReasonLabels {
    /// E.g. `UNAVAILABLE`.
    pub reason: &'static str,
}

/// One service's counters. Relaxed atomics: each is independent and read only for
/// reporting, so no ordering between them is promised or needed.
#[derive(Debug)]
pub struct Counters {
    /// Payments calls that reached this service.
    pub requests_received: Count,
    /// Calls made downstream (ledger: processor calls).
    pub downstream_attempts: Count,
    /// How many of those were retries.
    pub retries: Count,
    /// Retries the budget refused.
    pub budget_denied: Count,
    /// Attempts not made because the deadline left no room.
    pub deadline_denied: Count,
    /// Ledger: charges committed.
    pub executions: Count,
    /// Ledger: saved replies returned for a repeated key.
    pub replays: Count,
    /// The deadline last received, in ms.
    pub last_incoming_timeout_ms: AtomicU64,
    /// The deadline last sent downstream, in ms.
    pub last_outgoing_timeout_ms: AtomicU64,
    /// Finished Payments calls by method and code (Prometheus only).
    pub calls: Family<CallLabels, Counter>,
    /// Payments call latency by method, in seconds (Prometheus only).
    pub latency: Family<MethodLabels, Histogram, fn() -> Histogram>,
    /// Retries by the code that caused them; they sum to `retries`.
    pub retry_reasons: Family<ReasonLabels, Counter>,
    /// Attempts per downstream call, 1 to 5+ (Prometheus only).
    pub attempts_per_call: Histogram,
    /// How long each call refused as overloaded took to answer, in seconds (Prometheus
    /// only).
    pub shed_seconds: Histogram,
    /// Ledger: processor calls refused because their key came with other parameters.
    pub processor_conflicts: Count,
}

/// Latency buckets from 1 ms to 30 s: a hop answers in about a millisecond, a retried
/// charge in tens of milliseconds, a deadline in seconds.
fn latency_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ])
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            requests_received: Count::default(),
            downstream_attempts: Count::default(),
            retries: Count::default(),
            budget_denied: Count::default(),
            deadline_denied: Count::default(),
            executions: Count::default(),
            replays: Count::default(),
            last_incoming_timeout_ms: AtomicU64::default(),
            last_outgoing_timeout_ms: AtomicU64::default(),
            calls: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            retry_reasons: Family::default(),
            // gRFC A96 counts attempts per call in buckets 1..5.
            attempts_per_call: Histogram::new([1.0, 2.0, 3.0, 4.0, 5.0]),
            // A refusal is answered in microseconds; the goal is under 5 ms.
            shed_seconds: Histogram::new([
                0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 1.0,
            ]),
            processor_conflicts: Count::default(),
        }
    }
}

impl Counters {
    /// Adds one to a count.
    pub fn bump(count: &Count) {
        count.inc();
    }

    /// The counters as the wire message, with the budget's tokens now.
    pub fn snapshot(&self, service: &str, budget: Option<&Arc<dyn Throttle>>) -> Stats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            service: service.to_owned(),
            requests_received: self.requests_received.since_reset(),
            downstream_attempts: self.downstream_attempts.since_reset(),
            retries: self.retries.since_reset(),
            budget_denied: self.budget_denied.since_reset(),
            deadline_denied: self.deadline_denied.since_reset(),
            budget_tokens: budget.map_or(0.0, |b| b.tokens()),
            executions: self.executions.since_reset(),
            replays: self.replays.since_reset(),
            last_incoming_timeout_ms: get(&self.last_incoming_timeout_ms),
            last_outgoing_timeout_ms: get(&self.last_outgoing_timeout_ms),
            processor_conflicts: self.processor_conflicts.since_reset(),
            ..Stats::default()
        }
    }

    /// Zeroes every Stats counter (the Prometheus totals go on).
    pub fn reset(&self) {
        for count in [
            &self.requests_received,
            &self.downstream_attempts,
            &self.retries,
            &self.budget_denied,
            &self.deadline_denied,
            &self.executions,
            &self.replays,
            &self.processor_conflicts,
        ] {
            count.reset();
        }
        self.last_incoming_timeout_ms.store(0, Ordering::Relaxed);
        self.last_outgoing_timeout_ms.store(0, Ordering::Relaxed);
    }

    /// Records a finished Payments call.
    pub fn call_finished(&self, method: &'static str, code: tonic::Code, seconds: f64) {
        self.calls
            .get_or_create(&CallLabels {
                method,
                code: resilience::wire::code_name(code),
            })
            .inc();
        self.latency
            .get_or_create(&MethodLabels { method })
            .observe(seconds);
    }
}

/// What the retry loops report (the hops' layer, the ledger's executor), counted.
impl RetryObserver for Counters {
    fn attempt(&self, _path: &str, attempt: &AttemptInfo) {
        self.downstream_attempts.inc();
        if attempt.previous > 0 {
            self.retries.inc();
            let reason = attempt
                .retry_of
                .map_or("UNKNOWN", resilience::wire::code_name);
            self.retry_reasons
                .get_or_create(&ReasonLabels { reason })
                .inc();
        }
        if let Some(timeout) = attempt.timeout {
            self.last_outgoing_timeout_ms
                .store(timeout.as_millis() as u64, Ordering::Relaxed);
        }
    }

    fn refused(&self, _path: &str, reason: Refusal) {
        match reason {
            Refusal::Throttle => self.budget_denied.inc(),
            Refusal::Deadline => self.deadline_denied.inc(),
            Refusal::Pushback => {}
        }
    }

    fn call_finished(&self, _path: &str, attempts: u32) {
        if attempts > 0 {
            self.attempts_per_call.observe(f64::from(attempts));
        }
    }
}

/// What the ledger's database reports to `/metrics`; the node knows nothing of Postgres.
pub trait DatabaseGauges: std::fmt::Debug + Send + Sync {
    /// Pooled connections running a statement or transaction.
    fn connections_in_use(&self) -> u64;
    /// Pooled connections idle.
    fn connections_idle(&self) -> u64;
    /// Requests waiting for a connection now.
    fn acquires_waiting(&self) -> u64;
    /// Requests that waited for another request with their key, since start.
    fn key_waits_total(&self) -> u64;
    /// How long each database round trip of a request took (the ledger's own clock), for
    /// choosing the round-trip bound from what a healthy database does.
    fn round_trip_seconds(&self) -> Histogram;
    /// Charges taken over from an owner whose lease passed and resumed, and times an owner
    /// found its key taken over (phase 2 refused, or a renewal that found it taken), since
    /// start.
    fn takeovers(&self) -> (u64, u64);
}

/// The buckets of the database round-trip histogram, in seconds: 100 µs to 5 s.
pub fn round_trip_buckets() -> impl Iterator<Item = f64> {
    [
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        5.0,
    ]
    .into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_restart_from_zero_while_totals_go_on() {
        let counters = Counters::default();
        counters.requests_received.inc();
        counters.requests_received.inc();
        counters.reset();
        counters.requests_received.inc();
        assert_eq!(counters.requests_received.since_reset(), 1);
        assert_eq!(counters.requests_received.total(), 3);
        assert_eq!(counters.snapshot("edge", None).requests_received, 1);
    }
}
