//! The five-hop chain end to end: bottom calls per retry mode, deadlines, pushback, the
//! override gate, lost replies, keys and traces. Real services over the wire, real Postgres:
//! in this test's runtime, or processes where a log or a signal is the point.
//!
//! The tests in [`deployment`] also run against an external deployment (e.g. `docker
//! compose up`) when RETRYCHAIN_EDGE … RETRYCHAIN_LEDGER are set.

use std::time::{Duration, Instant};

use crate::support::*;
use futures::StreamExt;
use retrychain_proto::v1::Faults;
use tonic::Code;

const LONG: Duration = Duration::from_secs(30);
const EVERY_LAYER: (&str, &str) = (RETRY_MODE, "every-layer");

fn received(stats: &[retrychain_proto::v1::Stats]) -> Vec<u64> {
    stats.iter().map(|s| s.requests_received).collect()
}

/// `requests` against a dead processor with up to 4 attempts each, 16 at a time.
async fn outage_load(requests: u64, budget: bool) -> (u64, u64) {
    let mut options = Options::default();
    let edge = &mut options.spec.edge().service;
    edge.max_attempts = 4;
    edge.no_budget = !budget;
    let chain = Chain::spawn(options).await;
    chain.fail_processor().await;
    let edge = chain.edge().await;
    let failures = futures::stream::iter(0..requests)
        .map(|i| {
            let edge = edge.clone();
            async move { charge_on(&edge, &format!("outage-{i}"), 100, None, LONG).await }
        })
        .buffer_unordered(16)
        .filter(|r| std::future::ready(r.is_err()))
        .count()
        .await;
    assert_eq!(
        failures as u64, requests,
        "every request fails in a total outage"
    );
    let stats = chain.all_stats().await;
    (
        stats[EDGE].requests_received,
        stats[LEDGER].downstream_attempts,
    )
}

#[tokio::test]
async fn an_outage_is_not_amplified_with_the_budget() {
    // Enough requests that the bucket's initial 10 tokens (0.5% here) do not hide the
    // steady state: a tenth of a retry per request.
    let (first, bottom) = outage_load(2000, true).await;
    let load = bottom as f64 / first as f64;
    println!(
        "outage with the default budget: {bottom} bottom calls for {first} requests = {load:.3}x"
    );
    assert_eq!(first, 2000);
    assert!(load <= 1.11, "load {load:.3}x (design notes: 1.10x)");
}

#[tokio::test]
async fn an_outage_is_amplified_4x_without_the_budget() {
    // Exact at any size: every request makes its 4 attempts.
    let (first, bottom) = outage_load(500, false).await;
    println!("outage without a budget: {bottom} bottom calls for {first} requests");
    assert_eq!((first, bottom), (500, 2000), "exactly 4.00x");
}

#[tokio::test]
async fn the_deadline_shrinks_at_every_hop_and_ends_in_deadline_exceeded() {
    // One attempt at the edge, so the deadlines recorded are those of one path down the
    // chain (a retry in the last few ms would overwrite them with smaller ones).
    let mut options = Options::default();
    options.spec.edge().service.max_attempts = 1;
    let chain = Chain::spawn(options).await;
    chain.set_faults(LEDGER, delayed(5000)).await;

    let start = Instant::now();
    let status = chain
        .charge_new(Duration::from_secs(2), &[])
        .await
        .expect_err("the processor is slower than the deadline");
    let elapsed = start.elapsed();

    println!("client saw {:?} after {elapsed:?}", status.code());
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    // Not before the deadline; and at it, by the edge (its trace id on the answer), not by
    // the client's own timer after the 5 s processor.
    assert!(elapsed >= Duration::from_millis(1800), "{elapsed:?}");
    assert!(
        status_header(&status, TRACE_ID).is_some(),
        "the edge answered: {status:?}"
    );
    let stats = chain.all_stats().await;
    let incoming: Vec<u64> = stats.iter().map(|s| s.last_incoming_timeout_ms).collect();
    println!("deadlines received, edge to ledger: {incoming:?} ms");
    assert!(
        incoming[EDGE] <= 2000 && incoming[EDGE] > 1900,
        "{incoming:?}"
    );
    assert!(
        incoming.windows(2).all(|w| w[0] > w[1]),
        "strictly decreasing: {incoming:?}"
    );
    for s in &stats[..LEDGER] {
        assert!(
            s.last_outgoing_timeout_ms < s.last_incoming_timeout_ms,
            "{s:?}"
        );
    }
    assert_eq!(stats[LEDGER].executions, 0);
    assert!(status_header(&status, TRACE_ID).is_some(), "{status:?}");
    let key = status_header(&status, IDEMPOTENCY_KEY).expect("the edge returns the key it made");
    assert!(uuid::Uuid::parse_str(&key).is_ok(), "{key}");
}

#[tokio::test]
async fn the_retry_mode_override_needs_the_flag() {
    let options = Options::default().each(|s| s.allow_retry_mode_override = false);
    let chain = Chain::spawn(options).await;
    chain.fail_processor().await;
    chain
        .charge_new(LONG, &[EVERY_LAYER])
        .await
        .expect_err("fails");
    let stats = chain.all_stats().await;
    assert_eq!(
        stats[LEDGER].downstream_attempts, 3,
        "edge-only: the header was ignored"
    );
    assert_eq!(received(&stats), vec![1, 3, 3, 3, 3], "and not passed on");
}

#[tokio::test]
async fn one_trace_id_runs_through_all_five_logs() {
    let chain = Chain::spawn(Options::processes()).await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = format!("00-{trace}-00f067aa0ba902b7-01");
    let reply = chain
        .charge(
            &new_account(),
            500,
            Some("trace-me"),
            LONG,
            &[(TRACEPARENT, &parent)],
        )
        .await
        .unwrap();
    assert_eq!(header(&reply, TRACE_ID).as_deref(), Some(trace));
    for (i, name) in NAMES.iter().enumerate() {
        // The lines reach us through a pipe and a reader thread: wait for them.
        let start = Instant::now();
        while !chain.log(i).contains("rpc done") && start.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let lines: Vec<String> = chain
            .log(i)
            .lines()
            .filter(|l| l.contains(trace))
            .map(String::from)
            .collect();
        assert!(
            !lines.is_empty(),
            "{name}'s log lacks trace {trace}:\n{}",
            chain.log(i)
        );
        assert!(
            lines.iter().any(|l| l.contains("trace-me")),
            "{name}: the key is on the line"
        );
        assert!(
            lines.iter().any(|l| l.contains("rpc done")),
            "{name}: one outcome line"
        );
    }
}

#[tokio::test]
async fn set_faults_without_fault_injection_is_permission_denied() {
    let chain = Chain::spawn(Options::default().each(|s| s.fault_injection = false)).await;
    for (i, name) in NAMES.iter().enumerate() {
        let status = chain
            .control(i)
            .await
            .set_faults(failing())
            .await
            .expect_err("refused");
        assert_eq!(status.code(), Code::PermissionDenied, "{name}");
    }
}

#[tokio::test]
async fn sigterm_stops_every_service_cleanly() {
    let mut chain = Chain::spawn(Options::processes()).await;
    chain.charge_new(LONG, &[]).await.unwrap();
    for service in &mut chain.services {
        // Drained calls get DRAIN_GRACE; past that (and a margin) it did not stop.
        let grace = retrychain_node::DRAIN_GRACE + Duration::from_secs(5);
        let status = service.terminate(grace).await;
        let status = status.expect("exits on SIGTERM");
        assert!(status.success(), "{} exited with {status}", service.name);
    }
}

/// The tests that also run against an external deployment (`docker compose up`,
/// `retrychain up`) when RETRYCHAIN_EDGE … RETRYCHAIN_LEDGER are set: `cargo test --test
/// chain -- deployment::` runs them alone.
mod deployment {
    use super::*;

    #[tokio::test]
    async fn every_layer_makes_243_bottom_calls() {
        let chain = Chain::deployment().await;
        chain.fail_processor().await;
        let account = new_account();

        let status = chain
            .charge(&account, 500, None, LONG, &[EVERY_LAYER])
            .await
            .expect_err("the processor always fails");

        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        let stats = chain.all_stats().await;
        assert_eq!(stats[LEDGER].downstream_attempts, 243, "3^5 bottom calls");
        assert_eq!(received(&stats), vec![1, 3, 9, 27, 81]);
        assert_eq!(stats[LEDGER].executions, 0);
        assert_eq!(chain.account(&account).await, None, "nothing committed");
    }

    #[tokio::test]
    async fn edge_only_makes_3_bottom_calls() {
        let chain = Chain::deployment().await;
        chain.fail_processor().await;

        let status = chain
            .charge_new(LONG, &[])
            .await
            .expect_err("the processor always fails");

        assert_eq!(status.code(), Code::Unavailable);
        assert!(
            status.message().contains("3 attempts"),
            "{}",
            status.message()
        );
        let stats = chain.all_stats().await;
        assert_eq!(stats[LEDGER].downstream_attempts, 3);
        assert_eq!(received(&stats), vec![1, 3, 3, 3, 3]);
        assert_eq!(stats[EDGE].retries, 2, "the edge retried");
        for hop in &stats[1..] {
            assert_eq!(hop.retries, 0, "{} must not retry", hop.service);
        }
    }

    #[tokio::test]
    async fn a_lost_reply_retried_by_the_edge_charges_once() {
        let chain = Chain::deployment().await;
        let account = new_account();
        let key = new_key();
        chain.set_faults(LEDGER, losing_replies(1.0)).await;

        let lost = chain.charge(&account, 500, Some(&key), LONG, &[]).await;
        let status = lost.expect_err("every reply is lost");
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(
            status_header(&status, IDEMPOTENCY_KEY).as_deref(),
            Some(key.as_str())
        );

        chain.set_faults(LEDGER, faults()).await;
        let later = chain
            .charge(&account, 500, Some(&key), LONG, &[])
            .await
            .expect("the reply gets through now");
        assert_eq!(header(&later, IDEMPOTENT_REPLAYED).as_deref(), Some("true"));
        let again = chain
            .charge(&account, 500, Some(&key), LONG, &[])
            .await
            .unwrap();
        assert_eq!(later.get_ref().charge_id, again.get_ref().charge_id);
        let stats = chain.all_stats().await;
        assert_eq!(stats[LEDGER].executions, 1, "one execution");
        assert!(
            stats[LEDGER].replays >= 3,
            "the edge's retries and the later calls replayed"
        );
        assert_eq!(chain.account(&account).await, Some((500, 1)));
    }

    #[tokio::test]
    async fn a_short_deadline_caps_every_layer_retries() {
        let chain = Chain::deployment().await;
        chain
            .set_faults(
                LEDGER,
                Faults {
                    delay_ms: 5,
                    ..failing()
                },
            )
            .await;

        let start = Instant::now();
        let status = chain
            .charge_new(Duration::from_millis(300), &[EVERY_LAYER])
            .await
            .expect_err("fails");
        let elapsed = start.elapsed();
        let bottom_at_answer = chain.stats(LEDGER).await.downstream_attempts;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let bottom_later = chain.stats(LEDGER).await.downstream_attempts;

        println!(
            "300 ms deadline, every-layer: {bottom_at_answer} bottom calls, answer after {elapsed:?}"
        );
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(bottom_at_answer < 243, "the deadline capped the storm");
        assert!(bottom_at_answer > 0);
        assert_eq!(
            bottom_later, bottom_at_answer,
            "no attempt started after the deadline"
        );
        let denied: u64 = chain
            .all_stats()
            .await
            .iter()
            .map(|s| s.deadline_denied)
            .sum();
        assert!(denied > 0, "some layer declined to retry for lack of time");
    }

    #[tokio::test]
    async fn a_non_retryable_failure_is_one_bottom_call_in_both_modes() {
        let chain = Chain::deployment().await;
        chain
            .set_faults(LEDGER, failing_with(Code::InvalidArgument))
            .await;
        for mode in [&[][..], &[EVERY_LAYER][..]] {
            chain.reset_stats().await;
            let status = chain.charge_new(LONG, mode).await.expect_err("fails");
            assert_eq!(status.code(), Code::InvalidArgument);
            assert_eq!(
                chain.stats(LEDGER).await.downstream_attempts,
                1,
                "mode {mode:?}"
            );
            assert_eq!(received(&chain.all_stats().await), vec![1, 1, 1, 1, 1]);
        }
    }

    #[tokio::test]
    async fn pushback_is_honoured_and_a_negative_one_stops_retries() {
        let chain = Chain::deployment().await;
        chain
            .set_faults(
                LEDGER,
                Faults {
                    pushback_ms: 200,
                    ..failing_with(Code::ResourceExhausted)
                },
            )
            .await;
        let start = Instant::now();
        let status = chain.charge_new(LONG, &[]).await.expect_err("busy");
        let elapsed = start.elapsed();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(chain.stats(LEDGER).await.downstream_attempts, 3);
        assert!(
            elapsed >= Duration::from_millis(400),
            "two retries, each after 200 ms: {elapsed:?}"
        );

        chain
            .set_faults(
                LEDGER,
                Faults {
                    pushback_never: true,
                    ..failing_with(Code::ResourceExhausted)
                },
            )
            .await;
        chain.reset_stats().await;
        let status = chain.charge_new(LONG, &[]).await.expect_err("busy");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(
            status.message().contains("pushback"),
            "{}",
            status.message()
        );
        assert_eq!(chain.stats(LEDGER).await.downstream_attempts, 1, "no retry");
    }

    #[tokio::test]
    async fn the_edge_makes_a_key_and_returns_it() {
        let chain = Chain::deployment().await;
        let account = new_account();
        let first = chain.charge(&account, 250, None, LONG, &[]).await.unwrap();
        let key = header(&first, IDEMPOTENCY_KEY).expect("the edge returns the key it made");
        assert!(uuid::Uuid::parse_str(&key).is_ok(), "{key}");
        let retry = chain
            .charge(&account, 250, Some(&key), LONG, &[])
            .await
            .unwrap();
        assert_eq!(header(&retry, IDEMPOTENT_REPLAYED).as_deref(), Some("true"));
        assert_eq!(retry.get_ref().charge_id, first.get_ref().charge_id);
        assert_eq!(chain.account(&account).await, Some((250, 1)));
    }

    #[tokio::test]
    async fn bad_input_at_the_edge_goes_no_further() {
        let chain = Chain::deployment().await;
        for request in [
            charge("", 500, None, LONG, &[]),
            charge("x", 0, None, LONG, &[]),
            charge("x", 500, Some("has space"), LONG, &[]),
            charge("x", 500, None, LONG, &[(TIMEOUT_HEADER, "12 seconds")]),
        ] {
            let status = chain
                .edge()
                .await
                .charge(request)
                .await
                .expect_err("invalid");
            assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        }
        assert_eq!(chain.stats(EDGE).await.downstream_attempts, 0);
    }

    #[tokio::test]
    async fn faults_at_a_middle_hop_are_retried_by_the_edge() {
        let chain = Chain::deployment().await;
        chain.set_faults(2, failing()).await;
        let status = chain.charge_new(LONG, &[]).await.expect_err("hop3 fails");
        assert!(status.message().contains("hop3"), "{}", status.message());
        let stats = chain.all_stats().await;
        assert_eq!(
            received(&stats),
            vec![1, 3, 3, 0, 0],
            "the calls never got past hop3"
        );
    }
}
