//! The layer's extensions for a service in a chain (the one retrying layer, the least
//! attempt worth making), the deadline handed down by the propagation layer, and the
//! per-attempt timeout over a real channel.

use super::*;

// ---- Extensions for a service in a chain ----

/// Up to 3 attempts 100 ms apart, as the layer of a service that is the one retrying layer.
fn one_retrying_layer() -> RetryLayer {
    RetryLayer::new(config(&policy(3), ""))
        .refuse_caller_retries()
        .annotate_failures("edge")
}

fn pushback_of(status: &Status) -> Option<&str> {
    status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .map(|v| v.to_str().unwrap())
}

#[tokio::test(start_paused = true)]
async fn a_layer_that_retried_tells_its_caller_not_to_retry_and_says_why() {
    let server = Scripted::failing(unavailable(3));
    let status = charge(&mut client_of(one_retrying_layer(), &server))
        .await
        .expect_err("3 failures");
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(pushback_of(&status), Some("-1"));
    assert_eq!(
        status.message(),
        "down [edge: 3 attempts, max attempts (3) reached]"
    );
}

#[tokio::test(start_paused = true)]
async fn a_throttled_retry_also_refuses_the_callers_retries() {
    let server = Scripted::failing(unavailable(3));
    let budget = Arc::new(resilience::RetryBudget::new(0.0, 0.0));
    let layer = one_retrying_layer().throttle(budget);
    let status = charge(&mut client_of(layer, &server))
        .await
        .expect_err("no retry allowed");
    assert_eq!(server.seen().len(), 1);
    assert_eq!(pushback_of(&status), Some("-1"));
    assert!(
        status
            .message()
            .ends_with("[edge: 1 attempt, stopped by the retry budget]"),
        "{status:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failure_not_retried_is_the_servers_answer_unchanged() {
    let server = Scripted::failing(vec![with_pushback(Status::not_found("no"), "50")]);
    let status = charge(&mut client_of(one_retrying_layer(), &server))
        .await
        .expect_err("not retryable");
    assert_eq!(status.message(), "no");
    assert_eq!(
        pushback_of(&status),
        Some("50"),
        "the server's pushback travels on"
    );
}

#[tokio::test(start_paused = true)]
async fn no_retry_starts_with_less_than_min_attempt_left() {
    let server = Scripted::failing(unavailable(10));
    let layer = RetryLayer::new(config(&policy(5), "")).min_attempt(Duration::from_millis(150));
    let mut request = Request::new(ChargeRequest::default());
    request.set_timeout(Duration::from_millis(400));
    let status = client_of(layer, &server)
        .charge(request)
        .await
        .expect_err("fails");
    // After the failures at 0 and 0.1 s, 0.4 and 0.3 s are left: room for the 0.1 s wait
    // and 0.15 s of attempt. After the one at 0.2 s, 0.2 s is not (without the minimum, a
    // fourth attempt would start at 0.3 s with 0.1 s left).
    assert_eq!(server.seen().len(), 3);
    assert_eq!(status.code(), Code::DeadlineExceeded);
}

#[tokio::test(start_paused = true)]
async fn a_layer_that_hedged_tells_its_caller_not_to_retry() {
    let layer = hedging(2, 10, r#""UNAVAILABLE""#, "")
        .refuse_caller_retries()
        .annotate_failures("edge");
    let both_fail = slow(vec![
        (5, Some(Status::unavailable("busy"))),
        (5, Some(Status::unavailable("busy"))),
    ]);
    let status = PaymentsClient::new(tower::Layer::layer(&layer, PaymentsServer::new(both_fail)))
        .charge(ChargeRequest::default())
        .await
        .expect_err("both copies fail");
    assert_eq!(pushback_of(&status), Some("-1"), "{status:?}");
    assert!(
        status
            .message()
            .ends_with("[edge: 2 attempts, max attempts (2) reached]")
    );

    // A fatal failure of the first copy, before any hedge: the server's answer as it was.
    let fatal = slow(vec![(5, Some(Status::invalid_argument("bad")))]);
    let status = PaymentsClient::new(tower::Layer::layer(&layer, PaymentsServer::new(fatal)))
        .charge(ChargeRequest::default())
        .await
        .expect_err("fatal");
    assert_eq!(status.message(), "bad");
    assert_eq!(pushback_of(&status), None);
}

// ---- Propagation: a server's handler calls downstream through the client layers ----

/// The client stack of a service in the middle: the served request's deadline, less the
/// margin, handed to the engine, which writes it on the wire.
fn middle_stack(
    downstream: &Scripted,
) -> impl tower::Service<
    http::Request<tonic::body::Body>,
    Response = http::Response<tonic::body::Body>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::ServiceBuilder::new()
        .layer(resilience::PropagateDeadlineLayer::new(
            Duration::from_millis(20),
            Duration::from_millis(30),
        ))
        .layer(RetryLayer::new(ServiceConfig::default()).unary())
        .service(PaymentsServer::new(downstream.clone()))
}

/// A service in the middle: its handler calls `downstream` as the handler of a hop does,
/// writing the key it forwards on its call itself.
#[derive(Clone)]
struct Middle {
    downstream: Scripted,
}

#[tonic::async_trait]
impl Payments for Middle {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let key = request.metadata().get("idempotency-key").cloned();
        let mut outgoing = Request::new(request.into_inner());
        if let Some(key) = key {
            outgoing.metadata_mut().insert("idempotency-key", key);
        }
        PaymentsClient::new(middle_stack(&self.downstream))
            .charge(outgoing)
            .await
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

/// Calls `middle` as a server would run it: its deadline in the task.
async fn call_middle(middle: Middle, timeout: Duration) -> Result<Response<ChargeReply>, Status> {
    let server = tower::ServiceBuilder::new()
        .layer(resilience::DeadlineLayer::new(
            Duration::from_secs(10),
            Duration::from_millis(10),
        ))
        .service(PaymentsServer::new(middle));
    let mut request = Request::new(ChargeRequest::default());
    request.set_timeout(timeout);
    let metadata = request.metadata_mut();
    metadata.insert("idempotency-key", "from-the-caller".parse().unwrap());
    PaymentsClient::new(server).charge(request).await
}

#[tokio::test(start_paused = true)]
async fn a_call_downstream_gets_the_time_left_less_the_margin() {
    let downstream = Scripted::default();
    let middle = Middle {
        downstream: downstream.clone(),
    };
    call_middle(middle, Duration::from_secs(1)).await.unwrap();
    let seen = downstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].timeout.as_deref(),
        Some("980000u"),
        "1 s less the 20 ms margin"
    );
    assert_eq!(seen[0].key.as_deref(), Some("from-the-caller"));
}

#[tokio::test(start_paused = true)]
async fn no_call_goes_downstream_without_room_for_it() {
    let downstream = Scripted::default();
    let middle = Middle {
        downstream: downstream.clone(),
    };
    // 45 ms less the 20 ms margin leaves 25 ms, under the 30 ms an attempt needs.
    let status = call_middle(middle, Duration::from_millis(45))
        .await
        .expect_err("no room");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(downstream.seen().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_call_made_outside_a_request_goes_out_as_it_is() {
    let downstream = Scripted::default();
    PaymentsClient::new(middle_stack(&downstream))
        .charge(ChargeRequest::default())
        .await
        .unwrap();
    let seen = downstream.seen();
    assert_eq!(seen[0].timeout, None);
    assert_eq!(seen[0].key, None);
}

// ---- Over a real channel ----

/// Counts the deadline refusals it is told of.
#[derive(Default)]
struct DeadlineRefusals(std::sync::atomic::AtomicU32);

impl resilience::RetryObserver for DeadlineRefusals {
    fn attempt(&self, _: &str, _: &resilience::AttemptInfo) {}
    fn refused(&self, _: &str, reason: resilience::Refusal) {
        if reason == resilience::Refusal::Deadline {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

#[tokio::test]
async fn over_a_channel_a_silent_server_ends_the_call_deadline_exceeded_not_cancelled() {
    // Whichever timer fires first — the layer's, or the Channel's own for the grpc-timeout
    // it sends, which reports CANCELLED — the caller sees DEADLINE_EXCEEDED, and the
    // retry the deadline refused is counted.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PaymentsServer::new(slow(vec![(10_000, None)])))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect_lazy();
    let refusals = Arc::new(DeadlineRefusals::default());
    let layer = RetryLayer::new(config(
        r#"{"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
             "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE", "DEADLINE_EXCEEDED"]}"#,
        "",
    ))
    .observer(refusals.clone());
    let mut client = PaymentsClient::new(tower::Layer::layer(&layer, channel));
    let mut request = Request::new(ChargeRequest::default());
    request.set_timeout(Duration::from_millis(300));
    let status = client.charge(request).await.expect_err("no answer in time");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(refusals.0.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_attempt_timeout_is_unavailable_whichever_timer_fires_first() {
    // The retry layer cuts each attempt at 40 ms and sends that as the attempt's
    // grpc-timeout; the balancer's connection keeps the attempt's timer, and the server,
    // plain tonic, enforces the 40 ms too, answering CANCELLED "Timeout expired" (a tonic
    // channel under the balancer kept a third timer, on the same millisecond tick).
    // Whichever fires first, the attempt's expiry is told as a per-attempt timeout
    // (UNAVAILABLE, which a caller may retry elsewhere), never as the call's deadline
    // passing (DEADLINE_EXCEEDED) nor as CANCELLED — the call itself had seconds left.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PaymentsServer::new(slow(vec![(10_000, None); 400])))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let balancer = resilience::Balancer::start(
        resilience::Downstream::Urls(vec![format!("http://{address}")]),
        resilience::BalanceSettings {
            // One replica, failing every time: never ejected, so every call reaches it.
            max_ejection_percent: 0,
            ..resilience::BalanceSettings::default()
        },
    )
    .await;
    // One attempt per call (no policy), each cut at 40 ms.
    let layer = RetryLayer::new(ServiceConfig::default())
        .unary()
        .per_try_timeout(Some(Duration::from_millis(40)));
    let client = PaymentsClient::new(tower::Layer::layer(&layer, balancer));
    // Four at a time, on a connection already open (the first calls wait for it, and
    // the channel's timer starts only once it is there).
    let mut answers = Vec::new();
    for _ in 0..50 {
        answers.extend(
            futures::future::join_all((0..4).map(|_| {
                let mut client = client.clone();
                async move {
                    let mut request = Request::new(ChargeRequest::default());
                    request.set_timeout(Duration::from_secs(5));
                    client.charge(request).await.expect_err("no answer")
                }
            }))
            .await,
        );
    }
    for status in &answers {
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("per-attempt timeout"),
            "{status:?}"
        );
    }
}
