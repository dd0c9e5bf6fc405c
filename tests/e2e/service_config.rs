//! `--service-config`: the retry policy as a gRPC service config document (gRFC A6), the
//! same JSON grpc-go and grpc-java accept, on a real chain.

use std::time::Duration;

use crate::support::*;
use tonic::Code;

/// Writes `json` to a file that lives as long as the returned handle.
fn config_file(json: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), json).unwrap();
    file
}

fn edge_with(config: &tempfile::NamedTempFile) -> Options {
    let mut options = Options::default();
    options.spec.edge().service.service_config = Some(config.path().to_owned());
    options
}

const RETRY_4_THROTTLED: &str = r#"{
    "methodConfig": [{
        "name": [{"service": "retrychain.v1.Payments", "method": "Charge"}],
        "retryPolicy": {
            "maxAttempts": 4,
            "initialBackoff": "0.002s",
            "maxBackoff": "0.02s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"]
        }
    }],
    "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
}"#;

#[tokio::test]
async fn the_retry_policy_and_a6_throttling_come_from_the_document() {
    let config = config_file(RETRY_4_THROTTLED);
    let chain = Chain::spawn(edge_with(&config)).await;
    chain.fail_processor().await;
    let deadline = Duration::from_secs(10);

    // maxAttempts 4: four bottom calls. Each failure costs a token: 10 -> 6.
    chain
        .charge_new(deadline, &[])
        .await
        .expect_err("the processor fails");
    let stats = chain.stats(EDGE).await;
    assert_eq!(stats.downstream_attempts, 4);
    assert_eq!(stats.budget_tokens, 6.0);

    // The next failure leaves 5, not above half of 10: A6 allows no retry.
    let status = chain
        .charge_new(deadline, &[])
        .await
        .expect_err("the processor fails");
    assert_eq!(status.code(), Code::Unavailable);
    let stats = chain.stats(EDGE).await;
    assert_eq!(stats.downstream_attempts, 5, "one attempt, no retry");
    assert_eq!(stats.budget_denied, 1);
    assert_eq!(stats.budget_tokens, 5.0);
}

#[tokio::test]
async fn only_the_configured_codes_are_retried() {
    let config = config_file(
        r#"{"methodConfig": [{
            "name": [{"service": "retrychain.v1.Payments"}],
            "retryPolicy": {
                "maxAttempts": 5, "initialBackoff": "0.001s", "maxBackoff": "0.01s",
                "backoffMultiplier": 1.5, "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]
            }
        }]}"#,
    );
    let chain = Chain::spawn(edge_with(&config)).await;
    chain.fail_processor().await; // UNAVAILABLE: not in the list
    chain
        .charge_new(Duration::from_secs(10), &[])
        .await
        .expect_err("fails");
    assert_eq!(chain.stats(LEDGER).await.downstream_attempts, 1);
}

/// Runs `retrychain edge --service-config <json>`; what it printed on stderr, having failed.
fn refused(json: &str) -> String {
    let config = config_file(json);
    let output = std::process::Command::new(BIN)
        .args(["edge", "--listen", "127.0.0.1:0", "--service-config"])
        .arg(config.path())
        .output()
        .unwrap();
    assert!(!output.status.success(), "started on {json}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn an_invalid_config_is_refused_at_start_with_the_field_and_the_reason() {
    let stderr = refused(
        r#"{"methodConfig": [{"name": [{"service": "retrychain.v1.Payments"}],
            "retryPolicy": {"maxAttempts": 1, "initialBackoff": "0.1s", "maxBackoff": "1s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
    );
    assert!(
        stderr.contains("methodConfig[0].retryPolicy.maxAttempts: must be at least 2"),
        "{stderr}"
    );
    let stderr = refused(r#"{"retryThrottling": {"maxTokens": 10}}"#);
    assert!(
        stderr.contains("retryThrottling.tokenRatio: is required"),
        "{stderr}"
    );
    let stderr = refused(
        r#"{"methodConfig": [{"name": [{"service": "retrychain.v1.Payments"}],
            "hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "1"}}]}"#,
    );
    assert!(
        stderr.contains("methodConfig[0].hedgingPolicy.hedgingDelay"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_hedging_policy_hedges_at_the_edge_and_the_key_makes_it_one_charge() {
    let config = config_file(
        r#"{"methodConfig": [{
            "name": [{"service": "retrychain.v1.Payments", "method": "Charge"}],
            "hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": "0.05s"}
        }]}"#,
    );
    let chain = Chain::spawn(edge_with(&config)).await;
    // A slow processor: the first copy holds the key for 300 ms, so the hedge goes after
    // 50 ms, reaches the ledger with the same key, waits for it, and replays its reply.
    chain.set_faults(LEDGER, delayed(300)).await;
    let account = new_account();
    chain
        .charge(&account, 500, None, Duration::from_secs(10), &[])
        .await
        .expect("charged");

    let stats = chain.all_stats().await;
    assert_eq!(
        stats[EDGE].downstream_attempts, 2,
        "the first copy and one hedge"
    );
    assert_eq!(stats[LEDGER].requests_received, 2);
    assert_eq!(
        stats[LEDGER].executions, 1,
        "one charge: both copies carry one key"
    );
    assert_eq!(chain.account(&account).await, Some((500, 1)));
}

/// A config naming Payments/Charge applies to Charge only, as gRPC resolves method
/// configs: with hop2 refusing every call, the edge retries a Charge four times and a
/// GetAccount not at all.
#[tokio::test]
async fn a_charge_only_config_leaves_get_account_unretried() {
    let config = config_file(RETRY_4_THROTTLED);
    let chain = Chain::spawn(edge_with(&config)).await;
    chain.set_faults(1, failing()).await; // hop2's calls downstream fail: hop2 answers UNAVAILABLE
    chain.reset_stats().await;
    chain
        .charge_new(Duration::from_secs(10), &[])
        .await
        .expect_err("hop2 fails every call");
    assert_eq!(
        chain.stats(1).await.requests_received,
        4,
        "Charge: maxAttempts 4"
    );

    chain.reset_stats().await;
    let status = chain
        .client
        .account(&new_account())
        .await
        .expect_err("hop2 fails every call");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(
        chain.stats(1).await.requests_received,
        1,
        "GetAccount: no policy, one attempt"
    );
}
