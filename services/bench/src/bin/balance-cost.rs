//! What balancing over replicas costs, and what it buys.
//!
//! 1. **Overhead**: on one thread, the same Charges through a tonic client over one
//!    connection to a server that answers at once, and through a `resilience::Balancer`
//!    over three such servers (power of two choices over peak-EWMA, the per-call record of
//!    replicas tried), in alternating rounds; the difference in time per call is the
//!    balancer's CPU (client and servers share the thread).
//! 2. **One slow replica**: three replicas answering after 1 ms, one of them after 50 ms
//!    (50× slower), 16 calls in flight: p50 and p99 with the balancer, with round robin
//!    over the same three, and with a single fast replica.
//!
//! ```text
//! cargo run --release -p retrychain-bench --bin balance-cost -- --calls 20000 --rounds 5
//! ```

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use clap::Parser;
use futures::StreamExt;
use hdrhistogram::Histogram;
use resilience::{Balancer, Downstream, Tried, balance::BalanceSettings};
use retrychain_bench::{Sink, median, serve};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest, payments_client::PaymentsClient,
    payments_server::Payments,
};
use serde::Serialize;
use tonic::{Request, Response, Status, body::Body, transport::Channel};
use tower::{Service, ServiceExt};

#[derive(Debug, Parser)]
struct Cli {
    /// Calls per round and variant (overhead), and per variant (slow replica).
    #[arg(long, default_value_t = 20_000)]
    calls: u32,
    /// Rounds of the overhead comparison, alternating the two variants.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    /// Overhead: median time per call over one connection, in µs.
    direct_us_per_call: f64,
    /// Overhead: median time per call through the balancer, in µs.
    balanced_us_per_call: f64,
    /// The median over rounds of (balanced − direct), in µs per call.
    added_us_per_call: f64,
    /// The smallest and largest per-round difference.
    added_us_spread: (f64, f64),
    /// One slow replica: latency with each strategy, in ms.
    slow_replica: SlowReplica,
}

#[derive(Debug, Serialize)]
struct SlowReplica {
    balancer: Latency,
    round_robin: Latency,
    single_fast_replica: Latency,
    /// round_robin.p99 / balancer.p99.
    p99_round_robin_over_balancer: f64,
}

#[derive(Debug, Clone, Copy, Serialize)]
struct Latency {
    p50_ms: f64,
    p99_ms: f64,
}

/// Answers after a fixed delay: a replica with work to do.
#[derive(Debug, Clone)]
struct Delayed(Duration);

#[tonic::async_trait]
impl Payments for Delayed {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        tokio::time::sleep(self.0).await;
        Sink.charge(request).await
    }

    async fn get_account(
        &self,
        request: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Sink.get_account(request).await
    }
}

/// Round robin over channels: the baseline a load-aware balancer is measured against.
#[derive(Debug, Clone)]
struct RoundRobin {
    channels: Arc<Vec<Channel>>,
    next: Arc<AtomicUsize>,
}

impl Service<http::Request<Body>> for RoundRobin {
    type Response = http::Response<Body>;
    type Error = tonic::transport::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.channels.len();
        Box::pin(self.channels[i].clone().oneshot(request))
    }
}

fn request() -> Request<ChargeRequest> {
    let mut request = Request::new(ChargeRequest {
        account_id: "acct-1".into(),
        amount_cents: 500,
    });
    // What the retry engine gives each call, so the balancer does what it does in a hop.
    request.extensions_mut().insert(Tried::default());
    request
}

/// Starts `service` on a free port; its URL.
async fn start<P: Payments>(service: P) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(serve(listener, service));
    Ok(url)
}

async fn channel(url: &str) -> anyhow::Result<Channel> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_owned())?
        .tcp_nodelay(true)
        .connect()
        .await?)
}

async fn balancer(urls: &[String]) -> anyhow::Result<Balancer> {
    let downstream = Downstream::parse(&urls.join(","))?;
    Ok(Balancer::start(downstream, BalanceSettings::default()).await)
}

/// Time per call of `calls` sequential Charges on `client`, in µs.
async fn per_call<T>(client: &mut PaymentsClient<T>, calls: u32) -> anyhow::Result<f64>
where
    T: tonic::client::GrpcService<Body>,
    T::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    let start = Instant::now();
    for _ in 0..calls {
        client.charge(request()).await?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e6 / f64::from(calls))
}

/// p50 and p99 of `calls` Charges, 16 in flight, on `client`.
async fn latency<T>(client: PaymentsClient<T>, calls: u32) -> anyhow::Result<Latency>
where
    T: tonic::client::GrpcService<Body> + Clone,
    T::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    let mut histogram = Histogram::<u64>::new(3)?;
    let times: Vec<Result<Duration, Status>> = futures::stream::iter(0..calls)
        .map(|_| {
            let mut client = client.clone();
            async move {
                let start = Instant::now();
                client.charge(request()).await?;
                Ok(start.elapsed())
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for time in times {
        histogram.record(time?.as_micros() as u64)?;
    }
    Ok(Latency {
        p50_ms: histogram.value_at_quantile(0.5) as f64 / 1000.0,
        p99_ms: histogram.value_at_quantile(0.99) as f64 / 1000.0,
    })
}

async fn overhead(calls: u32, rounds: u32) -> anyhow::Result<(f64, f64, Vec<f64>)> {
    let mut urls = Vec::new();
    for _ in 0..3 {
        urls.push(start(Sink).await?);
    }
    let mut direct = PaymentsClient::new(channel(&urls[0]).await?);
    let mut balanced = PaymentsClient::new(balancer(&urls).await?);
    // Warm up both (connections made, estimates learnt).
    per_call(&mut direct, 1000).await?;
    per_call(&mut balanced, 1000).await?;
    let (mut directs, mut balanceds, mut added) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let d = per_call(&mut direct, calls).await?;
        let b = per_call(&mut balanced, calls).await?;
        directs.push(d);
        balanceds.push(b);
        added.push(b - d);
    }
    Ok((median(&directs), median(&balanceds), added))
}

async fn slow_replica(calls: u32) -> anyhow::Result<SlowReplica> {
    let fast = Duration::from_millis(1);
    let urls = vec![
        start(Delayed(fast)).await?,
        start(Delayed(fast)).await?,
        start(Delayed(fast * 50)).await?,
    ];
    let mut channels = Vec::new();
    for url in &urls {
        channels.push(channel(url).await?);
    }
    let round_robin = RoundRobin {
        channels: Arc::new(channels.clone()),
        next: Arc::new(AtomicUsize::new(0)),
    };
    let balancer = latency(PaymentsClient::new(balancer(&urls).await?), calls).await?;
    let round_robin = latency(PaymentsClient::new(round_robin), calls).await?;
    let single_fast_replica = latency(PaymentsClient::new(channels[0].clone()), calls).await?;
    Ok(SlowReplica {
        p99_round_robin_over_balancer: round_robin.p99_ms / balancer.p99_ms,
        balancer,
        round_robin,
        single_fast_replica,
    })
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // One thread: the time a call takes is the CPU it costs (client and servers).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(async {
        let (direct, balanced, added) = overhead(cli.calls, cli.rounds).await?;
        let spread = (
            added.iter().copied().fold(f64::INFINITY, f64::min),
            added.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
        let slow_replica = slow_replica(cli.calls.clamp(500, 5000)).await?;
        anyhow::Ok(Report {
            direct_us_per_call: direct,
            balanced_us_per_call: balanced,
            added_us_per_call: median(&added),
            added_us_spread: spread,
            slow_replica,
        })
    })?;
    if cli.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let s = &report.slow_replica;
        println!(
            "overhead, one thread: direct {:.2} µs/call, balanced over 3 {:.2} µs/call, added {:.2} µs (rounds {:.2}..{:.2})",
            report.direct_us_per_call,
            report.balanced_us_per_call,
            report.added_us_per_call,
            report.added_us_spread.0,
            report.added_us_spread.1
        );
        println!(
            "one of three replicas 50x slower (1 ms vs 50 ms), 16 in flight: p50/p99 balancer {:.1}/{:.1} ms, round robin {:.1}/{:.1} ms, one fast replica {:.1}/{:.1} ms; round robin p99 / balancer p99 = {:.1}",
            s.balancer.p50_ms,
            s.balancer.p99_ms,
            s.round_robin.p50_ms,
            s.round_robin.p99_ms,
            s.single_fast_replica.p50_ms,
            s.single_fast_replica.p99_ms,
            s.p99_round_robin_over_balancer
        );
    }
    Ok(())
}
