//! The retry executor: one logical call, several attempts, under a policy — for calls that
//! are not gRPC requests through a tower stack (the ledger's in-process processor, the
//! simulations). gRPC clients use [`RetryLayer`](crate::RetryLayer); both loops make the
//! same decision after a failure ([`crate::rules`]).
//!
//! [`Retry::run`] takes a closure that makes one attempt, given its [`Attempt`]: its number,
//! the time it may take (the deadline less the margin, so it fails while the caller can
//! still react) and the failure it retries.

use std::{
    future::Future,
    sync::{Arc, Mutex},
    time::Duration,
};

use rand::{SeedableRng, rngs::SmallRng};
use tonic::{Code, Status, metadata::MetadataValue};
use tracing::Instrument;

use crate::{
    backoff::Backoff,
    classify::{RETRYABLE, pushback, transport_failure_as_unavailable},
    deadline::{Deadline, format_grpc_timeout},
    observe::{AttemptInfo, Refusal, RetryObserver},
    rules::{Next, Retrying, StopReason},
    throttle::Throttle,
};

/// Request metadata that tells the server how many attempts preceded this one (gRFC A6).
pub const PREVIOUS_ATTEMPTS_HEADER: &str = "grpc-previous-rpc-attempts";

/// The standard gRPC deadline header.
pub const TIMEOUT_HEADER: &str = "grpc-timeout";

/// How one call may be retried.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Attempts in all, the first included; 1 means never retry.
    pub max_attempts: u32,
    /// The wait between attempts when the server gave no pushback.
    pub backoff: Backoff,
    /// The token bucket retries draw on; `None` limits retries by `max_attempts` alone.
    pub budget: Option<Arc<dyn Throttle>>,
    /// The codes worth another attempt; `None`: the contract's set ([`crate::is_retryable`]). A
    /// service config's `retryableStatusCodes` sets it, and then exactly those are retried.
    pub retryable: Option<Vec<Code>>,
    /// Taken off the remaining time for each attempt's deadline, so the attempt fails while
    /// this caller still has time to react.
    pub margin: Duration,
    /// The shortest attempt worth starting; with less room the call stops.
    pub min_attempt: Duration,
}

impl RetryPolicy {
    /// A policy that tries exactly once (the ledger's processor in `edge-only` mode).
    pub fn single_attempt(backoff: Backoff, margin: Duration, min_attempt: Duration) -> Self {
        Self {
            max_attempts: 1,
            backoff,
            budget: None,
            retryable: None,
            margin,
            min_attempt,
        }
    }
}

/// One attempt of a call.
#[derive(Debug, Clone, Copy)]
pub struct Attempt {
    /// 1 for the first attempt, 2 for the first retry, …
    pub number: u32,
    /// The time this attempt may take: hand it downstream as `grpc-timeout`.
    pub timeout: Duration,
    /// On a retry: the code of the failure that caused it (why this attempt is made).
    pub retry_of: Option<Code>,
}

impl Attempt {
    /// Attempts made before this one.
    pub fn previous_attempts(&self) -> u32 {
        self.number - 1
    }

    /// Whether this attempt is a retry.
    pub fn is_retry(&self) -> bool {
        self.number > 1
    }

    /// Writes this attempt's `grpc-timeout` and, on a retry, `grpc-previous-rpc-attempts`.
    pub fn apply<T>(&self, request: &mut tonic::Request<T>) {
        let metadata = request.metadata_mut();
        if let Ok(value) = format_grpc_timeout(self.timeout).parse() {
            metadata.insert(TIMEOUT_HEADER, value);
        }
        if self.is_retry() {
            metadata.insert(
                PREVIOUS_ATTEMPTS_HEADER,
                MetadataValue::from(self.previous_attempts()),
            );
        } else {
            metadata.remove(PREVIOUS_ATTEMPTS_HEADER);
        }
    }
}

/// Runs calls under a [`RetryPolicy`]. One per downstream, shared by all requests.
#[derive(Debug)]
pub struct Retry {
    /// The rules.
    policy: RetryPolicy,
    /// Jitter source; a mutex so one executor serves concurrent calls, held only to draw.
    rng: Mutex<SmallRng>,
    /// Who retries (a service name), for the message of a call that gave up: in a chain
    /// where several layers retry, each layer's note says which layer it was.
    label: String,
}

impl Retry {
    /// An executor with jitter seeded from the operating system.
    pub fn new(policy: RetryPolicy) -> Self {
        Self::with_rng(policy, rand::make_rng())
    }

    /// An executor with a fixed seed, so tests see the same waits every run.
    pub fn with_seed(policy: RetryPolicy, seed: u64) -> Self {
        Self::with_rng(policy, SmallRng::seed_from_u64(seed))
    }

    fn with_rng(policy: RetryPolicy, rng: SmallRng) -> Self {
        Self {
            policy,
            rng: Mutex::new(rng),
            label: String::new(),
        }
    }

    /// Names who retries in the messages of calls that gave up.
    pub fn with_label(mut self, label: impl Into<String>) -> Self {
        self.label = label.into();
        self
    }

    /// The policy this executor applies.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Makes attempts with `call` until one succeeds or the policy says stop, never starting
    /// an attempt or sleeping past `deadline`. On failure returns the last attempt's status —
    /// DEADLINE_EXCEEDED when the deadline ended it — and, when retries were allowed, a
    /// message naming the attempts made and why they stopped.
    pub async fn run<T, F, Fut>(
        &self,
        deadline: Deadline,
        observer: &dyn RetryObserver,
        mut call: F,
    ) -> Result<T, Status>
    where
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let policy = &self.policy;
        let mut retrying = Retrying::start(
            policy.max_attempts,
            policy.retryable.as_deref().unwrap_or(&RETRYABLE),
            policy.backoff,
            policy.budget.as_deref(),
        );
        let mut retry_of = None;
        let mut waited = Duration::ZERO;
        let result = loop {
            let timeout = match deadline.downstream_timeout(policy.margin, policy.min_attempt) {
                Ok(timeout) => timeout,
                Err(no_room) => {
                    observer.refused(&self.label, Refusal::Deadline);
                    let status = Status::deadline_exceeded(format!(
                        "no attempt started: {:?} left of the deadline, an attempt needs more than {:?}",
                        no_room.remaining, no_room.needed
                    ));
                    break Err(self.stopped(status, retrying.attempts, StopReason::NoRoom));
                }
            };
            retrying.attempts += 1;
            let number = retrying.attempts;
            let attempt = Attempt {
                number,
                timeout,
                retry_of,
            };
            observer.attempt(
                &self.label,
                &AttemptInfo {
                    previous: number - 1,
                    retry_of,
                    timeout: Some(timeout),
                },
            );
            // The attempt's span: a client span in a trace (OpenTelemetry), the parent of
            // what the call does — it is built inside it.
            let span = tracing::info_span!(
                "attempt",
                otel.kind = "client",
                otel.status_code = tracing::field::Empty,
                attempt = number,
                retry_of = retry_of.map(|code| format!("{code:?}")),
                backoff_ms = waited.as_secs_f64() * 1e3,
                budget_tokens = policy.budget.as_ref().map(|b| b.tokens()),
                timeout_ms = timeout.as_millis() as u64,
                outcome = tracing::field::Empty,
            );
            let future = span.in_scope(|| call(attempt));
            let started = tokio::time::Instant::now();
            let answer = tokio::time::timeout(timeout, future)
                .instrument(span.clone())
                .await;
            let status = match answer {
                Ok(Ok(value)) => {
                    span.record("outcome", "OK");
                    retrying.succeeded();
                    break Ok(value);
                }
                Ok(Err(status)) => status,
                Err(_) => Status::deadline_exceeded(format!(
                    "attempt {number} got no answer within {timeout:?}"
                )),
            };
            let status = transport_failure_as_unavailable(status);
            // tonic's client answers CANCELLED when the grpc-timeout it sent runs out.
            let status = if status.code() == Code::Cancelled && started.elapsed() >= timeout {
                Status::with_metadata(
                    Code::DeadlineExceeded,
                    status.message().to_owned(),
                    status.metadata().clone(),
                )
            } else {
                status
            };
            span.record("outcome", format!("{:?}", status.code()));
            span.record("otel.status_code", "ERROR");

            let room = |wait| deadline.has_room_after(wait, policy.margin, policy.min_attempt);
            match retrying.after_failure(status.code(), pushback(&status), room, &self.rng) {
                Next::RetryAfter(wait) => {
                    tracing::info!(
                        attempt = number,
                        code = ?status.code(),
                        wait_ms = wait.as_secs_f64() * 1e3,
                        remaining_ms = deadline.remaining().as_millis() as u64,
                        "attempt failed, retrying"
                    );
                    tokio::time::sleep(wait).await;
                    retry_of = Some(status.code());
                    waited = wait;
                }
                Next::NoRoom { wait } => {
                    observer.refused(&self.label, Refusal::Deadline);
                    // DEADLINE_EXCEEDED, as the contract asks when the deadline stops the
                    // call; the last failure's code and message stay in the message and its
                    // metadata (a pushback, say) stays on the status.
                    let status = Status::with_metadata(
                        Code::DeadlineExceeded,
                        format!(
                            "last failure {:?}: {}; a retry after {wait:?} would not fit in the {:?} left",
                            status.code(),
                            status.message(),
                            deadline.remaining()
                        ),
                        status.metadata().clone(),
                    );
                    break Err(self.stopped(status, number, StopReason::NoRoom));
                }
                Next::Stop(reason) => {
                    if let Some(refusal) = reason.refusal() {
                        observer.refused(&self.label, refusal);
                    }
                    break Err(self.stopped(status, number, reason));
                }
            }
        };
        observer.call_finished(&self.label, retrying.attempts);
        result
    }

    /// The status to return when retrying stops: the last failure, its message extended by
    /// how many attempts were made and why they stopped (left as it was when nothing was
    /// retried, so a single-attempt relay passes failures through unchanged).
    fn stopped(&self, status: Status, attempts: u32, reason: StopReason) -> Status {
        if !reason.is_the_loops_verdict(attempts, self.policy.max_attempts) {
            return status;
        }
        tracing::info!(attempts, ?reason, code = ?status.code(), "giving up");
        let message = reason.annotate(
            status.message(),
            &self.label,
            attempts,
            self.policy.max_attempts,
        );
        Status::with_metadata(status.code(), message, status.metadata().clone())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use tokio::time::Instant;

    use super::*;
    use crate::{
        backoff::BackoffKind,
        classify::{Pushback, set_pushback},
    };

    #[derive(Default)]
    struct Counts {
        attempts: AtomicU64,
        retries: AtomicU64,
        budget_denied: AtomicU64,
        deadline_denied: AtomicU64,
    }

    impl RetryObserver for Counts {
        fn attempt(&self, _: &str, attempt: &AttemptInfo) {
            self.attempts.fetch_add(1, Ordering::Relaxed);
            if attempt.previous > 0 {
                self.retries.fetch_add(1, Ordering::Relaxed);
            }
        }
        fn refused(&self, _: &str, reason: Refusal) {
            let count = match reason {
                Refusal::Throttle => &self.budget_denied,
                Refusal::Deadline => &self.deadline_denied,
                Refusal::Pushback => return,
            };
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn policy(max_attempts: u32, kind: BackoffKind) -> RetryPolicy {
        RetryPolicy {
            max_attempts,
            backoff: Backoff::new(kind, Duration::from_millis(10), Duration::from_millis(100)),
            budget: None,
            retryable: None,
            margin: Duration::from_millis(5),
            min_attempt: Duration::from_millis(1),
        }
    }

    fn long() -> Deadline {
        Deadline::after(Duration::from_secs(60))
    }

    #[tokio::test(start_paused = true)]
    async fn stops_at_max_attempts_with_the_last_status() {
        let retry = Retry::with_seed(policy(3, BackoffKind::Full), 1);
        let counts = Counts::default();
        let result: Result<(), Status> = retry
            .run(long(), &counts, |_| async {
                Err(Status::unavailable("down"))
            })
            .await;
        let status = result.expect_err("always fails");
        assert_eq!(status.code(), Code::Unavailable);
        assert!(
            status.message().contains("3 attempts"),
            "{}",
            status.message()
        );
        assert!(
            status.message().contains("max attempts"),
            "{}",
            status.message()
        );
        assert_eq!(counts.attempts.load(Ordering::Relaxed), 3);
        assert_eq!(counts.retries.load(Ordering::Relaxed), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn returns_the_first_success() {
        let retry = Retry::with_seed(policy(5, BackoffKind::Full), 1);
        let value = retry
            .run(long(), &(), |attempt| async move {
                if attempt.number < 3 {
                    Err(Status::aborted("conflict"))
                } else {
                    Ok(attempt.number)
                }
            })
            .await;
        assert_eq!(value.expect("third attempt succeeds"), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn stops_when_the_budget_is_empty() {
        let mut p = policy(3, BackoffKind::None);
        p.budget = Some(Arc::new(crate::RetryBudget::new(1.0, 0.0)));
        let retry = Retry::with_seed(p, 1);
        let counts = Counts::default();
        let status = retry
            .run(long(), &counts, |_| async {
                Err::<(), _>(Status::unavailable("down"))
            })
            .await
            .expect_err("fails");
        // One token: the first retry is paid for, the second is refused.
        assert_eq!(counts.attempts.load(Ordering::Relaxed), 2);
        assert_eq!(counts.budget_denied.load(Ordering::Relaxed), 1);
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().contains("budget"), "{}", status.message());
        assert!(
            status.message().contains("2 attempts"),
            "{}",
            status.message()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn never_sleeps_past_the_deadline_nor_starts_without_room() {
        let mut p = policy(100, BackoffKind::Exponential);
        p.backoff = Backoff::new(
            BackoffKind::Exponential,
            Duration::from_millis(20),
            Duration::from_secs(10),
        );
        let retry = Retry::with_seed(p.clone(), 1);
        let counts = Counts::default();
        let start = Instant::now();
        let deadline = Deadline::after(Duration::from_millis(500));
        let starts = Mutex::new(Vec::new());
        let status = retry
            .run(deadline, &counts, |attempt| {
                starts
                    .lock()
                    .expect("lock")
                    .push((start.elapsed(), attempt.timeout));
                async { Err::<(), _>(Status::unavailable("down")) }
            })
            .await
            .expect_err("fails");
        assert_eq!(status.code(), Code::DeadlineExceeded);
        assert!(
            Instant::now() <= deadline.instant(),
            "returned after the deadline"
        );
        let starts = starts.into_inner().expect("lock");
        // Waits 20, 40, 80, 160 ms: attempts at 0, 20, 60, 140, 300; the next wait (320 ms)
        // would end past the deadline, so the executor stops without sleeping it.
        let at: Vec<u64> = starts.iter().map(|(t, _)| t.as_millis() as u64).collect();
        assert_eq!(at, vec![0, 20, 60, 140, 300]);
        for (t, timeout) in starts {
            assert!(t + timeout + p.margin <= Duration::from_millis(500));
            assert!(timeout >= p.min_attempt);
        }
        assert_eq!(counts.deadline_denied.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_spent_deadline_makes_no_attempt() {
        let retry = Retry::with_seed(policy(3, BackoffKind::Full), 1);
        let counts = Counts::default();
        let deadline = Deadline::after(Duration::from_millis(3));
        let status = retry
            .run(deadline, &counts, |_| async { Ok::<_, Status>(()) })
            .await
            .expect_err("no room");
        assert_eq!(status.code(), Code::DeadlineExceeded);
        assert_eq!(counts.attempts.load(Ordering::Relaxed), 0);
        assert_eq!(counts.deadline_denied.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_attempt_ends_at_its_timeout_before_the_deadline() {
        let retry = Retry::with_seed(policy(3, BackoffKind::None), 1);
        let counts = Counts::default();
        let deadline = Deadline::after(Duration::from_millis(1000));
        let status = retry
            .run(deadline, &counts, |_| {
                std::future::pending::<Result<(), Status>>()
            })
            .await
            .expect_err("never answers");
        assert_eq!(status.code(), Code::DeadlineExceeded);
        // The attempt had all but the margin; no retry fits in what is left.
        assert_eq!(deadline.remaining(), Duration::from_millis(5));
        assert_eq!(counts.attempts.load(Ordering::Relaxed), 1);
        assert_eq!(counts.deadline_denied.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempts_deadline_exceeded_is_retried_while_the_call_has_room() {
        let retry = Retry::with_seed(policy(3, BackoffKind::None), 1);
        let value = retry
            .run(long(), &(), |attempt| async move {
                if attempt.number == 1 {
                    Err(Status::deadline_exceeded("inner hop ran out"))
                } else {
                    Ok(attempt.number)
                }
            })
            .await;
        assert_eq!(value.expect("retried"), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn never_retries_final_codes() {
        for code in [
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::NotFound,
            Code::PermissionDenied,
            Code::OutOfRange,
            Code::Internal,
        ] {
            let retry = Retry::with_seed(policy(5, BackoffKind::None), 1);
            let counts = Counts::default();
            let status = retry
                .run(long(), &counts, |_| async move {
                    Err::<(), _>(Status::new(code, "final"))
                })
                .await
                .expect_err("fails");
            assert_eq!(status.code(), code);
            assert_eq!(status.message(), "final", "returned unchanged");
            assert_eq!(counts.attempts.load(Ordering::Relaxed), 1, "{code:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn honours_pushback_exactly_and_stops_on_negative() {
        let retry = Retry::with_seed(policy(2, BackoffKind::Full), 1);
        let start = Instant::now();
        let starts = Mutex::new(Vec::new());
        let _ = retry
            .run(long(), &(), |_| {
                starts.lock().expect("lock").push(start.elapsed());
                async {
                    let mut status = Status::resource_exhausted("busy");
                    set_pushback(&mut status, 200);
                    Err::<(), _>(status)
                }
            })
            .await;
        assert_eq!(
            starts.into_inner().expect("lock"),
            vec![Duration::ZERO, Duration::from_millis(200)]
        );

        let counts = Counts::default();
        let status = retry
            .run(long(), &counts, |_| async {
                let mut status = Status::resource_exhausted("go away");
                set_pushback(&mut status, -1);
                Err::<(), _>(status)
            })
            .await
            .expect_err("fails");
        assert_eq!(counts.attempts.load(Ordering::Relaxed), 1);
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(status.message().contains("pushback"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_pushback_past_the_deadline_ends_in_deadline_exceeded_keeping_the_pushback() {
        let retry = Retry::with_seed(policy(3, BackoffKind::None), 1).with_label("edge");
        let deadline = Deadline::after(Duration::from_secs(1));
        let status = retry
            .run(deadline, &(), |_| async {
                let mut status = Status::resource_exhausted("busy");
                set_pushback(&mut status, 5000);
                Err::<(), _>(status)
            })
            .await
            .expect_err("fails");
        assert_eq!(status.code(), Code::DeadlineExceeded);
        assert!(
            status.message().contains("ResourceExhausted"),
            "{}",
            status.message()
        );
        assert!(
            status.message().contains("[edge: 1 attempt,"),
            "{}",
            status.message()
        );
        assert_eq!(
            pushback(&status),
            Pushback::RetryAfter(Duration::from_secs(5)),
            "the caller still learns to wait"
        );
        assert!(
            deadline.remaining() > Duration::from_millis(900),
            "answered at once"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_final_failure_after_retries_names_the_attempts() {
        let retry = Retry::with_seed(policy(3, BackoffKind::None), 1).with_label("hop2");
        let status = retry
            .run(long(), &(), |attempt| async move {
                Err::<(), _>(if attempt.number == 1 {
                    Status::unavailable("blip")
                } else {
                    Status::failed_precondition("key reused with different parameters")
                })
            })
            .await
            .expect_err("fails");
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert!(
            status
                .message()
                .starts_with("key reused with different parameters")
        );
        assert!(
            status
                .message()
                .contains("[hop2: 2 attempts, not retryable]"),
            "{}",
            status.message()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn sets_previous_attempts_on_retries() {
        let retry = Retry::with_seed(policy(4, BackoffKind::None), 1);
        let seen = Mutex::new(Vec::new());
        let _ = retry
            .run(long(), &(), |attempt| {
                let mut request = tonic::Request::new(());
                attempt.apply(&mut request);
                let header = request
                    .metadata()
                    .get(PREVIOUS_ATTEMPTS_HEADER)
                    .map(|v| v.to_str().expect("ascii").to_owned());
                assert!(request.metadata().get(TIMEOUT_HEADER).is_some());
                seen.lock().expect("lock").push(header);
                async { Err::<(), _>(Status::unavailable("down")) }
            })
            .await;
        assert_eq!(
            seen.into_inner().expect("lock"),
            vec![
                None,
                Some("1".to_owned()),
                Some("2".to_owned()),
                Some("3".to_owned())
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_single_attempt_policy_passes_failures_through() {
        let retry = Retry::with_seed(
            RetryPolicy::single_attempt(
                Backoff::new(BackoffKind::Full, Duration::ZERO, Duration::ZERO),
                Duration::from_millis(5),
                Duration::from_millis(1),
            ),
            1,
        );
        let status = retry
            .run(long(), &(), |_| async {
                Err::<(), _>(Status::unavailable("processor down"))
            })
            .await
            .expect_err("fails");
        assert_eq!(status.message(), "processor down");
    }
}
