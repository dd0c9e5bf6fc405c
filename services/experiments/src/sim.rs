//! `retrychain sim`: the design notes' three simulations, run on the resilience crate's own
//! retry engine, backoff and budget — so the figures describe the code the services run, not a
//! model of it — and a fourth that sets the three throttles side by side through an outage
//! and its end. No network, no clock: time is simulated.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use clap::Args;
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use resilience::{
    A6Throttle, AdaptiveThrottle, Attempt, AttemptRequest, Backoff, BackoffKind, CallRequest,
    RetryBudget, RetryLayer, ServiceConfig, Throttle,
    service_config::{CallPolicy, RetryPolicyConfig},
};
use serde::Serialize;
use tonic::Status;
use tower::{ServiceExt, util::BoxCloneSyncService};

/// How many seeds the jitter storm is averaged over unless `--seeds` says otherwise.
pub const DEFAULT_SEEDS: u64 = 20;

/// Flags of `sim`.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Print one JSON object instead of tables.
    #[arg(long, env = "RETRYCHAIN_SIM_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub json: bool,
    /// Seeds to average the jitter storm over.
    #[arg(long, default_value_t = DEFAULT_SEEDS, env = "RETRYCHAIN_SIM_SEEDS")]
    pub seeds: u64,
}

/// Everything `sim` measures.
#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    /// Bottom calls for 1..=5 layers of 3 tries, every call failing.
    pub layered: Vec<u64>,
    /// The contention storm, per backoff policy.
    pub storm: StormReport,
    /// The total outage, without and with a budget.
    pub outage: OutageReport,
    /// The throttles through an outage and after it.
    pub throttles: ThrottleReport,
}

/// Each throttle through [`through_outage`].
#[derive(Debug, Clone, Serialize)]
pub struct ThrottleReport {
    /// Retries limited only by the attempt count.
    pub none: ThrottleRun,
    /// The retry budget: 10 tokens, 0.1 refunded per first attempt.
    pub budget: ThrottleRun,
    /// gRFC A6's `retryThrottling`: maxTokens 10, tokenRatio 0.1.
    pub a6: ThrottleRun,
    /// Adaptive client-side throttling: K = 2 over 10 s.
    pub adaptive: ThrottleRun,
}

/// One throttle through an outage and after it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ThrottleRun {
    /// Calls the clients made while the backend was down.
    pub first: u64,
    /// Attempts the backend received meanwhile.
    pub backend: u64,
    /// backend / first.
    pub load: f64,
    /// Calls failed by the throttle without an attempt sent, while down.
    pub rejected_locally: u64,
    /// Seconds from the backend's return to the first whole second in which at least
    /// 99% of the calls succeeded.
    pub recovery_s: f64,
    /// Calls failed after the backend was back.
    pub failed_after: u64,
}

/// Mean calls and ticks of the storm, per policy.
#[derive(Debug, Clone, Serialize)]
pub struct StormReport {
    /// Retry on the next tick.
    pub none: StormResult,
    /// Exponential, no jitter.
    pub exponential: StormResult,
    /// Full jitter.
    pub full: StormResult,
    /// Equal jitter.
    pub equal: StormResult,
    /// Decorrelated jitter.
    pub decorrelated: StormResult,
}

/// One policy's storm result, averaged over the seeds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StormResult {
    /// Calls the resource received.
    pub calls: f64,
    /// Ticks until every client succeeded.
    pub ticks: f64,
}

/// The outage with and without a budget.
#[derive(Debug, Clone, Serialize)]
pub struct OutageReport {
    /// Retries limited only by the attempt count.
    pub no_budget: OutageResult,
    /// A 10-token bucket refunding 0.1 per first attempt.
    pub budget: OutageResult,
}

/// Backend load in one outage run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OutageResult {
    /// First attempts.
    pub first: u64,
    /// Calls the backend received.
    pub backend: u64,
    /// backend / first.
    pub load: f64,
}

/// Runs all three simulations.
pub fn run(seeds: u64) -> anyhow::Result<SimReport> {
    let layered = (1..=5)
        .map(|layers| layered_bottom_calls(layers, 3))
        .collect::<anyhow::Result<_>>()?;
    let storm = |kind| mean_storm(kind, 100, seeds);
    Ok(SimReport {
        layered,
        storm: StormReport {
            none: storm(BackoffKind::None),
            exponential: storm(BackoffKind::Exponential),
            full: storm(BackoffKind::Full),
            equal: storm(BackoffKind::Equal),
            decorrelated: storm(BackoffKind::Decorrelated),
        },
        outage: OutageReport {
            no_budget: outage(None, 6000, 3),
            budget: outage(Some(&RetryBudget::new(10.0, 0.1)), 6000, 3),
        },
        throttles: ThrottleReport {
            none: through_outage(|_| None)?,
            budget: through_outage(|_| Some(Arc::new(RetryBudget::new(10.0, 0.1))))?,
            a6: through_outage(|_| Some(Arc::new(A6Throttle::new(10.0, 0.1))))?,
            adaptive: through_outage(|clock| {
                Some(Arc::new(
                    AdaptiveThrottle::with_clock(
                        resilience::throttle::ADAPTIVE_K,
                        resilience::throttle::ADAPTIVE_WINDOW,
                        clock,
                    )
                    .seed(0),
                ))
            })?,
        },
    })
}

/// Calls per simulated second in [`through_outage`].
const RATE: u64 = 100;
/// Seconds the backend is down, then up, in [`through_outage`].
const DOWN_S: u64 = 60;
const UP_S: u64 = 120;

/// 100 calls a second through the real retry engine (up to 3 retries, no backoff) with
/// the throttle `throttle` makes (given the simulation's clock, for a throttle that keeps
/// time): the backend fails everything for 60 s, then answers everything for 120 s.
/// Counts what the backend received while down and how long the clients took to see
/// their calls succeed again once it was back.
pub fn through_outage(
    throttle: impl FnOnce(resilience::throttle::Clock) -> Option<Arc<dyn Throttle>>,
) -> anyhow::Result<ThrottleRun> {
    let elapsed_ms = Arc::new(AtomicU64::new(0));
    let clock: resilience::throttle::Clock = {
        let (origin, elapsed_ms) = (tokio::time::Instant::now(), Arc::clone(&elapsed_ms));
        Arc::new(move || origin + Duration::from_millis(elapsed_ms.load(Ordering::Relaxed)))
    };
    let throttle = throttle(clock);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let policy = Arc::new(ServiceConfig::every_method(CallPolicy::Retry(
        RetryPolicyConfig::new(
            4,
            Backoff::new(BackoffKind::None, Duration::ZERO, Duration::ZERO),
            resilience::classify::RETRYABLE.to_vec(),
        ),
    )));
    let layer = RetryLayer::new(policy).seed(0);
    let layer = match throttle {
        Some(throttle) => layer.throttle(throttle),
        None => layer.no_throttle(),
    };
    let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let received = Arc::new(AtomicU64::new(0));
    let backend = {
        let (down, received) = (Arc::clone(&down), Arc::clone(&received));
        tower::service_fn(move |_: AttemptRequest<()>| {
            received.fetch_add(1, Ordering::Relaxed);
            std::future::ready(if down.load(Ordering::Relaxed) {
                Err(Status::unavailable("the backend is down"))
            } else {
                Ok(())
            })
        })
    };
    let calls = layer.calls("/sim/Outage", backend);
    runtime.block_on(async move {
        let mut run = ThrottleRun {
            first: DOWN_S * RATE,
            backend: 0,
            load: 0.0,
            rejected_locally: 0,
            recovery_s: UP_S as f64,
            failed_after: 0,
        };
        let mut succeeded_this_second = 0;
        for n in 0..(DOWN_S + UP_S) * RATE {
            if n == DOWN_S * RATE {
                down.store(false, Ordering::Relaxed);
                run.backend = received.load(Ordering::Relaxed);
            }
            let before = received.load(Ordering::Relaxed);
            let answer = calls
                .clone()
                .oneshot(CallRequest {
                    request: (),
                    deadline: None,
                })
                .await;
            let sent = received.load(Ordering::Relaxed) - before;
            if n < DOWN_S * RATE {
                run.rejected_locally += u64::from(sent == 0);
            } else {
                run.failed_after += u64::from(answer.is_err());
                succeeded_this_second += u64::from(answer.is_ok());
                if (n + 1) % RATE == 0 {
                    let second = (n + 1) / RATE - DOWN_S - 1;
                    if succeeded_this_second * 100 >= RATE * 99 && run.recovery_s == UP_S as f64 {
                        run.recovery_s = second as f64;
                    }
                    succeeded_this_second = 0;
                }
            }
            elapsed_ms.fetch_add(1000 / RATE, Ordering::Relaxed);
        }
        run.load = run.backend as f64 / run.first as f64;
        Ok(run)
    })
}

/// Nests `layers` retry engines (each allowing `attempts` tries, each a
/// [`RetryCalls`](resilience::RetryCalls) over the one below) over a bottom call that
/// always fails, and counts bottom calls: the real engine, in process.
pub fn layered_bottom_calls(layers: u32, attempts: u32) -> anyhow::Result<u64> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let policy = Arc::new(ServiceConfig::every_method(CallPolicy::Retry(
        RetryPolicyConfig::new(
            attempts,
            Backoff::new(BackoffKind::None, Duration::ZERO, Duration::ZERO),
            resilience::classify::RETRYABLE.to_vec(),
        ),
    )));
    let bottom = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&bottom);
    let mut service: Layer =
        BoxCloneSyncService::new(tower::service_fn(move |_: AttemptRequest<()>| {
            counted.fetch_add(1, Ordering::Relaxed);
            std::future::ready(Err(Status::unavailable("the bottom service is down")))
        }));
    for _ in 0..layers {
        // Each layer's call lasts as long as the attempt above it has.
        let retrying = RetryLayer::new(Arc::clone(&policy))
            .seed(0)
            .calls("/sim/Layer", service)
            .map_request(|above: AttemptRequest<()>| CallRequest {
                request: (),
                deadline: above.attempt.deadline,
            });
        service = BoxCloneSyncService::new(retrying);
    }
    let first = AttemptRequest {
        request: (),
        attempt: Attempt {
            number: 1,
            deadline: None,
            retry_of: None,
        },
    };
    let _ = runtime.block_on(service.oneshot(first));
    Ok(bottom.load(Ordering::Relaxed))
}

/// One layer of the nest: the engine over the layers below.
type Layer = BoxCloneSyncService<AttemptRequest<()>, (), Status>;

/// One simulated tick, as a duration for the backoff code.
const TICK: Duration = Duration::from_millis(1);

/// The contention storm: `clients` start together against a resource that serves one call
/// per tick; every loser waits per `kind` (base 2, cap 64 ticks, at least one tick) and
/// tries again. Returns (calls, ticks).
pub fn storm(kind: BackoffKind, clients: usize, seed: u64) -> (u64, u64) {
    let backoff = Backoff::new(kind, 2 * TICK, 64 * TICK);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut schedules: Vec<_> = (0..clients).map(|_| backoff.schedule()).collect();
    // Next attempt time per client, in ticks; None once served.
    let mut due: Vec<Option<f64>> = vec![Some(0.0); clients];
    let mut waiting = clients;
    let (mut calls, mut tick) = (0u64, 0u64);
    while waiting > 0 {
        tick += 1;
        let now = tick as f64;
        let ready: Vec<usize> = (0..clients)
            .filter(|&c| due[c].is_some_and(|t| t <= now))
            .collect();
        if ready.is_empty() {
            continue;
        }
        calls += ready.len() as u64;
        let winner = ready[rng.random_range(0..ready.len())];
        due[winner] = None;
        waiting -= 1;
        for &client in ready.iter().filter(|&&c| c != winner) {
            let wait = schedules[client].next_delay(&mut rng);
            let ticks = (wait.as_secs_f64() / TICK.as_secs_f64()).max(1.0);
            due[client] = Some(now + ticks);
        }
    }
    (calls, tick)
}

fn mean_storm(kind: BackoffKind, clients: usize, seeds: u64) -> StormResult {
    let runs: Vec<(u64, u64)> = (0..seeds).map(|seed| storm(kind, clients, seed)).collect();
    let n = runs.len().max(1) as f64;
    StormResult {
        calls: runs.iter().map(|r| r.0 as f64).sum::<f64>() / n,
        ticks: runs.iter().map(|r| r.1 as f64).sum::<f64>() / n,
    }
}

/// A total outage: `first_attempts` calls, all failing, each allowed `max_retries` retries,
/// drawing on `budget` if there is one.
pub fn outage(budget: Option<&RetryBudget>, first_attempts: u64, max_retries: u32) -> OutageResult {
    let backend = resilience::budget::outage_backend_calls(budget, first_attempts, max_retries);
    OutageResult {
        first: first_attempts,
        backend,
        load: backend as f64 / first_attempts as f64,
    }
}

/// The design notes' figures, printed beside ours.
const NOTES_LAYERED: [u64; 5] = [3, 9, 27, 81, 243];
const NOTES_STORM: [(&str, f64, f64); 5] = [
    ("none", 5050.0, 100.0),
    ("exponential", 5050.0, 6079.0),
    ("full", 643.0, 167.0),
    ("equal", 657.0, 223.0),
    ("decorrelated", 576.0, 194.0),
];

/// Prints the report as tables, with the design notes' figures beside ours.
pub fn print_tables(report: &SimReport, seeds: u64) {
    println!("Layered retries: 3 tries per layer, every call failing");
    println!(
        "  {:<8} {:>12} {:>14}",
        "layers", "bottom calls", "design notes"
    );
    for (i, calls) in report.layered.iter().enumerate() {
        println!("  {:<8} {:>12} {:>14}", i + 1, calls, NOTES_LAYERED[i]);
    }
    println!();
    println!(
        "Jitter storm: 100 clients, one served per tick, base 2 / cap 64 ticks, mean of {seeds} seeds"
    );
    println!(
        "  {:<13} {:>8} {:>8}   {:>22}",
        "backoff", "calls", "ticks", "design notes (calls/ticks)"
    );
    let s = &report.storm;
    let ours = [s.none, s.exponential, s.full, s.equal, s.decorrelated];
    for ((name, calls, ticks), result) in NOTES_STORM.iter().zip(ours) {
        println!(
            "  {:<13} {:>8.0} {:>8.0}   {:>13.0} / {:<8.0}",
            name, result.calls, result.ticks, calls, ticks
        );
    }
    println!();
    println!("Total outage: 100 requests/s for 60 s, every call failing, up to 3 retries");
    println!(
        "  {:<22} {:>6} {:>8} {:>7}   {:>14}",
        "", "first", "backend", "load", "design notes"
    );
    for (name, result, notes) in [
        ("no budget", report.outage.no_budget, "24000 (4.00x)"),
        (
            "budget 10, refund 0.1",
            report.outage.budget,
            "6609 (1.10x)",
        ),
    ] {
        println!(
            "  {:<22} {:>6} {:>8} {:>6.2}x   {:>14}",
            name, result.first, result.backend, result.load, notes
        );
    }
    println!();
    println!(
        "Throttles through an outage: 100 calls/s, backend down {DOWN_S} s then up, up to 3 retries, the real engine"
    );
    println!(
        "  {:<26} {:>8} {:>7} {:>9} {:>10} {:>13}",
        "throttle", "backend", "load", "shed", "recovery", "failed after"
    );
    let t = &report.throttles;
    for (name, run) in [
        ("none (max attempts only)", t.none),
        ("budget 10, refund 0.1", t.budget),
        ("A6 maxTokens 10, ratio 0.1", t.a6),
        ("adaptive K=2, 10 s", t.adaptive),
    ] {
        println!(
            "  {:<26} {:>8} {:>6.2}x {:>9} {:>9.0} s {:>13}",
            name, run.backend, run.load, run.rejected_locally, run.recovery_s, run.failed_after
        );
    }
    println!(
        "  (load: backend attempts per call while down; shed: calls the throttle failed without sending;\n   recovery: seconds after the backend's return until a whole second with 99% of calls succeeding)"
    );
}
