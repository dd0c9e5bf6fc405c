//! Admission on against off, side by side on the same machine in the same run: two chains
//! of the same binary on the same Postgres, one as started by default and one with every
//! service started with `--min-concurrency 4096 --max-in-flight 4096` (admitting
//! everything up to the memory bound), loaded in turn at each point:
//!
//! - closed loop at 64, 256 and 1,500 calls in flight (5 s deadlines);
//! - open loop at 1×, 2×, 5× and 10× the chain's capacity (measured first, closed loop at
//!   32 on the chain without admission), as many calls in flight as it takes.
//!
//! At each point, for each chain: goodput (OK within the deadline, per second), the p99 of
//! the successes, how many calls were refused as overloaded and by which service (every
//! service's own count, `Stats.shed`), the edge's CPU per refusal, and the CPU the load
//! generator (this process) used per call sent. And where the machine's CPU went, per call
//! answered OK: the five services, Postgres (`--postgres-pid`, its exited backends
//! included), the load generator and the rest (the kernel's work not charged to a
//! process, anything else running), with the share of the machine that was busy — what
//! bounds goodput once the two cores are full. The ratios judged (goodput on / off ≥
//! 0.95, the p99 of successes on / off ≤ 1, the share of refusals made at the edge ≥ 90%
//! from 2× up) are printed beside.
//!
//! Each point is measured in `--rounds` alternating rounds (on then off, then off then on,
//! …), so that drift on a shared machine — Postgres's caches, the other chain's leftovers,
//! a background job — falls on both alike; a ratio is the median of the rounds' ratios,
//! reported with its spread (the lowest and highest round).
//!
//! ```text
//! target/release/admission --on http://127.0.0.1:50051 --on-admins <5 admin URLs> \
//!     --off http://127.0.0.1:50061 --off-admins <5 admin URLs> --on-pids <5 pids> \
//!     --off-pids <5 pids> --postgres-pid P
//! ```

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use retrychain_experiments::storm::{self, StormArgs, StormReport};
use retrychain_proto::v1::{GetStatsRequest, control_client::ControlClient};
use serde::Serialize;

#[derive(Debug, Parser)]
struct Cli {
    /// The edge of the chain with admission as configured.
    #[arg(long)]
    on: String,
    /// Its five services' admin addresses, edge first, comma-separated.
    #[arg(long, value_delimiter = ',')]
    on_admins: Vec<String>,
    /// Its five services' processes, edge first, comma-separated: their CPU.
    #[arg(long, value_delimiter = ',')]
    on_pids: Vec<u32>,
    /// The edge of the chain that admits everything (up to the memory bound).
    #[arg(long)]
    off: String,
    /// Its five services' admin addresses, edge first.
    #[arg(long, value_delimiter = ',')]
    off_admins: Vec<String>,
    /// Its five services' processes, edge first.
    #[arg(long, value_delimiter = ',')]
    off_pids: Vec<u32>,
    /// The postmaster of the Postgres both chains use: its CPU and its backends'.
    #[arg(long)]
    postgres_pid: Option<u32>,
    /// Closed-loop points: calls in flight.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1500")]
    closed: Vec<usize>,
    /// Open-loop points: multiples of the capacity.
    #[arg(long, value_delimiter = ',', default_value = "1,2,5,10")]
    open: Vec<f64>,
    /// How long each point lasts on each chain, each round.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Rounds at each point, alternating which chain goes first.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
}

/// One chain at one point.
#[derive(Debug, Clone, Serialize)]
struct Run {
    goodput_rps: f64,
    ok_p99_ms: f64,
    requests: u64,
    refused: u64,
    /// Refusals counted by each service (edge, hop2, hop3, hop4, ledger).
    refused_by: Vec<u64>,
    /// Of all refusals, the share the edge made.
    edge_share: Option<f64>,
    /// Calls answered OK.
    ok: u64,
    /// The edge process's CPU over the run, µs.
    edge_cpu_us: f64,
    /// The load generator's CPU per call it sent, µs.
    generator_cpu_us_per_call: f64,
    /// How long a refused call waited for its refusal, as the load generator saw it:
    /// the median and the p99, ms (`None` without refusals).
    refusal_ms: Option<(f64, f64)>,
    /// The bound (ms) of the edge's `shed_seconds` bucket that holds the p99 of its
    /// refusals over the run, by its own clock (`None` without refusals at the edge).
    edge_refusal_p99_ms: Option<f64>,
    /// Where the machine's CPU went over the run.
    cpu: CpuAccount,
}

/// The machine's CPU over one run, µs, by whom it was used.
#[derive(Debug, Clone, Copy, Serialize)]
struct CpuAccount {
    /// The chain's five services.
    services_us: f64,
    /// Postgres, its exited backends included (0 without `--postgres-pid`).
    postgres_us: f64,
    /// The load generator.
    generator_us: f64,
    /// Busy CPU not charged to any of those: the kernel's work done outside a process's
    /// time (softirqs on the loopback), anything else on the machine.
    rest_us: f64,
    /// Busy and idle CPU of the machine, over all its cores.
    busy_us: f64,
    idle_us: f64,
}

/// A run's CPU per call answered OK, µs, and how busy the machine was: what a call that
/// counts in goodput cost, refusals and the generator included.
#[derive(Debug, Clone, Copy, Serialize)]
struct PerOk {
    services_us: f64,
    edge_us: f64,
    postgres_us: f64,
    generator_us: f64,
    rest_us: f64,
    /// The share of the machine's CPU that was busy.
    busy_share: f64,
}

impl PerOk {
    fn of(run: &Run) -> PerOk {
        let ok = run.ok.max(1) as f64;
        let c = &run.cpu;
        PerOk {
            services_us: c.services_us / ok,
            edge_us: run.edge_cpu_us / ok,
            postgres_us: c.postgres_us / ok,
            generator_us: c.generator_us / ok,
            rest_us: c.rest_us / ok,
            busy_share: c.busy_us / (c.busy_us + c.idle_us).max(1e-9),
        }
    }

    /// The median of each figure over `runs`.
    fn median(runs: &[PerOk]) -> PerOk {
        let m = |f: fn(&PerOk) -> f64| {
            retrychain_bench::median(&runs.iter().map(f).collect::<Vec<_>>())
        };
        PerOk {
            services_us: m(|p| p.services_us),
            edge_us: m(|p| p.edge_us),
            postgres_us: m(|p| p.postgres_us),
            generator_us: m(|p| p.generator_us),
            rest_us: m(|p| p.rest_us),
            busy_share: m(|p| p.busy_share),
        }
    }

    fn describe(&self) -> String {
        format!(
            "machine {:.0}% busy; CPU per OK call {:.0} µs: services {:.0} (edge {:.0}), Postgres {:.0}, load generator {:.0}, the rest {:.0}",
            self.busy_share * 100.0,
            self.services_us + self.postgres_us + self.generator_us + self.rest_us,
            self.services_us,
            self.edge_us,
            self.postgres_us,
            self.generator_us,
            self.rest_us,
        )
    }
}

/// One round of one point: both chains, one after the other.
#[derive(Debug, Serialize)]
struct Round {
    on: Run,
    off: Run,
    /// Goodput with admission over goodput without.
    goodput_ratio: f64,
    /// The p99 of successes with admission over without.
    ok_p99_ratio: f64,
    /// The edge's CPU per refusal with admission, µs: its CPU beyond what the calls it
    /// served cost at the first point without refusals, per refusal.
    edge_cpu_us_per_refusal: Option<f64>,
}

/// A figure over the rounds: their median, and the lowest and highest round.
#[derive(Debug, Clone, Copy, Serialize)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(values: &[f64]) -> Option<Spread> {
        (!values.is_empty()).then(|| Spread {
            median: retrychain_bench::median(values),
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        })
    }
}

/// One point, both chains, every round, and the medians judged.
#[derive(Debug, Serialize)]
struct Point {
    load: String,
    rounds: Vec<Round>,
    goodput_ratio: Spread,
    ok_p99_ratio: Spread,
    on_goodput_rps: Spread,
    off_goodput_rps: Spread,
    on_ok_p99_ms: Spread,
    off_ok_p99_ms: Spread,
    /// Refusals with admission, summed over the rounds.
    refused: u64,
    /// Calls sent to the chain with admission, summed over the rounds.
    requests: u64,
    /// Of the refusals every service counted with admission, the edge's share.
    edge_share: Option<f64>,
    edge_cpu_us_per_refusal: Option<Spread>,
    /// How many rounds the CPU per refusal is over (those where refusals were a fifth of
    /// the calls or more).
    edge_cpu_rounds: usize,
    /// The load generator's CPU per call, median over both chains' rounds.
    generator_cpu_us_per_call: f64,
    /// With admission, how long a refused call waited for its refusal (the load
    /// generator's p99, ms), over the rounds with refusals.
    refusal_p99_ms: Option<Spread>,
    /// With admission, the edge's own p99 bound for its refusals (ms), over the rounds
    /// with refusals at the edge.
    edge_refusal_p99_ms: Option<Spread>,
    /// Where the CPU went per call answered OK, medians over the rounds.
    on_per_ok: PerOk,
    off_per_ok: PerOk,
}

impl Point {
    fn of(load: String, rounds: Vec<Round>) -> Point {
        let over = |f: &dyn Fn(&Round) -> f64| {
            Spread::of(&rounds.iter().map(f).collect::<Vec<_>>()).expect("at least one round")
        };
        let refused_by: Vec<u64> = (0..5)
            .map(|i| rounds.iter().map(|r| r.on.refused_by[i]).sum())
            .collect();
        let counted: u64 = refused_by.iter().sum();
        let per_refusal: Vec<f64> = rounds
            .iter()
            .filter_map(|r| r.edge_cpu_us_per_refusal)
            .collect();
        let generator: Vec<f64> = rounds
            .iter()
            .flat_map(|r| {
                [
                    r.on.generator_cpu_us_per_call,
                    r.off.generator_cpu_us_per_call,
                ]
            })
            .collect();
        Point {
            goodput_ratio: over(&|r| r.goodput_ratio),
            ok_p99_ratio: over(&|r| r.ok_p99_ratio),
            on_goodput_rps: over(&|r| r.on.goodput_rps),
            off_goodput_rps: over(&|r| r.off.goodput_rps),
            on_ok_p99_ms: over(&|r| r.on.ok_p99_ms),
            off_ok_p99_ms: over(&|r| r.off.ok_p99_ms),
            refused: rounds.iter().map(|r| r.on.refused).sum(),
            requests: rounds.iter().map(|r| r.on.requests).sum(),
            edge_share: (counted > 0).then(|| refused_by[0] as f64 / counted as f64),
            edge_cpu_us_per_refusal: Spread::of(&per_refusal),
            edge_cpu_rounds: per_refusal.len(),
            generator_cpu_us_per_call: retrychain_bench::median(&generator),
            refusal_p99_ms: Spread::of(
                &rounds
                    .iter()
                    .filter_map(|r| r.on.refusal_ms.map(|(_, p99)| p99))
                    .collect::<Vec<_>>(),
            ),
            edge_refusal_p99_ms: Spread::of(
                &rounds
                    .iter()
                    .filter_map(|r| r.on.edge_refusal_p99_ms)
                    .collect::<Vec<_>>(),
            ),
            on_per_ok: PerOk::median(&rounds.iter().map(|r| PerOk::of(&r.on)).collect::<Vec<_>>()),
            off_per_ok: PerOk::median(
                &rounds.iter().map(|r| PerOk::of(&r.off)).collect::<Vec<_>>(),
            ),
            load,
            rounds,
        }
    }
}

#[derive(Debug, Serialize)]
struct Report {
    capacity_rps: f64,
    points: Vec<Point>,
}

async fn shed_counts(admins: &[String]) -> anyhow::Result<Vec<u64>> {
    let mut counts = Vec::new();
    for admin in admins {
        let channel = tonic::transport::Endpoint::from_shared(admin.clone())?
            .connect()
            .await
            .with_context(|| format!("the admin port {admin}"))?;
        let stats = ControlClient::new(channel)
            .get_stats(GetStatsRequest {})
            .await?
            .into_inner();
        counts.push(stats.shed);
    }
    Ok(counts)
}

fn storm_args(
    edge: &str,
    admin: &str,
    duration: Duration,
    extra: &[String],
) -> anyhow::Result<StormArgs> {
    let mut argv = vec![
        "--edge".to_owned(),
        edge.to_owned(),
        "--edge-admin".to_owned(),
        admin.to_owned(),
        // The ledger's counters are not what is measured here; the edge's admin port
        // answers Stats as well.
        "--ledger".to_owned(),
        edge.to_owned(),
        "--ledger-admin".to_owned(),
        admin.to_owned(),
        "--duration".to_owned(),
        format!("{}ms", duration.as_millis()),
    ];
    argv.extend(extra.iter().cloned());
    retrychain_bench::storm_args(argv)
}

/// CPU seconds of `pid` (0 when it cannot be read).
fn cpu_seconds(pid: u32) -> f64 {
    retrychain_bench::cpu_seconds(pid).unwrap_or(0.0)
}

/// CPU seconds so far: each of the chain's services, Postgres, this process, and the
/// machine's (busy, idle).
struct CpuReading {
    services: Vec<f64>,
    postgres: f64,
    generator: f64,
    machine: (f64, f64),
}

impl CpuReading {
    fn now(pids: &[u32], postgres: Option<u32>) -> anyhow::Result<CpuReading> {
        Ok(CpuReading {
            services: pids.iter().map(|&p| cpu_seconds(p)).collect(),
            postgres: match postgres {
                Some(pid) => postgres_cpu_seconds(pid)?,
                None => 0.0,
            },
            generator: cpu_seconds(std::process::id()),
            machine: retrychain_bench::machine_cpu_seconds()?,
        })
    }
}

/// Postgres's CPU seconds: the postmaster's own and its exited children's, plus its live
/// children's (the backends, the checkpointer, the WAL writer, …).
fn postgres_cpu_seconds(postmaster: u32) -> anyhow::Result<f64> {
    let mut total = retrychain_bench::cpu_seconds_with_reaped(postmaster)
        .context("the postmaster's /proc/<pid>/stat (--postgres-pid)")?;
    let children =
        std::fs::read_to_string(format!("/proc/{postmaster}/task/{postmaster}/children"))
            .unwrap_or_default();
    for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
        // A backend that exits between the listing and the reading is counted by the
        // postmaster's reaped time at the next reading instead.
        total += cpu_seconds(child);
    }
    Ok(total)
}

async fn run(
    edge: &str,
    admins: &[String],
    pids: &[u32],
    postgres: Option<u32>,
    duration: Duration,
    extra: &[String],
) -> anyhow::Result<Run> {
    let before = shed_counts(admins).await?;
    let buckets_before = retrychain_bench::refusal_buckets(&admins[0])
        .await
        .unwrap_or_default();
    let start = CpuReading::now(pids, postgres)?;
    let report: StormReport = storm::run(&storm_args(edge, &admins[0], duration, extra)?).await?;
    let end = CpuReading::now(pids, postgres)?;
    let us = |before: f64, after: f64| (after - before).max(0.0) * 1e6;
    let edge_cpu = us(start.services[0], end.services[0]);
    let services_us: f64 = start
        .services
        .iter()
        .zip(&end.services)
        .map(|(b, a)| us(*b, *a))
        .sum();
    let postgres_us = us(start.postgres, end.postgres);
    let generator_us = us(start.generator, end.generator);
    let busy_us = us(start.machine.0, end.machine.0);
    let cpu = CpuAccount {
        services_us,
        postgres_us,
        generator_us,
        rest_us: (busy_us - services_us - postgres_us - generator_us).max(0.0),
        busy_us,
        idle_us: us(start.machine.1, end.machine.1),
    };
    let after = shed_counts(admins).await?;
    let buckets_after = retrychain_bench::refusal_buckets(&admins[0])
        .await
        .unwrap_or_default();
    let refused_by: Vec<u64> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    let total: u64 = refused_by.iter().sum();
    Ok(Run {
        goodput_rps: report.goodput_rps,
        ok_p99_ms: report.ok_latency_ms.p99,
        requests: report.requests,
        refused: report.shed,
        edge_share: (total > 0).then(|| refused_by[0] as f64 / total as f64),
        refused_by,
        ok: report.ok,
        edge_cpu_us: edge_cpu,
        generator_cpu_us_per_call: generator_us / report.requests.max(1) as f64,
        refusal_ms: (report.shed > 0)
            .then_some((report.shed_latency_ms.p50, report.shed_latency_ms.p99)),
        edge_refusal_p99_ms: retrychain_bench::refusal_p99_ms(&buckets_before, &buckets_after),
        cpu,
    })
}

fn show_round(i: usize, round: &Round) {
    let line = |which: &str, r: &Run| {
        eprintln!(
            "    {which:<4} goodput {:>6.0}/s  ok p99 {:>7.1} ms  refused {:>7} of {:>7} (by edge..ledger {:?}; edge's share {}{})  load generator {:.1} µs CPU a call",
            r.goodput_rps,
            r.ok_p99_ms,
            r.refused,
            r.requests,
            r.refused_by,
            r.edge_share
                .map_or("-".to_owned(), |s| format!("{:.1}%", s * 100.0)),
            r.refusal_ms.map_or(String::new(), |(p50, p99)| format!(
                "; a refusal waited p50 {p50:.1} / p99 {p99:.1} ms, at the edge p99 ≤ {}",
                r.edge_refusal_p99_ms
                    .map_or("-".to_owned(), |ms| format!("{ms} ms"))
            )),
            r.generator_cpu_us_per_call,
        );
        eprintln!("         {}", PerOk::of(r).describe());
    };
    eprintln!(
        "  round {}: goodput on / off {:.2}, ok p99 on / off {:.2}",
        i + 1,
        round.goodput_ratio,
        round.ok_p99_ratio
    );
    line("on", &round.on);
    line("off", &round.off);
}

fn show(point: &Point) {
    let spread = |s: &Spread, digits: usize| {
        format!(
            "{:.digits$} ({:.digits$}–{:.digits$})",
            s.median, s.min, s.max
        )
    };
    eprintln!(
        "{}: goodput on / off {}, ok p99 on / off {}; on {}/s, off {}/s; refused {} of {} (edge's share {}){}{}  [median (lowest–highest) of {} rounds]",
        point.load,
        spread(&point.goodput_ratio, 2),
        spread(&point.ok_p99_ratio, 2),
        spread(&point.on_goodput_rps, 0),
        spread(&point.off_goodput_rps, 0),
        point.refused,
        point.requests,
        point
            .edge_share
            .map_or("-".to_owned(), |s| format!("{:.1}%", s * 100.0)),
        point
            .edge_cpu_us_per_refusal
            .map_or(String::new(), |s| format!(
                "; the edge's CPU per refusal {} µs over {} round(s)",
                spread(&s, 1),
                point.edge_cpu_rounds
            )),
        match (point.refusal_p99_ms, point.edge_refusal_p99_ms) {
            (None, _) => String::new(),
            (Some(client), edge) => format!(
                "; a refusal's p99 {} ms at the load generator, ≤ {} ms at the edge",
                spread(&client, 1),
                edge.map_or("-".to_owned(), |e| spread(&e, 2))
            ),
        },
        point.rounds.len(),
    );
    eprintln!("  on:  {}", point.on_per_ok.describe());
    eprintln!("  off: {}", point.off_per_ok.describe());
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    anyhow::ensure!(
        cli.on_admins.len() == 5 && cli.off_admins.len() == 5,
        "--on-admins and --off-admins name the five services' admin addresses, edge first"
    );
    anyhow::ensure!(
        cli.on_pids.len() == 5 && cli.off_pids.len() == 5,
        "--on-pids and --off-pids name the five services' processes, edge first"
    );
    let capacity = storm::run(&storm_args(
        &cli.off,
        &cli.off_admins[0],
        cli.duration,
        &["--concurrency".into(), "32".into()],
    )?)
    .await?
    .goodput_rps;
    eprintln!("capacity: {capacity:.0} charges/s at concurrency 32");
    let mut loads: Vec<(String, Vec<String>)> = cli
        .closed
        .iter()
        .map(|n| {
            (
                format!("closed loop, {n} in flight"),
                vec!["--concurrency".into(), n.to_string()],
            )
        })
        .collect();
    for factor in &cli.open {
        let rate = capacity * factor;
        loads.push((
            format!("open loop, {factor}x capacity ({rate:.0}/s)"),
            retrychain_bench::open_loop_args(rate),
        ));
    }
    let mut points = Vec::new();
    // The edge's CPU per served call with nothing refused: from the first point at which
    // the chain with admission refused nothing (the median over its rounds).
    let mut served_cost_us: Option<f64> = None;
    for (load, extra) in loads {
        let mut rounds = Vec::new();
        for round in 0..cli.rounds {
            let measure = async |on: bool| {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let (edge, admins, pids) = match on {
                    true => (&cli.on, &cli.on_admins, &cli.on_pids),
                    false => (&cli.off, &cli.off_admins, &cli.off_pids),
                };
                run(edge, admins, pids, cli.postgres_pid, cli.duration, &extra).await
            };
            // Alternate which chain goes first, so drift falls on both alike.
            let (on, off) = if round % 2 == 0 {
                let on = measure(true).await?;
                (on, measure(false).await?)
            } else {
                let off = measure(false).await?;
                (measure(true).await?, off)
            };
            rounds.push((on, off));
        }
        if served_cost_us.is_none() && rounds.iter().all(|(on, _)| on.refused == 0) {
            let costs: Vec<f64> = rounds
                .iter()
                .map(|(on, _)| on.edge_cpu_us / on.requests.max(1) as f64)
                .collect();
            served_cost_us = Some(retrychain_bench::median(&costs));
        }
        let rounds: Vec<Round> = rounds
            .into_iter()
            .map(|(on, off)| {
                // The edge's own count of its refusals: it also counts calls the client
                // had given up on by then, which the edge did not serve either.
                let served = on.requests.saturating_sub(on.refused_by[0]);
                // Only where refusals are a fifth of the calls or more: with a few, the
                // served calls' own variation is larger than what the refusals cost.
                let edge_cpu_us_per_refusal = match (served_cost_us, on.refused_by[0]) {
                    (Some(cost), refusals) if refusals * 5 >= on.requests.max(1) => {
                        Some(((on.edge_cpu_us - cost * served as f64) / refusals as f64).max(0.0))
                    }
                    _ => None,
                };
                Round {
                    goodput_ratio: on.goodput_rps / off.goodput_rps.max(1e-9),
                    ok_p99_ratio: on.ok_p99_ms / off.ok_p99_ms.max(1e-9),
                    on,
                    off,
                    edge_cpu_us_per_refusal,
                }
            })
            .collect();
        for (i, round) in rounds.iter().enumerate() {
            show_round(i, round);
        }
        let point = Point::of(load, rounds);
        show(&point);
        points.push(point);
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&Report {
            capacity_rps: capacity,
            points
        })?
    );
    Ok(())
}
