//! `retrychain storm`: load against a chain, with per-mode amplification and tail latency.
//!
//! Sends Charges with fresh keys (a closed loop of `--concurrency` workers, or an open loop
//! at `--rate` requests a second) over `--connections` HTTP/2 connections, for
//! `--duration` or `--requests`, optionally with faults set on the ledgers first, and
//! reports success, status codes, first attempts and bottom calls (from the edge's
//! counters and those of every ledger replica it is given), amplification, throughput,
//! goodput (OK within the deadline), the calls refused as overloaded, and latency
//! percentiles of all calls, of successes and of failures. `--csv` writes per-second
//! samples; `--svg` draws them.

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

use retrychain_harness::{
    ChainAddrs, ChainSpec, ServiceAddr, charge_request, connect_as, with_chain,
};
use retrychain_tls::{ClientAuth, Tls, TlsFiles};

use crate::chart::{self as chart, Sample};

/// Flags of `storm`.
#[derive(Debug, Clone, Args)]
pub struct StormArgs {
    /// An existing chain's edge (with --ledger). Unset: start a chain here.
    #[arg(long, env = "RETRYCHAIN_EDGE", requires = "ledger")]
    pub edge: Option<String>,
    /// The existing chain's ledger, for its counters and faults: one address, several
    /// comma-separated (every replica: bottom calls are counted on each), or
    /// dns:///host:port (every address the name resolves to).
    #[arg(long, env = "RETRYCHAIN_LEDGER")]
    pub ledger: Option<String>,
    /// The existing edge's admin address (Control) [default: --edge's port + 1000].
    #[arg(long, env = "RETRYCHAIN_EDGE_ADMIN")]
    pub edge_admin: Option<String>,
    /// The ledgers' admin addresses, comma-separated in --ledger's order [default: each
    /// ledger's port + 1000].
    #[arg(long, env = "RETRYCHAIN_LEDGER_ADMIN")]
    pub ledger_admin: Option<String>,
    /// HTTP/2 connections to the edge, calls spread over them in turn [default: one per
    /// 100 calls in flight]. One connection carries at most the edge's stream limit (512)
    /// at once; more calls would wait in this client, not at the edge.
    #[arg(long, env = "RETRYCHAIN_STORM_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    pub connections: Option<u32>,
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
    /// A call refused with a grpc-retry-pushback-ms holds its worker (closed loop) or its
    /// place in flight (open loop) for that long before the next call: a client that
    /// listens. The next call is a new charge (a new key), not a retry of the refused one;
    /// in closed loop a waiting worker sends nothing, so fewer than --concurrency calls are
    /// in flight while workers wait (the report says how long they waited, in
    /// worker-seconds: divided by the run's seconds, the workers it kept idle on average).
    /// Unset, the next call goes at once, as a hostile client's would.
    #[arg(long, env = "RETRYCHAIN_STORM_HONOUR_PUSHBACK", value_parser = clap::builder::BoolishValueParser::new())]
    pub honour_pushback: bool,
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
    /// TLS: the operator's certificate, key and CA — a directory holding tls.crt, tls.key
    /// and ca.crt, as `up --tls` makes under `operator/` — for an existing chain given by
    /// https:// addresses (the edge's per-caller limit applies to the operator too).
    #[arg(long, env = "RETRYCHAIN_STORM_TLS_DIR", requires = "edge")]
    pub tls_dir: Option<PathBuf>,
    /// Print one JSON object instead of the report.
    #[arg(long, env = "RETRYCHAIN_STORM_JSON", value_parser = clap::builder::BoolishValueParser::new())]
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
    /// Processor calls the ledgers made during the run (their `downstream_attempts`, summed).
    pub bottom_calls: u64,
    /// How many ledgers' counters were read for `bottom_calls`.
    pub ledgers_read: usize,
    /// bottom_calls / first_attempts.
    pub amplification: f64,
    /// Completed requests per second.
    pub throughput_rps: f64,
    /// Requests answered OK within their deadline, per second.
    pub goodput_rps: f64,
    /// Requests refused as overloaded (UNAVAILABLE marked by the refusing service).
    pub shed: u64,
    /// Whether refused calls' pushbacks were waited out (--honour-pushback).
    pub honoured_pushback: bool,
    /// With --honour-pushback: the pushbacks waited out, and their sum in seconds (worker
    /// seconds spent sending nothing).
    pub pushback_waits: u64,
    /// See [`StormReport::pushback_waits`].
    pub pushback_wait_s: f64,
    /// Wall time of the run, in seconds.
    pub duration_s: f64,
    /// Latency percentiles, in ms.
    pub latency_ms: Latency,
    /// Latency percentiles of the requests answered OK, in ms.
    pub ok_latency_ms: Latency,
    /// Latency percentiles of the failed requests, in ms.
    pub failed_latency_ms: Latency,
    /// Latency percentiles of the requests refused as overloaded, in ms.
    pub shed_latency_ms: Latency,
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
    /// Requests answered OK within their deadline.
    good: AtomicU64,
    /// Requests refused as overloaded.
    shed: AtomicU64,
    /// Pushbacks waited out, and their sum in µs.
    pushback_waits: AtomicU64,
    pushback_wait_us: AtomicU64,
    /// Final codes.
    codes: Mutex<BTreeMap<String, u64>>,
    /// Latencies in µs: all, OK, failed, shed.
    latency: Mutex<Option<[Histogram<u64>; 4]>>,
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
        let ledgers = match &args.ledger {
            Some(ledger) => {
                ledger_addrs(ledger, args.ledger_admin.as_deref(), args.tls_dir.is_some()).await?
            }
            None => vec![addrs.ledger.clone()],
        };
        storm(args, &addrs.edge, &ledgers).await
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

/// The ledgers named by `--ledger` (a list or a `dns:///` name, whose addresses are reached
/// over TLS when `tls`) and `--ledger-admin`.
async fn ledger_addrs(
    ledger: &str,
    admin: Option<&str>,
    tls: bool,
) -> anyhow::Result<Vec<ServiceAddr>> {
    let scheme = if tls { "https" } else { "http" };
    let urls: Vec<String> = match ledger.trim().strip_prefix("dns:///") {
        Some(target) => {
            let (host, port) = target
                .rsplit_once(':')
                .with_context(|| format!("{ledger}: dns:///host:port"))?;
            let port: u16 = port
                .parse()
                .with_context(|| format!("{ledger}: the port"))?;
            let mut urls: Vec<String> = tokio::net::lookup_host((host, port))
                .await
                .with_context(|| format!("resolving {host}"))?
                .map(|addr| format!("{scheme}://{addr}"))
                .collect();
            urls.sort();
            urls.dedup();
            urls
        }
        None => ledger
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
    };
    anyhow::ensure!(!urls.is_empty(), "--ledger {ledger} names no ledger");
    let admins: Vec<&str> = admin
        .map(|a| {
            a.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    anyhow::ensure!(
        admins.is_empty() || admins.len() == urls.len(),
        "--ledger-admin names {} addresses for {} ledgers",
        admins.len(),
        urls.len()
    );
    Ok(urls
        .iter()
        .enumerate()
        .map(|(i, url)| ServiceAddr::external(url, admins.get(i).copied()))
        .collect())
}

async fn storm(
    args: &StormArgs,
    edge: &ServiceAddr,
    ledgers: &[ServiceAddr],
) -> anyhow::Result<StormReport> {
    let tls = match &args.tls_dir {
        Some(dir) => Some(
            Tls::load(TlsFiles::in_dir(dir), ClientAuth::Optional)
                .with_context(|| format!("--tls-dir {}", dir.display()))?,
        ),
        None => None,
    };
    let tls = tls.as_ref();
    let edge_control = ControlClient::new(connect_as(&edge.admin_url, "edge", tls).await?);
    let connections = args
        .connections
        .map_or_else(|| args.concurrency.div_ceil(100).max(1), |n| n as usize);
    let mut channels = Vec::with_capacity(connections);
    for _ in 0..connections {
        channels.push(connect_as(&edge.url, "edge", tls).await?);
    }
    let mut controls = Vec::with_capacity(ledgers.len());
    for ledger in ledgers {
        controls.push(ControlClient::new(
            connect_as(&ledger.admin_url, "ledger", tls).await?,
        ));
    }
    let faulty = args.fail_rate > 0.0 || args.delay_ms > 0 || args.drop_reply_rate > 0.0;
    let faults = Faults {
        fail_rate: args.fail_rate,
        fail_code: args.fail_code.clone(),
        delay_ms: args.delay_ms,
        drop_reply_rate: args.drop_reply_rate,
        ..Faults::default()
    };
    let mut result = Ok(());
    if faulty {
        for control in &mut controls {
            if let Err(error) = control.set_faults(faults.clone()).await {
                result = Err(anyhow::Error::from(error)
                    .context("setting a ledger's faults (it needs --fault-injection)"));
                break;
            }
        }
    }
    let result = match result {
        Ok(()) => measure(args, &channels, edge_control, Ledgers(controls.clone())).await,
        Err(error) => Err(error),
    };
    if faulty {
        // On every path: a storm must not leave a deployment failing.
        for control in &mut controls {
            let _ = control.set_faults(Faults::default()).await;
        }
    }
    result
}

/// The ledgers' Control clients: bottom calls are counted over all of them.
#[derive(Debug, Clone)]
struct Ledgers(Vec<ControlClient<Channel>>);

impl Ledgers {
    /// Processor calls made by every ledger, summed (`None` when one cannot be read).
    async fn bottom_calls(&mut self) -> Option<u64> {
        let mut total = 0;
        for control in &mut self.0 {
            total += bottom(control).await?;
        }
        Some(total)
    }
}

/// Sends the load and measures it; see the module docs.
async fn measure(
    args: &StormArgs,
    edge: &[Channel],
    mut edge_control: ControlClient<Channel>,
    mut ledger_control: Ledgers,
) -> anyhow::Result<StormReport> {
    let edge_before = stats(&mut edge_control).await?;
    let ledger_before = ledger_control
        .bottom_calls()
        .await
        .context("reading the ledgers' counters")?;

    let histogram = || Histogram::new_with_bounds(1, 600_000_000, 3);
    let tally = Arc::new(Tally {
        latency: Mutex::new(Some([
            histogram()?,
            histogram()?,
            histogram()?,
            histogram()?,
        ])),
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

    drive(args, &tally, end, sender(args, edge, &tally, run)).await?;
    let elapsed = start.elapsed();
    sampler.abort();
    mark(&tally, &mut ledger_control, start, &marks).await;
    let samples = samples(&marks);
    bar.finish_and_clear();

    let edge_after = stats(&mut edge_control).await?;
    let ledger_after = ledger_control
        .bottom_calls()
        .await
        .context("reading the ledgers' counters")?;
    let ok = tally.ok.load(Ordering::Relaxed);
    let requests = ok + tally.errors.load(Ordering::Relaxed);
    let first_attempts = edge_after
        .requests_received
        .saturating_sub(edge_before.requests_received);
    let bottom_calls = ledger_after.saturating_sub(ledger_before);
    let histograms = tally
        .latency
        .lock()
        .map_err(|_| anyhow::anyhow!("latency lock"))?
        .take();
    let latency = |i: usize| Latency::of(histograms.as_ref().map(|h| &h[i]));
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
        ledgers_read: ledger_control.0.len(),
        amplification: bottom_calls as f64 / first_attempts.max(1) as f64,
        throughput_rps: requests as f64 / elapsed.as_secs_f64(),
        goodput_rps: tally.good.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        shed: tally.shed.load(Ordering::Relaxed),
        honoured_pushback: args.honour_pushback,
        pushback_waits: tally.pushback_waits.load(Ordering::Relaxed),
        pushback_wait_s: tally.pushback_wait_us.load(Ordering::Relaxed) as f64 / 1e6,
        duration_s: elapsed.as_secs_f64(),
        latency_ms: latency(0),
        ok_latency_ms: latency(1),
        failed_latency_ms: latency(2),
        shed_latency_ms: latency(3),
        samples,
    })
}

/// What sends request number `n` of the storm (its own key, one of `--accounts`) and
/// records its outcome in `tally`.
fn sender(
    args: &StormArgs,
    edge: &[Channel],
    tally: &Arc<Tally>,
    run: String,
) -> impl Fn(u64) -> BoxFuture<'static, ()> + Clone + use<> {
    let tally = Arc::clone(tally);
    let clients: Arc<[PaymentsClient<Channel>]> =
        edge.iter().cloned().map(PaymentsClient::new).collect();
    let deadline = Duration::from_millis(args.deadline_ms);
    let accounts = args.accounts.max(1);
    let mode = args.retry_mode;
    let honour_pushback = args.honour_pushback;
    move |n: u64| {
        let mut client = clients[n as usize % clients.len()].clone();
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
            let mut wait = None;
            let outcome = result.map(|_| ()).map_err(|status| {
                let overloaded = status
                    .metadata()
                    .get(resilience::wire::OVERLOADED)
                    .is_some();
                if let resilience::wire::Pushback::RetryAfter(after) =
                    resilience::wire::pushback(&status)
                {
                    wait = Some(after);
                }
                (status.code(), overloaded)
            });
            tally.record(outcome, sent.elapsed(), deadline);
            if let (true, Some(wait)) = (honour_pushback, wait) {
                tally.pushback_waits.fetch_add(1, Ordering::Relaxed);
                tally
                    .pushback_wait_us
                    .fetch_add(wait.as_micros() as u64, Ordering::Relaxed);
                tokio::time::sleep(wait).await;
            }
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
    /// One completed request: OK, or its code and whether it was refused as overloaded.
    fn record(&self, result: Result<(), (Code, bool)>, latency: Duration, deadline: Duration) {
        let (code, which) = match result {
            Ok(()) => {
                self.ok.fetch_add(1, Ordering::Relaxed);
                if latency <= deadline {
                    self.good.fetch_add(1, Ordering::Relaxed);
                }
                ("OK", 1)
            }
            Err((code, overloaded)) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                if overloaded {
                    self.shed.fetch_add(1, Ordering::Relaxed);
                }
                (
                    resilience::wire::code_name(code),
                    if overloaded { 3 } else { 2 },
                )
            }
        };
        if let Ok(mut codes) = self.codes.lock() {
            *codes.entry(code.to_owned()).or_default() += 1;
        }
        if let Ok(mut histograms) = self.latency.lock()
            && let Some(histograms) = histograms.as_mut()
        {
            let us = latency.as_micros().max(1) as u64;
            let _ = histograms[0].record(us);
            let _ = histograms[which].record(us);
            if which == 3 {
                let _ = histograms[2].record(us);
            }
        }
    }
}

/// Running totals read once a second: (seconds since the start, ok, errors, bottom calls).
type Marks = Arc<Mutex<Vec<(f64, u64, u64, u64)>>>;

/// Reads the running totals once a second until aborted.
/// The bar counts requests (`by_requests`) or seconds.
async fn sample(
    tally: Arc<Tally>,
    mut ledger: Ledgers,
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

async fn mark(tally: &Tally, ledger: &mut Ledgers, start: Instant, marks: &Marks) {
    // A failed read carries the last value forward, so no interval gets a burst it did
    // not have.
    let calls = match ledger.bottom_calls().await {
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
    println!(
        "bottom calls    {} (the processor calls of {} ledger{})",
        r.bottom_calls,
        r.ledgers_read,
        if r.ledgers_read == 1 { "" } else { "s" }
    );
    println!(
        "amplification   {:.3} bottom calls per first attempt",
        r.amplification
    );
    println!(
        "throughput      {:.0} requests/s over {:.1} s",
        r.throughput_rps, r.duration_s
    );
    println!(
        "goodput         {:.0} requests/s OK within the deadline; {} refused as overloaded",
        r.goodput_rps, r.shed
    );
    if r.honoured_pushback {
        println!(
            "pushback        {} waited out, {:.1} worker-seconds sending nothing (on average {:.1} workers idle)",
            r.pushback_waits,
            r.pushback_wait_s,
            r.pushback_wait_s / r.duration_s.max(1e-9)
        );
    }
    for (what, l) in [
        ("latency ms     ", r.latency_ms),
        ("  of OK        ", r.ok_latency_ms),
        ("  of failures  ", r.failed_latency_ms),
        ("  of refusals  ", r.shed_latency_ms),
    ] {
        println!(
            "{what} p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            l.p50, l.p90, l.p99, l.p999, l.max
        );
    }
}
