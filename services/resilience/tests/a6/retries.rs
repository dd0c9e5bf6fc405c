//! A6's retries: how many, which codes, when, the pushback, the throttle, the buffer, the
//! deadline, and when a call is committed.

use super::*;

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
async fn each_attempt_is_sent_the_per_attempt_timeout_or_the_time_left_whichever_ends_first() {
    // The same schedule with a 300 ms per-attempt timeout: the first two attempts are cut
    // to it (1 s and 600 ms left), the last is sent its 200 ms left.
    let server = Scripted::failing(unavailable(10));
    let layer = RetryLayer::new(config(
        r#"{"maxAttempts": 5, "initialBackoff": "0.4s", "maxBackoff": "0.4s",
             "backoffMultiplier": 1, "retrychainJitter": "exponential",
             "retryableStatusCodes": ["UNAVAILABLE"]}"#,
        "",
    ))
    .per_try_timeout(Some(Duration::from_millis(300)));
    let mut client = client_of(layer, &server);
    let mut request = Request::new(ChargeRequest {
        account_id: "a".into(),
        amount_cents: 1,
    });
    request.set_timeout(Duration::from_secs(1));
    let status = client.charge(request).await.expect_err("fails");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let timeouts: Vec<Duration> = server
        .seen()
        .iter()
        .map(|s| resilience::wire::parse_timeout(s.timeout.as_deref().unwrap()).unwrap())
        .collect();
    assert_eq!(
        timeouts,
        [300, 300, 200].map(Duration::from_millis).to_vec()
    );
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
