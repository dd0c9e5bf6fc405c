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

/// A service must never wait for its stdout: a relay whose stdout is a pipe nobody reads
/// is sent calls until its log backlog (4 MiB, past the pipe's own buffer) is full and
/// lines are dropped, and a further batch past that; every call is still answered in time.
/// Then the pipe is read until the relay says how many lines it dropped (as `/metrics`
/// does), and left unread again; stuck once more, the relay still stops on SIGTERM.
/// Before lines were dropped, the task that logged past the backlog wrote it out itself,
/// and on a service's one thread that write, blocked on the full pipe, stopped every call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_whose_stdout_is_not_read_keeps_serving_and_counts_the_lines_it_dropped() {
    use futures::StreamExt;

    // A charge without a key is refused by a relay at once (INVALID_ARGUMENT), before any
    // downstream call, and logged: a line a call, about 300 bytes, with nothing below. On
    // one thread, as a service runs by default: there one blocked write stops everything.
    let launch = Launch {
        program: Some(BIN.into()),
        args: args(&[
            "relay",
            "--name",
            "hop2",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--downstream",
            "http://127.0.0.1:1",
            "--worker-threads",
            "1",
        ]),
        env: Vec::new(),
        logs: Logs::Unread,
    };
    let mut relay = ChildService::start("hop2", launch).await.unwrap();
    // Held open and not read until lines were dropped.
    let stdout = relay.take_stdout().unwrap();
    let (public, admin) = (relay.url().to_owned(), relay.addr.admin_url.clone());
    let client = retrychain_proto::v1::payments_client::PaymentsClient::new(connect(&public).await);
    let dropped = || async {
        let metrics = scrape_metrics(&admin).await;
        metrics
            .lines()
            .find(|l| l.starts_with("retrychain_log_lines_dropped_total"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no log_lines_dropped_total in:\n{metrics}"))
    };
    assert_eq!(dropped().await, 0, "none yet");

    // Batches of calls, 64 at once, until more lines are dropped than `past`; then one
    // more batch. Every call must be answered.
    let mut calls = 0;
    let mut calls_until_dropped = async |past: u64| {
        const BATCH: usize = 2_000;
        let mut batches_past = 0;
        while batches_past < 2 {
            assert!(
                calls < 100_000,
                "{calls} calls and no more lines dropped: are the lines logged at all?"
            );
            let answered = futures::stream::iter(0..BATCH)
                .map(|_| {
                    let client = client.clone();
                    async move {
                        let request =
                            charge(&new_account(), 100, None, Duration::from_secs(2), &[]);
                        tokio::time::timeout(Duration::from_secs(5), client.clone().charge(request))
                            .await
                    }
                })
                .buffer_unordered(64)
                .collect::<Vec<_>>()
                .await;
            for answer in answered {
                let status = answer
                    .unwrap_or_else(|_| {
                        panic!("a call was not answered in 5 s, after {calls} calls: the relay stalled on its stdout")
                    })
                    .expect_err("no key: refused");
                assert_eq!(
                    status.code(),
                    tonic::Code::InvalidArgument,
                    "after {calls} calls (the relay stalled on its stdout if its time ran out): {status:?}"
                );
            }
            calls += BATCH;
            if dropped().await > past {
                batches_past += 1;
            }
        }
    };
    calls_until_dropped(0).await;
    let total = dropped().await;

    // stdout read until the relay says what it dropped, then left unread again.
    let (line_tx, said) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        while stdout.read_line(&mut line).is_ok_and(|n| n > 0) {
            if line.contains("log lines dropped") {
                let _ = line_tx.send(line.clone());
                break;
            }
            line.clear();
        }
        stdout
    });
    let line = off_runtime(move || said.recv_timeout(Duration::from_secs(10)))
        .await
        .expect("a line says lines were dropped, once stdout is read");
    let reported: u64 = line
        .split_whitespace()
        .find_map(|word| word.strip_prefix("dropped_total="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("dropped_total on the line: {line}"));
    // The first such line counts every line dropped before stdout was read (more may
    // have been since the scrape: the relay's own warnings about its downstream).
    assert!(
        reported >= total,
        "the line's total {reported}, /metrics {total}: {line}"
    );
    let _unread = off_runtime(move || reader.join().unwrap()).await;

    // Stuck again (the backlog fills the pipe at once), and more dropped: SIGTERM stops
    // it all the same, its last lines dropped rather than waited for.
    let past = dropped().await;
    calls_until_dropped(past).await;
    let status = relay
        .terminate(Duration::from_secs(30))
        .await
        .expect("the relay stops on SIGTERM within 30 s with its stdout stuck");
    assert!(status.success(), "it stops cleanly: {status}");
}
