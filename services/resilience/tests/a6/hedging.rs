//! A6's hedging, the throttle's hold on hedges, and the call's deadline kept by the layer.

use super::*;

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
