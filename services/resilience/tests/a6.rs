//! gRFC A6 conformance of [`RetryLayer`], on paused time, against tonic servers called in
//! process (the generated `PaymentsServer` is itself a tower service: no sockets, so time
//! can be paused and every wait checked to the millisecond); then the layer's extensions
//! for a service in a chain, and the propagation layers above it.

#![allow(clippy::unwrap_used, missing_docs)] // tests: a panic is the failure report

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Duration,
};

use resilience::{RetryLayer, ServiceConfig};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest,
    payments_client::PaymentsClient,
    payments_server::{Payments, PaymentsServer},
};
use tokio::time::Instant;
use tonic::{Code, Request, Response, Status};

/// What the server saw of one call.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    previous_attempts: Option<String>,
    timeout: Option<String>,
    key: Option<String>,
}

/// A server that answers from a script (then OK) and remembers every call.
#[derive(Debug, Clone, Default)]
struct Scripted {
    script: Arc<Mutex<VecDeque<Status>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Scripted {
    fn failing(statuses: Vec<Status>) -> Self {
        Self {
            script: Arc::new(Mutex::new(statuses.into())),
            seen: Arc::default(),
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl Payments for Scripted {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let text = |key: &str| {
            request
                .metadata()
                .get(key)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        self.seen.lock().unwrap().push(Seen {
            at: Instant::now(),
            previous_attempts: text("grpc-previous-rpc-attempts"),
            timeout: text("grpc-timeout"),
            key: text("idempotency-key"),
        });
        match self.script.lock().unwrap().pop_front() {
            Some(status) => Err(status),
            None => Ok(Response::new(ChargeReply::default())),
        }
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

fn config(policy: &str, throttling: &str) -> ServiceConfig {
    ServiceConfig::parse(&format!(
        r#"{{"methodConfig": [{{"name": [{{"service": "retrychain.v1.Payments", "method": "Charge"}}],
            "retryPolicy": {policy}}}] {throttling}}}"#
    ))
    .unwrap()
}

/// Retry on UNAVAILABLE and RESOURCE_EXHAUSTED, 100 ms backoff without jitter.
fn policy(max_attempts: u32) -> String {
    format!(
        r#"{{"maxAttempts": {max_attempts}, "initialBackoff": "0.1s", "maxBackoff": "0.1s",
            "backoffMultiplier": 1, "retrychainJitter": "exponential",
            "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]}}"#
    )
}

fn client_of(
    layer: RetryLayer,
    server: &Scripted,
) -> PaymentsClient<resilience::client::RetryService<PaymentsServer<Scripted>>> {
    PaymentsClient::new(tower::Layer::layer(
        &layer,
        PaymentsServer::new(server.clone()),
    ))
}

async fn charge(
    client: &mut PaymentsClient<resilience::client::RetryService<PaymentsServer<Scripted>>>,
) -> Result<Response<ChargeReply>, Status> {
    client
        .charge(ChargeRequest {
            account_id: "a".into(),
            amount_cents: 1,
        })
        .await
}

fn unavailable(n: usize) -> Vec<Status> {
    (0..n).map(|_| Status::unavailable("down")).collect()
}

fn with_pushback(mut status: Status, ms: &str) -> Status {
    status
        .metadata_mut()
        .insert("grpc-retry-pushback-ms", ms.parse().unwrap());
    status
}

#[tokio::test(start_paused = true)]
async fn attempts_are_capped_at_5_and_marked() {
    let server = Scripted::failing(unavailable(10));
    let mut client = client_of(RetryLayer::new(config(&policy(9), "")), &server);
    let status = charge(&mut client).await.expect_err("fails throughout");
    assert_eq!(status.code(), Code::Unavailable);
    let seen = server.seen();
    assert_eq!(seen.len(), 5, "maxAttempts 9 is capped at 5");
    let marks: Vec<Option<String>> = seen.iter().map(|s| s.previous_attempts.clone()).collect();
    assert_eq!(
        marks,
        vec![
            None,
            Some("1".into()),
            Some("2".into()),
            Some("3".into()),
            Some("4".into())
        ]
    );
    for pair in seen.windows(2) {
        assert_eq!(
            pair[1].at - pair[0].at,
            Duration::from_millis(100),
            "the backoff"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_that_succeeds_returns_the_answer() {
    let server = Scripted::failing(unavailable(2));
    let mut client = client_of(RetryLayer::new(config(&policy(3), "")), &server);
    charge(&mut client)
        .await
        .expect("the third attempt succeeds");
    assert_eq!(server.seen().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn only_the_configured_codes_are_retried() {
    let server = Scripted::failing(vec![Status::aborted("conflict"), Status::aborted("again")]);
    let mut client = client_of(RetryLayer::new(config(&policy(5), "")), &server);
    let status = charge(&mut client)
        .await
        .expect_err("ABORTED is not in the list");
    assert_eq!(status.code(), Code::Aborted);
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn pushback_is_waited_exactly_and_a_negative_one_stops() {
    let server = Scripted::failing(vec![with_pushback(
        Status::resource_exhausted("busy"),
        "250",
    )]);
    let mut client = client_of(RetryLayer::new(config(&policy(3), "")), &server);
    charge(&mut client)
        .await
        .expect("succeeds after the pushback");
    let seen = server.seen();
    assert_eq!(seen[1].at - seen[0].at, Duration::from_millis(250));

    for stop in ["-1", "soon"] {
        let server = Scripted::failing(vec![with_pushback(Status::unavailable("no"), stop)]);
        let mut client = client_of(RetryLayer::new(config(&policy(3), "")), &server);
        charge(&mut client).await.expect_err("the server said stop");
        assert_eq!(server.seen().len(), 1, "pushback {stop}");
    }
}

#[tokio::test(start_paused = true)]
async fn throttling_allows_retries_only_above_half_the_tokens() {
    // maxTokens 4: the first failure leaves 3 (> 2: retry), the second 2 (not > 2: stop).
    let layer = RetryLayer::new(config(
        &policy(5),
        r#", "retryThrottling": {"maxTokens": 4, "tokenRatio": 1}"#,
    ));
    let server = Scripted::failing(unavailable(10));
    let mut first = client_of(layer.clone(), &server);
    charge(&mut first).await.expect_err("fails");
    assert_eq!(server.seen().len(), 2);
    // The throttle is the channel's: another client over the same layer shares it (2
    // tokens: no retry), and a success earns tokenRatio back.
    let mut second = client_of(layer.clone(), &server);
    charge(&mut second).await.expect_err("fails");
    assert_eq!(server.seen().len(), 3, "one attempt, no retry");
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_buffer_limit_is_sent_once() {
    let server = Scripted::failing(unavailable(3));
    let layer = RetryLayer::new(config(&policy(5), "")).buffer_limits(16, 1 << 20);
    let mut client = client_of(layer, &server);
    let status = client
        .charge(ChargeRequest {
            account_id: "x".repeat(100),
            amount_cents: 1,
        })
        .await
        .expect_err("fails once, unretried");
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn each_attempt_gets_the_time_left_and_none_starts_past_the_deadline() {
    let server = Scripted::failing(unavailable(10));
    let layer = RetryLayer::new(config(
        r#"{"maxAttempts": 5, "initialBackoff": "0.4s", "maxBackoff": "0.4s",
             "backoffMultiplier": 1, "retrychainJitter": "exponential",
             "retryableStatusCodes": ["UNAVAILABLE"]}"#,
        "",
    ));
    let mut client = client_of(layer, &server);
    let mut request = Request::new(ChargeRequest {
        account_id: "a".into(),
        amount_cents: 1,
    });
    request.set_timeout(Duration::from_secs(1));
    let status = client.charge(request).await.expect_err("fails");
    let seen = server.seen();
    // Attempts at 0, 0.4 and 0.8 s; one at 1.2 s would be past the deadline, so the call
    // ends as grpc-go's would once the deadline passed: DEADLINE_EXCEEDED.
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("Unavailable: down"), "{status:?}");
    assert_eq!(seen.len(), 3);
    let timeouts: Vec<Duration> = seen
        .iter()
        .map(|s| resilience::wire::parse_timeout(s.timeout.as_deref().unwrap()).unwrap())
        .collect();
    assert_eq!(timeouts[0], Duration::from_secs(1));
    assert_eq!(timeouts[1], Duration::from_millis(600));
    assert_eq!(timeouts[2], Duration::from_millis(200));
}

#[tokio::test(start_paused = true)]
async fn methods_without_a_retry_policy_pass_through() {
    let server = Scripted::failing(unavailable(3));
    let config = ServiceConfig::parse(
        r#"{"methodConfig": [{"name": [{"service": "other.Service"}],
            "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "0.1s",
                            "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
    )
    .unwrap();
    let mut client = client_of(RetryLayer::new(config), &server);
    charge(&mut client).await.expect_err("fails");
    assert_eq!(server.seen().len(), 1);
}

/// A transport that answers every call the same scripted way, counting calls: for
/// answers a tonic server would never give (headers, then a failure in the trailers) and
/// for calls that reach no server at all.
struct Fake<E> {
    calls: Arc<Mutex<u32>>,
    answer: fn() -> Result<http::Response<tonic::body::Body>, E>,
}

// By hand: the derive would ask `E: Clone`, and io::Error is not.
impl<E> Clone for Fake<E> {
    fn clone(&self) -> Self {
        Self {
            calls: Arc::clone(&self.calls),
            answer: self.answer,
        }
    }
}

impl<E> Fake<E> {
    fn new(answer: fn() -> Result<http::Response<tonic::body::Body>, E>) -> Self {
        Self {
            calls: Arc::default(),
            answer,
        }
    }

    fn calls(&self) -> u32 {
        *self.calls.lock().unwrap()
    }
}

impl<E> tower::Service<http::Request<tonic::body::Body>> for Fake<E> {
    type Response = http::Response<tonic::body::Body>;
    type Error = E;
    type Future = std::future::Ready<Result<Self::Response, E>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), E>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
        *self.calls.lock().unwrap() += 1;
        std::future::ready((self.answer)())
    }
}

/// Response headers (committing the call), and only then a failure, in the trailers.
fn headers_then_unavailable() -> Result<http::Response<tonic::body::Body>, std::convert::Infallible>
{
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", "14".parse().unwrap());
    trailers.insert("grpc-message", "failed%20after%20headers".parse().unwrap());
    let frames: Vec<Result<http_body::Frame<bytes::Bytes>, Status>> =
        vec![Ok(http_body::Frame::trailers(trailers))];
    let body = tonic::body::Body::new(http_body_util::StreamBody::new(futures::stream::iter(
        frames,
    )));
    Ok(http::Response::builder()
        .header("content-type", "application/grpc")
        .body(body)
        .unwrap())
}

/// No server: the connection is reset.
fn connection_reset() -> Result<http::Response<tonic::body::Body>, std::io::Error> {
    Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
}

#[tokio::test(start_paused = true)]
async fn a_call_is_committed_once_response_headers_arrive() {
    let server = Fake::new(headers_then_unavailable);
    let layer = RetryLayer::new(config(&policy(5), ""));
    let mut client = PaymentsClient::new(tower::Layer::layer(&layer, server.clone()));
    let status = client
        .charge(ChargeRequest::default())
        .await
        .expect_err("the trailers say UNAVAILABLE");
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(
        *server.calls.lock().unwrap(),
        1,
        "never retried after headers"
    );
}

/// A server whose calls take a scripted time and answer a scripted outcome, and which
/// notices when a call is cancelled (its handler dropped before it answered).
#[derive(Debug, Clone, Default)]
struct Slow {
    script: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    cancelled: Arc<Mutex<u32>>,
}

/// How long a call takes, and its failure (`None`: OK).
type Step = (Duration, Option<Status>);

/// Counts a cancellation unless disarmed.
struct CancelGuard(Option<Arc<Mutex<u32>>>);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if let Some(cancelled) = self.0.take() {
            *cancelled.lock().unwrap() += 1;
        }
    }
}

#[tonic::async_trait]
impl Payments for Slow {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        self.seen.lock().unwrap().push(Seen {
            at: Instant::now(),
            previous_attempts: request
                .metadata()
                .get("grpc-previous-rpc-attempts")
                .map(|v| v.to_str().unwrap().to_owned()),
            timeout: None,
            key: None,
        });
        let (delay, outcome) = self
            .script
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or((Duration::ZERO, None));
        let mut guard = CancelGuard(Some(Arc::clone(&self.cancelled)));
        tokio::time::sleep(delay).await;
        guard.0 = None;
        match outcome {
            Some(status) => Err(status),
            None => Ok(Response::new(ChargeReply {
                charge_id: format!("after {delay:?}"),
                ..ChargeReply::default()
            })),
        }
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

fn hedging(max_attempts: u32, delay_ms: u64, non_fatal: &str, throttling: &str) -> RetryLayer {
    RetryLayer::new(
        ServiceConfig::parse(&format!(
            r#"{{"methodConfig": [{{"name": [{{"service": "retrychain.v1.Payments"}}],
                "hedgingPolicy": {{"maxAttempts": {max_attempts}, "hedgingDelay": "{}s",
                                   "nonFatalStatusCodes": [{non_fatal}]}}}}] {throttling}}}"#,
            delay_ms as f64 / 1000.0
        ))
        .unwrap(),
    )
}

fn slow(script: Vec<(u64, Option<Status>)>) -> Slow {
    Slow {
        script: Arc::new(Mutex::new(
            script
                .into_iter()
                .map(|(ms, outcome)| (Duration::from_millis(ms), outcome))
                .collect(),
        )),
        ..Slow::default()
    }
}

#[tokio::test(start_paused = true)]
async fn hedges_go_at_the_delays_the_first_answer_wins_and_the_rest_are_cancelled() {
    let server = slow(vec![(1000, None), (1000, None), (10, None)]);
    let layer = hedging(3, 100, r#""UNAVAILABLE""#, "");
    let mut client = PaymentsClient::new(tower::Layer::layer(
        &layer,
        PaymentsServer::new(server.clone()),
    ));
    let start = Instant::now();
    let reply = client
        .charge(ChargeRequest::default())
        .await
        .expect("the third copy answers first");
    assert_eq!(reply.get_ref().charge_id, "after 10ms");
    assert_eq!(start.elapsed(), Duration::from_millis(210));
    let seen = server.seen.lock().unwrap().clone();
    let offsets: Vec<Duration> = seen.iter().map(|s| s.at - start).collect();
    assert_eq!(
        offsets,
        vec![
            Duration::ZERO,
            Duration::from_millis(100),
            Duration::from_millis(200)
        ]
    );
    let marks: Vec<Option<String>> = seen.iter().map(|s| s.previous_attempts.clone()).collect();
    assert_eq!(marks, vec![None, Some("1".into()), Some("2".into())]);
    tokio::task::yield_now().await;
    assert_eq!(
        *server.cancelled.lock().unwrap(),
        2,
        "the two slow copies were cancelled"
    );
}

#[tokio::test(start_paused = true)]
async fn a_non_fatal_failure_sends_the_next_hedge_at_once_and_a_fatal_one_ends_the_call() {
    let server = slow(vec![(5, Some(Status::unavailable("busy"))), (5, None)]);
    let layer = hedging(3, 1000, r#""UNAVAILABLE""#, "");
    let mut client = PaymentsClient::new(tower::Layer::layer(
        &layer,
        PaymentsServer::new(server.clone()),
    ));
    let start = Instant::now();
    client
        .charge(ChargeRequest::default())
        .await
        .expect("the second copy succeeds");
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(10),
        "no 1 s hedging delay"
    );

    let server = slow(vec![
        (5, Some(Status::invalid_argument("bad"))),
        (1000, None),
    ]);
    let mut client = PaymentsClient::new(tower::Layer::layer(
        &layer,
        PaymentsServer::new(server.clone()),
    ));
    let status = client
        .charge(ChargeRequest::default())
        .await
        .expect_err("INVALID_ARGUMENT is fatal");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        server.seen.lock().unwrap().len(),
        1,
        "no hedge after a fatal failure"
    );
}

#[tokio::test(start_paused = true)]
async fn hedges_count_against_the_throttle() {
    // maxTokens 2: one non-fatal failure leaves 1, not above half: no more hedges.
    let server = slow(vec![
        (5, Some(Status::unavailable("busy"))),
        (5, Some(Status::unavailable("busy"))),
    ]);
    let layer = hedging(
        3,
        50,
        r#""UNAVAILABLE""#,
        r#", "retryThrottling": {"maxTokens": 2, "tokenRatio": 0.1}"#,
    );
    let mut client = PaymentsClient::new(tower::Layer::layer(
        &layer,
        PaymentsServer::new(server.clone()),
    ));
    let status = client
        .charge(ChargeRequest::default())
        .await
        .expect_err("throttled");
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(server.seen.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn our_retry_budget_can_stand_in_for_the_throttle() {
    // One token, no refund: the first call may retry once, the second not at all.
    let budget = std::sync::Arc::new(resilience::RetryBudget::new(1.0, 0.0));
    let layer = RetryLayer::new(config(&policy(5), "")).throttle(budget.clone());
    let server = Scripted::failing(unavailable(10));
    let mut client = client_of(layer, &server);
    charge(&mut client).await.expect_err("fails");
    assert_eq!(server.seen().len(), 2, "one retry, paid by the only token");
    charge(&mut client).await.expect_err("fails");
    assert_eq!(server.seen().len(), 3, "no token left: no retry");
    assert_eq!(budget.tokens(), 0.0);
}

#[tokio::test(start_paused = true)]
async fn the_layer_ends_a_call_at_its_deadline_even_if_the_server_does_not() {
    // The server takes 10 s and ignores grpc-timeout; the call's deadline is 1 s.
    let server = slow(vec![(10_000, None)]);
    let layer = RetryLayer::new(config(&policy(3), ""));
    let mut client = PaymentsClient::new(tower::Layer::layer(
        &layer,
        PaymentsServer::new(server.clone()),
    ));
    let mut request = Request::new(ChargeRequest::default());
    request.set_timeout(Duration::from_secs(1));
    let start = Instant::now();
    let status = client
        .charge(request)
        .await
        .expect_err("the deadline passes");
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), Duration::from_secs(1));

    // With no grpc-timeout, the method config's `timeout` is the deadline.
    let server = slow(vec![(10_000, None)]);
    let layer = RetryLayer::new(
        ServiceConfig::parse(
            r#"{"methodConfig": [{"name": [{"service": "retrychain.v1.Payments"}], "timeout": "0.5s",
                "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.1s", "maxBackoff": "0.1s",
                                "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
        )
        .unwrap(),
    );
    let mut client = PaymentsClient::new(tower::Layer::layer(
        &layer,
        PaymentsServer::new(server.clone()),
    ));
    let start = Instant::now();
    let status = client
        .charge(ChargeRequest::default())
        .await
        .expect_err("the configured timeout passes");
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert_eq!(start.elapsed(), Duration::from_millis(500));
}

#[tokio::test(start_paused = true)]
async fn a_call_that_reaches_no_server_is_unavailable_and_retried() {
    let transport = Fake::new(connection_reset);
    let layer = RetryLayer::new(config(&policy(3), ""));
    let mut client = PaymentsClient::new(tower::Layer::layer(&layer, transport.clone()));
    let status = client
        .charge(ChargeRequest::default())
        .await
        .expect_err("no server");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(transport.calls(), 3);
}

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
    // grpc-timeout, for which tonic's channel keeps a timer of its own, set a moment after
    // the balancer's: both usually fall on the same millisecond tick. Whichever is polled
    // first, the attempt's expiry is told as a per-attempt timeout (UNAVAILABLE, which a
    // caller may retry elsewhere), never as the call's deadline passing (DEADLINE_EXCEEDED)
    // nor as CANCELLED — the call itself had seconds left. (The server, plain tonic,
    // enforces the 40 ms too, answering CANCELLED "Timeout expired": a third timer.)
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
