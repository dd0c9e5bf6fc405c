//! The counters a service exposes through `Control.GetStats`.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use resilience::{Attempt, RetryBudget, RetryObserver};
use retrychain_proto::v1::Stats;

/// One service's counters. Relaxed atomics: each counter is independent and read only for
/// reporting, so no ordering between them is promised or needed.
#[derive(Debug, Default)]
pub struct Counters {
    /// Payments calls that reached this service.
    pub requests_received: AtomicU64,
    /// Calls made downstream (ledger: processor calls).
    pub downstream_attempts: AtomicU64,
    /// How many of those were retries.
    pub retries: AtomicU64,
    /// Retries the budget refused.
    pub budget_denied: AtomicU64,
    /// Attempts not made because the deadline left no room.
    pub deadline_denied: AtomicU64,
    /// Ledger: charges committed.
    pub executions: AtomicU64,
    /// Ledger: saved replies returned for a repeated key.
    pub replays: AtomicU64,
    /// The deadline last received, in ms.
    pub last_incoming_timeout_ms: AtomicU64,
    /// The deadline last sent downstream, in ms.
    pub last_outgoing_timeout_ms: AtomicU64,
}

impl Counters {
    /// Adds one to a counter.
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters as the wire message, with the budget's tokens now.
    pub fn snapshot(&self, service: &str, budget: Option<&Arc<RetryBudget>>) -> Stats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            service: service.to_owned(),
            requests_received: get(&self.requests_received),
            downstream_attempts: get(&self.downstream_attempts),
            retries: get(&self.retries),
            budget_denied: get(&self.budget_denied),
            deadline_denied: get(&self.deadline_denied),
            budget_tokens: budget.map_or(0.0, |b| b.tokens()),
            executions: get(&self.executions),
            replays: get(&self.replays),
            last_incoming_timeout_ms: get(&self.last_incoming_timeout_ms),
            last_outgoing_timeout_ms: get(&self.last_outgoing_timeout_ms),
        }
    }

    /// Zeroes every counter.
    pub fn reset(&self) {
        for counter in [
            &self.requests_received,
            &self.downstream_attempts,
            &self.retries,
            &self.budget_denied,
            &self.deadline_denied,
            &self.executions,
            &self.replays,
            &self.last_incoming_timeout_ms,
            &self.last_outgoing_timeout_ms,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
    }
}

/// The retry executor reports straight into the counters.
impl RetryObserver for Counters {
    fn attempt_started(&self, attempt: &Attempt) {
        Self::bump(&self.downstream_attempts);
        if attempt.is_retry() {
            Self::bump(&self.retries);
        }
        self.last_outgoing_timeout_ms
            .store(attempt.timeout.as_millis() as u64, Ordering::Relaxed);
    }

    fn budget_denied(&self) {
        Self::bump(&self.budget_denied);
    }

    fn deadline_denied(&self) {
        Self::bump(&self.deadline_denied);
    }
}
