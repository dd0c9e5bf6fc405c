//! What `resilience::RetryLayer` adds to a call that succeeds at once: the same Charges
//! through a tonic client over an in-process server, with and without the layer (a retry
//! policy on the method, so the request is buffered for replay), alternating rounds in
//! one process; the difference in time per call on one thread is the layer's CPU.
//!
//! ```text
//! cargo run --release -p retrychain-bench --bin layer-cost -- --calls 200000
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use resilience::{RetryLayer, ServiceConfig};
use retrychain_bench::Sink;
use retrychain_proto::v1::{
    ChargeRequest, payments_client::PaymentsClient, payments_server::PaymentsServer,
};
use serde::Serialize;

#[derive(Debug, Parser)]
struct Cli {
    /// Calls per round and variant.
    #[arg(long, default_value_t = 100_000)]
    calls: u32,
    /// Rounds, alternating the two variants.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    calls: u64,
    bare_us_per_call: f64,
    layer_us_per_call: f64,
    added_us_per_call: f64,
}

const CONFIG: &str = r#"{"methodConfig": [{"name": [{"service": "retrychain.v1.Payments"}],
    "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}],
    "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}}"#;

fn request() -> ChargeRequest {
    ChargeRequest {
        account_id: "acct-1".into(),
        amount_cents: 500,
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // One thread: the time a call takes is the CPU it costs.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let layer = RetryLayer::new(ServiceConfig::parse(CONFIG)?);
    let mut bare = PaymentsClient::new(PaymentsServer::new(Sink));
    let mut layered = PaymentsClient::new(tower::Layer::layer(&layer, PaymentsServer::new(Sink)));
    let (mut bare_time, mut layer_time) = (Duration::ZERO, Duration::ZERO);
    runtime.block_on(async {
        // Warm up both.
        for _ in 0..1000 {
            bare.charge(request()).await?;
            layered.charge(request()).await?;
        }
        for _ in 0..cli.rounds {
            let start = Instant::now();
            for _ in 0..cli.calls {
                bare.charge(request()).await?;
            }
            bare_time += start.elapsed();
            let start = Instant::now();
            for _ in 0..cli.calls {
                layered.charge(request()).await?;
            }
            layer_time += start.elapsed();
        }
        Ok::<_, tonic::Status>(())
    })?;
    let calls = u64::from(cli.calls) * u64::from(cli.rounds);
    let per = |d: Duration| d.as_secs_f64() * 1e6 / calls as f64;
    let report = Report {
        calls,
        bare_us_per_call: per(bare_time),
        layer_us_per_call: per(layer_time),
        added_us_per_call: per(layer_time) - per(bare_time),
    };
    if cli.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "bare client:  {:.2} µs per call\nwith layer:   {:.2} µs per call\nadded:        {:.2} µs per call",
            report.bare_us_per_call, report.layer_us_per_call, report.added_us_per_call
        );
    }
    Ok(())
}
