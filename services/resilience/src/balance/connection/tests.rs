//! Tests of [`super`]: a replica's connection, over real sockets to a tonic server.

use std::{
    net::SocketAddr,
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest,
    payments_client::PaymentsClient,
    payments_server::{Payments, PaymentsServer},
};
use tokio::{net::TcpListener, sync::oneshot, time::Instant};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::{BalanceSettings, Balancer, Downstream, balance::Connector};

/// Answers every Charge at once.
struct Answers;

#[tonic::async_trait]
impl Payments for Answers {
    async fn charge(&self, _: Request<ChargeRequest>) -> Result<Response<ChargeReply>, Status> {
        Ok(Response::new(ChargeReply::default()))
    }

    /// An account whose id is 3 MiB long: an answer larger than a stream's flow-control
    /// window (2 MiB), which comes whole only if the reader gives its window back.
    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Ok(Response::new(Account {
            account_id: "a".repeat(3 << 20),
            ..Account::default()
        }))
    }
}

/// Serves on `listener` until the sender is used or dropped (a graceful stop: GOAWAY,
/// then the connections close); the task ends when the server has.
fn serve(listener: TcpListener) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve_connections(
        Answers,
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        stopped,
    ));
    (stop, task)
}

async fn balancer(address: SocketAddr, connector: Option<Connector>) -> Balancer {
    let downstream = Downstream::Urls(vec![format!("http://{address}")]);
    let settings = BalanceSettings {
        // One replica, whatever it does: never ejected.
        max_ejection_percent: 0,
        ..BalanceSettings::default()
    };
    match connector {
        Some(connector) => Balancer::start_with_connector(downstream, settings, connector).await,
        None => Balancer::start(downstream, settings).await,
    }
}

/// One Charge through `balancer`, within `timeout`.
async fn charge(balancer: &Balancer, timeout: Duration) -> Result<(), Status> {
    let mut request = Request::new(ChargeRequest::default());
    request.set_timeout(timeout);
    PaymentsClient::new(balancer.clone())
        .charge(request)
        .await
        .map(drop)
}

/// Connections over plain TCP, each dial counted and taking `delay` first.
fn slow_dials(delay: Duration) -> (Connector, std::sync::Arc<AtomicUsize>) {
    let dials = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = dials.clone();
    let connector = Connector::new(tower::service_fn(move |uri: http::Uri| {
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            tokio::time::sleep(delay).await;
            let address = uri.authority().map(|a| a.to_string()).unwrap_or_default();
            let tcp = tokio::net::TcpStream::connect(address).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
        }
    }));
    (connector, dials)
}

#[tokio::test]
async fn a_replica_that_restarts_is_called_again_on_a_new_connection() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = serve(listener);
    let balancer = balancer(address, None).await;
    charge(&balancer, Duration::from_secs(2))
        .await
        .expect("served");

    stop.send(()).unwrap();
    stopped.await.unwrap();
    // Nobody listens: a call fails at once, its request never sent.
    let started = Instant::now();
    charge(&balancer, Duration::from_secs(2))
        .await
        .expect_err("no server");
    assert!(started.elapsed() < Duration::from_secs(1), "failed fast");

    // The same port again: the next call opens a new connection.
    let (_stop, _stopped) = serve(TcpListener::bind(address).await.unwrap());
    charge(&balancer, Duration::from_secs(2))
        .await
        .expect("served on a new connection");
}

#[tokio::test]
async fn a_refused_connection_is_told_as_a_request_never_sent() {
    // A port that was bound and let go: nothing listens there.
    let address = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let balancer = balancer(address, None).await;
    let request = http::Request::builder()
        .uri("/retrychain.v1.Payments/Charge")
        .body(tonic::body::Body::empty())
        .unwrap();
    let error = tower::ServiceExt::oneshot(balancer, request)
        .await
        .expect_err("no server");
    assert!(
        crate::classify::never_processed(&*error),
        "safe to send again: {error}"
    );
}

#[tokio::test]
async fn calls_waiting_for_a_connection_share_one_dial() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let _server = serve(listener);
    let (connector, dials) = slow_dials(Duration::from_millis(100));
    let balancer = balancer(address, Some(connector)).await;
    let answers =
        futures::future::join_all((0..16).map(|_| charge(&balancer, Duration::from_secs(2)))).await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    assert_eq!(dials.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_opening_its_calls_gave_up_on_still_ends_and_serves_the_next_call() {
    // The first call gives up before the dial (200 ms) is done. The opening goes on
    // without it; a call that comes after the connect timeout (2 s) finds the connection
    // open, rather than a half-made attempt whose time has run out.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let _server = serve(listener);
    let (connector, dials) = slow_dials(Duration::from_millis(200));
    let balancer = balancer(address, Some(connector)).await;
    charge(&balancer, Duration::from_millis(50))
        .await
        .expect_err("the dial outlasts the call");
    tokio::time::sleep(super::CONNECT_TIMEOUT + Duration::from_millis(500)).await;
    charge(&balancer, Duration::from_millis(100))
        .await
        .expect("the connection was opened meanwhile");
    assert_eq!(dials.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn answers_larger_than_the_flow_control_windows_keep_coming() {
    // Three answers of 3 MiB each: each past its stream's window (2 MiB), all three past
    // the connection's (5 MiB). They come whole only if the window is given back as each
    // frame is read.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let _server = serve(listener);
    let balancer = balancer(address, None).await;
    for _ in 0..3 {
        let mut request = Request::new(GetAccountRequest::default());
        request.set_timeout(Duration::from_secs(5));
        let mut client = PaymentsClient::new(balancer.clone());
        // The call's timer ends with the answer's head: a body that stalls is caught here.
        let account = tokio::time::timeout(Duration::from_secs(10), client.get_account(request))
            .await
            .expect("the answer's body stalled")
            .expect("the answer came")
            .into_inner();
        assert_eq!(account.account_id.len(), 3 << 20);
    }
}

/// Answers every Charge after a while.
struct Slowly(Duration);

#[tonic::async_trait]
impl Payments for Slowly {
    async fn charge(&self, _: Request<ChargeRequest>) -> Result<Response<ChargeReply>, Status> {
        tokio::time::sleep(self.0).await;
        Ok(Response::new(ChargeReply::default()))
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::unimplemented("not here"))
    }
}

/// Serves `service` on the connections `incoming` yields, until `stop`.
async fn serve_connections<S: Payments>(
    service: S,
    incoming: impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Send + 'static,
    stop: oneshot::Receiver<()>,
) {
    let _ = tonic::transport::Server::builder()
        .add_service(PaymentsServer::new(service))
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop.await;
        })
        .await;
}

#[tokio::test]
async fn a_replica_that_drains_is_called_on_a_new_connection_and_no_call_fails() {
    // One port, two servers: the first connection goes to one, every later one to the
    // other. The first drains while a call is still in flight on its connection: it has
    // sent GOAWAY, and the connection stays open until that call is answered. A call made
    // then finds the connection refusing new streams: it goes on a new connection, to the
    // second server, and neither call fails.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (first_tx, first_rx) = tokio::sync::mpsc::channel(1);
    let (later_tx, later_rx) = tokio::sync::mpsc::channel(8);
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        first_tx.send(Ok(tcp)).await.unwrap();
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = later_tx.send(Ok(tcp)).await;
        }
    });
    let (stop_first, first_stops) = oneshot::channel();
    let first = tokio::spawn(serve_connections(
        Slowly(Duration::from_millis(600)),
        ReceiverStream::new(first_rx),
        first_stops,
    ));
    let (_stop_later, later_stops) = oneshot::channel();
    tokio::spawn(serve_connections(
        Answers,
        ReceiverStream::new(later_rx),
        later_stops,
    ));

    let balancer = balancer(address, None).await;
    let in_flight = tokio::spawn({
        let balancer = balancer.clone();
        async move { charge(&balancer, Duration::from_secs(5)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop_first.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    charge(&balancer, Duration::from_secs(2))
        .await
        .expect("served by the second, on a new connection");
    in_flight
        .await
        .unwrap()
        .expect("the call in flight when the first drained is answered");
    first.await.unwrap();
}

#[tokio::test]
async fn a_call_waiting_for_the_servers_limit_on_streams_is_never_sent_when_the_connection_breaks()
{
    // The first connection goes to a server that allows one stream at once. With one call
    // in flight there and a second waiting for its turn, the connection breaks (the socket
    // closed, no GOAWAY). The call in flight may have been acted on, and fails as such. The
    // one waiting was never sent: it goes on a new connection, to a server that answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (later_tx, later_rx) = tokio::sync::mpsc::channel(8);
    let (took_first, first_taken) = oneshot::channel();
    let (cut, cut_now) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        tokio::spawn(async move {
            let mut connection = h2::server::Builder::new()
                .max_concurrent_streams(1)
                .handshake::<_, bytes::Bytes>(tcp)
                .await
                .unwrap();
            // Held, never answered.
            let first = connection.accept().await;
            took_first.send(()).unwrap();
            tokio::select! {
                _ = cut_now => {}
                _ = async { while connection.accept().await.is_some() {} } => {}
            }
            drop(connection);
            drop(first);
        });
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = later_tx.send(Ok(tcp)).await;
        }
    });
    let (_stop_later, later_stops) = oneshot::channel();
    tokio::spawn(serve_connections(
        Answers,
        ReceiverStream::new(later_rx),
        later_stops,
    ));

    let balancer = balancer(address, None).await;
    let in_flight = tokio::spawn(tower::ServiceExt::oneshot(
        balancer.clone(),
        http::Request::builder()
            .uri("/retrychain.v1.Payments/Charge")
            .body(tonic::body::Body::empty())
            .unwrap(),
    ));
    first_taken.await.unwrap();
    // The server's limit has come with its settings, before the first call's stream.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waiting = tokio::spawn({
        let balancer = balancer.clone();
        async move { charge(&balancer, Duration::from_secs(5)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "the second call waits for its turn");
    cut.send(()).unwrap();
    waiting
        .await
        .unwrap()
        .expect("never sent on the broken connection: served on a new one");
    let error = in_flight
        .await
        .unwrap()
        .expect_err("its connection broke under it");
    assert!(
        !crate::classify::never_processed(&*error),
        "the server had the call in flight: {error}"
    );
}

#[test]
fn a_limit_lowered_while_streams_are_open_is_kept_as_they_end() {
    // Four streams open, then the server allows one: the three that end first give no
    // place back, the fourth's is the one place there is. Raised to three again, two more.
    let streams = super::Streams::new(4);
    let open: Vec<_> = (0..4)
        .map(|_| {
            streams.free.try_acquire().unwrap().forget();
            super::Slot(streams.clone())
        })
        .collect();
    streams.resize(1);
    let mut open = open.into_iter();
    for slot in open.by_ref().take(3) {
        drop(slot);
        assert_eq!(streams.free.available_permits(), 0);
    }
    drop(open);
    assert_eq!(streams.free.available_permits(), 1);
    streams.resize(3);
    assert_eq!(streams.free.available_permits(), 3);
    // Lowered with places free: those go at once.
    streams.resize(2);
    assert_eq!(streams.free.available_permits(), 2);
}

/// Holds every Charge until `0` of them are in at once, then answers them all.
struct AllAtOnce(std::sync::Arc<tokio::sync::Barrier>);

#[tonic::async_trait]
impl Payments for AllAtOnce {
    async fn charge(&self, _: Request<ChargeRequest>) -> Result<Response<ChargeReply>, Status> {
        self.0.wait().await;
        Ok(Response::new(ChargeReply::default()))
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::unimplemented("not here"))
    }
}

#[tokio::test]
async fn a_burst_on_a_new_connection_goes_past_the_first_limit_once_the_servers_settings_come() {
    // 150 calls at once on a new connection, to a server that allows 512 streams and
    // answers none until all 150 are in. Before its settings come, a connection assumes
    // 100: 50 calls wait for a place. Only the settings can let them go (no stream ends
    // before they do); else every call runs out of time.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(150));
    tokio::spawn(
        tonic::transport::Server::builder()
            .max_concurrent_streams(512)
            .add_service(PaymentsServer::new(AllAtOnce(barrier)))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let balancer = balancer(address, None).await;
    let answers =
        futures::future::join_all((0..150).map(|_| charge(&balancer, Duration::from_secs(3))))
            .await;
    let failed = answers.iter().filter(|answer| answer.is_err()).count();
    assert_eq!(failed, 0, "{:?}", answers.iter().find(|a| a.is_err()));
}

/// Answers a stream OK with an empty message.
fn answer_ok(mut respond: h2::server::SendResponse<bytes::Bytes>) {
    let head = http::Response::builder()
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let Ok(mut stream) = respond.send_response(head, false) else {
        return;
    };
    // A gRPC message: not compressed, zero bytes long.
    let _ = stream.send_data(bytes::Bytes::from_static(&[0; 5]), false);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let _ = stream.send_trailers(trailers);
}

/// One HTTP/2 connection served on `listener`, allowing `streams` at once: each stream's
/// `grpc-timeout` is reported as it arrives, and each is answered OK at once — the first
/// only when `release` fires.
fn timeouts_seen(
    listener: TcpListener,
    streams: u32,
    release: oneshot::Receiver<()>,
) -> tokio::sync::mpsc::UnboundedReceiver<Duration> {
    let (seen, timeouts) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut connection = h2::server::Builder::new()
            .max_concurrent_streams(streams)
            .handshake::<_, bytes::Bytes>(tcp)
            .await
            .unwrap();
        let mut release = Some(release);
        while let Some(Ok((request, respond))) = connection.accept().await {
            let timeout = crate::wire::timeout_of(request.headers()).unwrap().unwrap();
            seen.send(timeout).unwrap();
            match release.take() {
                Some(release) => {
                    tokio::spawn(async move {
                        let _ = release.await;
                        answer_ok(respond);
                    });
                }
                None => answer_ok(respond),
            }
        }
    });
    timeouts
}

#[tokio::test]
async fn a_call_that_waited_for_a_place_within_the_servers_limit_tells_it_only_the_time_left() {
    // The server allows one stream at once and holds the first call for 500 ms; the
    // second waits for its place meanwhile. What the server is told the second has is
    // its 5 s less that wait: its deadline is never later than the caller's.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (release, released) = oneshot::channel();
    let mut seen = timeouts_seen(listener, 1, released);
    let balancer = balancer(address, None).await;
    let first = tokio::spawn({
        let balancer = balancer.clone();
        async move { charge(&balancer, Duration::from_secs(5)).await }
    });
    seen.recv().await.unwrap();
    // The server's limit has come with its settings, before the first call's stream.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = tokio::spawn({
        let balancer = balancer.clone();
        async move { charge(&balancer, Duration::from_secs(5)).await }
    });
    // The second call has begun and waits for the place (this test's runtime has one
    // thread: it ran while this one slept); it waits at least from here to the release.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let from = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waited = from.elapsed();
    release.send(()).unwrap();
    first.await.unwrap().expect("answered");
    second.await.unwrap().expect("answered after its wait");
    let told = seen.recv().await.unwrap();
    assert!(
        told <= Duration::from_secs(5) - waited,
        "told {told:?} after waiting at least {waited:?} of 5 s"
    );
    assert!(told >= Duration::from_secs(3), "told {told:?}");
}

#[tokio::test]
async fn a_call_that_waited_for_its_connection_to_open_tells_the_server_only_the_time_left() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (release, released) = oneshot::channel();
    release.send(()).unwrap();
    let mut seen = timeouts_seen(listener, 100, released);
    let dial = Duration::from_millis(300);
    let (connector, _) = slow_dials(dial);
    let balancer = balancer(address, Some(connector)).await;
    charge(&balancer, Duration::from_secs(5))
        .await
        .expect("answered");
    let told = seen.recv().await.unwrap();
    assert!(
        told <= Duration::from_secs(5) - dial,
        "told {told:?} after a dial of {dial:?}"
    );
    assert!(told >= Duration::from_secs(3), "told {told:?}");
}
