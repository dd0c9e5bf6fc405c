//! The retry budget: a token bucket that caps how much retrying one process may do.
//!
//! Backoff decides *when* to retry; the budget decides *whether* retrying is still worth it.
//! Every first attempt refunds a fraction of a token and every retry costs a whole one, so
//! in steady failure retries settle at `refund` per first attempt (0.1 → 1.1× load) however
//! many attempts each call is allowed. A bucket is per process, not global: each caller
//! limits itself with no coordination.

use std::sync::Mutex;

/// What one retry costs.
pub const RETRY_COST: f64 = 1.0;

/// A token bucket for retries, shared by all calls a service makes downstream.
#[derive(Debug)]
pub struct RetryBudget {
    /// Most tokens the bucket holds; it starts full.
    capacity: f64,
    /// Tokens each first attempt puts back.
    refund: f64,
    /// Tokens now. A mutex rather than an atomic: the read-modify-write must see one value,
    /// and it is held for a few instructions.
    tokens: Mutex<f64>,
}

impl RetryBudget {
    /// A full bucket of `capacity` tokens that gains `refund` per first attempt.
    pub fn new(capacity: f64, refund: f64) -> Self {
        let capacity = capacity.max(0.0);
        Self {
            capacity,
            refund: refund.max(0.0),
            tokens: Mutex::new(capacity),
        }
    }

    /// Records a first attempt: refunds a fraction of a token, never above capacity.
    pub fn deposit_first_attempt(&self) {
        let mut tokens = self.lock();
        *tokens = (*tokens + self.refund).min(self.capacity);
    }

    /// Takes the cost of one retry if the bucket holds it; `false` means do not retry.
    pub fn try_withdraw(&self) -> bool {
        let mut tokens = self.lock();
        if *tokens < RETRY_COST {
            return false;
        }
        *tokens -= RETRY_COST;
        true
    }

    /// Fills the bucket to capacity, as at start-up (for a fresh measurement).
    pub fn refill(&self) {
        *self.lock() = self.capacity;
    }

    /// Tokens in the bucket now.
    pub fn tokens(&self) -> f64 {
        *self.lock()
    }

    /// The bucket's capacity.
    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    /// The refund per first attempt.
    pub fn refund(&self) -> f64 {
        self.refund
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, f64> {
        // A poisoned bucket still holds a valid f64; keep using it.
        self.tokens
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The design notes' total outage, on this bucket: `first_attempts` calls that all fail,
/// each allowed `max_retries` retries, drawing on `budget` if there is one; the calls the
/// backend receives. Without a budget that is `first_attempts × (1 + max_retries)`; with
/// one, about `first_attempts × (1 + refund)` plus the capacity.
pub fn outage_backend_calls(
    budget: Option<&RetryBudget>,
    first_attempts: u64,
    max_retries: u32,
) -> u64 {
    let mut backend = 0;
    for _ in 0..first_attempts {
        backend += 1;
        if let Some(b) = budget {
            b.deposit_first_attempt();
        }
        for _ in 0..max_retries {
            if let Some(b) = budget
                && !b.try_withdraw()
            {
                break;
            }
            backend += 1;
        }
    }
    backend
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn outage(budget: Option<&RetryBudget>, first_attempts: u64, max_retries: u32) -> u64 {
        outage_backend_calls(budget, first_attempts, max_retries)
    }

    #[test]
    fn outage_arithmetic_matches_the_design_notes() {
        assert_eq!(outage(None, 6000, 3), 24_000);
        let budget = RetryBudget::new(10.0, 0.1);
        assert_eq!(outage(Some(&budget), 6000, 3), 6609);
    }

    #[test]
    fn tokens_never_exceed_capacity() {
        let budget = RetryBudget::new(10.0, 0.1);
        for _ in 0..1000 {
            budget.deposit_first_attempt();
            assert!(budget.tokens() <= 10.0);
        }
        assert_eq!(budget.tokens(), 10.0);
    }

    #[test]
    fn an_empty_bucket_refuses_until_refunded() {
        let budget = RetryBudget::new(2.0, 0.5);
        assert!(budget.try_withdraw());
        assert!(budget.try_withdraw());
        assert!(!budget.try_withdraw());
        budget.deposit_first_attempt();
        assert!(!budget.try_withdraw(), "half a token is not a retry");
        budget.deposit_first_attempt();
        assert!(budget.try_withdraw());
    }

    #[test]
    fn concurrent_withdrawals_never_overdraw() {
        let budget = Arc::new(RetryBudget::new(1000.0, 0.0));
        let granted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let budget = Arc::clone(&budget);
                    scope.spawn(move || (0..500).filter(|_| budget.try_withdraw()).count())
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).sum()
        });
        assert_eq!(granted, 1000);
        assert_eq!(budget.tokens(), 0.0);
    }
}
