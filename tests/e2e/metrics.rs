//! Prometheus metrics on every service's admin port: scraped over plain HTTP/1.1 after a
//! scenario, parsed with a Prometheus text-format parser, and held against `Stats`.

use std::{io::Write, time::Duration};

use crate::support::*;
use retrychain_proto::v1::Stats;

fn parse(text: &str) -> prometheus_parse::Scrape {
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap()
}

/// The sum of the samples named `name` whose labels include `labels`.
fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
        .map(|s| match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            _ => 0.0,
        })
        .sum()
}

fn histogram_count(scrape: &prometheus_parse::Scrape, name: &str) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .map(|s| match &s.value {
            prometheus_parse::Value::Histogram(buckets) => buckets.last().map_or(0.0, |b| b.count),
            _ => 0.0,
        })
        .sum()
}

/// How many observations of histogram `name` were at most `le`.
fn bucket(scrape: &prometheus_parse::Scrape, name: &str, le: f64) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .map(|s| match &s.value {
            prometheus_parse::Value::Histogram(buckets) => buckets
                .iter()
                .find(|b| b.less_than == le)
                .map_or(0.0, |b| b.count),
            _ => 0.0,
        })
        .sum()
}

fn assert_agree(scrape: &prometheus_parse::Scrape, stats: &Stats) {
    let service = stats.service.as_str();
    let s = &[("service", service)][..];
    let pairs = [
        (
            "retrychain_requests_received_total",
            stats.requests_received,
        ),
        (
            "retrychain_downstream_attempts_total",
            stats.downstream_attempts,
        ),
        ("retrychain_retries_total", stats.retries),
    ];
    for (name, expected) in pairs {
        assert_eq!(value(scrape, name, s), expected as f64, "{service} {name}");
    }
    assert_eq!(
        value(
            scrape,
            "retrychain_retries_refused_total",
            &[("by", "budget")]
        ),
        stats.budget_denied as f64,
        "{service} refused by the budget"
    );
    assert_eq!(
        value(
            scrape,
            "retrychain_retries_refused_total",
            &[("by", "deadline")]
        ),
        stats.deadline_denied as f64,
        "{service} refused by the deadline"
    );
    assert_eq!(
        value(scrape, "retrychain_requests_total", s),
        stats.requests_received as f64,
        "{service}: every call received has finished with a code"
    );
    assert_eq!(
        histogram_count(scrape, "retrychain_request_duration_seconds"),
        stats.requests_received as f64,
        "{service}: one latency per call"
    );
    if service == "edge" {
        assert_eq!(
            value(scrape, "retrychain_budget_tokens", s),
            stats.budget_tokens,
            "edge budget"
        );
    }
    if service == "ledger" {
        assert_eq!(
            value(scrape, "retrychain_ledger_executions_total", s),
            stats.executions as f64
        );
        assert_eq!(
            value(scrape, "retrychain_ledger_replays_total", s),
            stats.replays as f64
        );
    }
}

#[tokio::test]
async fn metrics_on_every_admin_port_agree_with_stats() {
    let chain = Chain::spawn(Options::default()).await;
    let edge = chain.edge().await;
    let account = new_account();
    // Charges, a replay, a failure the edge retries, a refused bad input.
    let key = new_key();
    for _ in 0..2 {
        charge_on(&edge, &account, 500, Some(&key), Duration::from_secs(5))
            .await
            .unwrap();
    }
    charge_on(&edge, &account, 0, None, Duration::from_secs(5))
        .await
        .expect_err("bad amount");
    chain.fail_processor().await;
    for _ in 0..3 {
        charge_on(&edge, &account, 100, None, Duration::from_secs(5))
            .await
            .expect_err("the processor fails");
    }
    chain.set_faults(LEDGER, faults()).await;

    let stats = chain.all_stats().await;
    assert_eq!(stats[LEDGER].executions, 1);
    assert_eq!(stats[LEDGER].replays, 1);
    assert!(
        stats[EDGE].retries >= 6,
        "the edge retried: {:?}",
        stats[EDGE]
    );
    let promtool = which_promtool();
    for (i, admin) in chain.admins.iter().enumerate() {
        let text = scrape_metrics(admin).await;
        let scrape = parse(&text);
        assert_agree(&scrape, &stats[i]);
        if let Some(promtool) = &promtool {
            let (ok, said) = std::process::Command::new(promtool)
                .args(["check", "metrics"])
                .stdin(std::process::Stdio::piped())
                .output_with_stdin(&text);
            assert!(ok, "promtool check metrics on {}: {said}", NAMES[i]);
        }
    }
    // Retries by reason: the edge's all came from UNAVAILABLE.
    let edge_scrape = parse(&scrape_metrics(&chain.admins[EDGE]).await);
    assert_eq!(
        value(
            &edge_scrape,
            "retrychain_retries_total",
            &[("reason", "UNAVAILABLE")]
        ),
        stats[EDGE].retries as f64
    );
    assert_eq!(
        value(
            &edge_scrape,
            "retrychain_requests_total",
            &[("method", "Charge"), ("code", "INVALID_ARGUMENT")]
        ),
        1.0
    );
    if promtool.is_none() {
        missing_tool("promtool is not installed: the text format was checked by the parser only");
    }
}

fn which_promtool() -> Option<String> {
    std::env::var("PROMTOOL").ok().or_else(|| {
        std::process::Command::new("promtool")
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|_| "promtool".to_owned())
    })
}

trait OutputWithStdin {
    fn output_with_stdin(&mut self, input: &str) -> (bool, String);
}

impl OutputWithStdin for std::process::Command {
    fn output_with_stdin(&mut self, input: &str) -> (bool, String) {
        let mut child = self
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        (
            output.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        )
    }
}

/// The ledger's processor calls go through the same retry engine, and report to the same
/// observer, as every hop's downstream calls: in every-layer mode with the processor down,
/// the ledger's attempts-per-call histogram and its retries by reason read exactly as
/// hop4's: 3 attempts per call, 2 of them retries of UNAVAILABLE, one call per request.
#[tokio::test]
async fn the_processors_attempts_are_counted_like_a_hops() {
    let chain = Chain::spawn(Options::default()).await;
    chain.fail_processor().await;
    chain.reset_stats().await;
    chain
        .charge_new(Duration::from_secs(30), &[(RETRY_MODE, "every-layer")])
        .await
        .expect_err("the processor fails");
    let stats = chain.all_stats().await;
    assert_eq!(stats[LEDGER].downstream_attempts, 243);
    for i in [3, LEDGER] {
        let scrape = parse(&scrape_metrics(&chain.admins[i]).await);
        let calls = histogram_count(&scrape, "retrychain_attempts_per_call");
        assert_eq!(
            calls, stats[i].requests_received as f64,
            "{}: one call per request received (hop4 27, the ledger 81)",
            NAMES[i]
        );
        let (two, three) = (
            bucket(&scrape, "retrychain_attempts_per_call", 2.0),
            bucket(&scrape, "retrychain_attempts_per_call", 3.0),
        );
        assert_eq!(
            (two, three),
            (0.0, calls),
            "{}: 3 attempts per call",
            NAMES[i]
        );
        assert_eq!(
            value(
                &scrape,
                "retrychain_retries_total",
                &[("reason", "UNAVAILABLE")]
            ),
            2.0 * calls,
            "{}: 2 retries per call, both of UNAVAILABLE",
            NAMES[i]
        );
        assert_eq!(stats[i].retries as f64, 2.0 * calls, "{}", NAMES[i]);
    }
}
