//! gRFC A6 hedging on the engine's parts: the first attempt at once, another every
//! `hedgingDelay` (at once after a non-fatal failure, or after the server's pushback) up to
//! `maxAttempts`, while the deadline has room and the throttle allows; the first committed
//! answer, or the first fatal failure, wins, and the other attempts are dropped — their
//! streams reset, so their servers see the cancellation.
//!
//! The stop reason written on a failure is the one that ended the call: a fatal code
//! (not retryable), the attempts spent, the throttle, the server's pushback, the deadline.

use std::time::Duration;

use futures::{StreamExt, stream::FuturesUnordered};
use tokio::time::Instant;
use tonic::Status;
use tracing::Instrument;

use crate::{
    engine::{Attempt, Attempts, Call, Verdict, outcome},
    observe::Refusal,
    rules::StopReason,
    service_config::HedgingPolicy,
    wire::{self, Pushback},
};

/// One hedged attempt on its way: the attempt, its span, its answer.
async fn launched<F: Future>(
    sent: F,
    attempt: Attempt,
    span: tracing::Span,
) -> (Attempt, tracing::Span, F::Output) {
    let answer = sent.instrument(span.clone()).await;
    (attempt, span, answer)
}

/// Where a hedged call stands.
struct Hedging<'p, A: Attempts> {
    policy: &'p HedgingPolicy,
    /// Attempts sent (transparent resends not counted: A6 does not).
    sent: u32,
    /// Whether the one transparent resend was used.
    resent_unprocessed: bool,
    /// The latest non-fatal failure, the call's answer if nothing better comes.
    last: Option<(Status, A::Answer)>,
    /// When the next hedge goes; `None`: no more.
    next_hedge: Option<Instant>,
    /// Why no more hedges go.
    stop: StopReason,
}

impl<A: Attempts> Hedging<'_, A> {
    /// After a non-fatal failure with `pushback`: the next hedge at once, after the
    /// pushback, or never.
    fn after_failure(&mut self, call: &Call<'_>, pushback: Pushback) {
        if self.sent >= self.policy.max_attempts {
            return;
        }
        self.next_hedge = match pushback {
            Pushback::Absent => Some(Instant::now()),
            Pushback::RetryAfter(wait) => Some(Instant::now() + wait),
            Pushback::DoNotRetry => {
                call.settings.observer.refused(call.path, Refusal::Pushback);
                self.stop = StopReason::PushbackRefused;
                None
            }
        };
    }

    /// Whether a hedge (not the first attempt) may go now: the deadline has room and the
    /// throttle allows it. A refusal is told to the observer and kept as the stop reason.
    fn may_hedge(&mut self, call: &Call<'_>) -> bool {
        if self.sent == 0 {
            return true;
        }
        let refusal = if !call.has_room(Duration::ZERO) {
            self.stop = StopReason::NoRoom;
            Refusal::Deadline
        } else if call
            .settings
            .throttle
            .as_ref()
            .is_some_and(|t| !t.try_retry())
        {
            self.stop = StopReason::BudgetExhausted;
            Refusal::Throttle
        } else {
            return true;
        };
        call.settings.observer.refused(call.path, refusal);
        false
    }
}

/// How an answer left the call.
enum Ended<T> {
    /// A committed answer: the call's, as it is.
    Committed(T),
    /// The call failed, for this reason.
    Failed(T, StopReason),
}

/// The attempts on their way.
type Running<F> = FuturesUnordered<F>;

impl<A: Attempts> Hedging<'_, A> {
    /// Sends the hedge that is due, if any and if it may go; schedules the next.
    fn send_due<F>(
        &mut self,
        call: &Call<'_>,
        attempts: &mut A,
        running: &mut Running<F>,
        send: impl Fn(&Call<'_>, &mut A, Attempt) -> F,
    ) {
        if self.next_hedge.is_none_or(|at| at > Instant::now()) {
            return;
        }
        self.next_hedge = None;
        if !self.may_hedge(call) {
            return;
        }
        let attempt = Attempt {
            number: self.sent + 1,
            deadline: call.deadline,
            retry_of: self.last.as_ref().map(|(status, _)| status.code()),
        };
        self.sent += 1;
        running.push(send(call, attempts, attempt));
        if self.sent < self.policy.max_attempts {
            self.next_hedge = Some(Instant::now() + self.policy.hedging_delay);
        }
    }

    /// Takes one attempt's answer: the call's end, or `None` to go on (a non-fatal
    /// failure kept, a transparent resend sent).
    fn on_answer<F>(
        &mut self,
        call: &Call<'_>,
        attempts: &mut A,
        running: &mut Running<F>,
        send: impl Fn(&Call<'_>, &mut A, Attempt) -> F,
        (attempt, span, answer): (Attempt, tracing::Span, A::Answer),
    ) -> Option<Ended<A::Answer>> {
        let settings = call.settings;
        match attempts.judge(answer, call.deadline) {
            Verdict::Committed(answer) => {
                outcome(&span, None);
                if let Some(throttle) = &settings.throttle {
                    throttle.attempt_succeeded();
                }
                Some(Ended::Committed(answer)) // the others are dropped: cancelled
            }
            // Never reached the server: sent again at once, once, not counted.
            Verdict::Unprocessed { status, .. }
                if !self.resent_unprocessed && call.has_room(Duration::ZERO) =>
            {
                outcome(&span, Some(status.code()));
                self.resent_unprocessed = true;
                let resend = Attempt {
                    retry_of: Some(status.code()),
                    ..attempt
                };
                running.push(send(call, attempts, resend));
                None
            }
            Verdict::Failed { status, answer } | Verdict::Unprocessed { status, answer } => {
                outcome(&span, Some(status.code()));
                if !self.policy.non_fatal_status_codes.contains(&status.code()) {
                    if let Some(throttle) = &settings.throttle {
                        throttle.attempt_answered(status.code());
                    }
                    // Cut by the call's own deadline: that is why it stopped.
                    let why = if status.code() == tonic::Code::DeadlineExceeded
                        && !call.has_room(Duration::ZERO)
                    {
                        StopReason::DeadlinePassed
                    } else {
                        StopReason::NotRetryable
                    };
                    return Some(Ended::Failed(answer, why));
                }
                if let Some(throttle) = &settings.throttle {
                    throttle.attempt_failed();
                }
                self.after_failure(call, wire::pushback(&status));
                self.last = Some((status, answer));
                None
            }
        }
    }

    /// When nothing runs and no hedge may go: the latest failure, with why no more went.
    /// (The first attempt always goes, so there is one.)
    fn exhausted(&mut self, attempts: &A) -> Ended<A::Answer> {
        match self.last.take() {
            Some((_, answer)) => Ended::Failed(answer, self.stop),
            None => Ended::Failed(
                attempts.failure(Status::deadline_exceeded("no attempt could be made")),
                StopReason::NoRoom,
            ),
        }
    }
}

/// Hedges `attempts` as `policy` says; see the module docs.
pub(crate) async fn hedge<A: Attempts>(
    call: Call<'_>,
    policy: &HedgingPolicy,
    mut attempts: A,
) -> A::Answer {
    if let Some(throttle) = &call.settings.throttle
        && !throttle.first_attempt()
    {
        return attempts.failure(call.throttled());
    }
    let mut state = Hedging::<A> {
        policy,
        sent: 0,
        resent_unprocessed: false,
        last: None,
        next_hedge: Some(Instant::now()),
        stop: StopReason::MaxAttempts,
    };
    let mut running = FuturesUnordered::new();
    let deadline_passes = until(call.deadline);
    tokio::pin!(deadline_passes);
    let ended = loop {
        // The hedge that is due goes now, without a timer for one due now (the first
        // attempt, or the one after a non-fatal failure).
        state.send_due(&call, &mut attempts, &mut running, send);
        if running.is_empty() && state.next_hedge.is_none() {
            break state.exhausted(&attempts);
        }
        tokio::select! {
            biased;
            Some(answered) = running.next(), if !running.is_empty() => {
                if let Some(ended) = state.on_answer(&call, &mut attempts, &mut running, send, answered) {
                    break ended;
                }
            }
            () = until(state.next_hedge) => {}
            () = &mut deadline_passes => {
                let status = Status::deadline_exceeded("the call's deadline passed before an answer");
                break Ended::Failed(attempts.failure(status), StopReason::DeadlinePassed);
            }
        }
    };
    let made = state.sent + u32::from(state.resent_unprocessed);
    call.settings.observer.call_finished(call.path, made);
    match ended {
        Ended::Committed(answer) => answer,
        Ended::Failed(answer, stop) => {
            call.finish(&attempts, answer, stop, state.sent, policy.max_attempts)
        }
    }
}

/// Completes at `at`, or never.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Tells the observer of `attempt` and starts it.
fn send<A: Attempts>(
    call: &Call<'_>,
    attempts: &mut A,
    attempt: Attempt,
) -> impl Future<Output = (Attempt, tracing::Span, A::Answer)> + Send + use<A> {
    let info = attempt.info();
    call.settings.observer.attempt(call.path, &info);
    let span = crate::engine::attempt_span(&attempt, info.timeout);
    let sent = attempts.send(&attempt);
    launched(sent, attempt, span)
}
