//! The decision at the heart of an idempotent call, without a database: what a key's
//! record, as the claim returned it, means for the request that asked ([`judge`]), and
//! which failures of the work between the phases end a key for good
//! ([`refused_for_good`]). Pure functions of their inputs, tested by a table of every state
//! a key can be in against every request that can find it.

use tonic::Code;
use uuid::Uuid;

/// How far a key's call got: the `state` a persistence keeps with the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Claimed: its owner (the lease's) is doing the work, or vanished doing it.
    Started,
    /// The effect and the reply were recorded together.
    Finished,
    /// The work was refused for good; the error is saved and replayed.
    Failed,
}

impl State {
    /// The name a persistence stores.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Started => "started",
            State::Finished => "finished",
            State::Failed => "failed",
        }
    }

    /// The state a stored name stands for.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "started" => Some(State::Started),
            "finished" => Some(State::Finished),
            "failed" => Some(State::Failed),
            _ => None,
        }
    }
}

/// An error saved with a failed key, replayed to every later request with its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedError {
    /// The status code, as a gRPC code number.
    pub code: i32,
    /// The status message.
    pub message: String,
}

/// A key's record as the claim returned it.
#[derive(Debug, Clone)]
pub struct Record<F, R> {
    /// Whether this claim inserted it (a fresh key, as against one found).
    pub inserted: bool,
    /// How far its call got.
    pub state: State,
    /// The fingerprint of the request that first used the key.
    pub fingerprint: F,
    /// The saved reply, once finished.
    pub reply: Option<R>,
    /// Who holds the lease (started keys).
    pub owner: Option<Uuid>,
    /// The key the work calls its own downstream under, saved with the claim, so that a
    /// resumed key repeats the first request's downstream call, never a new one.
    pub step_key: Option<String>,
    /// The saved error, once failed.
    pub error: Option<SavedError>,
}

/// What an idempotent call came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<R> {
    /// This request did the work and recorded it (a fresh key, or one it resumed).
    Executed(R),
    /// The key was settled with the same request: its saved reply, nothing done.
    Replayed(R),
}

impl<R> Outcome<R> {
    /// The reply, however it came.
    pub fn into_reply(self) -> R {
        match self {
            Outcome::Executed(reply) | Outcome::Replayed(reply) => reply,
        }
    }

    /// Whether the reply was replayed.
    pub fn is_replay(&self) -> bool {
        matches!(self, Outcome::Replayed(_))
    }

    /// The same outcome with its reply mapped.
    pub fn map<T>(self, f: impl FnOnce(R) -> T) -> Outcome<T> {
        match self {
            Outcome::Executed(reply) => Outcome::Executed(f(reply)),
            Outcome::Replayed(reply) => Outcome::Replayed(f(reply)),
        }
    }
}

/// Why a key's record refuses the request that found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal<F> {
    /// The key was first used with another request: refused in every state, also while
    /// the first is running or after it stopped half-way.
    Reused {
        /// The first request's fingerprint.
        saved: F,
        /// This request's.
        requested: F,
    },
    /// The key failed for good: its saved error.
    Failed(SavedError),
    /// A finished key without a saved reply: the persistence records them together, so
    /// its schema or its code is broken.
    NoReply,
}

/// What a key's record means for the request that asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<F, R> {
    /// The key is this request's: freshly claimed, or taken over from an owner whose lease
    /// passed (`resumed`). Do the work under `step_key`.
    Ours {
        /// The key to do the work under: the one saved with the claim.
        step_key: String,
        /// Taken over, not freshly claimed.
        resumed: bool,
    },
    /// Settled with the same request: its saved reply.
    Replay(R),
    /// Refused.
    Refused(Refusal<F>),
    /// Running under someone else's live lease.
    Running,
}

/// What `record` means for a request with `fingerprint`, whose lease owner is `owner` and
/// whose own step key is `step_key` (used only if the record saved none).
pub fn judge<F: PartialEq + Clone, R>(
    fingerprint: &F,
    owner: Uuid,
    step_key: &str,
    record: Record<F, R>,
) -> Verdict<F, R> {
    if record.fingerprint != *fingerprint {
        return Verdict::Refused(Refusal::Reused {
            saved: record.fingerprint,
            requested: fingerprint.clone(),
        });
    }
    match record.state {
        State::Finished => match record.reply {
            Some(reply) => Verdict::Replay(reply),
            None => Verdict::Refused(Refusal::NoReply),
        },
        State::Failed => Verdict::Refused(Refusal::Failed(record.error.unwrap_or(SavedError {
            code: Code::Unknown as i32,
            message: String::new(),
        }))),
        State::Started if record.owner == Some(owner) => Verdict::Ours {
            step_key: record.step_key.unwrap_or_else(|| step_key.to_owned()),
            resumed: !record.inserted,
        },
        State::Started => Verdict::Running,
    }
}

/// Whether a failure of the work is for good: it reached a downstream that said no (a
/// retry with the same request would be told the same), as against a failure to reach
/// it, a busy one, or one that ran out of time — which leave the key to be resumed.
pub fn refused_for_good(status: &tonic::Status) -> bool {
    !matches!(
        status.code(),
        Code::Unavailable
            | Code::ResourceExhausted
            | Code::Aborted
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_downstream_that_said_no_fails_a_key_for_good() {
        for code in [
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::PermissionDenied,
            Code::OutOfRange,
            Code::AlreadyExists,
        ] {
            assert!(
                refused_for_good(&tonic::Status::new(code, "no")),
                "{code:?}"
            );
        }
        for code in [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
            Code::Aborted,
            Code::Cancelled,
            Code::Unknown,
            Code::Internal,
        ] {
            assert!(
                !refused_for_good(&tonic::Status::new(code, "later")),
                "{code:?}"
            );
        }
    }

    /// What a [`Verdict`] says, in a form a table can hold.
    fn told(verdict: Verdict<i64, &str>) -> String {
        match verdict {
            Verdict::Ours { step_key, resumed } => {
                format!("ours under {step_key}, resumed {resumed}")
            }
            Verdict::Running => "running".to_owned(),
            Verdict::Replay(reply) => format!("replayed {reply}"),
            Verdict::Refused(Refusal::Reused { saved, requested }) => {
                format!("reused: saved {saved}, requested {requested}")
            }
            Verdict::Refused(Refusal::Failed(error)) => {
                format!("failed {:?}: {}", Code::from_i32(error.code), error.message)
            }
            Verdict::Refused(Refusal::NoReply) => "broken".to_owned(),
        }
    }

    /// Every state a claim can return a key in, against a request with the same or another
    /// fingerprint. (A key in another caller's scope never reaches `judge`: the claim
    /// returns no record for it; a started key whose lease passed comes back already taken
    /// over, under this request's owner, when the fingerprints match.)
    #[test]
    fn what_a_key_means_for_the_request_that_found_it() {
        let ours = Uuid::from_u128(1);
        let theirs = Uuid::from_u128(2);
        let record = |inserted, state, fingerprint, owner| Record {
            inserted,
            state,
            fingerprint,
            reply: None,
            owner,
            step_key: Some("step-first".to_owned()),
            error: None,
        };
        let finished = |fingerprint, reply| Record {
            reply,
            ..record(false, State::Finished, fingerprint, None)
        };
        let failed = |fingerprint, error| Record {
            error,
            ..record(false, State::Failed, fingerprint, None)
        };
        let declined = Some(SavedError {
            code: Code::FailedPrecondition as i32,
            message: "card declined".to_owned(),
        });
        let cases: Vec<(&str, Record<i64, &str>, &str)> = vec![
            (
                "a new key, claimed by this request",
                record(true, State::Started, 500, Some(ours)),
                "ours under step-first, resumed false",
            ),
            (
                "a new key whose record saved no step key: this request's",
                Record {
                    step_key: None,
                    ..record(true, State::Started, 500, Some(ours))
                },
                "ours under step-this-request, resumed false",
            ),
            (
                "started, lease passed, same request: taken over, the first step key kept",
                record(false, State::Started, 500, Some(ours)),
                "ours under step-first, resumed true",
            ),
            (
                "started, lease held by another request",
                record(false, State::Started, 500, Some(theirs)),
                "running",
            ),
            (
                "started, released (no owner), same request, not yet taken over",
                record(false, State::Started, 500, None),
                "running",
            ),
            (
                "started, lease held, another request",
                record(false, State::Started, 700, Some(theirs)),
                "reused: saved 700, requested 500",
            ),
            (
                "started, lease passed, another request (not taken over)",
                record(false, State::Started, 700, None),
                "reused: saved 700, requested 500",
            ),
            (
                "finished, same request: its saved reply",
                finished(500, Some("reply-1")),
                "replayed reply-1",
            ),
            (
                "finished, another request",
                finished(700, Some("reply-1")),
                "reused: saved 700, requested 500",
            ),
            (
                "finished without a saved reply: the schema or the code is broken",
                finished(500, None),
                "broken",
            ),
            (
                "failed, same request: its saved error",
                failed(500, declined.clone()),
                "failed FailedPrecondition: card declined",
            ),
            (
                "failed, another request",
                failed(700, declined),
                "reused: saved 700, requested 500",
            ),
            (
                "failed without a saved error",
                failed(500, None),
                "failed Unknown: ",
            ),
        ];
        for (case, record, expected) in cases {
            assert_eq!(
                told(judge(&500, ours, "step-this-request", record)),
                expected,
                "{case}"
            );
        }
    }

    #[test]
    fn states_round_trip_through_their_stored_names() {
        for state in [State::Started, State::Finished, State::Failed] {
            assert_eq!(State::parse(state.as_str()), Some(state));
        }
        assert_eq!(State::parse("done"), None);
    }
}
