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
use tonic::{Request, Response, Status};

use crate::{BalanceSettings, Balancer, Downstream, balance::Connector};

/// Answers every Charge at once.
struct Answers;

#[tonic::async_trait]
impl Payments for Answers {
    async fn charge(&self, _: Request<ChargeRequest>) -> Result<Response<ChargeReply>, Status> {
        Ok(Response::new(ChargeReply::default()))
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::not_found("no accounts here"))
    }
}

/// Serves on `listener` until the sender is used or dropped (a graceful stop: GOAWAY,
/// then the connections close); the task ends when the server has.
fn serve(listener: TcpListener) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(PaymentsServer::new(Answers))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = stopped.await;
                },
            )
            .await;
    });
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
