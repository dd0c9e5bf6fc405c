//! The retry engine through its in-process face ([`RetryCalls`]) on paused time: the loop
//! every caller shares (a hop's gRPC calls go through the same `engine::retry`; their
//! wire-specific parts are in a6/). Each test is an exact schedule.

#![allow(clippy::unwrap_used, missing_docs)] // tests: a panic is the failure report

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use resilience::{
    AttemptInfo, AttemptRequest, Backoff, BackoffKind, CallRequest, Refusal, RetryBudget,
    RetryCalls, RetryLayer, RetryObserver, ServiceConfig,
    service_config::{CallPolicy, HedgingPolicy, RetryPolicyConfig},
    wire::{self, Pushback},
};
use tokio::time::Instant;
use tonic::{Code, Status};
use tower::{ServiceExt, util::BoxCloneSyncService};

/// What an observer hears.
#[derive(Default)]
struct Counts {
    attempts: AtomicU64,
    retries: AtomicU64,
    budget_denied: AtomicU64,
    deadline_denied: AtomicU64,
    finished: Mutex<Vec<u32>>,
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
    fn call_finished(&self, _: &str, attempts: u32) {
        self.finished.lock().unwrap().push(attempts);
    }
}

impl Counts {
    fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }
}

type Inner = BoxCloneSyncService<AttemptRequest<()>, u32, Status>;

/// A service whose attempt `n` answers `answer(n)`, recording when each attempt started.
fn service(
    answer: impl Fn(u32) -> Result<u32, Status> + Send + Sync + 'static,
) -> (Inner, Arc<Mutex<Vec<Duration>>>) {
    let start = Instant::now();
    let starts = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&starts);
    let answer = Arc::new(answer);
    let inner = BoxCloneSyncService::new(tower::service_fn(move |call: AttemptRequest<()>| {
        seen.lock().unwrap().push(start.elapsed());
        std::future::ready(answer(call.attempt.number))
    }));
    (inner, starts)
}

/// Retry `max_attempts` times on the contract's codes, waiting as `kind` says (10..100 ms).
fn retrying(max_attempts: u32, kind: BackoffKind) -> RetryLayer {
    RetryLayer::new(ServiceConfig::every_method(CallPolicy::Retry(
        RetryPolicyConfig::new(
            max_attempts,
            Backoff::new(kind, Duration::from_millis(10), Duration::from_millis(100)),
            resilience::classify::RETRYABLE.to_vec(),
        ),
    )))
    .seed(1)
}

async fn call(calls: RetryCalls<Inner>, deadline: Option<Duration>) -> Result<u32, Status> {
    calls
        .oneshot(CallRequest {
            request: (),
            deadline: deadline.map(|d| Instant::now() + d),
        })
        .await
}

fn with_counts(layer: RetryLayer, counts: &Arc<Counts>) -> RetryLayer {
    layer.observer(Arc::clone(counts) as _)
}

const LONG: Option<Duration> = Some(Duration::from_secs(60));

#[tokio::test(start_paused = true)]
async fn stops_at_max_attempts_with_the_last_status() {
    let counts = Arc::new(Counts::default());
    let (inner, _) = service(|_| Err(Status::unavailable("down")));
    let layer = with_counts(retrying(3, BackoffKind::Full), &counts).annotate_failures("edge");
    let status = call(layer.calls("/t/M", inner), LONG).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status
            .message()
            .contains("[edge: 3 attempts, max attempts (3) reached]"),
        "{}",
        status.message()
    );
    assert_eq!(counts.attempts(), 3);
    assert_eq!(counts.retries.load(Ordering::Relaxed), 2);
    assert_eq!(*counts.finished.lock().unwrap(), vec![3]);
}

#[tokio::test(start_paused = true)]
async fn returns_the_first_success() {
    let (inner, _) = service(|n| {
        if n < 3 {
            Err(Status::aborted("conflict"))
        } else {
            Ok(n)
        }
    });
    let value = call(retrying(5, BackoffKind::Full).calls("/t/M", inner), LONG).await;
    assert_eq!(value.unwrap(), 3);
}

#[tokio::test(start_paused = true)]
async fn stops_when_the_budget_is_empty() {
    let counts = Arc::new(Counts::default());
    let (inner, _) = service(|_| Err(Status::unavailable("down")));
    let layer = with_counts(retrying(3, BackoffKind::None), &counts)
        .throttle(Arc::new(RetryBudget::new(1.0, 0.0)))
        .annotate_failures("edge");
    let status = call(layer.calls("/t/M", inner), LONG).await.unwrap_err();
    // One token: the first retry is paid for, the second is refused.
    assert_eq!(counts.attempts(), 2);
    assert_eq!(counts.budget_denied.load(Ordering::Relaxed), 1);
    assert!(
        status
            .message()
            .contains("2 attempts, stopped by the retry budget"),
        "{}",
        status.message()
    );
}

#[tokio::test(start_paused = true)]
async fn never_sleeps_past_the_deadline_nor_starts_without_room() {
    let counts = Arc::new(Counts::default());
    let (inner, starts) = service(|_| Err(Status::unavailable("down")));
    let layer = RetryLayer::new(ServiceConfig::every_method(CallPolicy::Retry(
        RetryPolicyConfig::new(
            100,
            Backoff::new(
                BackoffKind::Exponential,
                Duration::from_millis(20),
                Duration::from_secs(10),
            ),
            vec![Code::Unavailable],
        ),
    )))
    .min_attempt(Duration::from_millis(1));
    let layer = with_counts(layer, &counts);
    let deadline = Instant::now() + Duration::from_millis(500);
    let status = call(layer.calls("/t/M", inner), Some(Duration::from_millis(500)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert!(Instant::now() <= deadline, "returned after the deadline");
    // Waits 20, 40, 80, 160 ms: attempts at 0, 20, 60, 140, 300; the next wait (320 ms)
    // would end past the deadline, so the engine stops without sleeping it.
    let at: Vec<u64> = starts
        .lock()
        .unwrap()
        .iter()
        .map(|t| t.as_millis() as u64)
        .collect();
    assert_eq!(at, vec![0, 20, 60, 140, 300]);
    assert_eq!(counts.deadline_denied.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_spent_deadline_makes_no_attempt() {
    let counts = Arc::new(Counts::default());
    let (inner, _) = service(Ok);
    let layer =
        with_counts(retrying(3, BackoffKind::Full), &counts).min_attempt(Duration::from_millis(5));
    let status = call(layer.calls("/t/M", inner), Some(Duration::from_millis(3)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert_eq!(counts.attempts(), 0);
    assert_eq!(counts.deadline_denied.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_hanging_attempt_ends_at_the_deadline() {
    let counts = Arc::new(Counts::default());
    let inner: Inner = BoxCloneSyncService::new(tower::service_fn(|_: AttemptRequest<()>| {
        std::future::pending::<Result<u32, Status>>()
    }));
    let layer = with_counts(
        retrying(3, BackoffKind::None).annotate_failures("edge"),
        &counts,
    );
    let started = Instant::now();
    let status = call(layer.calls("/t/M", inner), Some(Duration::from_secs(1)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert_eq!(counts.attempts(), 1);
    assert!(
        status
            .message()
            .contains("[edge: 1 attempt, the call's deadline passed]"),
        "the deadline, not 'not retryable': {}",
        status.message()
    );
}

/// The server answers DEADLINE_EXCEEDED as the call's own deadline runs out (a code this
/// policy does not retry): the stop is told as the deadline, not as "not retryable".
#[tokio::test(start_paused = true)]
async fn an_attempt_the_server_cut_at_the_calls_deadline_reads_deadline() {
    let inner = slow_service(
        |_| 1000,
        |_| {
            Err(Status::deadline_exceeded(
                "the deadline ran out before an answer",
            ))
        },
    );
    let status = call(
        hedging(3, 2_000, vec![Code::Unavailable]).calls("/t/M", inner),
        Some(Duration::from_secs(1)),
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert!(
        status.message().contains("the call's deadline passed]"),
        "{}",
        status.message()
    );
}

#[tokio::test(start_paused = true)]
async fn an_attempts_deadline_exceeded_is_retried_while_the_call_has_room() {
    let (inner, _) = service(|n| {
        if n == 1 {
            Err(Status::deadline_exceeded("inner hop ran out"))
        } else {
            Ok(n)
        }
    });
    let value = call(retrying(3, BackoffKind::None).calls("/t/M", inner), LONG).await;
    assert_eq!(value.unwrap(), 2);
}

#[tokio::test(start_paused = true)]
async fn never_retries_final_codes_and_returns_them_unchanged() {
    for code in [
        Code::InvalidArgument,
        Code::FailedPrecondition,
        Code::NotFound,
        Code::PermissionDenied,
        Code::OutOfRange,
        Code::Internal,
    ] {
        let counts = Arc::new(Counts::default());
        let (inner, _) = service(move |_| Err(Status::new(code, "final")));
        let layer = with_counts(retrying(5, BackoffKind::None), &counts).annotate_failures("x");
        let status = call(layer.calls("/t/M", inner), LONG).await.unwrap_err();
        assert_eq!(status.code(), code);
        assert_eq!(status.message(), "final", "returned unchanged");
        assert_eq!(counts.attempts(), 1, "{code:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn honours_pushback_exactly_and_stops_on_negative() {
    let (inner, starts) = service(|_| {
        let mut status = Status::resource_exhausted("busy");
        wire::set_pushback(&mut status, 200);
        Err(status)
    });
    let _ = call(retrying(2, BackoffKind::Full).calls("/t/M", inner), LONG).await;
    assert_eq!(
        *starts.lock().unwrap(),
        vec![Duration::ZERO, Duration::from_millis(200)]
    );

    let counts = Arc::new(Counts::default());
    let (inner, _) = service(|_| {
        let mut status = Status::resource_exhausted("go away");
        wire::set_pushback(&mut status, -1);
        Err(status)
    });
    let layer = with_counts(retrying(2, BackoffKind::Full), &counts).annotate_failures("edge");
    let status = call(layer.calls("/t/M", inner), LONG).await.unwrap_err();
    assert_eq!(counts.attempts(), 1);
    assert!(
        status.message().contains("pushback"),
        "{}",
        status.message()
    );
}

#[tokio::test(start_paused = true)]
async fn two_pushback_values_mean_one_attempt() {
    let counts = Arc::new(Counts::default());
    let (inner, _) = service(|_| {
        let mut status = Status::resource_exhausted("busy");
        status
            .metadata_mut()
            .append(wire::PUSHBACK, "10".parse().unwrap());
        status
            .metadata_mut()
            .append(wire::PUSHBACK, "20".parse().unwrap());
        Err(status)
    });
    let layer = with_counts(retrying(5, BackoffKind::None), &counts);
    let status = call(layer.calls("/t/M", inner), LONG).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(counts.attempts(), 1, "grpc-go's rule: two values, no retry");
}

#[tokio::test(start_paused = true)]
async fn a_pushback_past_the_deadline_ends_in_deadline_exceeded_at_the_deadline_keeping_the_pushback()
 {
    let (inner, _) = service(|_| {
        let mut status = Status::resource_exhausted("busy");
        wire::set_pushback(&mut status, 5000);
        Err(status)
    });
    let layer = retrying(3, BackoffKind::None).annotate_failures("edge");
    let started = Instant::now();
    let status = call(layer.calls("/t/M", inner), Some(Duration::from_secs(1)))
        .await
        .unwrap_err();
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
        wire::pushback(&status),
        Pushback::RetryAfter(Duration::from_secs(5)),
        "the caller still learns to wait"
    );
    // As gRPC core and grpc-go end it (they wait for the pushback and meet the deadline):
    // DEADLINE_EXCEEDED only once the deadline has passed, never with time left.
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(1),
        "answered at the deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn a_final_failure_after_retries_names_the_attempts() {
    let (inner, _) = service(|n| {
        Err(if n == 1 {
            Status::unavailable("blip")
        } else {
            Status::failed_precondition("key reused with different parameters")
        })
    });
    let layer = retrying(3, BackoffKind::None).annotate_failures("hop2");
    let status = call(layer.calls("/t/M", inner), LONG).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status
            .message()
            .starts_with("key reused with different parameters"),
        "{}",
        status.message()
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
async fn attempts_are_numbered() {
    let numbers = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&numbers);
    let inner: Inner =
        BoxCloneSyncService::new(tower::service_fn(move |call: AttemptRequest<()>| {
            seen.lock()
                .unwrap()
                .push((call.attempt.previous(), call.attempt.deadline.is_some()));
            std::future::ready(Err::<u32, _>(Status::unavailable("down")))
        }));
    let _ = call(retrying(4, BackoffKind::None).calls("/t/M", inner), LONG).await;
    assert_eq!(
        *numbers.lock().unwrap(),
        vec![(0, true), (1, true), (2, true), (3, true)]
    );
}

#[tokio::test(start_paused = true)]
async fn a_method_without_a_policy_is_tried_once_and_its_failure_passed_through() {
    let counts = Arc::new(Counts::default());
    let (inner, _) = service(|_| Err(Status::unavailable("processor down")));
    // A config for another method only: this one has no policy.
    let config = ServiceConfig::parse(
        r#"{"methodConfig": [{"name": [{"service": "t", "method": "Other"}],
            "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
                            "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
    )
    .unwrap();
    let layer = with_counts(RetryLayer::new(config), &counts).annotate_failures("ledger");
    let status = call(layer.calls("/t/M", inner), LONG).await.unwrap_err();
    assert_eq!(status.message(), "processor down");
    assert_eq!(counts.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_below_is_unavailable_to_the_caller() {
    let (inner, _) = service(|_| Err(Status::cancelled("operation was canceled")));
    let status = call(
        RetryLayer::new(ServiceConfig::default()).calls("/t/M", inner),
        LONG,
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
}

// ---- Hedging on the same parts: the stop reason is the real one ----

fn hedging(max_attempts: u32, delay_ms: u64, non_fatal: Vec<Code>) -> RetryLayer {
    RetryLayer::new(ServiceConfig::every_method(CallPolicy::Hedging(
        HedgingPolicy {
            max_attempts,
            hedging_delay: Duration::from_millis(delay_ms),
            non_fatal_status_codes: non_fatal,
        },
    )))
    .annotate_failures("edge")
}

/// Attempt `n` answers after `delay(n)` ms with `answer(n)`.
fn slow_service(
    delay: impl Fn(u32) -> u64 + Send + Sync + 'static,
    answer: impl Fn(u32) -> Result<u32, Status> + Send + Sync + 'static,
) -> Inner {
    let (delay, answer) = (Arc::new(delay), Arc::new(answer));
    BoxCloneSyncService::new(tower::service_fn(move |call: AttemptRequest<()>| {
        let n = call.attempt.number;
        let (delay, answer) = (Arc::clone(&delay), Arc::clone(&answer));
        async move {
            tokio::time::sleep(Duration::from_millis(delay(n))).await;
            answer(n)
        }
    }))
}

#[tokio::test(start_paused = true)]
async fn a_fatal_code_after_two_hedges_reads_not_retryable() {
    // Attempt 1 hangs; attempt 2 (after 50 ms) fails fatally at 60 ms; 3 of 3 allowed.
    let inner = slow_service(
        |n| if n == 1 { 10_000 } else { 10 },
        |_| Err(Status::invalid_argument("bad")),
    );
    let status = call(
        hedging(3, 50, vec![Code::Unavailable]).calls("/t/M", inner),
        LONG,
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("[edge: 2 attempts, not retryable]"),
        "{}",
        status.message()
    );
}

#[tokio::test(start_paused = true)]
async fn hedges_that_run_out_of_time_read_deadline() {
    let inner = slow_service(|_| 10_000, Ok);
    let status = call(
        hedging(3, 50, vec![Code::Unavailable]).calls("/t/M", inner),
        Some(Duration::from_millis(120)),
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert!(
        status
            .message()
            .contains("3 attempts, the call's deadline passed]"),
        "{}",
        status.message()
    );
}

#[tokio::test(start_paused = true)]
async fn hedges_that_all_fail_read_max_attempts() {
    let inner = slow_service(|_| 5, |_| Err(Status::unavailable("down")));
    let status = call(
        hedging(3, 50, vec![Code::Unavailable]).calls("/t/M", inner),
        LONG,
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status
            .message()
            .contains("[edge: 3 attempts, max attempts (3) reached]"),
        "{}",
        status.message()
    );
}
