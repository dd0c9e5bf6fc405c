//! Whether sending is still worth it: three throttles behind one trait.
//!
//! - [`RetryBudget`] (this crate's, as in Finagle and linkerd): each first attempt refunds a
//!   fraction of a token and each retry costs one, so retries settle at `refund` per
//!   request in an outage.
//! - [`A6Throttle`] (gRFC A6's `retryThrottling`, what grpc-go, grpc-java and gRPC core
//!   do): every failed attempt costs a token, every success earns `token_ratio`, and
//!   retries are allowed only while more than half the tokens are left.
//! - [`AdaptiveThrottle`] (Google SRE's client-side throttling): over a sliding window,
//!   every attempt is rejected locally — first attempts too — with probability
//!   `max(0, (requests − K·accepts) / (requests + 1))`. The other two only stop retries;
//!   this one also sheds new calls while the service below accepts too few of them.
//!
//! The retry engine speaks only [`Throttle`]; a service config's `retryThrottling` or
//! `adaptiveThrottling` picks one, else the command line's flags do.

use std::{sync::Mutex, time::Duration};

use rand::{RngExt, rngs::SmallRng};
use tokio::time::Instant;
use tonic::Code;

use crate::budget::RetryBudget;

/// A limit on retries shared by every call of a channel or process.
pub trait Throttle: std::fmt::Debug + Send + Sync {
    /// A call is starting: whether its first attempt may be sent. Only adaptive
    /// throttling says no (the call then fails locally, UNAVAILABLE); a budget takes its
    /// refund here.
    fn first_attempt(&self) -> bool {
        true
    }
    /// An attempt failed with a code the policy retries.
    fn attempt_failed(&self) {}
    /// An attempt failed with `code`, which the policy does not retry: the server
    /// answered, perhaps with an answer of the application's (adaptive throttling counts
    /// that as accepted).
    fn attempt_answered(&self, _code: Code) {}
    /// An attempt succeeded.
    fn attempt_succeeded(&self) {}
    /// Whether a retry may start now (taking its cost, where retries cost).
    fn try_retry(&self) -> bool;
    /// Tokens now, for Stats and metrics: for adaptive throttling, the requests that may
    /// still be sent before rejections start (`K·accepts − requests`, at least 0).
    fn tokens(&self) -> f64;
    /// The probability that an attempt is rejected locally now (adaptive throttling;
    /// 0 for the others, which refuse by tokens, not by chance).
    fn reject_probability(&self) -> f64 {
        0.0
    }
}

impl Throttle for RetryBudget {
    fn first_attempt(&self) -> bool {
        self.deposit_first_attempt();
        true
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

/// Google SRE's adaptive client-side throttling; see the module docs.
///
/// `requests` counts every attempt the caller wanted to send in the window, those
/// rejected locally included (so that rejection keeps its own pressure on), each when its
/// fate is known — an attempt still in flight is not yet a request, so that a burst of
/// calls into an empty window is not rejected before any could be accepted; `accepts`
/// the attempts the server accepted: successes, and failures the policy does not retry
/// unless they are the overload codes (UNAVAILABLE, RESOURCE_EXHAUSTED,
/// DEADLINE_EXCEEDED, INTERNAL, UNKNOWN, DATA_LOSS, CANCELLED). With the server failing
/// everything, what it receives stays near `K·accepts` plus the window's first few
/// draws; as it recovers, each accepted attempt widens the way for the next.
pub struct AdaptiveThrottle {
    /// How many requests per accept are tolerated before rejecting (the book's K, 2).
    k: f64,
    /// One bucket's span: the window over [`BUCKETS`].
    bucket: Duration,
    state: Mutex<Window>,
    /// Where the time comes from: the runtime's clock, or a simulation's.
    clock: Clock,
}

/// A source of the time now, for a throttle driven by simulated time.
pub type Clock = std::sync::Arc<dyn Fn() -> Instant + Send + Sync>;

impl std::fmt::Debug for AdaptiveThrottle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveThrottle")
            .field("k", &self.k)
            .field("bucket", &self.bucket)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// The window's buckets: it slides by one bucket at a time.
const BUCKETS: usize = 10;

/// The default multiplier: "K = 2" in Google's SRE book.
pub const ADAPTIVE_K: f64 = 2.0;

/// The default window. The book keeps two minutes of history; at the request rates of
/// this chain a shorter one lets the throttle open again sooner after an outage ends
/// (the time to recover grows with the window: `retrychain sim` shows it).
pub const ADAPTIVE_WINDOW: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Window {
    /// Requests and accepts per bucket.
    counts: [(u64, u64); BUCKETS],
    /// The bucket now being filled.
    current: usize,
    /// When it started.
    started: Instant,
    /// The draws.
    rng: SmallRng,
}

impl Window {
    /// Slides the window to `now`, emptying the buckets it leaves behind.
    fn advance(&mut self, now: Instant, bucket: Duration) {
        let elapsed = now.saturating_duration_since(self.started);
        let steps = (elapsed.as_nanos() / bucket.as_nanos().max(1)) as u64;
        if steps == 0 {
            return;
        }
        for step in 1..=steps.min(BUCKETS as u64) {
            self.counts[(self.current + step as usize) % BUCKETS] = (0, 0);
        }
        self.current = (self.current + (steps % BUCKETS as u64) as usize) % BUCKETS;
        self.started += bucket * steps.min(u64::from(u32::MAX)) as u32;
    }

    fn totals(&self) -> (f64, f64) {
        let (requests, accepts) = self
            .counts
            .iter()
            .fold((0, 0), |(r, a), (br, ba)| (r + br, a + ba));
        (requests as f64, accepts as f64)
    }
}

impl AdaptiveThrottle {
    /// Rejects with probability `(requests − k·accepts) / (requests + 1)` over the last
    /// `window`. `k` below 1 would reject even a healthy server's calls; it is raised to 1.
    pub fn new(k: f64, window: Duration) -> Self {
        Self::with_clock(k, window, std::sync::Arc::new(Instant::now))
    }

    /// The same, its window slid by `clock` (`retrychain sim` runs it on simulated time).
    pub fn with_clock(k: f64, window: Duration, clock: Clock) -> Self {
        let window = window.max(Duration::from_millis(BUCKETS as u64));
        Self {
            k: if k.is_finite() {
                k.max(1.0)
            } else {
                ADAPTIVE_K
            },
            bucket: window / BUCKETS as u32,
            state: Mutex::new(Window {
                counts: [(0, 0); BUCKETS],
                current: 0,
                started: clock(),
                rng: rand::make_rng(),
            }),
            clock,
        }
    }

    /// Makes its draws from `seed`: a simulation gives the same figures every run.
    pub fn seed(self, seed: u64) -> Self {
        use rand::SeedableRng;
        self.state.lock().unwrap_or_else(|p| p.into_inner()).rng = SmallRng::seed_from_u64(seed);
        self
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        let mut window = self.state.lock().unwrap_or_else(|p| p.into_inner());
        window.advance((self.clock)(), self.bucket);
        window
    }

    fn probability(&self, window: &Window) -> f64 {
        let (requests, accepts) = window.totals();
        ((requests - self.k * accepts) / (requests + 1.0)).max(0.0)
    }

    /// One attempt wants to go: drawn against; counted as a request when rejected here,
    /// else when its answer comes ([`Self::ended`]).
    fn admit(&self) -> bool {
        let mut window = self.window();
        let p = self.probability(&window);
        if p == 0.0 || window.rng.random::<f64>() >= p {
            return true;
        }
        let current = window.current;
        window.counts[current].0 += 1;
        false
    }

    /// An attempt's answer came: a request, and an accept if `accepted`.
    fn ended(&self, accepted: bool) {
        let mut window = self.window();
        let current = window.current;
        window.counts[current].0 += 1;
        window.counts[current].1 += u64::from(accepted);
    }
}

/// Failures that say the server did not accept the call (overloaded, broken, gone).
fn is_overload(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::ResourceExhausted
            | Code::DeadlineExceeded
            | Code::Internal
            | Code::Unknown
            | Code::DataLoss
            | Code::Cancelled
    )
}

impl Throttle for AdaptiveThrottle {
    fn first_attempt(&self) -> bool {
        self.admit()
    }

    fn attempt_failed(&self) {
        self.ended(false);
    }

    fn attempt_answered(&self, code: Code) {
        self.ended(!is_overload(code));
    }

    fn attempt_succeeded(&self) {
        self.ended(true);
    }

    fn try_retry(&self) -> bool {
        self.admit()
    }

    fn tokens(&self) -> f64 {
        let (requests, accepts) = self.window().totals();
        (self.k * accepts - requests).max(0.0)
    }

    fn reject_probability(&self) -> f64 {
        let window = self.window();
        self.probability(&window)
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

    #[tokio::test(start_paused = true)]
    async fn adaptive_throttle_sheds_what_the_server_does_not_accept() {
        let throttle = AdaptiveThrottle::new(ADAPTIVE_K, Duration::from_secs(10));
        assert!(throttle.first_attempt(), "an empty window rejects nothing");
        // A healthy server: every attempt accepted, nothing rejected.
        for _ in 0..1000 {
            assert!(throttle.first_attempt());
            throttle.attempt_succeeded();
        }
        assert_eq!(throttle.reject_probability(), 0.0);
        // Application errors are accepts too.
        throttle.attempt_answered(Code::InvalidArgument);
        // A total outage, 11 s later (the healthy window has slid out): what gets through
        // stays near the first few draws, far below the requests.
        tokio::time::advance(Duration::from_secs(11)).await;
        let mut sent = 0;
        for _ in 0..5000 {
            if throttle.first_attempt() {
                sent += 1;
                throttle.attempt_failed();
            }
        }
        assert!(sent <= 30, "{sent} of 5000 got through a total outage");
        assert!(throttle.reject_probability() > 0.99);
        assert_eq!(throttle.tokens(), 0.0);
        // The window slides: 11 s without requests forgets the outage.
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(throttle.reject_probability(), 0.0);
        assert!(throttle.first_attempt());
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_throttle_rejects_nothing_while_k_accepts_cover_the_requests() {
        // 60% of the attempts accepted: K·accepts (1.2 per request) covers the requests.
        let throttle = AdaptiveThrottle::new(2.0, Duration::from_secs(10));
        let mut rejected = 0;
        for i in 0..2000 {
            if throttle.first_attempt() {
                if i % 5 < 3 {
                    throttle.attempt_succeeded();
                } else {
                    throttle.attempt_failed();
                }
            } else {
                rejected += 1;
            }
        }
        assert!(rejected <= 2, "{rejected} rejected at a 60% accept rate");
        // With K = 1 the same server loses calls to the throttle once accepts lag.
        let strict = AdaptiveThrottle::new(1.0, Duration::from_secs(10));
        let mut rejected = 0;
        for i in 0..2000 {
            if strict.first_attempt() {
                if i % 5 < 3 {
                    strict.attempt_succeeded();
                } else {
                    strict.attempt_failed();
                }
            } else {
                rejected += 1;
            }
        }
        assert!(rejected > 100, "K = 1 rejected only {rejected}");
    }
}
