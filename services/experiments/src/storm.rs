//! `retrychain storm`: load against a chain, with per-mode amplification and tail latency.
//!
//! Sends Charges with fresh keys (a closed loop of `--concurrency` workers, or an open loop
//! at `--rate` requests a second) for `--duration` or `--requests`, optionally with faults
//! set on the ledger first, and reports success, status codes, first attempts and bottom
//! calls (from the edge's and the ledger's own counters), amplification, throughput and
//! latency percentiles. `--csv` writes per-second samples; `--svg` draws them.

use futures::future::BoxFuture;
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use retrychain_proto::v1::{
    Faults, GetStatsRequest, Stats, control_client::ControlClient, payments_client::PaymentsClient,
};
use serde::Serialize;
use tonic::{Code, transport::Channel};

use retrychain_harness::{ChainAddrs, ChainSpec, ServiceAddr, charge_request, connect, with_chain};

use crate::chart::{self as chart, Sample};

/// Flags of `storm`.
#[derive(Debug, Clone, Args)]
pub struct StormArgs {
    /// An existing chain's edge (with --ledger). Unset: start a chain here.
    #[arg(long, env = "RETRYCHAIN_EDGE", requires = "ledger")]
    pub edge: Option<String>,
    /// The existing chain's ledger, for its counters and faults.
    #[arg(long, env = "RETRYCHAIN_LEDGER")]
    pub ledger: Option<String>,
    /// The existing edge's admin address (Control) [default: --edge's port + 1000].
    #[arg(long, env = "RETRYCHAIN_EDGE_ADMIN")]
    pub edge_admin: Option<String>,
    /// The ledger's admin address [default: --ledger's port + 1000].
    #[arg(long, env = "RETRYCHAIN_LEDGER_ADMIN")]
    pub ledger_admin: Option<String>,
    /// Requests in flight at once (closed loop); with --rate, the most in flight.
    #[arg(long, default_value_t = 32, env = "RETRYCHAIN_STORM_CONCURRENCY")]
    pub concurrency: usize,
    /// Open loop: start this many requests a second, whatever the latency.
    #[arg(long, env = "RETRYCHAIN_STORM_RATE")]
    pub rate: Option<f64>,
    /// How long to send (e.g. 10s, 1m).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, env = "RETRYCHAIN_STORM_DURATION")]
    pub duration: Duration,
    /// Stop after this many requests instead of after --duration.
    #[arg(long, env = "RETRYCHAIN_STORM_REQUESTS")]
    pub requests: Option<u64>,
    /// Send `x-retry-mode` (honoured by services started with --allow-retry-mode-override).
    #[arg(long, value_enum, env = "RETRYCHAIN_STORM_RETRY_MODE")]
    pub retry_mode: Option<retrychain_node::RetryMode>,
    /// Ledger fault during the run: probability that a processor call fails.
    #[arg(long, default_value_t = 0.0, env = "RETRYCHAIN_STORM_FAIL_RATE")]
    pub fail_rate: f64,
    /// Ledger fault: the code of those failures.
    #[arg(long, default_value = "", env = "RETRYCHAIN_STORM_FAIL_CODE")]
    pub fail_code: String,
    /// Ledger fault: processor latency, in ms.
    #[arg(long, default_value_t = 0, env = "RETRYCHAIN_STORM_DELAY_MS")]
    pub delay_ms: u32,
    /// Ledger fault: probability that a reply is lost after commit.
    #[arg(long, default_value_t = 0.0, env = "RETRYCHAIN_STORM_DROP_REPLY_RATE")]
    pub drop_reply_rate: f64,
    /// Deadline of each request, in ms.
    #[arg(long, default_value_t = 5000, env = "RETRYCHAIN_STORM_DEADLINE_MS")]
    pub deadline_ms: u64,
    /// Spread charges over this many accounts.
    #[arg(long, default_value_t = 1000, env = "RETRYCHAIN_STORM_ACCOUNTS")]
    pub accounts: u64,
    /// For a chain started here: backoff of its services.
    #[arg(long, value_enum, default_value_t = resilience::BackoffKind::Full, env = "RETRYCHAIN_STORM_BACKOFF")]
    pub backoff: resilience::BackoffKind,
    /// For a chain started here: Postgres URL (unset: a throwaway cluster).
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
    /// For a chain started here: the edge's port; the others take the next four.
    #[arg(long, default_value_t = 50071, env = "RETRYCHAIN_STORM_BASE_PORT")]
    pub base_port: u16,
    /// Print one JSON object instead of the report.
    #[arg(long, env = "RETRYCHAIN_STORM_JSON")]
    pub json: bool,
    /// Write per-second samples to this CSV file.
    #[arg(long, env = "RETRYCHAIN_STORM_CSV")]
    pub csv: Option<PathBuf>,
    /// Draw throughput, errors and bottom calls per second into this SVG file.
    #[arg(long, env = "RETRYCHAIN_STORM_SVG")]
    pub svg: Option<PathBuf>,
}

/// What one storm measured.
#[derive(Debug, Clone, Serialize)]
pub struct StormReport {
    /// Requests completed.
    pub requests: u64,
    /// Requests that succeeded.
    pub ok: u64,
    /// ok / requests.
    pub success_rate: f64,
    /// Completed requests per final status code.
    pub codes: BTreeMap<String, u64>,
    /// Requests the edge received during the run (its `requests_received`).
    pub first_attempts: u64,
    /// Processor calls the ledger made during the run (its `downstream_attempts`).
    pub bottom_calls: u64,
    /// bottom_calls / first_attempts.
    pub amplification: f64,
    /// Completed requests per second.
    pub throughput_rps: f64,
    /// Wall time of the run, in seconds.
    pub duration_s: f64,
    /// Latency percentiles, in ms.
    pub latency_ms: Latency,
    /// Per-second samples.
    pub samples: Vec<Sample>,
}

/// Latency percentiles of completed requests, in ms.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Slowest.
    pub max: f64,
}

/// Counters the workers share.
#[derive(Debug, Default)]
struct Tally {
    /// Requests started (for --requests).
    started: AtomicU64,
    /// Requests completed OK.
    ok: AtomicU64,
    /// Requests failed.
    errors: AtomicU64,
    /// Final codes.
    codes: Mutex<BTreeMap<String, u64>>,
    /// Latencies in µs.
    latency: Mutex<Option<Histogram<u64>>>,
}

/// Runs a storm per `args` and returns its report.
pub async fn run(args: &StormArgs) -> anyhow::Result<StormReport> {
    let external = args.edge.as_ref().map(|edge| {
        let edge = ServiceAddr::external(edge, args.edge_admin.as_deref());
        let ledger = ServiceAddr::external(
            args.ledger.as_deref().unwrap_or_default(),
            args.ledger_admin.as_deref(),
        );
        // with_chain wants five services, edge first and ledger last; storm uses those two.
        let unused = ServiceAddr::external("", None);
        ChainAddrs::from_array([edge, unused.clone(), unused.clone(), unused, ledger])
    });
    let spec = ChainSpec {
        database_url: args.database_url.clone(),
        base_port: args.base_port,
        ..ChainSpec::default()
    }
    .each(|service| service.backoff = args.backoff);
    let report = with_chain(external, spec, |addrs| async move {
        storm(args, &addrs.edge, &addrs.ledger).await
    })
    .await?;
    if let Some(path) = &args.csv {
        write_csv(path, &report.samples)?;
    }
    if let Some(path) = &args.svg {
        chart::draw(path, &report.samples)?;
    }
    Ok(report)
}

/// A service's counters.
async fn stats(control: &mut ControlClient<Channel>) -> anyhow::Result<Stats> {
    Ok(control.get_stats(GetStatsRequest {}).await?.into_inner())
}

async fn storm(
    args: &StormArgs,
    edge: &ServiceAddr,
    ledger: &ServiceAddr,
) -> anyhow::Result<StormReport> {
    let edge_control = ControlClient::new(connect(&edge.admin_url).await?);
    let edge = connect(&edge.url).await?;
    let mut ledger_control = ControlClient::new(connect(&ledger.admin_url).await?);
    let faulty = args.fail_rate > 0.0 || args.delay_ms > 0 || args.drop_reply_rate > 0.0;
    if faulty {
        ledger_control
            .set_faults(Faults {
                fail_rate: args.fail_rate,
                fail_code: args.fail_code.clone(),
                delay_ms: args.delay_ms,
                drop_reply_rate: args.drop_reply_rate,
                ..Faults::default()
            })
            .await
            .context("setting the ledger's faults (it needs --fault-injection)")?;
    }
    let result = measure(args, edge, edge_control, ledger_control.clone()).await;
    if faulty {
        // On every path: a storm must not leave a deployment failing.
        let _ = ledger_control.set_faults(Faults::default()).await;
    }
    result
}

/// Sends the load and measures it; see the module docs.
async fn measure(
    args: &StormArgs,
    edge: Channel,
    mut edge_control: ControlClient<Channel>,
    mut ledger_control: ControlClient<Channel>,
) -> anyhow::Result<StormReport> {
    let edge_before = stats(&mut edge_control).await?;
    let ledger_before = stats(&mut ledger_control).await?;

    let tally = Arc::new(Tally {
        latency: Mutex::new(Some(Histogram::new_with_bounds(1, 600_000_000, 3)?)),
        ..Tally::default()
    });
    let start = Instant::now();
    let end = start + args.duration;
    let bar = progress(args);
    let marks: Marks = Arc::default();
    mark(&tally, &mut ledger_control, start, &marks).await;
    let sampler = tokio::spawn(sample(
        Arc::clone(&tally),
        ledger_control.clone(),
        start,
        Arc::clone(&marks),
        bar.clone(),
        args.requests.is_some(),
    ));
    let run = format!("{:08x}", rand::random::<u32>());

    drive(args, &tally, end, sender(args, &edge, &tally, run)).await?;
    let elapsed = start.elapsed();
    sampler.abort();
    mark(&tally, &mut ledger_control, start, &marks).await;
    let samples = samples(&marks);
    bar.finish_and_clear();

    let edge_after = stats(&mut edge_control).await?;
    let ledger_after = stats(&mut ledger_control).await?;
    let ok = tally.ok.load(Ordering::Relaxed);
    let requests = ok + tally.errors.load(Ordering::Relaxed);
    let first_attempts = edge_after
        .requests_received
        .saturating_sub(edge_before.requests_received);
    let bottom_calls = ledger_after
        .downstream_attempts
        .saturating_sub(ledger_before.downstream_attempts);
    let histogram = tally
        .latency
        .lock()
        .map_err(|_| anyhow::anyhow!("latency lock"))?
        .take();
    let latency = Latency::of(histogram.as_ref());
    let codes = tally
        .codes
        .lock()
        .map_err(|_| anyhow::anyhow!("codes lock"))?
        .clone();
    Ok(StormReport {
        requests,
        ok,
        success_rate: ok as f64 / requests.max(1) as f64,
        codes,
        first_attempts,
        bottom_calls,
        amplification: bottom_calls as f64 / first_attempts.max(1) as f64,
        throughput_rps: requests as f64 / elapsed.as_secs_f64(),
        duration_s: elapsed.as_secs_f64(),
        latency_ms: latency,
        samples,
    })
}

/// What sends request number `n` of the storm (its own key, one of `--accounts`) and
/// records its outcome in `tally`.
fn sender(
    args: &StormArgs,
    edge: &Channel,
    tally: &Arc<Tally>,
    run: String,
) -> impl Fn(u64) -> BoxFuture<'static, ()> + Clone + use<> {
    let tally = Arc::clone(tally);
    let client = PaymentsClient::new(edge.clone());
    let deadline = Duration::from_millis(args.deadline_ms);
    let accounts = args.accounts.max(1);
    let mode = args.retry_mode;
    move |n: u64| {
        let mut client = client.clone();
        let tally = Arc::clone(&tally);
        let request = charge_request(
            &format!("storm-{}", n % accounts),
            100,
            Some(&format!("storm-{run}-{n}")),
            deadline,
            mode,
        );
        Box::pin(async move {
            let sent = Instant::now();
            let result = client.charge(request).await;
            tally.record(result.map(|_| ()).map_err(|s| s.code()), sent.elapsed());
        })
    }
}

/// Sends requests with `send` as the flags say — closed loop at `--concurrency`, or open
/// loop at `--rate` — until `--requests` are sent or `end`.
async fn drive<F, Fut>(
    args: &StormArgs,
    tally: &Arc<Tally>,
    end: Instant,
    send: F,
) -> anyhow::Result<()>
where
    F: Fn(u64) -> Fut + Clone,
    Fut: Future<Output = ()> + Send + 'static,
{
    let limit = args.requests.unwrap_or(u64::MAX);
    let more = |tally: &Tally| {
        let n = tally.started.fetch_add(1, Ordering::Relaxed);
        (n < limit && (args.requests.is_some() || Instant::now() < end)).then_some(n)
    };
    let Some(rate) = args.rate else {
        let workers = (0..args.concurrency.max(1)).map(|_| {
            let send = send.clone();
            let tally = Arc::clone(tally);
            async move {
                while let Some(n) = more(&tally) {
                    send(n).await;
                }
            }
        });
        futures::future::join_all(workers).await;
        return Ok(());
    };
    let permits = Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.001)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(n) = more(tally) {
        ticker.tick().await;
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let request = send(n);
        tasks.spawn(async move {
            request.await;
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

impl Latency {
    /// The quantiles of `histogram` (microseconds), in milliseconds; zeros when none.
    fn of(histogram: Option<&Histogram<u64>>) -> Self {
        histogram.map_or(
            Latency {
                p50: 0.0,
                p90: 0.0,
                p99: 0.0,
                p999: 0.0,
                max: 0.0,
            },
            |h| Latency {
                p50: h.value_at_quantile(0.5) as f64 / 1e3,
                p90: h.value_at_quantile(0.9) as f64 / 1e3,
                p99: h.value_at_quantile(0.99) as f64 / 1e3,
                p999: h.value_at_quantile(0.999) as f64 / 1e3,
                max: h.max() as f64 / 1e3,
            },
        )
    }
}

impl Tally {
    fn record(&self, result: Result<(), Code>, latency: Duration) {
        let code = match result {
            Ok(()) => {
                self.ok.fetch_add(1, Ordering::Relaxed);
                "OK"
            }
            Err(code) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                resilience::wire::code_name(code)
            }
        };
        if let Ok(mut codes) = self.codes.lock() {
            *codes.entry(code.to_owned()).or_default() += 1;
        }
        if let Ok(mut histogram) = self.latency.lock()
            && let Some(histogram) = histogram.as_mut()
        {
            let _ = histogram.record(latency.as_micros().max(1) as u64);
        }
    }
}

/// Running totals read once a second: (seconds since the start, ok, errors, bottom calls).
type Marks = Arc<Mutex<Vec<(f64, u64, u64, u64)>>>;

/// Reads the running totals once a second until aborted.
/// The bar counts requests (`by_requests`) or seconds.
async fn sample(
    tally: Arc<Tally>,
    mut ledger: ControlClient<Channel>,
    start: Instant,
    marks: Marks,
    bar: ProgressBar,
    by_requests: bool,
) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await; // the first tick is immediate; the start mark is already taken
    loop {
        ticker.tick().await;
        mark(&tally, &mut ledger, start, &marks).await;
        let (ok, errors) = (
            tally.ok.load(Ordering::Relaxed),
            tally.errors.load(Ordering::Relaxed),
        );
        if by_requests {
            bar.set_position(ok + errors);
        } else {
            bar.set_position(start.elapsed().as_secs());
        }
        bar.set_message(format!("ok {ok}, errors {errors}"));
    }
}

async fn mark(tally: &Tally, ledger: &mut ControlClient<Channel>, start: Instant, marks: &Marks) {
    // A failed read carries the last value forward, so no interval gets a burst it did
    // not have.
    let calls = match bottom(ledger).await {
        Some(calls) => calls,
        None => marks
            .lock()
            .ok()
            .and_then(|m| m.last().map(|last| last.3))
            .unwrap_or(0),
    };
    let entry = (
        start.elapsed().as_secs_f64(),
        tally.ok.load(Ordering::Relaxed),
        tally.errors.load(Ordering::Relaxed),
        calls,
    );
    if let Ok(mut marks) = marks.lock() {
        marks.push(entry);
    }
}

/// Per-second samples: the differences between consecutive marks (the last interval may
/// be shorter than a second).
fn samples(marks: &Marks) -> Vec<Sample> {
    let marks = marks.lock().map(|m| m.clone()).unwrap_or_default();
    marks
        .windows(2)
        .map(|w| Sample {
            second: w[1].0,
            ok: w[1].1.saturating_sub(w[0].1),
            errors: w[1].2.saturating_sub(w[0].2),
            bottom_calls: w[1].3.saturating_sub(w[0].3),
        })
        .collect()
}

async fn bottom(ledger: &mut ControlClient<Channel>) -> Option<u64> {
    ledger
        .get_stats(GetStatsRequest {})
        .await
        .ok()
        .map(|s| s.into_inner().downstream_attempts)
}

fn progress(args: &StormArgs) -> ProgressBar {
    let bar = match args.requests {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new(args.duration.as_secs().max(1)),
    };
    if let Ok(style) = ProgressStyle::with_template("storm [{bar:30}] {pos}/{len} {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn write_csv(path: &PathBuf, samples: &[Sample]) -> anyhow::Result<()> {
    let mut text = String::from("second,ok,errors,bottom_calls\n");
    for s in samples {
        text.push_str(&format!(
            "{:.2},{},{},{}\n",
            s.second, s.ok, s.errors, s.bottom_calls
        ));
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Prints the report for people.
pub fn print_report(r: &StormReport) {
    println!("requests        {}", r.requests);
    println!(
        "success rate    {:.2}% ({} ok)",
        r.success_rate * 100.0,
        r.ok
    );
    let codes: Vec<String> = r.codes.iter().map(|(c, n)| format!("{c} {n}")).collect();
    println!("status codes    {}", codes.join(", "));
    println!("first attempts  {}", r.first_attempts);
    println!("bottom calls    {}", r.bottom_calls);
    println!(
        "amplification   {:.3} bottom calls per first attempt",
        r.amplification
    );
    println!(
        "throughput      {:.0} requests/s over {:.1} s",
        r.throughput_rps, r.duration_s
    );
    let l = r.latency_ms;
    println!(
        "latency ms      p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
        l.p50, l.p90, l.p99, l.p999, l.max
    );
}
