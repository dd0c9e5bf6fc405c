//! One replica's HTTP/2 connection, held by the balancer itself rather than by a tonic
//! `Channel`.
//!
//! A `Channel` puts a `tower::Buffer` in front of its connection: each call is handed
//! through a queue to a worker task that sends it on, and its answer handed back — a
//! task hop and two wake-ups a call, for a queue the balancer has no use for (it picks a
//! replica per call, and HTTP/2 multiplexes the calls on one connection). Here a call
//! goes straight to hyper's `SendRequest`. What the channel did besides is done here:
//!
//! - the connection is opened on first use and again once it has closed; one opening at
//!   a time, shared by every call that waits for it, within [`CONNECT_TIMEOUT`];
//! - a connection that could not be opened fails the call as `tonic::ConnectError`, which
//!   [`never_processed`](crate::classify::never_processed) knows: the request never left,
//!   so sending it again is safe;
//! - the call's `grpc-timeout` is kept by a timer (the balancer's, one per attempt), its
//!   expiry `tonic::TimeoutExpired` (what
//!   [`is_local_timeout`](crate::classify::is_local_timeout) knows), so a replica that
//!   never answers costs the call its deadline and no more;
//! - the request's URI gets the replica's scheme and authority (`:scheme`, `:authority`),
//!   and a `user-agent`.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{FutureExt, future::Shared};
use http::{HeaderValue, Uri, header::USER_AGENT, uri::PathAndQuery};
use hyper::client::conn::http2::{Builder, SendRequest};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tonic::body::Body;
use tower::BoxError;

/// How long opening a connection may take, TLS handshake included.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Sent on every call (gRPC's `user-agent`: the client's name and version).
const AGENT: HeaderValue =
    HeaderValue::from_static(concat!("retrychain/", env!("CARGO_PKG_VERSION")));

/// An open byte stream to a replica, plain TCP or TLS.
pub(super) trait Io: hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static {}
impl<T: hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static> Io for T {}

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
type Opening = Shared<BoxFuture<Result<SendRequest<Body>, Unreachable>>>;

/// What the connection is doing.
enum State {
    /// None open: the next call opens one.
    Closed,
    /// Being opened by a task of its own (the attempt numbered `.1`), which runs to its
    /// end whether or not a call still waits for it, and then leaves `Open` or `Closed`.
    Opening(Opening, u64),
    /// Open (until hyper says it closed).
    Open(SendRequest<Body>),
}

/// One replica's connection (see the module's documentation).
pub(super) struct Connection {
    /// `scheme://authority`, also what a dial is given.
    origin: Uri,
    dial: Dial,
    /// Shared with the task opening the connection, which updates it.
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
            attempts: Default::default(),
        })
    }

    /// Sends `request`, on the open connection or on one opened for it, failing it with
    /// `tonic::TimeoutExpired` when no answer has come within `timeout` (its
    /// `grpc-timeout`, or a shorter one), the opening included.
    pub(super) async fn send(
        &self,
        mut request: http::Request<Body>,
        timeout: Option<Duration>,
    ) -> Result<http::Response<Body>, BoxError> {
        let sent = async {
            let mut sender = self.sender().await?;
            self.address(&mut request);
            let response = sender.send_request(request).await?;
            Ok::<_, BoxError>(response.map(Body::new))
        };
        match timeout {
            Some(timeout) => match tokio::time::timeout(timeout, sent).await {
                Ok(answer) => answer,
                Err(_) => Err(Box::new(tonic::TimeoutExpired(()))),
            },
            None => sent.await,
        }
    }

    /// The request's URI made absolute with the replica's origin, and the user-agent.
    fn address(&self, request: &mut http::Request<Body>) {
        let mut parts = self.origin.clone().into_parts();
        parts.path_and_query = request.uri().path_and_query().cloned();
        if let Ok(uri) = Uri::from_parts(parts) {
            *request.uri_mut() = uri;
        }
        // A user-agent the request already carries is kept.
        request.headers_mut().entry(USER_AGENT).or_insert(AGENT);
    }

    /// The open connection's sender, opening one when there is none.
    async fn sender(&self) -> Result<SendRequest<Body>, BoxError> {
        let opening = {
            let mut state = lock(&self.state);
            match &*state {
                State::Open(sender) if !sender.is_closed() => return Ok(sender.clone()),
                State::Opening(opening, _) => opening.clone(),
                State::Open(_) | State::Closed => {
                    let attempt = self.attempts.fetch_add(1, Ordering::Relaxed);
                    let opening = self.open(attempt);
                    *state = State::Opening(opening.clone(), attempt);
                    opening
                }
            }
        };
        opening
            .await
            .map_err(|unreachable| Box::new(tonic::ConnectError(Box::new(unreachable))) as _)
    }

    /// One attempt to open the connection, in a task of its own so that it ends within
    /// [`CONNECT_TIMEOUT`] even when every call that waited for it has given up (a call
    /// that comes later finds it open, or tries again): dial, then HTTP/2's handshake;
    /// the connection then driven by another task until it closes (when the replica
    /// leaves, the last sender is dropped and it closes).
    fn open(&self, attempt: u64) -> Opening {
        let url = self.origin.to_string().trim_end_matches('/').to_owned();
        let dial = (self.dial)(self.origin.clone());
        let state = Arc::downgrade(&self.state);
        let settle = move |opened: &Result<SendRequest<Body>, Unreachable>| {
            let Some(state) = state.upgrade() else { return };
            let mut state = lock(&state);
            if matches!(&*state, State::Opening(_, current) if *current == attempt) {
                *state = match opened {
                    Ok(sender) => State::Open(sender.clone()),
                    // The next call tries again.
                    Err(_) => State::Closed,
                };
            }
        };
        let task = tokio::spawn({
            let url = url.clone();
            let settle = settle.clone();
            async move {
                let opened = handshake(dial, CONNECT_TIMEOUT)
                    .await
                    .map(|(sender, connection)| {
                        let url = url.clone();
                        tokio::spawn(async move {
                            if let Err(error) = connection.await {
                                tracing::debug!(%url, %error, "connection to a replica closed");
                            }
                        });
                        sender
                    })
                    .map_err(|reason| Unreachable {
                        url: url.clone(),
                        reason,
                    });
                settle(&opened);
                opened
            }
        });
        async move {
            task.await.unwrap_or_else(|error| {
                let failed = Err(Unreachable {
                    url,
                    reason: format!("the task opening the connection failed: {error}"),
                });
                settle(&failed);
                failed
            })
        }
        .boxed()
        .shared()
    }
}

/// The state, whether or not a panic poisoned its lock (every change to it is one
/// assignment, so it is never left half made).
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

type Handshaken = (
    SendRequest<Body>,
    hyper::client::conn::http2::Connection<Box<dyn Io>, Body, TokioExecutor>,
);

/// Dials, then makes HTTP/2's handshake, within `limit`.
async fn handshake(
    dial: BoxFuture<Result<Box<dyn Io>, BoxError>>,
    limit: Duration,
) -> Result<Handshaken, String> {
    let handshake = async {
        let io = dial.await.map_err(|error| error.to_string())?;
        Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake::<_, Body>(io)
            .await
            .map_err(|error| format!("HTTP/2 handshake: {error}"))
    };
    tokio::time::timeout(limit, handshake)
        .await
        .map_err(|_| format!("no connection within {limit:?}"))?
}

/// Dials plain TCP, without Nagle's delay (a call's frames go out as they are written).
/// A name that resolves to several addresses has them tried in turn, each given its share
/// of [`CONNECT_TIMEOUT`], so that one that does not answer leaves time for the next.
pub(super) fn tcp() -> Dial {
    Arc::new(|uri: Uri| {
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or("the URL names no host")?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().unwrap_or(80);
            let addresses: Vec<_> = tokio::net::lookup_host((host.as_str(), port))
                .await?
                .collect();
            let share = CONNECT_TIMEOUT / u32::try_from(addresses.len().max(1)).unwrap_or(1);
            let mut failures = Vec::new();
            for address in addresses {
                match tokio::time::timeout(share, tokio::net::TcpStream::connect(address)).await {
                    Ok(Ok(tcp)) => {
                        tcp.set_nodelay(true)?;
                        return Ok(Box::new(TokioIo::new(tcp)) as Box<dyn Io>);
                    }
                    Ok(Err(error)) => failures.push(format!("{address}: {error}")),
                    Err(_) => failures.push(format!("{address}: no answer within {share:?}")),
                }
            }
            if failures.is_empty() {
                return Err(format!("{host} resolved to no address").into());
            }
            Err(failures.join("; ").into())
        })
    })
}

#[cfg(test)]
mod tests;
