//! Hedging against a latency tail, with `resilience::RetryLayer`: a server whose calls
//! take about 1 ms, except 1% (`--slow-percent`) that take 200 ms, called with and without a hedging policy
//! that sends a second copy after the p95 latency. Prints each variant's p50/p99/p99.9 and
//! how many calls the server served, beside "The Tail at Scale" (Dean & Barroso, 2013):
//! hedging after 10 ms cut BigTable's p99.9 from 1,800 ms to 74 ms for 2% more requests.
//!
//! ```text
//! cargo run --release -p retrychain-bench --bin hedge-tail -- --calls 5000
//! ```

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Parser;
use hdrhistogram::Histogram;
use rand::RngExt;
use resilience::{RetryLayer, ServiceConfig};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest,
    payments_client::PaymentsClient,
    payments_server::{Payments, PaymentsServer},
};
use serde::Serialize;
use tonic::{Request, Response, Status};

#[derive(Debug, Parser)]
struct Cli {
    /// Calls per variant.
    #[arg(long, default_value_t = 5000)]
    calls: u32,
    /// Calls in flight.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Hedge after this many ms (about the p95 of the no-hedging run).
    #[arg(long, default_value_t = 3)]
    hedge_after_ms: u64,
    /// The share of calls that take 200 ms, in percent. At 1%, the p99 sits on the edge of
    /// the tail (half the runs put it inside); p99.9 is inside it.
    #[arg(long, default_value_t = 1.0)]
    slow_percent: f64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// About 1 ms a call; a share of calls 200 ms.
#[derive(Debug, Default, Clone)]
struct Tail {
    served: Arc<AtomicU64>,
    /// The probability of a 200 ms call.
    slow: f64,
}

#[tonic::async_trait]
impl Payments for Tail {
    async fn charge(&self, _: Request<ChargeRequest>) -> Result<Response<ChargeReply>, Status> {
        self.served.fetch_add(1, Ordering::Relaxed);
        let slow = rand::rng().random_bool(self.slow);
        let delay = if slow { 200 } else { 1 };
        tokio::time::sleep(Duration::from_millis(delay)).await;
        Ok(Response::new(ChargeReply::default()))
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::unimplemented("not here"))
    }
}

#[derive(Debug, Serialize)]
struct Variant {
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    served: u64,
    extra_calls_percent: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    calls: u32,
    hedge_after_ms: u64,
    slow_percent: f64,
    without: Variant,
    hedged: Variant,
    p99_cut: f64,
    p999_cut: f64,
}

async fn run<S>(client: PaymentsClient<S>, cli: &Cli, served: &AtomicU64) -> anyhow::Result<Variant>
where
    S: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + 'static,
    S::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::Future: Send,
{
    use futures::StreamExt;
    served.store(0, Ordering::Relaxed);
    let latencies: Vec<Duration> = futures::stream::iter(0..cli.calls)
        .map(|_| {
            let mut client = client.clone();
            async move {
                let start = Instant::now();
                let _ = client
                    .charge(ChargeRequest {
                        account_id: "a".into(),
                        amount_cents: 1,
                    })
                    .await;
                start.elapsed()
            }
        })
        .buffer_unordered(cli.concurrency)
        .collect()
        .await;
    let mut histogram = Histogram::<u64>::new(3)?;
    for latency in latencies {
        histogram.record(latency.as_micros() as u64)?;
    }
    let ms = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
    let served = served.load(Ordering::Relaxed);
    Ok(Variant {
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        p999_ms: ms(0.999),
        served,
        extra_calls_percent: (served as f64 / f64::from(cli.calls) - 1.0) * 100.0,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let tail = Tail {
        slow: cli.slow_percent / 100.0,
        ..Tail::default()
    };
    let without = run(
        PaymentsClient::new(PaymentsServer::new(tail.clone())),
        &cli,
        &tail.served,
    )
    .await?;
    let config = ServiceConfig::parse(&format!(
        r#"{{"methodConfig": [{{"name": [{{"service": "retrychain.v1.Payments"}}],
            "hedgingPolicy": {{"maxAttempts": 2, "hedgingDelay": "{}s"}}}}]}}"#,
        cli.hedge_after_ms as f64 / 1000.0
    ))?;
    let layer = RetryLayer::new(config);
    let hedged = run(
        PaymentsClient::new(tower::Layer::layer(
            &layer,
            PaymentsServer::new(tail.clone()),
        )),
        &cli,
        &tail.served,
    )
    .await?;
    let report = Report {
        calls: cli.calls,
        hedge_after_ms: cli.hedge_after_ms,
        slow_percent: cli.slow_percent,
        p99_cut: without.p99_ms / hedged.p99_ms,
        p999_cut: without.p999_ms / hedged.p999_ms,
        without,
        hedged,
    };
    if cli.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} calls, {}% take 200 ms, the rest ~1 ms; hedging after {} ms",
            report.calls, report.slow_percent, report.hedge_after_ms
        );
        for (name, v) in [
            ("without hedging", &report.without),
            ("hedged", &report.hedged),
        ] {
            println!(
                "  {name:<16} p50 {:>7.2} ms  p99 {:>7.2} ms  p99.9 {:>7.2} ms  served {} ({:+.1}%)",
                v.p50_ms, v.p99_ms, v.p999_ms, v.served, v.extra_calls_percent
            );
        }
        println!(
            "  p99 cut {:.1}x, p99.9 cut {:.1}x   (The Tail at Scale: hedging after 10 ms, p99.9 1,800 ms -> 74 ms for 2% more requests)",
            report.p99_cut, report.p999_cut
        );
    }
    Ok(())
}
