//! A gRPC call made replayable: its request body read into memory once, then sent again
//! for each attempt — what the engine needs of a tonic call, whose streaming body is not
//! `Clone` (hyperium/tonic#733).
//!
//! Memory is bounded as grpc-java bounds it: a call whose body is over the per-call limit,
//! or would take all calls' buffered bytes over the per-channel limit, is not buffered; it
//! goes through once, unretried. A body is held until its call ends.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use bytes::{Bytes, BytesMut};
use http_body::Body as _;
use http_body_util::BodyExt;
use tokio::time::Instant;
use tonic::{Code, Status, body::Body};
use tower::{Service, ServiceExt};

use crate::{
    balance::Tried,
    classify::{is_local_timeout, never_processed, transport_failure_as_unavailable},
    deadline::{CallDeadline, PerAttemptTimeout},
    engine::{Attempt, Attempts, Verdict, uncancelled},
    wire,
};

/// The largest request body buffered for replay, by default (grpc-java's default).
pub const DEFAULT_PER_CALL_LIMIT: usize = 1 << 20;
/// The most request bytes all calls of a channel may hold buffered at once, by default
/// (grpc-java's default).
pub const DEFAULT_PER_CHANNEL_LIMIT: usize = 16 << 20;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How many bytes the calls of one layer may hold for replay.
#[derive(Debug)]
pub(crate) struct ReplayBudget {
    /// One call's limit.
    pub per_call: usize,
    /// All calls' limit.
    pub per_channel: usize,
    /// Bytes held now, across calls.
    buffered: AtomicUsize,
}

impl ReplayBudget {
    /// A budget with these limits and nothing held.
    pub fn new(per_call: usize, per_channel: usize) -> Self {
        Self {
            per_call,
            per_channel,
            buffered: AtomicUsize::new(0),
        }
    }
}

/// A request's body, read into memory for replay, holding its share of the budget until
/// dropped.
struct Buffered {
    bytes: Bytes,
    budget: Arc<ReplayBudget>,
}

impl Drop for Buffered {
    fn drop(&mut self) {
        self.budget
            .buffered
            .fetch_sub(self.bytes.len(), Ordering::AcqRel);
    }
}

/// Bytes of the budget held by a call still reading its body: given back on drop, however
/// the read ends (cancellation included).
struct Reservation<'a> {
    budget: &'a ReplayBudget,
    bytes: usize,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.budget.buffered.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Reads `body` up to the limits: `Ok` with all of it, or `Err` with a body that replays
/// what was read and then the rest (to send once, unretried).
async fn buffer(budget: &Arc<ReplayBudget>, mut body: Body) -> Result<Buffered, Body> {
    let mut bytes = BytesMut::new();
    let mut reservation = Reservation {
        budget: budget.as_ref(),
        bytes: 0,
    };
    loop {
        let frame = match body.frame().await {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(error)) => return Err(error_after(bytes.freeze(), error)),
        };
        let Ok(data) = frame.into_data() else {
            continue; // request trailers: gRPC clients send none
        };
        let size = data.len();
        let total = budget.buffered.fetch_add(size, Ordering::AcqRel) + size;
        reservation.bytes += size;
        bytes.extend_from_slice(&data);
        if bytes.len() > budget.per_call || total > budget.per_channel {
            return Err(chain(bytes.freeze(), body));
        }
        if body.is_end_stream() {
            break;
        }
    }
    // The bytes are now held by the `Buffered`, which gives them back when dropped.
    reservation.bytes = 0;
    Ok(Buffered {
        bytes: bytes.freeze(),
        budget: Arc::clone(budget),
    })
}

/// A body of `prefix`, then whatever `rest` still yields.
fn chain(prefix: Bytes, rest: Body) -> Body {
    let first = futures::stream::once(async move { Ok(http_body::Frame::data(prefix)) });
    let rest = http_body_util::BodyStream::new(rest);
    Body::new(http_body_util::StreamBody::new(futures::StreamExt::chain(
        first, rest,
    )))
}

/// A body of `prefix`, then `error`.
fn error_after(prefix: Bytes, error: Status) -> Body {
    let frames: Vec<Result<http_body::Frame<Bytes>, Status>> =
        vec![Ok(http_body::Frame::data(prefix)), Err(error)];
    Body::new(http_body_util::StreamBody::new(futures::stream::iter(
        frames,
    )))
}

/// A gRPC call ready to be attempted again and again over `inner`.
pub(crate) struct Replay<S> {
    /// Where attempts go; each goes through a clone of it.
    inner: S,
    /// The request's head, copied into each attempt.
    parts: http::request::Parts,
    /// The request's body, replayed by each attempt.
    body: Buffered,
    /// Where each attempt is cut short of the call's time left (`RetryLayer::per_try_timeout`).
    per_try: Option<std::time::Duration>,
}

impl<S> Replay<S> {
    /// Buffers `request` for replay over `inner`, each attempt cut at `per_try` where that
    /// ends first; a call over the budget comes back as the request to send once,
    /// unretried.
    pub async fn prepare(
        inner: S,
        budget: &Arc<ReplayBudget>,
        request: http::Request<Body>,
        per_try: Option<std::time::Duration>,
    ) -> Result<Self, (S, http::Request<Body>)> {
        let (mut parts, body) = request.into_parts();
        // One per call, shared by its attempts (each gets a copy of these parts): where a
        // balancer below records the replicas tried, so that a retry goes elsewhere.
        if parts.extensions.get::<Tried>().is_none() {
            parts.extensions.insert(Tried::default());
        }
        match buffer(budget, body).await {
            Ok(body) => Ok(Self {
                inner,
                parts,
                body,
                per_try,
            }),
            Err(whole) => Err((inner, http::Request::from_parts(parts, whole))),
        }
    }

    /// The call's deadline: its [`CallDeadline`] (set by a layer above), the timeout its
    /// caller wrote on it, or `configured` (the method config's `timeout`), whichever ends
    /// first.
    pub fn deadline(
        request: &http::Request<Body>,
        configured: Option<std::time::Duration>,
    ) -> Option<Instant> {
        let now = Instant::now();
        let written = wire::timeout_of(request.headers()).ok().flatten();
        [
            request.extensions().get::<CallDeadline>().map(|d| d.0),
            written.and_then(|timeout| now.checked_add(timeout)),
            configured.and_then(|timeout| now.checked_add(timeout)),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

impl<S, ResBody> Attempts for Replay<S>
where
    S: Service<http::Request<Body>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError> + Send,
    ResBody: Default + Send + 'static,
{
    type Answer = Result<http::Response<ResBody>, S::Error>;
    type Sent = tower::util::Oneshot<S, http::Request<Body>>;

    /// The same request, marked with its previous attempts after the first, its timeout
    /// the time left or the per-attempt timeout, whichever ends first: the one place an
    /// attempt's `grpc-timeout` is written (the balancer's connection takes off it what
    /// the attempt then waits before its stream opens). Cut by the per-attempt timeout,
    /// the attempt also says so to the balancer below ([`PerAttemptTimeout`]).
    fn send(&mut self, attempt: &Attempt) -> Self::Sent {
        let mut request = http::Request::from_parts(
            self.parts.clone(),
            Body::new(http_body_util::Full::new(self.body.bytes.clone())),
        );
        wire::set_previous_attempts(request.headers_mut(), attempt.previous());
        let left = attempt.time_left();
        let timeout = match (left, self.per_try) {
            (left, Some(per_try)) if left.is_none_or(|left| per_try < left) => {
                request.extensions_mut().insert(PerAttemptTimeout(per_try));
                Some(per_try)
            }
            (left, _) => left,
        };
        if let Some(timeout) = timeout {
            wire::set_timeout(request.headers_mut(), timeout);
        }
        self.inner.clone().oneshot(request)
    }

    /// Committed once headers without a status arrive (or OK): a Trailers-Only answer (the
    /// status in the headers, how servers refuse a call at once) or no answer at all is a
    /// failure. An error without an answer is judged as tonic would judge it — a broken
    /// connection UNAVAILABLE — with the connection's own timer (the balancer's, or a
    /// tonic channel's) a DEADLINE_EXCEEDED and a request that never reached the server
    /// [`Verdict::Unprocessed`].
    fn judge(&self, answer: Self::Answer, deadline: Option<Instant>) -> Verdict<Self::Answer> {
        let failed = |status: Status| Verdict::Failed {
            answer: Ok(status.clone().into_http()),
            status,
        };
        match answer {
            Ok(response) => match wire::failure_in(response.headers()) {
                Some(status) if status.code() == Code::Cancelled => {
                    failed(uncancelled(status, deadline))
                }
                Some(status) => Verdict::Failed {
                    status,
                    answer: Ok(response),
                },
                None => Verdict::Committed(Ok(response)),
            },
            Err(error) => {
                let error: BoxError = error.into();
                if is_local_timeout(&*error) {
                    return failed(Status::deadline_exceeded(
                        "the call's deadline passed before an answer",
                    ));
                }
                if never_processed(&*error) {
                    let status = Status::unavailable(format!(
                        "the call never reached the server (its connection was closing or could not be made): {error}"
                    ));
                    return Verdict::Unprocessed {
                        answer: Ok(status.clone().into_http()),
                        status,
                    };
                }
                let status = transport_failure_as_unavailable(Status::from_error(error));
                failed(uncancelled(status, deadline))
            }
        }
    }

    fn failure(&self, status: Status) -> Self::Answer {
        Ok(status.into_http())
    }

    fn restate(
        &self,
        answer: Self::Answer,
        restate: impl FnOnce(Status) -> Status,
    ) -> Self::Answer {
        answer.map(|response| match wire::failure_in(response.headers()) {
            Some(status) => restate(status).into_http(),
            None => response,
        })
    }
}
