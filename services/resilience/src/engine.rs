//! The one retry loop. Every retrying caller in the workspace goes through it: a hop's gRPC
//! calls (through [`RetryLayer`](crate::RetryLayer) over a channel, their bodies replayed
//! from [`replay`](crate::replay)), the ledger's processor calls and the simulations
//! (through [`RetryCalls`](crate::client::RetryCalls), their requests cloned). Hedging
//! ([`hedge`](crate::hedge)) is built on the same parts.
//!
//! What differs between kinds of call is behind [`Attempts`]: how attempt *n* is sent,
//! what its answer says ([`Verdict`]), and how a failure is written. What does not differ
//! is here, once: the decision after a failure ([`rules`](crate::rules)), the deadline
//! that bounds every attempt and wait, the transparent resend of a call that never reached
//! the server, the attempt's span, what the observer hears, and the stop reason written on
//! a failure the loop gave up on.

use std::{sync::Mutex, time::Duration};

use rand::rngs::SmallRng;
use tokio::time::Instant;
use tonic::{Code, Status};
use tracing::Instrument;

use crate::{
    observe::{AttemptInfo, Refusal, RetryObserver},
    rules::{Next, Retrying, StopReason},
    service_config::RetryPolicyConfig,
    throttle::Throttle,
    wire,
};

/// One attempt of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first attempt, 2 for the first retry, …
    pub number: u32,
    /// When the call ends: the attempt must be answered by then.
    pub deadline: Option<Instant>,
    /// On a retry, or a hedge sent after a failure: the code of that failure.
    pub retry_of: Option<Code>,
}

impl Attempt {
    /// Attempts made before this one (written on it as [`wire::PREVIOUS_ATTEMPTS`]).
    pub fn previous(&self) -> u32 {
        self.number - 1
    }

    /// The time this attempt has, when the call has a deadline.
    pub fn time_left(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// How the observer is told of it.
    pub(crate) fn info(&self) -> AttemptInfo {
        AttemptInfo {
            previous: self.previous(),
            retry_of: self.retry_of,
            timeout: self.time_left(),
        }
    }
}

/// What an attempt's answer says.
pub(crate) enum Verdict<A> {
    /// A success, or a gRPC answer whose headers arrived (the call is committed): hand it
    /// back.
    Committed(A),
    /// A failure: maybe retry.
    Failed { status: Status, answer: A },
    /// No answer, and the request provably never reached the server's application
    /// ([`never_processed`](crate::classify::never_processed)): sending it again is safe
    /// whatever the policy says, once (gRFC A6's transparent retry). Otherwise an
    /// UNAVAILABLE failure like any other.
    Unprocessed { status: Status, answer: A },
}

/// A kind of call the loop can drive: how to send each attempt, judge its answer and write
/// a failure of the loop's own.
pub(crate) trait Attempts: Send {
    /// What an attempt comes back with (and the call answers).
    type Answer: Send + 'static;
    /// One attempt on its way. It owns what it needs: hedged attempts run side by side.
    type Sent: Future<Output = Self::Answer> + Send + 'static;

    /// Sends `attempt`.
    fn send(&mut self, attempt: &Attempt) -> Self::Sent;

    /// What `answer` says. CANCELLED means "the caller cancelled", and the loop's caller
    /// has not (it is waiting for this answer), so no CANCELLED passes up: past the
    /// deadline it is DEADLINE_EXCEEDED, otherwise UNAVAILABLE.
    fn judge(&self, answer: Self::Answer, deadline: Option<Instant>) -> Verdict<Self::Answer>;

    /// A failure the loop answers itself (a deadline, a refused retry).
    fn failure(&self, status: Status) -> Self::Answer;

    /// A failed `answer` with its status rewritten by `restate` (its other metadata kept).
    fn restate(&self, answer: Self::Answer, restate: impl FnOnce(Status) -> Status)
    -> Self::Answer;
}

/// CANCELLED that the caller did not ask for, told apart as [`Attempts::judge`] says.
pub(crate) fn uncancelled(status: Status, deadline: Option<Instant>) -> Status {
    if status.code() != Code::Cancelled {
        return status;
    }
    let code = if deadline.is_some_and(|d| Instant::now() >= d) {
        Code::DeadlineExceeded
    } else {
        Code::Unavailable
    };
    Status::with_metadata(
        code,
        format!("the call was cancelled below: {}", status.message()),
        status.metadata().clone(),
    )
}

/// What one retrying layer shares between all its calls.
pub(crate) struct Settings {
    /// Limits retries across calls (a budget, A6's throttle); `None`: attempts only.
    pub throttle: Option<std::sync::Arc<dyn Throttle>>,
    /// Jitter.
    pub rng: Mutex<SmallRng>,
    /// Who is told.
    pub observer: std::sync::Arc<dyn RetryObserver>,
    /// The least time left worth starting an attempt with.
    pub min_attempt: Duration,
    /// Whether a call this layer retried, or wanted to retry, fails with a negative
    /// pushback.
    pub refuse_caller_retries: bool,
    /// Who this layer is in annotated failure messages (`"edge"`); `None`: messages are
    /// the server's.
    pub label: Option<String>,
}

/// One call the loop drives: the layer's settings, what is called, until when.
pub(crate) struct Call<'a> {
    /// The layer's settings.
    pub settings: &'a Settings,
    /// `/package.Service/Method` (or an in-process call's name), for the observer.
    pub path: &'a str,
    /// When the call ends.
    pub deadline: Option<Instant>,
}

impl Call<'_> {
    /// Whether an attempt could still start after `wait`.
    pub fn has_room(&self, wait: Duration) -> bool {
        self.deadline.is_none_or(|deadline| {
            deadline.saturating_duration_since(Instant::now()) > wait + self.settings.min_attempt
        })
    }

    /// Starts `attempt` and waits for its answer, at most until the call's deadline: a
    /// server that ignores its timeout, or a network gone silent, does not hold the call
    /// past it.
    /// The attempt's span comes back too, for its outcome ([`outcome`]).
    pub async fn attempt<A: Attempts>(
        &self,
        attempts: &mut A,
        attempt: &Attempt,
    ) -> (A::Answer, tracing::Span) {
        let info = attempt.info();
        self.settings.observer.attempt(self.path, &info);
        let span = attempt_span(attempt, info.timeout);
        let sent = attempts.send(attempt).instrument(span.clone());
        let answer = match self.deadline {
            Some(deadline) => match tokio::time::timeout_at(deadline, sent).await {
                Ok(answer) => answer,
                Err(_) => attempts.failure(Status::deadline_exceeded(
                    "the call's deadline passed before an answer",
                )),
            },
            None => sent.await,
        };
        (answer, span)
    }

    /// The failure when the deadline leaves no room for an attempt: DEADLINE_EXCEEDED, as
    /// the call would have ended had the attempt been made (grpc-go's answer), keeping the
    /// last failure's message and metadata. Told once the deadline has passed (see
    /// [`Call::until_deadline`]), never with time left.
    pub fn no_room(&self, last: Option<&Status>, wait: Duration) -> Status {
        self.settings.observer.refused(self.path, Refusal::Deadline);
        match last {
            Some(last) => Status::with_metadata(
                Code::DeadlineExceeded,
                format!(
                    "last failure {:?}: {}; a retry after {wait:?} would not fit before the deadline",
                    last.code(),
                    last.message(),
                ),
                last.metadata().clone(),
            ),
            None => Status::deadline_exceeded(format!(
                "no attempt started: the deadline leaves less than {:?}",
                self.settings.min_attempt
            )),
        }
    }

    /// Waits until the call's deadline. A retry whose wait (backoff, or a server's
    /// pushback) would end past the deadline is not made; the call then ends as it would
    /// have in grpc-go or gRPC core, which wait out the backoff and meet the deadline: with
    /// DEADLINE_EXCEEDED at the deadline. Said earlier, DEADLINE_EXCEEDED would reach a
    /// caller whose deadline still had time — and that caller, told its deadline passed,
    /// would neither retry nor believe it.
    pub async fn until_deadline(&self) {
        if let Some(deadline) = self.deadline {
            tokio::time::sleep_until(deadline).await;
        }
    }

    /// The failure of a call the throttle rejected before its first attempt (adaptive
    /// throttling: the service below has accepted too few of the latest calls):
    /// UNAVAILABLE, with a negative pushback where this layer is the retrying one, so
    /// that a caller does not put back the load the throttle just shed.
    pub fn throttled(&self) -> Status {
        let settings = self.settings;
        settings.observer.refused(self.path, Refusal::Throttle);
        let probability = settings
            .throttle
            .as_ref()
            .map_or(0.0, |t| t.reject_probability());
        let who = settings
            .label
            .as_deref()
            .map_or(String::new(), |who| format!("{who}: "));
        let mut status = Status::unavailable(format!(
            "{who}rejected locally by adaptive throttling: the service below accepted too few of the latest calls (rejecting {:.0}% now)",
            probability * 100.0
        ));
        if settings.refuse_caller_retries {
            wire::set_pushback(&mut status, -1);
        }
        status
    }

    /// A failed call's answer, told as the layer was set up: its message naming the
    /// attempts made and why they stopped (`label`), and a negative pushback where this
    /// layer was the retrying one (`refuse_caller_retries`).
    pub fn finish<A: Attempts>(
        &self,
        attempts: &A,
        answer: A::Answer,
        stop: StopReason,
        made: u32,
        max_attempts: u32,
    ) -> A::Answer {
        if !stop.is_the_loops_verdict(made, max_attempts) {
            return answer; // nothing was retried or refused: the answer is the server's
        }
        let settings = self.settings;
        attempts.restate(answer, |status| {
            let mut status = match &settings.label {
                Some(who) => Status::with_metadata(
                    status.code(),
                    stop.annotate(status.message(), who, made, max_attempts),
                    status.metadata().clone(),
                ),
                None => status,
            };
            if settings.refuse_caller_retries && stop.retries_were_spent(made, max_attempts) {
                wire::set_pushback(&mut status, -1);
            }
            status
        })
    }
}

/// The span of one attempt: a client span in a trace, the parent of the server's (layers
/// below inject it into the request when exporting).
pub(crate) fn attempt_span(attempt: &Attempt, time_left: Option<Duration>) -> tracing::Span {
    tracing::info_span!(
        target: crate::observe::TRACE_ONLY,
        "attempt",
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        attempt = attempt.number,
        retry_of = attempt.retry_of.map(wire::code_name),
        timeout_ms = time_left.map(|left| left.as_millis() as u64),
        outcome = tracing::field::Empty,
    )
}

/// Writes an attempt's outcome on its span: `OK`, or the failure's code (an error span).
pub(crate) fn outcome(span: &tracing::Span, failure: Option<Code>) {
    match failure {
        None => {
            span.record("outcome", "OK");
        }
        Some(code) => {
            span.record("outcome", wire::code_name(code));
            span.record("otel.status_code", "ERROR");
        }
    }
}

/// Drives `attempts` under `policy` until one is committed or the policy says stop, and
/// answers: the success, or the last failure (DEADLINE_EXCEEDED when the deadline ended
/// it), written as [`Call::finish`] says.
pub(crate) async fn retry<A: Attempts>(
    call: Call<'_>,
    policy: &RetryPolicyConfig,
    mut attempts: A,
) -> A::Answer {
    let settings = call.settings;
    let Some(mut state) = Retrying::start(
        policy.max_attempts,
        &policy.retryable_status_codes,
        policy.backoff(),
        settings.throttle.as_deref(),
    ) else {
        return attempts.failure(call.throttled());
    };
    let mut sent = 0;
    let mut retry_of = None;
    let mut last: Option<Status> = None;
    let mut resent_unprocessed = false;
    let (answer, stop) = loop {
        if !call.has_room(Duration::ZERO) {
            let status = call.no_room(last.as_ref(), Duration::ZERO);
            break (attempts.failure(status), StopReason::NoRoom);
        }
        state.attempts += 1;
        sent += 1;
        let attempt = Attempt {
            number: state.attempts,
            deadline: call.deadline,
            retry_of,
        };
        let (answer, span) = call.attempt(&mut attempts, &attempt).await;
        let (status, answer) = match attempts.judge(answer, call.deadline) {
            Verdict::Committed(answer) => {
                outcome(&span, None);
                state.succeeded();
                settings.observer.call_finished(call.path, sent);
                return answer;
            }
            // Sent again at once, whatever the policy: it never reached the server. Once
            // only, so a server that keeps refusing is not hammered; and not one of
            // `maxAttempts` (gRFC A6), so it neither spends nor marks an attempt.
            Verdict::Unprocessed { status, .. } if !resent_unprocessed => {
                outcome(&span, Some(status.code()));
                resent_unprocessed = true;
                state.attempts -= 1;
                retry_of = Some(status.code());
                continue;
            }
            Verdict::Failed { status, answer } | Verdict::Unprocessed { status, answer } => {
                outcome(&span, Some(status.code()));
                (status, answer)
            }
        };
        let pushback = wire::pushback(&status);
        match state.after_failure(status.code(), pushback, |w| call.has_room(w), &settings.rng) {
            Next::RetryAfter(wait) => {
                retry_of = Some(status.code());
                last = Some(status);
                if !wait.is_zero() {
                    // No timer for no wait (a timer fires at the next millisecond).
                    tokio::time::sleep(wait).await;
                }
            }
            Next::NoRoom { wait } => {
                call.until_deadline().await;
                let status = call.no_room(Some(&status), wait);
                break (attempts.failure(status), StopReason::NoRoom);
            }
            Next::Stop(reason) => {
                if let Some(refusal) = reason.refusal() {
                    settings.observer.refused(call.path, refusal);
                }
                break (answer, reason);
            }
        }
    };
    settings.observer.call_finished(call.path, sent);
    call.finish(&attempts, answer, stop, state.attempts, policy.max_attempts)
}
