//! One replica's HTTP/2 connection, held by the balancer itself, on the `h2` crate.
//!
//! Neither a tonic `Channel` nor hyper's client: each puts tasks between a call and its
//! stream. A `Channel` puts a `tower::Buffer` in front of its connection — each call handed
//! through a queue to a worker task that sends it on, its answer handed back. Under it,
//! hyper's HTTP/2 client hands each request through a second queue to the connection's
//! task, which opens the stream and then spawns a task per request to wait for its answer
//! and hand that back. A relayed call paid two queues, a spawned task and four wake-ups
//! at each hop, for nothing the balancer needs: it picks a replica per attempt, and HTTP/2
//! multiplexes the calls on one connection.
//!
//! Here the calling task opens the stream itself (`h2::client::SendRequest`), writes the
//! request's body into it and waits for the answer on it; the connection's one task only
//! reads and writes the socket. What the channel and hyper did besides is done here:
//!
//! - the connection is opened on first use and again once it has ended (or refused a new
//!   stream); one opening at a time, in a task of its own shared by every call that waits
//!   for it, within [`CONNECT_TIMEOUT`];
//! - a connection that could not be opened fails the call as `tonic::ConnectError`, and a
//!   stream the connection would not open as [`NeverSent`]: both are known to
//!   [`never_processed`](crate::classify::never_processed) — the request never left, so
//!   sending it again is safe. A connection found ended or ending (a GOAWAY) before the
//!   stream is opened is first replaced, once, for the same call;
//! - no more streams at once than the server allows (its `SETTINGS_MAX_CONCURRENT_STREAMS`):
//!   a call past the limit waits here, outside `h2`, for one of them to end. `h2` would
//!   queue it unwritten, and should the connection then break, fail it like a stream the
//!   server had been sent, possibly processed; waiting here, it is never sent, and goes on
//!   a new connection or fails as [`NeverSent`];
//! - the attempt's timer (its `grpc-timeout`, or the per-attempt timeout), its expiry
//!   `tonic::TimeoutExpired` (what [`is_local_timeout`](crate::classify::is_local_timeout)
//!   knows): a replica that never answers costs the attempt its time and no more; an
//!   attempt given up resets its stream (CANCEL), as dropping any `h2` stream does;
//! - the time the replica is told it has is what is left when the stream opens: a wait
//!   here (for the connection to open, for a place within the server's limit on streams)
//!   is taken off the request's `grpc-timeout`. Under 1,500 calls in flight a call waited
//!   1.8 s for a place and the hop below was still told its whole time. (What passes
//!   after the stream opens — the headers in transit, a busy server reading them — no
//!   relative timeout carries; each hop's margin is for that);
//! - the request's URI gets the replica's scheme and authority (`:scheme`, `:authority`),
//!   and a `user-agent`; the answer's body gives back its flow-control window as it is
//!   read;
//! - hyper's HTTP/2 client settings (its windows, frame and header-list sizes, send
//!   buffer, no server push).
//!
//! A request's body in memory (the retry engine's replay buffer, a relay's forwarded
//! frame: every unary call) is written whole by the calling task before it awaits the
//! answer. A body still coming (one too large to buffer for replay) is written by a task
//! of its own at the pace the stream's window allows, as hyper's client does.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError, Weak,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures::{FutureExt, future::Shared};
use h2::{RecvStream, SendStream, client::SendRequest};
use http::{HeaderValue, Uri, header::USER_AGENT, uri::PathAndQuery};
use http_body::{Body as _, Frame};
use http_body_util::BodyExt;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::Semaphore,
    time::Instant,
};
use tonic::body::Body;
use tower::BoxError;

use crate::{classify::NeverSent, wire};

/// How long opening a connection may take, TLS handshake included.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A wait before the stream opens shorter than this is left in the request's
/// `grpc-timeout`, as the network's own delay is (each hop's margin covers both); a longer
/// one is taken off it. Rewriting the header for every call would cost each a formatting
/// for microseconds nobody below acts on.
const WAIT_TAKEN_OFF: Duration = Duration::from_millis(1);

/// How many streams a new connection opens at once before the server's own limit is
/// known (hyper's client's figure).
const INITIAL_MAX_SEND_STREAMS: usize = 100;

/// Sent on every call (gRPC's `user-agent`: the client's name and version).
const AGENT: HeaderValue =
    HeaderValue::from_static(concat!("retrychain/", env!("CARGO_PKG_VERSION")));

/// An open byte stream to a replica, plain TCP or TLS.
pub(super) trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Opens a byte stream to the URI's host and port.
pub(super) type Dial = Arc<dyn Fn(Uri) -> BoxFuture<Result<Box<dyn Io>, BoxError>> + Send + Sync>;

/// Why a connection could not be opened, kept for every call that waited on the attempt.
#[derive(Debug, Clone, thiserror::Error)]
#[error("could not connect to {url}: {reason}")]
pub(super) struct Unreachable {
    url: String,
    reason: String,
}

/// A replica's URL without a scheme and a host.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a URL with a scheme and a host")]
pub(super) struct BadUrl(String);

/// An opening's result, shared by every call that waits for it.
type Opening = Shared<BoxFuture<Result<Opened, Unreachable>>>;

/// An open connection: its sender, and the count of its streams against the server's
/// limit.
#[derive(Clone)]
struct Opened {
    sender: SendRequest<Bytes>,
    streams: Arc<Streams>,
}

/// The streams a connection may still open: one permit for each the server allows at
/// once (its `SETTINGS_MAX_CONCURRENT_STREAMS`, as `h2` last read it) and this side has
/// not opened. A call takes one before its stream is opened and gives it back once `h2`
/// has let the stream go (its answer read to the end, or it was reset), so `h2` itself
/// holds no stream back for the limit. Not quite: `h2` counts a stream it reset until
/// its RST_STREAM is written, a moment on a connection that writes, but on one that
/// cannot (its path black-holed, its peer's window full) until the connection ends; a
/// call given that place meanwhile waits in `h2` and, should the connection break, fails
/// as possibly processed (the retry policy's case, and the idempotency key's). Closed
/// when the connection ends or refuses a stream: the calls waiting then were never sent.
struct Streams {
    free: Semaphore,
    /// What the permits add up to, and how many of those out are not to come back (the
    /// server lowered its limit while they were out).
    limit: Mutex<Limit>,
}

struct Limit {
    total: usize,
    owed: usize,
}

/// A stream's place within the server's limit, given back when dropped.
struct Slot(Arc<Streams>);

/// The connection ended, or began refusing new streams, while a call waited for a
/// stream; it was never sent.
#[derive(Debug, thiserror::Error)]
#[error("the connection ended while the call waited for the server's limit on streams at once")]
struct Ended;

impl Streams {
    /// As many permits as `h2` lets a new connection open before the server's own limit is
    /// known (`initial_max_send_streams`).
    fn new(initial: usize) -> Arc<Self> {
        Arc::new(Self {
            free: Semaphore::new(initial),
            limit: Mutex::new(Limit {
                total: initial,
                owed: 0,
            }),
        })
    }

    /// A place for one more stream, waited for while the server's limit is reached.
    async fn slot(self: &Arc<Self>) -> Result<Slot, Ended> {
        self.free.acquire().await.map_err(|_| Ended)?.forget();
        Ok(Slot(self.clone()))
    }

    /// The permits made to add up to the server's new `limit` (only the task driving the
    /// connection, which sees its settings, calls this): more given, or fewer — those free
    /// forgotten at once, those out kept when they come back.
    fn resize(&self, limit: usize) {
        let mut now = self.limit.lock().unwrap_or_else(PoisonError::into_inner);
        if limit > now.total {
            let more = limit - now.total;
            let repaid = more.min(now.owed);
            now.owed -= repaid;
            self.free.add_permits(more - repaid);
        } else {
            let fewer = now.total - limit;
            now.owed += fewer - self.free.forget_permits(fewer);
        }
        now.total = limit;
    }

    /// A stream let go: its permit back, unless a lowered limit is owed it (under the
    /// lock, so that a lowering cannot count as owed a permit already given back).
    fn release(&self) {
        let mut now = self.limit.lock().unwrap_or_else(PoisonError::into_inner);
        if now.owed > 0 {
            now.owed -= 1;
        } else {
            self.free.add_permits(1);
        }
    }
}

/// Closes a connection's count when the task driving the connection ends, however it
/// ends: the calls still waiting for a stream were never sent.
struct CloseOnDrop(Arc<Streams>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.free.close();
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// What the connection is doing. Each opening is numbered; whoever ends one (the task that
/// opened it, the task that drives it, a call it refused) changes the state only while it
/// is still that opening's.
enum State {
    /// None open: the next call opens one.
    Closed,
    /// Being opened by a task of its own, which runs to its end whether or not a call
    /// still waits for it, and then leaves `Open` or `Closed`.
    Opening(Opening, u64),
    /// Open, until its task ends or it refuses a new stream.
    Open(Opened, u64),
}

impl State {
    fn attempt(&self) -> Option<u64> {
        match self {
            Self::Closed => None,
            Self::Opening(_, attempt) | Self::Open(_, attempt) => Some(*attempt),
        }
    }
}

/// One replica's connection (see the module's documentation).
pub(super) struct Connection {
    /// `scheme://authority`, also what a dial is given.
    origin: Uri,
    dial: Dial,
    /// Shared with the tasks that open and drive the connection, which update it.
    state: Arc<Mutex<State>>,
    /// Numbers the openings.
    attempts: AtomicU64,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// A connection to `url` (`http://host:port`), opened by `dial` when it is needed.
    pub(super) fn new(url: &str, dial: Dial) -> Result<Self, BadUrl> {
        let bad = || BadUrl(url.to_owned());
        let mut parts = url.parse::<Uri>().map_err(|_| bad())?.into_parts();
        if parts.scheme.is_none() || parts.authority.is_none() {
            return Err(bad());
        }
        parts.path_and_query = Some(PathAndQuery::from_static("/"));
        Ok(Self {
            origin: Uri::from_parts(parts).map_err(|_| bad())?,
            dial,
            state: Arc::new(Mutex::new(State::Closed)),
            attempts: AtomicU64::new(0),
        })
    }

    /// Sends `request`, on the open connection or on one opened for it, failing it with
    /// `tonic::TimeoutExpired` when no answer has come within `timeout` (its
    /// `grpc-timeout`, or a shorter one), the opening included.
    pub(super) async fn send(
        &self,
        request: http::Request<Body>,
        timeout: Option<Duration>,
    ) -> Result<http::Response<Body>, BoxError> {
        let sent = self.exchange(request, timeout.map(|timeout| (Instant::now(), timeout)));
        match timeout {
            Some(timeout) => match tokio::time::timeout(timeout, sent).await {
                Ok(answer) => answer,
                Err(_) => Err(Box::new(tonic::TimeoutExpired(()))),
            },
            None => sent.await,
        }
    }

    /// One request and its answer's head, on a stream of this connection; `timer` is when
    /// the attempt's timer began and how long it runs.
    async fn exchange(
        &self,
        request: http::Request<Body>,
        timer: Option<(Instant, Duration)>,
    ) -> Result<http::Response<Body>, BoxError> {
        let (mut sender, slot) = self.ready().await?;
        let (mut head, body) = request.into_parts();
        self.address(&mut head);
        if let Some((began, timeout)) = timer {
            let waited = began.elapsed();
            if waited >= WAIT_TAKEN_OFF {
                match timeout.checked_sub(waited) {
                    Some(left) if left >= WAIT_TAKEN_OFF => {
                        if head.headers.contains_key(&wire::names::TIMEOUT) {
                            wire::set_timeout(&mut head.headers, left);
                        }
                    }
                    // Spent waiting, or as good as: never sent (the replica could only
                    // refuse it, and the timer would reset it a moment later).
                    _ => return Err(Box::new(tonic::TimeoutExpired(()))),
                }
            }
        }
        let in_memory = body.size_hint().exact().is_some();
        let ends = body.is_end_stream();
        let (answer, stream) = sender
            .0
            .send_request(http::Request::from_parts(head, ()), ends)
            .map_err(|error| {
                if error.is_io() || error.is_go_away() || error.is_remote() {
                    // The connection ended between `ready` and now: nothing was written.
                    self.refused(sender.1, Box::new(error))
                } else {
                    // A request h2 will not write (a connection-specific header, say): a
                    // fault of the caller's, not the connection's.
                    Box::new(tonic::Status::internal(format!(
                        "the request could not be sent: {error}"
                    )))
                }
            })?;
        let (written, slot) = match (ends, in_memory) {
            (true, _) => (Ok(()), Held::Alone(slot)),
            (false, true) => (write_body(body, stream, false).await, Held::Alone(slot)),
            // A body still coming (one too large to buffer for replay) is written by a
            // task of its own, at the pace the stream's window allows, as hyper's client
            // does: the answer may come first. The stream's place is let go when both
            // its halves are.
            (false, false) => {
                let slot = Arc::new(slot);
                let writer = slot.clone();
                tokio::spawn(async move {
                    if let Err(error) = write_body(body, stream, true).await {
                        tracing::debug!(%error, "a request's body could not be written whole");
                    }
                    drop(writer);
                });
                (Ok(()), Held::Shared(slot))
            }
        };
        // Declared after the slot, so dropped before it when the call is given up: `h2`
        // lets the stream go (a reset) before its place is given back.
        let answer = answer;
        // An answer that came is the answer, even if the body could not all be written
        // (a server may answer, and reset the stream, before it has read it all). Without
        // one, the stream's error says why (a reset's reason), unless the body itself
        // failed here.
        match answer.await {
            Ok(response) => Ok(response.map(|stream| Body::new(Incoming::new(stream, slot)))),
            Err(error) => match written {
                Err(failed) if failed.is::<tonic::Status>() => Err(failed),
                _ => Err(Box::new(error)),
            },
        }
    }

    /// A sender that may open a stream now, with its opening's number, and the stream's
    /// place within the server's limit (waited for while the limit is reached). A
    /// connection found ended, or ending (a GOAWAY received), or that ended while the call
    /// waited, is replaced once: nothing of the request has been written yet, so the call
    /// loses nothing and the replica is not blamed for it.
    async fn ready(&self) -> Result<((SendRequest<Bytes>, u64), Slot), BoxError> {
        let mut replaced = false;
        loop {
            let (opened, attempt) = self.sender().await?;
            let ready = match opened.streams.slot().await {
                Ok(slot) => match opened.sender.ready().await {
                    Ok(sender) => Ok((sender, slot)),
                    Err(error) => {
                        // Ending (a GOAWAY) or ended: the calls waiting for one of its
                        // streams go to the next connection too, now.
                        opened.streams.free.close();
                        Err(BoxError::from(error))
                    }
                },
                Err(ended) => Err(BoxError::from(ended)),
            };
            match ready {
                Ok((sender, slot)) => return Ok(((sender, attempt), slot)),
                Err(error) if replaced => return Err(self.refused(attempt, error)),
                Err(error) => {
                    let _ = self.refused(attempt, error);
                    replaced = true;
                }
            }
        }
    }

    /// The request's URI made absolute with the replica's origin, and the user-agent.
    fn address(&self, head: &mut http::request::Parts) {
        let mut parts = self.origin.clone().into_parts();
        parts.path_and_query = head.uri.path_and_query().cloned();
        if let Ok(uri) = Uri::from_parts(parts) {
            head.uri = uri;
        }
        // A user-agent the request already carries is kept.
        head.headers.entry(USER_AGENT).or_insert(AGENT);
    }

    /// The connection would not open a stream: it has ended, or is ending (a GOAWAY). The
    /// next call opens another; this one fails as never sent.
    fn refused(&self, attempt: u64, error: BoxError) -> BoxError {
        settle(&Arc::downgrade(&self.state), attempt, State::Closed);
        Box::new(NeverSent(error))
    }

    /// The open connection and its opening's number, opening one when there is none.
    async fn sender(&self) -> Result<(Opened, u64), BoxError> {
        let (opening, attempt) = {
            let mut state = lock(&self.state);
            match &*state {
                State::Open(opened, attempt) => return Ok((opened.clone(), *attempt)),
                State::Opening(opening, attempt) => (opening.clone(), *attempt),
                State::Closed => {
                    let attempt = self.attempts.fetch_add(1, Ordering::Relaxed);
                    let opening = self.open(attempt);
                    *state = State::Opening(opening.clone(), attempt);
                    (opening, attempt)
                }
            }
        };
        match opening.await {
            Ok(opened) => Ok((opened, attempt)),
            Err(unreachable) => Err(Box::new(tonic::ConnectError(Box::new(unreachable)))),
        }
    }

    /// Opening `attempt`, in a task of its own so that it ends within [`CONNECT_TIMEOUT`]
    /// even when every call that waited for it has given up (a call that comes later
    /// finds it open, or tries again): dial, then HTTP/2's handshake. The connection is
    /// then driven by another task until it ends — when the replica leaves and the last
    /// sender is dropped, or the socket fails — which then closes the state.
    fn open(&self, attempt: u64) -> Opening {
        let url = self.origin.to_string().trim_end_matches('/').to_owned();
        let dial = (self.dial)(self.origin.clone());
        let state = Arc::downgrade(&self.state);
        let task = tokio::spawn({
            let (url, state) = (url.clone(), state.clone());
            async move {
                let opened = match handshake(dial, CONNECT_TIMEOUT).await {
                    Ok((sender, connection)) => {
                        let streams = Streams::new(INITIAL_MAX_SEND_STREAMS);
                        let (url, state) = (url.clone(), state.clone());
                        let ended = CloseOnDrop(streams.clone());
                        tokio::spawn(async move {
                            if let Err(error) = drive(connection, &ended.0).await {
                                tracing::debug!(%url, %error, "connection to a replica ended");
                            }
                            settle(&state, attempt, State::Closed);
                        });
                        Ok(Opened { sender, streams })
                    }
                    Err(reason) => Err(Unreachable { url, reason }),
                };
                let next = match &opened {
                    Ok(opened) => State::Open(opened.clone(), attempt),
                    // The next call tries again.
                    Err(_) => State::Closed,
                };
                settle(&state, attempt, next);
                opened
            }
        });
        async move {
            task.await.unwrap_or_else(|error| {
                settle(&state, attempt, State::Closed);
                Err(Unreachable {
                    url,
                    reason: format!("the task opening the connection failed: {error}"),
                })
            })
        }
        .boxed()
        .shared()
    }
}

/// Drives `connection` (its frames read and written) until it ends, and keeps its count
/// of streams at the server's limit: each poll is where `h2` applies the server's
/// settings, so calls waiting for a place go as soon as a raised limit comes (a new
/// connection assumes 100 until the first settings), not when a stream ends. No limit
/// announced counts as the most the count can hold.
async fn drive(
    mut connection: h2::client::Connection<Box<dyn Io>, Bytes>,
    streams: &Streams,
) -> Result<(), h2::Error> {
    let mut known = INITIAL_MAX_SEND_STREAMS;
    std::future::poll_fn(|cx| {
        let polled = Pin::new(&mut connection).poll(cx);
        let limit = connection
            .max_concurrent_send_streams()
            .min(Semaphore::MAX_PERMITS / 2);
        if limit != known {
            streams.resize(limit);
            known = limit;
        }
        polled
    })
    .await
}

/// Sets the state to `next` if it is still opening `attempt`'s.
fn settle(state: &Weak<Mutex<State>>, attempt: u64, next: State) {
    let Some(state) = state.upgrade() else { return };
    let mut state = lock(&state);
    if state.attempt() == Some(attempt) {
        *state = next;
    }
}

/// The state, whether or not a panic poisoned its lock (every change to it is one
/// assignment, so it is never left half made).
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

type Handshaken = (
    SendRequest<Bytes>,
    h2::client::Connection<Box<dyn Io>, Bytes>,
);

/// Dials, then makes HTTP/2's handshake, within `limit`, with hyper's client settings.
async fn handshake(
    dial: BoxFuture<Result<Box<dyn Io>, BoxError>>,
    limit: Duration,
) -> Result<Handshaken, String> {
    let handshake = async {
        let io = dial.await.map_err(|error| error.to_string())?;
        h2::client::Builder::new()
            .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
            .initial_window_size(2 * 1024 * 1024)
            .initial_connection_window_size(5 * 1024 * 1024)
            .max_frame_size(16 * 1024)
            .max_header_list_size(16 * 1024)
            .max_send_buffer_size(1024 * 1024)
            .max_local_error_reset_streams(Some(1024))
            .enable_push(false)
            .handshake::<_, Bytes>(io)
            .await
            .map_err(|error| format!("HTTP/2 handshake: {error}"))
    };
    tokio::time::timeout(limit, handshake)
        .await
        .map_err(|_| format!("no connection within {limit:?}"))?
}

/// Writes `body` into the request's stream, ending it. `paced` (a body still coming):
/// each chunk waits until the stream's window has room for it; else (a body in memory)
/// each goes at once, the last one ending the stream itself. A body that fails resets the
/// stream (CANCEL) and fails the call.
async fn write_body(
    mut body: Body,
    mut stream: SendStream<Bytes>,
    paced: bool,
) -> Result<(), BoxError> {
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => {
                stream.send_reset(h2::Reason::CANCEL);
                return Err(Box::new(error));
            }
        };
        let mut data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    stream.send_trailers(trailers)?;
                    return Ok(());
                }
                continue;
            }
        };
        let ends = body.is_end_stream();
        if !paced {
            stream.send_data(data, ends)?;
            if ends {
                return Ok(());
            }
            continue;
        }
        while !data.is_empty() {
            stream.reserve_capacity(data.len());
            let room = match std::future::poll_fn(|cx| stream.poll_capacity(cx)).await {
                Some(room) => room?,
                None => return Err("the stream closed before its body was written".into()),
            };
            if room > 0 {
                let chunk = data.split_to(room.min(data.len()));
                stream.send_data(chunk, false)?;
            }
        }
        if ends {
            break;
        }
    }
    stream.send_data(Bytes::new(), true)?;
    Ok(())
}

/// An answer's body, its data's flow-control window given back as each frame is read.
/// A reset with NO_ERROR ends it, not fails it: RFC 9113 §8.1, a server that has answered
/// before reading the whole request.
struct Incoming {
    stream: RecvStream,
    /// Whether the data has ended: the trailers are next.
    data_done: bool,
    /// The stream's place within the server's limit; dropped after `stream` (fields drop
    /// in order), so that `h2` has let the stream go first.
    _slot: Held,
}

/// A stream's place, held by its answer alone, or also by the task still writing its body.
#[expect(dead_code, reason = "held only to be dropped with the stream")]
enum Held {
    Alone(Slot),
    Shared(Arc<Slot>),
}

impl Incoming {
    fn new(stream: RecvStream, slot: Held) -> Self {
        Self {
            stream,
            data_done: false,
            _slot: slot,
        }
    }
}

impl http_body::Body for Incoming {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let early = |error: h2::Error| {
            if error.reason() == Some(h2::Reason::NO_ERROR) {
                None
            } else {
                Some(Err(error))
            }
        };
        if !self.data_done {
            match self.stream.poll_data(cx) {
                Poll::Ready(Some(Ok(data))) => {
                    let _ = self.stream.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(Some(Err(error))) => return Poll::Ready(early(error)),
                Poll::Ready(None) => self.data_done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
        match self.stream.poll_trailers(cx) {
            Poll::Ready(Ok(trailers)) => Poll::Ready(trailers.map(|t| Ok(Frame::trailers(t)))),
            Poll::Ready(Err(error)) => Poll::Ready(early(error)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.stream.is_end_stream()
    }
}

/// How long data sent to a replica may go unacknowledged (or a dead idle connection go
/// unprobed) before the kernel gives the connection up (`TCP_USER_TIMEOUT`). A replica whose
/// host vanished, or whose path black-holes packets, acknowledges nothing; without a bound,
/// TCP retransmits with a doubling delay for some fifteen minutes, and every call on the
/// connection waits out its deadline meanwhile — even after the path is back, until the
/// next retransmission (a partition of 20 s leaves the next one some 5 s after it healed,
/// one of 60 s up to 40 s). Shorter than the chain's partitions, longer than any call's
/// silence on a live path. A paused process's kernel acknowledges what arrives until its
/// receive buffer is full; since Linux 5.11 the bound also ends a connection whose peer
/// has shown a zero window for that long, so a replica paused past it under load loses
/// its connection too, as with gRPC's own clients, which set the same option: the calls
/// on it fail as possibly processed (their keys make a retry safe), and the next ones go
/// on a new connection, which the paused kernel accepts, and wait there as before: for
/// the replica to resume, or for their timeouts (and, over replicas, ejection).
pub(super) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// Dials plain TCP (see [`dial`]).
pub(super) fn tcp() -> Dial {
    Arc::new(|uri: Uri| Box::pin(async move { Ok(Box::new(dial(&uri).await?) as Box<dyn Io>) }))
}

/// Opens the TCP connection under every connection to a replica, TLS or not: without
/// Nagle's delay (a call's frames go out as they are written), given up by the kernel
/// after [`TCP_USER_TIMEOUT`] without an acknowledgement, and probed while idle (TCP
/// keepalive, answered by the peer's kernel) so that a dead idle connection is found
/// before a call meets it. A name that resolves to several addresses has them tried in
/// turn, each given its share of [`CONNECT_TIMEOUT`], so that one that does not answer
/// leaves time for the next.
pub(super) async fn dial(uri: &Uri) -> Result<tokio::net::TcpStream, BoxError> {
    let host = uri
        .host()
        .ok_or("the URL names no host")?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let default_port = if uri.scheme_str() == Some("https") {
        443
    } else {
        80
    };
    let port = uri.port_u16().unwrap_or(default_port);
    let addresses: Vec<_> = tokio::net::lookup_host((host.as_str(), port))
        .await?
        .collect();
    let share = CONNECT_TIMEOUT / u32::try_from(addresses.len().max(1)).unwrap_or(1);
    let mut failures = Vec::new();
    for address in addresses {
        match tokio::time::timeout(share, tokio::net::TcpStream::connect(address)).await {
            Ok(Ok(tcp)) => {
                tcp.set_nodelay(true)?;
                let socket = socket2::SockRef::from(&tcp);
                // Where the system has the option (Linux, as the chain is deployed);
                // elsewhere keepalive alone.
                #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
                socket.set_tcp_user_timeout(Some(TCP_USER_TIMEOUT))?;
                socket.set_tcp_keepalive(
                    &socket2::TcpKeepalive::new()
                        .with_time(TCP_USER_TIMEOUT / 2)
                        .with_interval(TCP_USER_TIMEOUT / 4)
                        .with_retries(2),
                )?;
                return Ok(tcp);
            }
            Ok(Err(error)) => failures.push(format!("{address}: {error}")),
            Err(_) => failures.push(format!("{address}: no answer within {share:?}")),
        }
    }
    if failures.is_empty() {
        return Err(format!("{host} resolved to no address").into());
    }
    Err(failures.join("; ").into())
}

#[cfg(test)]
mod tests;
