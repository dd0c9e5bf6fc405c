//! The decision the retry engine makes after a failed attempt, as a pure function of the
//! failure and the call's state, so it can be tested without time. In order: is the code retryable; are attempts left; what does the server's
//! pushback say, else the backoff; is there room before the deadline; does the throttle
//! allow it. The deadline comes before the throttle: a token is not spent on a retry that
//! could not happen anyway.

use std::{sync::Mutex, time::Duration};

use rand::rngs::SmallRng;
use tonic::Code;

use crate::{
    backoff::{Backoff, BackoffSchedule},
    observe::Refusal,
    throttle::Throttle,
    wire::Pushback,
};

/// Why retrying stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The failure is not worth retrying.
    NotRetryable,
    /// `max_attempts` were made.
    MaxAttempts,
    /// The retry budget (or throttle) was empty.
    BudgetExhausted,
    /// The deadline left no room for another attempt (or the backoff before it).
    NoRoom,
    /// The server's pushback said not to retry.
    PushbackRefused,
    /// The call's own deadline passed: an attempt cut by it (here, or answered
    /// DEADLINE_EXCEEDED by the server as it ran out there) with no time left for another.
    DeadlinePassed,
}

impl StopReason {
    /// Whether the loop was the retrying layer for its call: retries were allowed and it
    /// retried, or would have but was refused. A caller that retried too would multiply the
    /// load below.
    pub fn retries_were_spent(self, attempts: u32, max_attempts: u32) -> bool {
        if max_attempts <= 1 {
            return false;
        }
        match self {
            StopReason::NotRetryable => false,
            StopReason::MaxAttempts | StopReason::DeadlinePassed => attempts > 1,
            StopReason::BudgetExhausted | StopReason::NoRoom | StopReason::PushbackRefused => true,
        }
    }

    /// Whether the loop's note belongs on the failure: something was retried, a retry was
    /// refused, or the deadline left no room for the first attempt. Otherwise the failure
    /// is the server's, passed on unchanged.
    pub fn is_the_loops_verdict(self, attempts: u32, max_attempts: u32) -> bool {
        match self {
            StopReason::NoRoom => max_attempts > 1 || attempts == 0,
            StopReason::NotRetryable => max_attempts > 1 && attempts > 1,
            _ => max_attempts > 1,
        }
    }

    /// The refusal an observer is told of, when the stop was one.
    pub fn refusal(self) -> Option<Refusal> {
        match self {
            StopReason::BudgetExhausted => Some(Refusal::Throttle),
            StopReason::NoRoom => Some(Refusal::Deadline),
            StopReason::PushbackRefused => Some(Refusal::Pushback),
            // The retry that would have followed was not made: the deadline's doing.
            StopReason::DeadlinePassed => Some(Refusal::Deadline),
            StopReason::NotRetryable | StopReason::MaxAttempts => None,
        }
    }

    /// `message` followed by who stopped after how many attempts and why:
    /// `down [edge: 3 attempts, max attempts (3) reached]`. In a chain where several layers
    /// retry, each layer's note says which layer it was.
    pub fn annotate(self, message: &str, who: &str, attempts: u32, max_attempts: u32) -> String {
        let plural = if attempts == 1 { "" } else { "s" };
        let who = if who.is_empty() {
            String::new()
        } else {
            format!("{who}: ")
        };
        let why = match self {
            StopReason::NotRetryable => "not retryable".to_owned(),
            StopReason::MaxAttempts => format!("max attempts ({max_attempts}) reached"),
            StopReason::BudgetExhausted => "stopped by the retry budget".to_owned(),
            StopReason::NoRoom => "the deadline left no room for another attempt".to_owned(),
            StopReason::PushbackRefused => "the server's pushback said not to retry".to_owned(),
            StopReason::DeadlinePassed => "the call's deadline passed".to_owned(),
        };
        format!("{message} [{who}{attempts} attempt{plural}, {why}]")
    }
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Sleep this long, then make the next attempt.
    RetryAfter(Duration),
    /// Stop: the retry after `wait` would not fit before the deadline.
    NoRoom { wait: Duration },
    /// Stop, for another reason.
    Stop(StopReason),
}

/// One call's retrying: its attempts so far, its backoff schedule, its share of the
/// throttle.
pub(crate) struct Retrying<'a> {
    /// Attempts in all, the first included.
    max_attempts: u32,
    /// The codes worth another attempt.
    retryable: &'a [Code],
    /// The waits' formula, to restart after a pushback.
    backoff: Backoff,
    /// The waits handed out so far.
    schedule: BackoffSchedule,
    /// Shared across calls; `None`: attempts are the only limit.
    throttle: Option<&'a dyn Throttle>,
    /// Attempts made so far.
    pub attempts: u32,
}

impl<'a> Retrying<'a> {
    /// A call is starting (a budget's refund for a first attempt is taken here); `None`
    /// when the throttle rejects the call before its first attempt (adaptive throttling).
    pub fn start(
        max_attempts: u32,
        retryable: &'a [Code],
        backoff: Backoff,
        throttle: Option<&'a dyn Throttle>,
    ) -> Option<Self> {
        if let Some(throttle) = throttle
            && !throttle.first_attempt()
        {
            return None;
        }
        Some(Self {
            max_attempts,
            retryable,
            backoff,
            schedule: backoff.schedule(),
            throttle,
            attempts: 0,
        })
    }

    /// The attempt made counts as a success.
    pub fn succeeded(&self) {
        if let Some(throttle) = self.throttle {
            throttle.attempt_succeeded();
        }
    }

    /// After the latest attempt failed with `code` and `pushback`: retry after a wait, or
    /// stop. `room(wait)` says whether an attempt could still start after `wait`. An
    /// attempt that ran out of the call's own time (DEADLINE_EXCEEDED with no room left)
    /// stops for the deadline, whatever the policy thinks of the code.
    pub fn after_failure(
        &mut self,
        code: Code,
        pushback: Pushback,
        room: impl Fn(Duration) -> bool,
        rng: &Mutex<SmallRng>,
    ) -> Next {
        let retryable = self.retryable.contains(&code);
        if let Some(throttle) = self.throttle {
            if retryable {
                throttle.attempt_failed();
            } else {
                throttle.attempt_answered(code);
            }
        }
        if code == Code::DeadlineExceeded && !room(Duration::ZERO) {
            return Next::Stop(StopReason::DeadlinePassed);
        }
        if !retryable {
            return Next::Stop(StopReason::NotRetryable);
        }
        if self.attempts >= self.max_attempts {
            return Next::Stop(StopReason::MaxAttempts);
        }
        let wait = match pushback {
            Pushback::Absent => {
                let mut rng = rng.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                self.schedule.next_delay(&mut *rng)
            }
            Pushback::RetryAfter(wait) => {
                // As grpc-go and grpc-java: after a server's pushback, backoff starts over.
                self.schedule = self.backoff.schedule();
                wait
            }
            Pushback::DoNotRetry => return Next::Stop(StopReason::PushbackRefused),
        };
        if !room(wait) {
            return Next::NoRoom { wait };
        }
        if let Some(throttle) = self.throttle
            && !throttle.try_retry()
        {
            return Next::Stop(StopReason::BudgetExhausted);
        }
        Next::RetryAfter(wait)
    }
}
