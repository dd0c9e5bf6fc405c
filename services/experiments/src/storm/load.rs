//! The load itself: connections to the edge, the workers of a closed or an open loop,
//! and the measurement around them.

use super::{
    args::StormArgs,
    report::{Latency, StormReport},
    tally::{Ledgers, Marks, Tally, mark, sample, samples},
};
use anyhow::Context;
use futures::future::BoxFuture;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use retrychain_harness::{ServiceAddr, charge_request, connect_as};
use retrychain_proto::v1::{
    Faults, GetStatsRequest, Stats, control_client::ControlClient, payments_client::PaymentsClient,
};
use retrychain_tls::{ClientAuth, Tls, TlsFiles};
use std::{
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant},
};
use tonic::transport::Channel;

/// A service's counters.
pub(super) async fn stats(control: &mut ControlClient<Channel>) -> anyhow::Result<Stats> {
    Ok(control.get_stats(GetStatsRequest {}).await?.into_inner())
}

/// The ledgers named by `--ledger` (a list or a `dns:///` name, whose addresses are reached
/// over TLS when `tls`) and `--ledger-admin`.
pub(super) async fn ledger_addrs(
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

pub(super) async fn storm(
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
    let connections = args.connections_to_open();
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

/// Sends the load and measures it; see the module docs.
pub(super) async fn measure(
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
pub(super) fn sender(
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
pub(super) async fn drive<F, Fut>(
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

pub(super) fn progress(args: &StormArgs) -> ProgressBar {
    let bar = match args.requests {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new(args.duration.as_secs().max(1)),
    };
    if let Ok(style) = ProgressStyle::with_template("storm [{bar:30}] {pos}/{len} {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}
