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
        // gRPC reads no `date`; hyper would format one into every answer and HPACK-encode it.
        .auto_date_header(false)
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

    use std::{
        net::SocketAddr,
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        time::Duration,
    };

    use bytes::Bytes;
    use h2::{Reason, RecvStream};
    use http_body::Frame;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
        sync::{Notify, oneshot},
        time::{Instant, timeout},
    };

    use crate::limits::{ConnectionLimits, Refusal};

    const fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// A server on a loopback port answering with `service`, pinged every `ping_every`
    /// and closed when a ping is not answered within `ping_within`; it stops when the
    /// returned sender is dropped, and the handle ends once it has.
    async fn server<S>(
        service: S,
        ping_every: Duration,
        ping_within: Duration,
    ) -> (SocketAddr, oneshot::Sender<()>, tokio::task::JoinHandle<()>)
    where
        S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
        S::Error: Into<tower::BoxError>,
        S::Future: Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let settings = Http2Settings {
            max_concurrent_streams: 100,
            max_header_list_size: 16 * 1024,
            stream_window: 65_535,
            connection_window: 4 * 65_535,
            max_local_error_reset_streams: 1024,
            keepalive_interval: ping_every,
            keepalive_timeout: ping_within,
        };
        let incoming =
            crate::limits::incoming(listener, ConnectionLimits::default(), Refusal::GoAway);
        let served = tokio::spawn(serve_h2(incoming, service, settings, None, async {
            let _ = stopped.await;
        }));
        (addr, stop, served)
    }

    /// Pinged rarely enough that no test sees it.
    const QUIET: (Duration, Duration) = (Duration::from_secs(300), Duration::from_secs(60));

    /// An h2 client connection to `addr`, driven in a task of its own (which also answers
    /// the server's pings).
    async fn client(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (client, connection) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(connection);
        client.ready().await.unwrap()
    }

    fn request(path: &str) -> http::Request<()> {
        http::Request::post(format!("http://localhost{path}"))
            .body(())
            .unwrap()
    }

    /// Sends a call for `path` with no body and waits for its answer's headers.
    async fn call(
        client: &mut h2::client::SendRequest<Bytes>,
        path: &str,
    ) -> Result<http::Response<RecvStream>, h2::Error> {
        let (answer, _) = client.send_request(request(path), true)?;
        timeout(Duration::from_secs(10), answer).await.unwrap()
    }

    /// Every call answered at once, with an empty 200.
    macro_rules! ok {
        () => {
            tower::service_fn(|_| async { Ok::<_, Infallible>(http::Response::new(Body::empty())) })
        };
    }

    /// The frame types and flags in `bytes`, as a server writes them.
    fn frame_types(mut bytes: &[u8]) -> Vec<(u8, u8)> {
        let mut types = Vec::new();
        while bytes.len() >= 9 {
            let length =
                usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
            types.push((bytes[3], bytes[4]));
            bytes = &bytes[(9 + length).min(bytes.len())..];
        }
        types
    }

    /// Waits until `flag` is set (a call reached its service), at most 10 s.
    async fn until(flag: &AtomicBool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !flag.load(Ordering::SeqCst) {
            assert!(
                Instant::now() < deadline,
                "the call never reached the service"
            );
            tokio::time::sleep(ms(5)).await;
        }
    }

    #[tokio::test]
    async fn a_connection_whose_pings_go_unanswered_is_closed_with_a_goaway() {
        let (addr, _stop, _) = server(ok!(), ms(100), ms(200)).await;
        let mut socket = TcpStream::connect(addr).await.unwrap();
        // The preface and an empty SETTINGS frame, then nothing: no ack of anything.
        socket
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .unwrap();
        let started = Instant::now();
        let mut read = Vec::new();
        let closed = timeout(Duration::from_secs(10), socket.read_to_end(&mut read)).await;
        assert!(
            closed.is_ok(),
            "still open 10 s after its pings went unanswered"
        );
        assert!(
            started.elapsed() >= ms(300),
            "closed after {:?}, before a ping could go unanswered",
            started.elapsed()
        );
        let types = frame_types(&read);
        assert!(types.contains(&(6, 0)), "no PING sent: {types:?}");
        assert!(
            types.iter().any(|&(kind, _)| kind == 7),
            "no GOAWAY: {types:?}"
        );
    }

    #[tokio::test]
    async fn a_connection_that_answers_its_pings_stays_open() {
        let (addr, _stop, _) = server(ok!(), ms(50), ms(500)).await;
        let mut client = client(addr).await;
        tokio::time::sleep(ms(1_500)).await;
        // Many pings later, the same connection still serves.
        let answer = call(&mut client, "/a").await.unwrap();
        assert_eq!(answer.status(), http::StatusCode::OK);
    }

    #[tokio::test]
    async fn a_call_whose_client_resets_its_stream_is_dropped_at_once() {
        let started = Arc::new(AtomicBool::new(false));
        let dropped = Arc::new(Notify::new());
        struct Dropped(Arc<Notify>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.notify_one();
            }
        }
        let service = {
            let (started, dropped) = (Arc::clone(&started), Arc::clone(&dropped));
            tower::service_fn(move |_| {
                let guard = Dropped(Arc::clone(&dropped));
                started.store(true, Ordering::SeqCst);
                async move {
                    let _guard = guard;
                    std::future::pending::<Result<http::Response<Body>, Infallible>>().await
                }
            })
        };
        let (addr, _stop, _) = server(service, QUIET.0, QUIET.1).await;
        let mut client = client(addr).await;
        let (_answer, mut body) = client.send_request(request("/a"), false).unwrap();
        body.send_data(Bytes::from_static(b"\0\0\0\0\0"), false)
            .unwrap();
        until(&started).await;
        body.send_reset(Reason::CANCEL);
        timeout(Duration::from_secs(5), dropped.notified())
            .await
            .expect("the call went on after its client reset the stream");
    }

    #[tokio::test]
    async fn an_answer_waits_for_the_clients_window_then_sends_its_trailers() {
        const CHUNK: usize = 16 * 1024;
        const CHUNKS: usize = 64;
        let produced = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let service = {
            let produced = Arc::clone(&produced);
            tower::service_fn(move |_| {
                let produced = Arc::clone(&produced);
                async move {
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                    let frames = futures::stream::iter(0..=CHUNKS).map(move |at| {
                        produced.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, Infallible>(if at < CHUNKS {
                            Frame::data(Bytes::from(vec![7u8; CHUNK]))
                        } else {
                            Frame::trailers(trailers.clone())
                        })
                    });
                    Ok::<_, Infallible>(http::Response::new(Body::new(
                        http_body_util::StreamBody::new(frames),
                    )))
                }
            })
        };
        let (addr, _stop, _) = server(service, QUIET.0, QUIET.1).await;
        // The client's windows are HTTP/2's default, 64 KiB: the answer is sixteen of them.
        let mut client = client(addr).await;
        let mut body = call(&mut client, "/a").await.unwrap().into_body();
        // Nothing read for a while: the server must wait for room, not take the whole body.
        tokio::time::sleep(ms(300)).await;
        let early = produced.load(Ordering::SeqCst);
        assert!(
            early <= 8,
            "{early} of {CHUNKS} chunks taken from the body while the client read nothing"
        );
        let read = async {
            let mut received = 0;
            while let Some(data) = body.data().await {
                let data = data.unwrap();
                assert!(data.iter().all(|&byte| byte == 7));
                received += data.len();
                body.flow_control().release_capacity(data.len()).unwrap();
            }
            (received, body.trailers().await.unwrap())
        };
        let (received, trailers) = timeout(Duration::from_secs(10), read).await.unwrap();
        assert_eq!(received, CHUNK * CHUNKS);
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
    }

    #[tokio::test]
    async fn a_call_that_panics_or_fails_resets_its_own_stream_only() {
        let slow_started = Arc::new(AtomicBool::new(false));
        let release = Arc::new(Notify::new());
        let service = {
            let (slow_started, release) = (Arc::clone(&slow_started), Arc::clone(&release));
            tower::service_fn(move |request: http::Request<Body>| {
                let (slow_started, release) = (Arc::clone(&slow_started), Arc::clone(&release));
                async move {
                    match request.uri().path() {
                        "/panic" => panic!("a handler's bug"),
                        "/fail" => Err(tower::BoxError::from("a layer's error")),
                        "/slow" => {
                            slow_started.store(true, Ordering::SeqCst);
                            release.notified().await;
                            Ok(http::Response::new(Body::empty()))
                        }
                        _ => Ok(http::Response::new(Body::empty())),
                    }
                }
            })
        };
        let (addr, _stop, _) = server(service, QUIET.0, QUIET.1).await;
        let mut client = client(addr).await;
        let (slow, _) = client.send_request(request("/slow"), true).unwrap();
        until(&slow_started).await;
        // A service's error resets its stream INTERNAL_ERROR; a panic, its stream too (hyper's
        // task for it unwinds, and dropping the stream resets it CANCEL).
        let failed = call(&mut client, "/fail").await.expect_err("/fail");
        assert_eq!(failed.reason(), Some(Reason::INTERNAL_ERROR), "{failed}");
        let panicked = call(&mut client, "/panic").await.expect_err("/panic");
        assert!(
            matches!(
                panicked.reason(),
                Some(Reason::CANCEL | Reason::INTERNAL_ERROR)
            ),
            "{panicked}"
        );
        // The connection's other calls, the one in flight and a new one, are served.
        release.notify_one();
        let slow = timeout(Duration::from_secs(10), slow)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(slow.status(), http::StatusCode::OK);
        assert_eq!(
            call(&mut client, "/a").await.unwrap().status(),
            http::StatusCode::OK
        );
    }

    #[tokio::test]
    async fn stopping_sends_a_goaway_and_waits_for_the_calls_in_flight() {
        let started = Arc::new(AtomicBool::new(false));
        let release = Arc::new(Notify::new());
        let service = {
            let (started, release) = (Arc::clone(&started), Arc::clone(&release));
            tower::service_fn(move |request: http::Request<Body>| {
                let (started, release) = (Arc::clone(&started), Arc::clone(&release));
                async move {
                    if request.uri().path() == "/a" {
                        started.store(true, Ordering::SeqCst);
                        release.notified().await;
                    }
                    Ok::<_, Infallible>(http::Response::new(Body::empty()))
                }
            })
        };
        let (addr, stop, served) = server(service, QUIET.0, QUIET.1).await;
        let mut client = client(addr).await;
        let (answer, _) = client.send_request(request("/a"), true).unwrap();
        until(&started).await;
        drop(stop);
        // Stopping: no new connection is taken, no new call on this one, and the server
        // waits for the call in flight.
        tokio::time::sleep(ms(300)).await;
        assert!(!served.is_finished(), "stopped with a call in flight");
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "a new connection was taken"
        );
        // A new call on it is not served (refused by the client, which read the GOAWAY, or
        // by the server); "/b" would be answered at once.
        let served_after = match client.send_request(request("/b"), true) {
            Err(_) => false,
            Ok((answer, _)) => matches!(timeout(ms(1_000), answer).await, Ok(Ok(_))),
        };
        assert!(!served_after, "a call sent after the GOAWAY was served");
        release.notify_one();
        let answer = timeout(Duration::from_secs(10), answer)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer.status(), http::StatusCode::OK);
        timeout(Duration::from_secs(10), served)
            .await
            .expect("the server did not stop once its last call was answered")
            .unwrap();
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
