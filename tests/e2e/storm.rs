//! `retrychain storm` against a chain started here: its report agrees with the services'
//! own counters, and it writes its CSV and SVG.

use crate::support::*;
use retrychain_experiments::storm;

#[tokio::test]
async fn storm_counts_agree_with_the_services_stats() {
    let chain = Chain::spawn(Options::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let (csv, svg) = (dir.path().join("storm.csv"), dir.path().join("storm.svg"));
    let mut command = args(&[
        "--requests",
        "300",
        "--concurrency",
        "8",
        "--fail-rate",
        "0.3",
    ]);
    command.extend([
        "--edge".into(),
        chain.addrs[EDGE].clone(),
        "--edge-admin".into(),
        chain.admins[EDGE].clone(),
        "--ledger".into(),
        chain.addrs[LEDGER].clone(),
        "--ledger-admin".into(),
        chain.admins[LEDGER].clone(),
    ]);
    command.extend([
        "--csv".into(),
        csv.display().to_string(),
        "--svg".into(),
        svg.display().to_string(),
    ]);
    let report = storm::run(&parse_flags(&command)).await.unwrap();
    println!("{report:?}");

    let stats = chain.all_stats().await;
    assert_eq!(report.requests, 300);
    assert_eq!(report.first_attempts, stats[EDGE].requests_received);
    assert_eq!(report.first_attempts, 300);
    assert_eq!(report.bottom_calls, stats[LEDGER].downstream_attempts);
    assert_eq!(report.codes.values().sum::<u64>(), 300);
    assert_eq!(Some(&report.ok), report.codes.get("OK"));
    let bottom = report.bottom_calls;
    assert!(
        bottom > 300,
        "30% processor failures are retried by the edge: {bottom}"
    );
    assert!((report.amplification - bottom as f64 / 300.0).abs() < 1e-9);
    let latency = &report.latency_ms;
    for p in [latency.p50, latency.p90, latency.p99, latency.p999] {
        assert!(p > 0.0, "{latency:?}");
    }
    // The faults set for the run are cleared after it: 30 charges, 30 processor calls.
    chain.reset_stats().await;
    for _ in 0..30 {
        chain
            .charge(
                &new_account(),
                100,
                None,
                std::time::Duration::from_secs(5),
                &[],
            )
            .await
            .unwrap();
    }
    assert_eq!(chain.stats(LEDGER).await.downstream_attempts, 30);

    let csv = std::fs::read_to_string(csv).unwrap();
    assert!(csv.starts_with("second,ok,errors,bottom_calls\n"), "{csv}");
    let sampled: u64 = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(3).unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(
        sampled, bottom,
        "per-second bottom calls add up to the total"
    );
    let svg = std::fs::read_to_string(svg).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("bottom calls"),
        "an SVG chart"
    );
}

/// With three ledger replicas, storm counts the bottom calls of every one (it used to read
/// one of three: amplification 0.31): about 1.0 with no faults, about 1.1 in a processor
/// outage under the budget; and it says how many ledgers it read.
#[tokio::test]
async fn storm_counts_the_bottom_calls_of_every_ledger_replica() {
    let mut spec = Options::default().spec;
    spec.database_url = Some(database().await);
    spec.replicas = 3;
    let chain = InProcessChain::start(spec).await.unwrap();
    let addrs = chain.addrs();
    // The other replicas are listed tier by tier from the ledger up: the ledger's first.
    let ledgers: Vec<&ServiceAddr> = std::iter::once(&addrs.ledger)
        .chain(chain.replicas.iter().take(2).map(|service| &service.addr))
        .collect();
    let list = |f: fn(&ServiceAddr) -> &String| {
        ledgers
            .iter()
            .map(|a| f(a).clone())
            .collect::<Vec<_>>()
            .join(",")
    };
    let run = |extra: &[&str]| {
        let mut command = args(&["--requests", "300", "--concurrency", "8"]);
        command.extend(args(extra));
        command.extend([
            "--edge".into(),
            addrs.edge.url.clone(),
            "--edge-admin".into(),
            addrs.edge.admin_url.clone(),
            "--ledger".into(),
            list(|a| &a.url),
            "--ledger-admin".into(),
            list(|a| &a.admin_url),
        ]);
        command
    };
    let healthy = storm::run(&parse_flags(&run(&[]))).await.unwrap();
    assert_eq!(healthy.ledgers_read, 3);
    assert!(
        (healthy.amplification - 1.0).abs() < 0.02,
        "{} bottom calls for {} first attempts",
        healthy.bottom_calls,
        healthy.first_attempts
    );
    let outage = storm::run(&parse_flags(&run(&["--fail-rate", "1"])))
        .await
        .unwrap();
    println!(
        "three ledgers: {:.3} healthy, {:.3} in a processor outage",
        healthy.amplification, outage.amplification
    );
    assert!(
        outage.amplification > 1.0 && outage.amplification < 1.25,
        "the budget's 1.1: {}",
        outage.amplification
    );
}
