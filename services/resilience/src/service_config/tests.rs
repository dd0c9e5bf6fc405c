//! Tests of [`super`]: `service_config`.

use super::*;

/// grpc-go's documented example (examples/features/retry), verbatim but for the service.
const GRPC_GO_RETRY: &str = r#"{
    "methodConfig": [{
        "name": [{"service": "grpc.examples.echo.Echo"}],
        "waitForReady": true,
        "retryPolicy": {
            "MaxAttempts": 4,
            "maxAttempts": 4,
            "InitialBackoff": ".01s",
            "initialBackoff": "0.01s",
            "MaxBackoff": ".01s",
            "maxBackoff": "0.01s",
            "BackoffMultiplier": 1.0,
            "backoffMultiplier": 1.0,
            "RetryableStatusCodes": [ "UNAVAILABLE" ],
            "retryableStatusCodes": [ "UNAVAILABLE" ]
        }
    }]
}"#;

#[test]
fn grpc_go_examples_are_accepted() {
    let config = ServiceConfig::parse(GRPC_GO_RETRY).expect("accepted");
    let method = config
        .for_method("grpc.examples.echo.Echo", "UnaryEcho")
        .expect("the service's config");
    let Some(CallPolicy::Retry(retry)) = &method.policy else {
        panic!("a retry policy")
    };
    assert_eq!(retry.max_attempts, 4);
    assert_eq!(retry.initial_backoff, Duration::from_millis(10));
    assert_eq!(retry.retryable_status_codes, vec![Code::Unavailable]);

    // gRFC A6's hedging and throttling examples.
    let config = ServiceConfig::parse(
        r#"{
            "methodConfig": [{
                "name": [{"service": "EchoService", "method": "Echo"}],
                "hedgingPolicy": {
                    "maxAttempts": 3,
                    "hedgingDelay": "0.5s",
                    "nonFatalStatusCodes": ["UNAVAILABLE", "INTERNAL", "ABORTED"]
                },
                "timeout": "1.000000001s"
            }],
            "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
        }"#,
    )
    .expect("accepted");
    let method = config.for_method("EchoService", "Echo").expect("exact");
    assert_eq!(method.timeout, Some(Duration::new(1, 1)));
    assert_eq!(
        method.policy,
        Some(CallPolicy::Hedging(HedgingPolicy {
            max_attempts: 3,
            hedging_delay: Duration::from_millis(500),
            non_fatal_status_codes: vec![Code::Unavailable, Code::Internal, Code::Aborted],
        }))
    );
    assert_eq!(
        config.retry_throttling,
        Some(RetryThrottling {
            max_tokens: 10.0,
            token_ratio: 0.1
        })
    );
}

#[test]
fn the_extensions_per_try_timeout_and_adaptive_throttling() {
    let config = ServiceConfig::parse(
        r#"{"methodConfig": [{"name": [{}], "retrychainPerTryTimeout": "0.3s"}],
            "adaptiveThrottling": {"k": 3, "window": "20s"}}"#,
    )
    .expect("valid");
    assert_eq!(
        config.method_configs[0].per_try_timeout,
        Some(Duration::from_millis(300))
    );
    assert_eq!(
        config.adaptive_throttling,
        Some(AdaptiveThrottling {
            k: 3.0,
            window: Duration::from_secs(20)
        })
    );
    let throttle = config.throttle().expect("a throttle");
    assert_eq!(throttle.reject_probability(), 0.0);
    // Adaptive (no tokens until something is accepted), not A6 (which starts full).
    assert_eq!(throttle.tokens(), 0.0);
    let defaults = ServiceConfig::parse(r#"{"adaptiveThrottling": {}}"#).expect("valid");
    assert_eq!(
        defaults.adaptive_throttling.map(|t| (t.k, t.window)),
        Some((2.0, Duration::from_secs(10)))
    );
    for (json, field, reason) in [
        (
            r#"{"retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}, "adaptiveThrottling": {}}"#,
            "adaptiveThrottling",
            "not both",
        ),
        (
            r#"{"adaptiveThrottling": {"k": 0.5}}"#,
            "adaptiveThrottling.k",
            "at least 1",
        ),
        (
            r#"{"adaptiveThrottling": {"window": "0.5s"}}"#,
            "adaptiveThrottling.window",
            "between 1s and 600s",
        ),
        (
            r#"{"methodConfig": [{"retrychainPerTryTimeout": "0s"}]}"#,
            "methodConfig[0].retrychainPerTryTimeout",
            "above 0s",
        ),
    ] {
        let e = refused(json);
        assert_eq!(e.field, field, "{json}");
        assert!(e.reason.contains(reason), "{json}: {}", e.reason);
    }
}

#[test]
fn max_attempts_above_5_is_capped() {
    let config =
        ServiceConfig::parse(&retry_with("maxAttempts", serde_json::json!(9))).expect("ok");
    let Some(CallPolicy::Retry(retry)) = &config.method_configs[0].policy else {
        panic!()
    };
    assert_eq!(retry.max_attempts, 5);
}

/// A valid retry policy with `key` set to `value`.
fn retry_with(key: &str, value: Value) -> String {
    let mut policy = serde_json::json!({
        "maxAttempts": 3,
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"]
    });
    policy[key] = value;
    serde_json::json!({"methodConfig": [{"name": [{"service": "s"}], "retryPolicy": policy}]})
        .to_string()
}

fn refused(json: &str) -> ConfigError {
    ServiceConfig::parse(json).expect_err("refused")
}

#[test]
fn invalid_configs_are_refused_with_the_field_and_the_reason() {
    let cases: [(String, &str, &str); 9] = [
        (
            retry_with("maxAttempts", serde_json::json!(1)),
            "methodConfig[0].retryPolicy.maxAttempts",
            "at least 2",
        ),
        (
            retry_with("initialBackoff", serde_json::json!("100")),
            "methodConfig[0].retryPolicy.initialBackoff",
            "must end in \"s\"",
        ),
        (
            retry_with("maxBackoff", serde_json::json!("0s")),
            "methodConfig[0].retryPolicy.maxBackoff",
            "above 0s",
        ),
        (
            retry_with("backoffMultiplier", serde_json::json!(0)),
            "methodConfig[0].retryPolicy.backoffMultiplier",
            "above 0",
        ),
        (
            retry_with("retryableStatusCodes", serde_json::json!(["SOMETIMES"])),
            "methodConfig[0].retryPolicy.retryableStatusCodes[0]",
            "not a gRPC status code",
        ),
        (
            retry_with("retryableStatusCodes", serde_json::json!([])),
            "methodConfig[0].retryPolicy.retryableStatusCodes",
            "at least one",
        ),
        (
            r#"{"methodConfig": [{"name": [{"service": "s"}],
                "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
                "hedgingPolicy": {"maxAttempts": 2}}]}"#
                .to_owned(),
            "methodConfig[0]",
            "mutually exclusive",
        ),
        (
            r#"{"methodConfig": [{"name": [{"method": "Charge"}]}]}"#.to_owned(),
            "methodConfig[0].name[0].service",
            "needs its service",
        ),
        (
            r#"{"retryThrottling": {"maxTokens": 1001, "tokenRatio": 0.1}}"#.to_owned(),
            "retryThrottling.maxTokens",
            "at most 1000",
        ),
    ];
    for (json, field, reason) in cases {
        let error = refused(&json);
        assert_eq!(error.field, field, "{json}");
        assert!(error.reason.contains(reason), "{error} for {json}");
        assert!(error.to_string().contains(field));
    }
}

#[test]
fn duplicate_names_bad_json_ratios_timeouts_and_jitter_are_refused() {
    assert_eq!(
        refused(
            r#"{"methodConfig": [{"name": [{"service": "s"}]}, {"name": [{"service": "s"}]}]}"#
        )
        .field,
        "methodConfig[1].name[0]"
    );
    assert_eq!(refused(r#"{"methodConfig": "#).field, "(document)");
    for ratio in ["0", "0.0004"] {
        assert_eq!(
            refused(&format!(
                r#"{{"retryThrottling": {{"maxTokens": 10, "tokenRatio": {ratio}}}}}"#
            ))
            .field,
            "retryThrottling.tokenRatio",
            "{ratio}"
        );
    }
    assert_eq!(
        refused(r#"{"methodConfig": [{"name": [{"service": "s"}], "timeout": "0s"}]}"#).field,
        "methodConfig[0].timeout"
    );
    assert_eq!(
        refused(&retry_with("retrychainJitter", serde_json::json!("wobbly"))).field,
        "methodConfig[0].retryPolicy.retrychainJitter"
    );
}

#[test]
fn methods_match_exactly_then_by_service_then_by_default() {
    let config = ServiceConfig::parse(
        r#"{"methodConfig": [
            {"name": [{}], "timeout": "1s"},
            {"name": [{"service": "retrychain.v1.Payments"}], "timeout": "2s"},
            {"name": [{"service": "retrychain.v1.Payments", "method": "Charge"}], "timeout": "3s"}
        ]}"#,
    )
    .expect("ok");
    let timeout = |s: &str, m: &str| config.for_method(s, m).and_then(|c| c.timeout);
    assert_eq!(
        timeout("retrychain.v1.Payments", "Charge"),
        Some(Duration::from_secs(3))
    );
    assert_eq!(
        timeout("retrychain.v1.Payments", "GetAccount"),
        Some(Duration::from_secs(2))
    );
    assert_eq!(
        timeout("other.Service", "Any"),
        Some(Duration::from_secs(1))
    );
    assert_eq!(ServiceConfig::default().for_method("a", "b"), None);
}

#[test]
fn durations_are_proto3_json() {
    let d = |s: &str| duration("f", &Value::String(s.into()));
    assert_eq!(d("1s"), Ok(Duration::from_secs(1)));
    assert_eq!(d("0.010s"), Ok(Duration::from_millis(10)));
    assert_eq!(d("1.000000001s"), Ok(Duration::new(1, 1)));
    assert_eq!(
        d(".01s"),
        Ok(Duration::from_millis(10)),
        "grpc-go's own spelling"
    );
    for bad in [
        "1",
        "1ms",
        "s",
        ".s",
        "-1s",
        "1.0000000001s",
        "1e3s",
        "",
        "315576000001s",
    ] {
        assert!(d(bad).is_err(), "{bad}");
    }
}

#[test]
fn codes_by_name_in_any_case_or_by_number() {
    let parsed = codes(
        "c",
        &serde_json::json!(["unavailable", "RESOURCE_EXHAUSTED", 10, "UNAVAILABLE"]),
    )
    .expect("ok");
    assert_eq!(
        parsed,
        vec![Code::Unavailable, Code::ResourceExhausted, Code::Aborted]
    );
    assert!(codes("c", &serde_json::json!(["OK"])).is_err());
    assert!(codes("c", &serde_json::json!([0])).is_err());
    assert!(codes("c", &serde_json::json!([17])).is_err());
}
