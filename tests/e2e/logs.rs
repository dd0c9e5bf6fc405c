//! Logs a machine reads: `retrychain up --log-format json` writes one JSON object per line
//! on stdout and nothing else, each naming its service, and inside a request its trace id
//! and key, as top-level fields; numbers are numbers; no `otel.*` fields.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_json_logs_writes_one_json_object_per_line_and_nothing_else() {
    let base = free_base_port();
    let up = Command::new(BIN)
        .args([
            "up",
            "--base-port",
            &base.to_string(),
            "--log-format",
            "json",
        ])
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut up = KillOnDrop(up);
    let stdout = up.0.stdout.take().unwrap();
    let lines = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    // `up` says it is up on stderr, out of the JSON's way.
    let stderr = up.0.stderr.take().unwrap();
    let (ready_tx, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.starts_with("retrychain is up") {
                let _ = ready_tx.send(());
            }
        }
    });
    off_runtime(move || ready.recv_timeout(Duration::from_secs(90)))
        .await
        .expect("up says on stderr that it is up");
    let edge = format!("http://127.0.0.1:{base}");
    let key = new_key();
    let client = retrychain_proto::v1::payments_client::PaymentsClient::new(connect(&edge).await);
    charge_on(
        &client,
        &new_account(),
        500,
        Some(&key),
        Duration::from_secs(5),
    )
    .await
    .expect("a charge");
    let _ = Command::new("kill")
        .args(["-TERM", &up.0.id().to_string()])
        .status();
    let status = off_runtime(move || up.0.wait()).await.unwrap();
    assert!(status.success(), "up stops cleanly: {status}");
    let lines = lines.join().unwrap();
    assert!(lines.len() > 10, "the services logged: {lines:?}");

    let mut services = std::collections::BTreeSet::new();
    let mut request_lines = 0;
    let mut ledger_outcomes = 0;
    for line in &lines {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not one JSON object ({e}): {line}"));
        let object = value
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {line}"));
        let service = object["service"]
            .as_str()
            .expect("every line names its service");
        services.insert(service.to_owned());
        assert!(
            !object.keys().any(|k| k.starts_with("otel.")),
            "no otel.* fields: {line}"
        );
        if object.get("key").and_then(|k| k.as_str()) == Some(key.as_str()) {
            request_lines += 1;
            assert!(
                object["trace_id"].as_str().is_some_and(|t| t.len() == 32),
                "the trace id beside the key: {line}"
            );
            if let Some(elapsed) = object.get("elapsed_ms") {
                assert!(elapsed.is_f64(), "a number: {line}");
            }
            // The ledger's line for the charge says what it did: the charge and the
            // balance after it.
            if service == "ledger"
                && object.get("message").and_then(|m| m.as_str()) == Some("rpc done")
            {
                ledger_outcomes += 1;
                assert!(
                    object["charge_id"]
                        .as_str()
                        .is_some_and(|id| id.len() == 36),
                    "the charge id on the ledger's line: {line}"
                );
                assert!(object["balance_cents"].is_i64(), "the balance: {line}");
            }
        }
    }
    assert_eq!(
        services.into_iter().collect::<Vec<_>>(),
        ["edge", "hop2", "hop3", "hop4", "ledger"],
        "all five"
    );
    assert!(
        request_lines >= 5,
        "every service logged the charge under its key: {request_lines} lines"
    );
    assert_eq!(ledger_outcomes, 1, "one line for the charge at the ledger");
}
