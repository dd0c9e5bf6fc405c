//! The public port's HTTP/2 server: hyper, with tonic's services inside, and nothing per
//! request that the node's own layers already do.
//!
//! tonic's `Server` wraps every request in its own timeout layer, which parses
//! `grpc-timeout` again and arms a second timer for the deadline that the node's
//! `DeadlineLayer` already keeps (and answers CANCELLED where ours answers
//! DEADLINE_EXCEEDED first); in a boxed service; and in a layer that copies the peer's
//! address into every request, which nothing here reads. Its router sends every call
//! through axum's path matching. Here a connection is served by hyper directly, a Payments
//! call goes straight to its generated server ([`Dispatch`]), and everything else (health,
//! reflection) to tonic's router. What tonic's server does that matters is kept: errors of
//! the layers become gRPC statuses (tonic's `RecoverError`), and stopping sends every
//! connection a GOAWAY and waits for its calls to finish.

use std::{
    convert::Infallible,
    future::Future,
    task::{Context, Poll},
};

use futures::{Stream, StreamExt, future::Either};
use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::{body::Body, server::NamedService, service::Routes};
use tower::{Service, ServiceExt};

use crate::{
    authz::PeerIdentity,
    limits::{Counted, Guarded},
};
use retrychain_tls::Tls;

/// The longest a TLS handshake may take on an accepted connection before it is closed.
pub const HANDSHAKE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// The connection a request came on, a number unique in this process: in every request's
/// extensions, so that callers without credentials can still be told apart (a plaintext
/// edge's fair shares: `crate::callers::fair_key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectionId(pub u64);

impl ConnectionId {
    fn next() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

/// The HTTP/2 settings of a port that faces untrusted clients (docs/contract.md's table).
#[derive(Debug, Clone, Copy)]
pub struct Http2Settings {
    /// Concurrent streams (calls) per connection.
    pub max_concurrent_streams: u32,
    /// The largest header block accepted.
    pub max_header_list_size: u32,
    /// Flow-control window per stream.
    pub stream_window: u32,
    /// Flow-control window per connection.
    pub connection_window: u32,
    /// Streams a peer may make this server reset for protocol errors before the
    /// connection is closed (the "rapid reset" class of abuse).
    pub max_local_error_reset_streams: usize,
    /// How often a connection is pinged.
    pub keepalive_interval: std::time::Duration,
    /// How long a ping may go unanswered before the connection is closed.
    pub keepalive_timeout: std::time::Duration,
}

/// Serves `service` over HTTP/2 (prior knowledge, as gRPC speaks it) on every connection
/// `incoming` yields, until `shutdown` completes. Then it stops accepting (the listener is
/// dropped at once, so new clients are refused rather than left waiting), sends every
/// connection a GOAWAY (calls in flight finish, no new ones start) and returns once all
/// have closed. A failed accept is logged and the next one awaited (`incoming` paces
/// them).
/// An error `service` answers with (rather than a response) resets the call's stream, as
/// under tonic's server; the node's stack answers its own refusals as gRPC statuses.
///
/// With `tls`, each connection first completes a TLS handshake (in its own task, within
/// [`HANDSHAKE_WITHIN`], so a slow or silent client holds up nobody else), and every request
/// on it carries the caller's [`PeerIdentity`]; a failed handshake closes the connection.
pub async fn serve_h2<I, IO, S, B, F>(
    incoming: I,
    service: S,
    settings: Http2Settings,
    tls: Option<Tls>,
    shutdown: F,
) where
    I: Stream<Item = std::io::Result<IO>>,
    IO: AsyncRead + AsyncWrite + Guarded + Unpin + Send + 'static,
    S: Service<http::Request<Body>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Error: Into<tower::BoxError>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<tower::BoxError>,
    F: Future<Output = ()>,
{
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(settings.max_concurrent_streams)
        .max_header_list_size(settings.max_header_list_size)
        .initial_stream_window_size(settings.stream_window)
        .initial_connection_window_size(settings.connection_window)
        .max_local_error_reset_streams(Some(settings.max_local_error_reset_streams))
        .keep_alive_interval(Some(settings.keepalive_interval))
        .keep_alive_timeout(settings.keepalive_timeout);
    // Stopping: `stop` tells every connection to send its GOAWAY; each connection's task
    // holds a clone of `open`, so `all_closed` ends once the last one has closed.
    let (stop, _) = tokio::sync::watch::channel(false);
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    let mut incoming = Box::pin(incoming);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let io = tokio::select! {
            () = &mut shutdown => break,
            io = incoming.next() => match io {
                Some(Ok(io)) => io,
                Some(Err(error)) => {
                    tracing::debug!(%error, "accepting a connection failed");
                    continue;
                }
                None => break,
            },
        };
        let (stopping, open) = (stop.subscribe(), open.clone());
        let connection_id = ConnectionId::next();
        let Some(tls) = &tls else {
            let service = TowerToHyperService::new(service.clone().map_request(
                move |request: http::Request<Incoming>| {
                    let mut request = request.map(Body::new);
                    request.extensions_mut().insert(connection_id);
                    request
                },
            ));
            let evicted = io.evicted();
            let connection = builder.serve_connection(TokioIo::new(io), service);
            tokio::spawn(async move {
                let _open = open;
                serve_until(connection, stopping, evicted).await;
            });
            continue;
        };
        let (tls, service, builder) = (tls.clone(), service.clone(), builder.clone());
        let mut io = io;
        let activity = io.activity();
        let evicted = io.evicted();
        io.handshake_starts();
        tokio::spawn(async move {
            let _open = open;
            // Material renewed after this handshake: the connection is closed gracefully,
            // so its client reconnects on the new (a rotated-out certificate or authority
            // stops authenticating anything within one call's time).
            let renewed = tls.renewed();
            let goaway = async move {
                tokio::select! {
                    () = renewed => tracing::debug!("TLS material renewed: a connection made with the old one is closed (GOAWAY; its calls finish)"),
                    () = evicted => {}
                }
            };
            let (mut stream, identity) = match tokio::time::timeout(
                HANDSHAKE_WITHIN,
                retrychain_tls::accept(&tls, io),
            )
            .await
            {
                Ok(Ok(accepted)) => accepted,
                Ok(Err(error)) => {
                    tracing::info!(%error, "a TLS handshake failed: connection closed");
                    return;
                }
                Err(_) => {
                    tracing::info!(within = ?HANDSHAKE_WITHIN, "a TLS handshake did not finish in time: connection closed");
                    return;
                }
            };
            stream.get_mut().0.handshake_done();
            let peer = PeerIdentity(identity);
            let service = TowerToHyperService::new(service.map_request(
                move |request: http::Request<Incoming>| {
                    let mut request = request.map(Body::new);
                    request.extensions_mut().insert(peer.clone());
                    request.extensions_mut().insert(connection_id);
                    request
                },
            ));
            // The plaintext is what tells a connection that makes requests from one that
            // only holds a slot.
            let stream = Counted::new(stream, activity);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            serve_until(connection, stopping, goaway).await;
        });
    }
    drop(incoming);
    let _ = stop.send(true);
    drop(open);
    let _ = all_closed.recv().await;
}

/// Serves `connection` until it ends; when the server stops (`stop`) or `goaway` completes
/// (the connection evicted to make room, or its TLS material renewed), it is sent a GOAWAY
/// first (calls in flight finish, no new ones start).
async fn serve_until<I, S, B, E>(
    connection: hyper::server::conn::http2::Connection<I, S, E>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    goaway: impl Future<Output = ()>,
) where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: http_body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    let mut connection = std::pin::pin!(connection);
    let mut goaway = std::pin::pin!(goaway);
    let mut closing = false;
    let ended = loop {
        tokio::select! {
            ended = connection.as_mut() => break ended,
            _ = stop.wait_for(|stop| *stop), if !closing => {
                connection.as_mut().graceful_shutdown();
                closing = true;
            }
            () = &mut goaway, if !closing => {
                connection.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    };
    if let Err(error) = ended {
        tracing::debug!(%error, "a connection ended with an error");
    }
}

/// Sends a call for `P`'s service straight to it, and every other request to `others`
/// (tonic's router: health, reflection, and UNIMPLEMENTED for anything unknown).
#[derive(Debug, Clone)]
pub struct Dispatch<P> {
    /// The service on the hot path (Payments).
    direct: P,
    /// The rest.
    others: Routes,
}

impl<P: NamedService> Dispatch<P> {
    /// `direct` for its own paths, `others` for the rest.
    pub fn new(direct: P, others: Routes) -> Self {
        Self { direct, others }
    }

    /// Whether `path` is a method of `P` (`/<P::NAME>/<method>`).
    fn is_direct(path: &str) -> bool {
        path.strip_prefix('/')
            .and_then(|path| path.strip_prefix(P::NAME))
            .and_then(|rest| rest.strip_prefix('/'))
            .is_some_and(|method| !method.is_empty() && !method.contains('/'))
    }
}

impl<P> Service<http::Request<Body>> for Dispatch<P>
where
    P: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + NamedService
        + Clone,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Either<P::Future, <Routes as Service<http::Request<Body>>>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Both are always ready today (tonic's generated servers and router are); asked
        // anyway, so that either may one day push back.
        match self.direct.poll_ready(cx) {
            Poll::Ready(Ok(())) => Service::<http::Request<Body>>::poll_ready(&mut self.others, cx),
            not_ready => not_ready,
        }
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if Self::is_direct(request.uri().path()) {
            Either::Left(self.direct.call(request))
        } else {
            Either::Right(self.others.call(request))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct Named;
    impl NamedService for Named {
        const NAME: &'static str = "retrychain.v1.Payments";
    }

    #[test]
    fn only_the_named_services_methods_go_direct() {
        let direct = Dispatch::<Named>::is_direct;
        assert!(direct("/retrychain.v1.Payments/Charge"));
        assert!(direct("/retrychain.v1.Payments/GetAccount"));
        for other in [
            "/retrychain.v1.Payments/",
            "/retrychain.v1.Payments",
            "/retrychain.v1.PaymentsX/Charge",
            "/retrychain.v1.Payments/Charge/x",
            "/retrychain.v1.Control/Fail",
            "/grpc.health.v1.Health/Check",
            "retrychain.v1.Payments/Charge",
            "",
        ] {
            assert!(!direct(other), "{other}");
        }
    }
}
