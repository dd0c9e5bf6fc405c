//! What the retry loops report — each attempt, each refused retry, each finished call — to
//! whoever counts or logs them: a service's Stats and metrics, a test, an example's output.
//! One trait for both loops, the layer's and the executor's, so one implementation counts
//! either.

use std::time::Duration;

use tonic::Code;

/// An attempt about to be sent, as an observer is told of it.
#[derive(Debug, Clone, Copy)]
pub struct AttemptInfo {
    /// Attempts made before this one for the same call (written on it as [`PREVIOUS_ATTEMPTS`](crate::wire::PREVIOUS_ATTEMPTS)).
    pub previous: u32,
    /// On a retry, or a hedge sent after a failure: the code of that failure.
    pub retry_of: Option<Code>,
    /// The time the attempt is given (written on it as its [`TIMEOUT`](crate::wire::TIMEOUT)), when the call has a deadline.
    pub timeout: Option<Duration>,
}

/// Why a retry (or a call) was not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The throttle (gRFC A6's `retryThrottling`, or a retry budget) had too few tokens.
    Throttle,
    /// The deadline left no room for it.
    Deadline,
    /// The server's pushback said not to retry.
    Pushback,
}

impl Refusal {
    /// A short name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Throttle => "throttle",
            Refusal::Deadline => "deadline",
            Refusal::Pushback => "pushback",
        }
    }
}

/// The target of spans that exist for traces, not for log lines: a retry attempt, the
/// ledger's database steps. The log layer leaves them out, so that with no trace export
/// (or for an unsampled request) they are never created at all; the log line a request
/// writes carries the fields of its `rpc` span, which is enough to find it.
pub const TRACE_ONLY: &str = "retrychain::trace";

/// Told what a retry loop does. `call` names what is called: a gRPC method's path for the
/// layer, the executor's label for the executor.
pub trait RetryObserver: Send + Sync {
    /// An attempt is starting.
    fn attempt(&self, call: &str, attempt: &AttemptInfo);
    /// A retry (or a call) was refused, and why.
    fn refused(&self, call: &str, reason: Refusal);
    /// A call that could be retried ended after `attempts` attempts, whatever its outcome:
    /// an attempts-per-call histogram (as gRFC A96's per-call retry metrics).
    fn call_finished(&self, call: &str, attempts: u32) {
        let _ = (call, attempts);
    }
}

/// Observes nothing.
impl RetryObserver for () {
    fn attempt(&self, _: &str, _: &AttemptInfo) {}
    fn refused(&self, _: &str, _: Refusal) {}
}
