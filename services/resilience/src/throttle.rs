//! Whether retrying is still worth it: two token buckets behind one trait.
//!
//! - [`RetryBudget`] (this crate's, as in Finagle and linkerd): each first attempt refunds a
//!   fraction of a token and each retry costs one, so retries settle at `refund` per
//!   request in an outage.
//! - [`A6Throttle`] (gRFC A6's `retryThrottling`, what grpc-go, grpc-java and gRPC core
//!   do): every failed attempt costs a token, every success earns `token_ratio`, and
//!   retries are allowed only while more than half the tokens are left.
//!
//! Both retry loops speak only [`Throttle`]; a service config's `retryThrottling` picks
//! the second, the command line's `--budget-*` flags the first.

use std::sync::Mutex;

use crate::budget::RetryBudget;

/// A limit on retries shared by every call of a channel or process.
pub trait Throttle: std::fmt::Debug + Send + Sync {
    /// A call's first attempt is starting.
    fn first_attempt(&self) {}
    /// An attempt failed with a code the policy retries.
    fn attempt_failed(&self) {}
    /// An attempt succeeded.
    fn attempt_succeeded(&self) {}
    /// Whether a retry may start now (taking its cost, where retries cost).
    fn try_retry(&self) -> bool;
    /// Tokens now, for Stats and metrics.
    fn tokens(&self) -> f64;
}

impl Throttle for RetryBudget {
    fn first_attempt(&self) {
        self.deposit_first_attempt();
    }

    fn try_retry(&self) -> bool {
        self.try_withdraw()
    }

    fn tokens(&self) -> f64 {
        RetryBudget::tokens(self)
    }
}

/// tower's retry middleware can use the same budget: a deposit per request, a withdrawal
/// per retry.
impl tower::retry::budget::Budget for RetryBudget {
    fn deposit(&self) {
        self.deposit_first_attempt();
    }

    fn withdraw(&self) -> bool {
        self.try_withdraw()
    }
}

/// gRFC A6's retry throttling; see the module docs.
#[derive(Debug)]
pub struct A6Throttle {
    /// The bucket's size; it starts full.
    max_tokens: f64,
    /// Tokens a success adds back.
    token_ratio: f64,
    /// Tokens now.
    tokens: Mutex<f64>,
}

impl A6Throttle {
    /// A full bucket of `max_tokens` that gains `token_ratio` per success.
    pub fn new(max_tokens: f64, token_ratio: f64) -> Self {
        Self {
            max_tokens,
            token_ratio,
            tokens: Mutex::new(max_tokens),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, f64> {
        self.tokens
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Throttle for A6Throttle {
    fn attempt_failed(&self) {
        let mut tokens = self.lock();
        *tokens = (*tokens - 1.0).max(0.0);
    }

    fn attempt_succeeded(&self) {
        let mut tokens = self.lock();
        *tokens = (*tokens + self.token_ratio).min(self.max_tokens);
    }

    fn try_retry(&self) -> bool {
        *self.lock() > self.max_tokens / 2.0
    }

    fn tokens(&self) -> f64 {
        *self.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a6_throttle_arithmetic_and_the_half_full_threshold() {
        // gRFC A6's example: maxTokens 10, tokenRatio 0.1.
        let throttle = A6Throttle::new(10.0, 0.1);
        assert!(throttle.try_retry(), "starts full");
        for _ in 0..5 {
            throttle.attempt_failed();
        }
        assert_eq!(throttle.tokens(), 5.0);
        assert!(
            !throttle.try_retry(),
            "retries only above half: 5 is not above 5"
        );
        throttle.attempt_succeeded();
        assert!((throttle.tokens() - 5.1).abs() < 1e-9);
        let before = throttle.tokens();
        assert!(throttle.try_retry());
        assert_eq!(throttle.tokens(), before, "the check itself costs nothing");
        for _ in 0..20 {
            throttle.attempt_failed();
        }
        assert_eq!(throttle.tokens(), 0.0, "never below zero");
        for _ in 0..200 {
            throttle.attempt_succeeded();
        }
        assert_eq!(throttle.tokens(), 10.0, "never above the maximum");
    }

    #[test]
    fn the_budget_is_a_throttle_and_a_tower_budget() {
        use tower::retry::budget::Budget;
        let budget = RetryBudget::new(1.0, 0.5);
        assert!(Throttle::try_retry(&budget));
        assert!(!Budget::withdraw(&budget), "one token, spent");
        Budget::deposit(&budget);
        Throttle::first_attempt(&budget);
        assert!(Throttle::try_retry(&budget), "two refunds make a retry");
        budget.attempt_failed(); // costs nothing: retries pay, failures do not
        assert_eq!(Throttle::tokens(&budget), 0.0);
    }
}
