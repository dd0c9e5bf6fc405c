//! The ledger's memory per request in flight: a `retrychain ledger` whose processor holds
//! each charge for `--hold-ms`, sent `--keys` charges under distinct keys at once (over
//! enough connections for the 512 streams each allows), its RSS sampled while they all
//! wait; the growth per request in flight is (peak − idle) / keys. The database is
//! `DATABASE_URL`'s.
//!
//! ```text
//! DATABASE_URL=postgres://… cargo run --release -p retrychain-bench --bin inflight-memory -- --keys 10000
//! ```

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use retrychain_bench::{procs::RetrychainBinary, rss_kib};
use retrychain_harness::{ChildService, Launch, Logs, charge_request, connect};
use retrychain_proto::v1::{
    Faults, control_client::ControlClient, payments_client::PaymentsClient,
};
use serde::Serialize;

#[derive(Debug, Parser)]
struct Cli {
    /// Charges in flight at once, each under its own key.
    #[arg(long, default_value_t = 10_000)]
    keys: u32,
    /// How long the processor holds each charge, in ms (the first ones hold the pool's
    /// connections; the others wait for one).
    #[arg(long, default_value_t = 8000)]
    hold_ms: u32,
    #[command(flatten)]
    retrychain: RetrychainBinary,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    keys: u32,
    idle_rss_kib: u64,
    peak_rss_kib: u64,
    bytes_per_request_in_flight: f64,
    succeeded: u32,
}

/// Calls per connection: below the services' 512 concurrent streams.
const PER_CONNECTION: u32 = 400;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let database_url = std::env::var("DATABASE_URL").context("set DATABASE_URL")?;
    let program = cli.retrychain.path()?;
    let ledger = ChildService::start(
        "ledger",
        Launch {
            program: Some(program),
            args: [
                "ledger",
                "--listen",
                "127.0.0.1:0",
                "--fault-injection",
                // Every request waits for a connection as long as it takes.
                "--db-acquire-timeout-ms",
                "120000",
                // A fixed concurrency limit as high: the point is memory per call in
                // flight, not what the adaptive limit would admit.
                "--max-in-flight",
                "100000",
                "--min-concurrency",
                "100000",
            ]
            .map(String::from)
            .into(),
            env: vec![
                ("DATABASE_URL".to_owned(), database_url),
                ("RUST_LOG".to_owned(), "warn".to_owned()),
            ],
            logs: Logs::Discard,
        },
    )
    .await?;
    let pid = ledger.pid().context("the ledger runs")?;
    let mut control = ControlClient::new(connect(&ledger.addr.admin_url).await?);
    control
        .set_faults(Faults {
            delay_ms: cli.hold_ms,
            ..Faults::default()
        })
        .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = rss_kib(pid)?;
    let mut clients = Vec::new();
    for _ in 0..cli.keys.div_ceil(PER_CONNECTION) {
        let channel = tonic::transport::Endpoint::from_shared(ledger.url().to_owned())?
            .connect()
            .await?;
        clients.push(PaymentsClient::new(channel));
    }
    let run = std::process::id();
    let calls: Vec<_> = (0..cli.keys)
        .map(|n| {
            let mut client = clients[(n / PER_CONNECTION) as usize].clone();
            tokio::spawn(async move {
                let request = charge_request(
                    &format!("inflight-{run}-{n}"),
                    100,
                    Some(&format!("inflight-{run}-{n}")),
                    Duration::from_secs(110),
                    None,
                );
                client.charge(request).await.is_ok()
            })
        })
        .collect();
    // All sent and waiting: the peak while the first ones hold the processor.
    let started = Instant::now();
    let mut peak = idle;
    while started.elapsed() < Duration::from_millis(u64::from(cli.hold_ms) * 3 / 4) {
        peak = peak.max(rss_kib(pid)?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    control.set_faults(Faults::default()).await?;
    let mut succeeded = 0;
    for call in calls {
        succeeded += u32::from(call.await?);
    }
    let report = Report {
        keys: cli.keys,
        idle_rss_kib: idle,
        peak_rss_kib: peak,
        bytes_per_request_in_flight: (peak.saturating_sub(idle) * 1024) as f64
            / f64::from(cli.keys),
        succeeded,
    };
    if cli.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "ledger with {} charges in flight: RSS {} KiB idle, {} KiB peak: {:.0} bytes per request in flight ({} of them then succeeded)",
            report.keys,
            report.idle_rss_kib,
            report.peak_rss_kib,
            report.bytes_per_request_in_flight,
            report.succeeded
        );
    }
    Ok(())
}
