//! Deadlines: the arithmetic that hands each downstream call a strictly shorter deadline
//! than the one received. On the wire a deadline is a relative timeout
//! ([`wire`](crate::wire) reads and writes it); inside a process it is an instant.
//!
//! A deadline is kept as an absolute [`Instant`] (tokio's, so tests can pause time) because
//! it is spent by everything that happens under it — queueing, backoff sleeps, earlier
//! attempts — and a duration would have to be re-derived after each of those.

use std::{fmt, time::Duration};

use tokio::time::Instant;

/// The point in time by which a call must be answered.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline {
    /// When the call's time runs out.
    at: Instant,
}

impl fmt::Debug for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Deadline(in {:?})", self.remaining())
    }
}

/// The absolute deadline of an outgoing call, put in its request's extensions by a layer
/// above the retry engine ([`PropagateDeadlineLayer`](crate::PropagateDeadlineLayer)): an
/// instant, so that time spent before the engine (waiting for the channel, say) still
/// counts. The engine writes each attempt's timeout from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallDeadline(pub Instant);

/// An attempt cut short by its per-attempt timeout (Envoy's `per_try_timeout`, the retry
/// layer's or its method config's `retrychainPerTryTimeout`): put on the attempt's request
/// by the retry engine, which wrote this as its `grpc-timeout` because it ends before the
/// call's own time left does. A balancer below keeps the timer for it and tells its expiry
/// as this attempt's failure (UNAVAILABLE, retried at another replica), never as the
/// call's deadline; nothing else reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerAttemptTimeout(pub Duration);

/// There is too little time left to start another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("deadline leaves no room: {remaining:?} left, an attempt needs more than {needed:?}")]
pub struct NoRoom {
    /// Time left on the deadline when the attempt was considered.
    pub remaining: Duration,
    /// Margin plus the shortest attempt worth starting.
    pub needed: Duration,
}

impl Deadline {
    /// A deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Self {
        Self {
            at: Instant::now() + timeout,
        }
    }

    /// A deadline at a given instant.
    pub fn at(at: Instant) -> Self {
        Self { at }
    }

    /// The instant the deadline falls on.
    pub fn instant(&self) -> Instant {
        self.at
    }

    /// Time left; zero once spent.
    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// Whether the deadline has passed.
    pub fn is_spent(&self) -> bool {
        Instant::now() >= self.at
    }

    /// This deadline brought `by` earlier: the point a service stops working to, so that it
    /// can still answer before its caller's own deadline fires.
    pub fn earlier_by(&self, by: Duration) -> Self {
        Self {
            at: self.at.checked_sub(by).unwrap_or(self.at),
        }
    }

    /// The timeout to hand a downstream call: what remains minus `margin`, so it is strictly
    /// shorter than what this service has and the inner call fails first, while this service
    /// can still react. [`NoRoom`] when that would be shorter than `min_attempt`.
    pub fn downstream_timeout(
        &self,
        margin: Duration,
        min_attempt: Duration,
    ) -> Result<Duration, NoRoom> {
        let remaining = self.remaining();
        let needed = margin + min_attempt;
        match remaining.checked_sub(margin) {
            Some(timeout) if timeout >= min_attempt && !timeout.is_zero() => Ok(timeout),
            _ => Err(NoRoom { remaining, needed }),
        }
    }

    /// Whether `wait` can be slept and an attempt still started after it, by the same rule
    /// as [`Deadline::downstream_timeout`].
    pub fn has_room_after(&self, wait: Duration, margin: Duration, min_attempt: Duration) -> bool {
        self.remaining()
            .checked_sub(wait)
            .and_then(|left| left.checked_sub(margin))
            .is_some_and(|timeout| timeout >= min_attempt && !timeout.is_zero())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn downstream_timeout_is_strictly_shorter_or_no_room() {
        let deadline = Deadline::after(Duration::from_millis(100));
        let margin = Duration::from_millis(10);
        let min = Duration::from_millis(5);
        assert_eq!(
            deadline.downstream_timeout(margin, min),
            Ok(Duration::from_millis(90))
        );
        tokio::time::advance(Duration::from_millis(86)).await;
        assert!(deadline.downstream_timeout(margin, min).is_err());
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(deadline.is_spent());
        assert_eq!(deadline.remaining(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn room_after_a_wait_accounts_for_margin_and_minimum() {
        let deadline = Deadline::after(Duration::from_millis(100));
        let margin = Duration::from_millis(10);
        let min = Duration::from_millis(5);
        assert!(deadline.has_room_after(Duration::from_millis(85), margin, min));
        assert!(!deadline.has_room_after(Duration::from_millis(86), margin, min));
    }
}
