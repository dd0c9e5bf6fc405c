//! `retrychain chaos`: random faults under load, and a checker that decides from the record
//! of the run whether every guarantee held — Jepsen's method, for one payment chain.
//!
//! A run: a chain is started (or one is given by address); clients charge and read through
//! its edge and record every operation; a nemesis puts faults in on a seeded schedule and
//! heals them; then every fault is healed, every key never answered OK is re-sent until it
//! is, the database is read back, and the checker judges. The verdict is the exit code, a
//! summary, and JSON (the history and the verdict) beside a picture of the run.
//!
//! # Layout
//!
//! - [`history`]: what happened, as the client saw it (operations, fault windows).
//! - [`check`]: the checker, a pure function of the history and the rows read back.
//! - [`workload`]: the clients that make and record the operations; bursts; settling.
//! - [`nemesis`]: the schedule and the faults, made and healed.
//! - [`net`]: kernel packet filter rules on the loopback (partitions, loss).
//! - [`observe`]: reading back the database and the ledgers' counters.
//! - [`picture`]: the SVG timeline.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context;
use clap::Args;
use retrychain_harness::{ChainSpec, LocalChain, Logs, OwnDatabase, Postgres};
use serde::Serialize;
use tokio::time::Instant;

pub mod check;
pub mod history;
pub mod nemesis;
pub mod net;
pub mod observe;
pub mod picture;
pub mod workload;

use check::{Bounds, Verdict};
use history::History;
use nemesis::{FaultKind, Lab, Pacing, Planned};
use workload::{Mix, Workload};

/// Flags of `chaos`.
#[derive(Debug, Clone, Args)]
pub struct ChaosArgs {
    /// How long the faults and the load last (then everything is healed and settled).
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration, env = "RETRYCHAIN_CHAOS_DURATION")]
    pub duration: Duration,
    /// The schedule's seed: the same seed, kinds and duration give the same schedule.
    /// Unset: a random one, printed.
    #[arg(long, env = "RETRYCHAIN_CHAOS_SEED")]
    pub seed: Option<u64>,
    /// The fault kinds, comma-separated [default: every kind the chain allows: the
    /// failover kinds need --postgres ha, network kinds need iptables and root].
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        env = "RETRYCHAIN_CHAOS_FAULTS"
    )]
    pub faults: Vec<FaultKind>,
    /// Replicas of each relay and of the ledger in the chain started here.
    #[arg(long, default_value_t = 2, env = "RETRYCHAIN_CHAOS_REPLICAS", value_parser = clap::value_parser!(u16).range(1..=9))]
    pub replicas: u16,
    /// The Postgres the chain started here runs on.
    #[arg(long, value_enum, default_value_t = Postgres::Single, env = "RETRYCHAIN_CHAOS_POSTGRES")]
    pub postgres: Postgres,
    /// Clients, each making one call at a time.
    #[arg(long, default_value_t = 16, env = "RETRYCHAIN_CHAOS_CLIENTS", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub clients: u32,
    /// Accounts the charges spread over.
    #[arg(long, default_value_t = 20, env = "RETRYCHAIN_CHAOS_ACCOUNTS", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub accounts: u32,
    /// Each call's deadline, in ms.
    #[arg(long, default_value_t = 2000, env = "RETRYCHAIN_CHAOS_DEADLINE_MS", value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub deadline_ms: u64,
    /// Extra clients an overload fault adds.
    #[arg(long, default_value_t = 300, env = "RETRYCHAIN_CHAOS_BURST")]
    pub burst: usize,
    /// The shortest a fault lasts.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub shortest_fault: Duration,
    /// The longest a fault lasts.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub longest_fault: Duration,
    /// The shortest calm after a fault.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub shortest_gap: Duration,
    /// The longest calm after a fault.
    #[arg(long, default_value = "4s", value_parser = humantime::parse_duration)]
    pub longest_gap: Duration,
    /// The chance that a fault starts together with the next (a composite fault).
    #[arg(long, default_value_t = 0.25)]
    pub composite: f64,
    /// A fault's effect must end — a call answered OK — within this long of its healing
    /// [default: 20s; 60s with --postgres ha, whose failovers take their own time].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub recovery: Option<Duration>,
    /// After the faults, keys never answered OK are re-sent until they are; the run gives
    /// up on them (and reports them unsettled) once none has settled for this long.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub settle: Duration,
    /// Where the history, the verdict and the picture are written.
    #[arg(long, default_value = "chaos-results", env = "RETRYCHAIN_CHAOS_OUT")]
    pub out: PathBuf,
    /// The edge of an existing chain, instead of starting one (with --database-url; only
    /// the overload and latency faults can be made on it).
    #[arg(long, env = "RETRYCHAIN_CHAOS_EDGE", requires = "database_url")]
    pub edge: Option<String>,
    /// The existing chain's database, to read back what the run left.
    #[arg(long, env = "RETRYCHAIN_CHAOS_DATABASE_URL", requires = "edge")]
    pub database_url: Option<String>,
    /// The existing chain's admin addresses (Control), comma-separated: latency faults are
    /// put in through them, the ledgers' conflicts read from them.
    #[arg(
        long,
        value_delimiter = ',',
        env = "RETRYCHAIN_CHAOS_ADMIN",
        requires = "edge"
    )]
    pub admin: Vec<String>,
    /// Print the services' logs (prefixed by their names) instead of discarding them.
    #[arg(long, env = "RETRYCHAIN_CHAOS_SERVICE_LOGS", value_parser = clap::builder::BoolishValueParser::new())]
    pub service_logs: bool,
    /// Remove iptables rules a killed run left behind, and exit.
    #[arg(long)]
    pub clean: bool,
    /// Testing only (hidden): start the ledger broken (`--test-skip-key-claim`), to show
    /// the checker catching it.
    #[arg(long, hide = true)]
    pub break_ledger: bool,
}

/// What a run wrote beside its verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The run's id: every account and key it made starts with it.
    pub run: String,
    /// The seed.
    pub seed: u64,
    /// The kinds asked for.
    pub kinds: Vec<FaultKind>,
    /// The schedule.
    pub schedule: Vec<Planned>,
    /// Faults that could not be made, and why.
    pub skipped: Vec<String>,
    /// Keys still unsettled when settling gave up.
    pub unsettled_after_settle: usize,
    /// The checker's bounds.
    pub bounds: Bounds,
    /// The verdict.
    pub verdict: Verdict,
    /// Where the files are.
    pub files: Vec<PathBuf>,
}

/// Which kinds a run makes: those asked for, or every kind the chain allows.
fn kinds(args: &ChaosArgs) -> anyhow::Result<Vec<FaultKind>> {
    let iptables = net::available();
    let existing = args.edge.is_some();
    let allowed = |kind: FaultKind| -> Result<(), &'static str> {
        if existing && !matches!(kind, FaultKind::Overload | FaultKind::Latency) {
            return Err(
                "needs a chain this tool started (it holds the processes and the database)",
            );
        }
        if kind == FaultKind::Latency && existing && args.admin.is_empty() {
            return Err("needs --admin on an existing chain");
        }
        if kind.needs_formation() && args.postgres != Postgres::Ha {
            return Err("needs --postgres ha");
        }
        if kind.needs_iptables() && !iptables {
            return Err("needs iptables and root (iptables -S INPUT failed)");
        }
        Ok(())
    };
    if args.faults.is_empty() {
        let kinds: Vec<FaultKind> = FaultKind::ALL
            .into_iter()
            .filter(|k| allowed(*k).is_ok())
            .collect();
        for kind in FaultKind::ALL {
            if let Err(why) = allowed(kind) {
                eprintln!("chaos: not making {}: {why}", kind.name());
            }
        }
        return Ok(kinds);
    }
    for kind in &args.faults {
        if let Err(why) = allowed(*kind) {
            anyhow::bail!("--faults {}: {why}", kind.name());
        }
    }
    let mut kinds = args.faults.clone();
    kinds.sort();
    kinds.dedup();
    Ok(kinds)
}

/// Runs `chaos`: the report (`None` for `--clean`), or why the run could not be made.
/// Ctrl-C or SIGTERM stops it, with every fault healed and the chain it started stopped.
pub async fn run(args: &ChaosArgs) -> anyhow::Result<Option<Report>> {
    if args.clean {
        let removed = net::clean()?;
        eprintln!("chaos: removed {removed} iptables rules left by an earlier run");
        return Ok(None);
    }
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")?;
    // Dropping the run (Ctrl-C, SIGTERM) drops its faults, each healing itself: rules
    // removed, Postgres thawed, the chain it started killed and its database removed.
    let result = tokio::select! {
        result = run_until_done(args) => result,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted (Ctrl-C): faults healed, the chain stopped")),
        _ = terminate.recv() => Err(anyhow::anyhow!("terminated (SIGTERM): faults healed, the chain stopped")),
    };
    result.map(Some)
}

async fn run_until_done(args: &ChaosArgs) -> anyhow::Result<Report> {
    let kinds = kinds(args)?;
    let seed = args.seed.unwrap_or_else(rand::random);
    let run = format!("chaos-{seed:x}-{:x}", rand::random::<u16>());
    // Rules a run killed outright left behind (one run at a time per machine: this
    // removes every rule tagged as ours).
    if net::available() {
        let removed = net::clean()?;
        if removed > 0 {
            eprintln!("chaos: removed {removed} iptables rules an earlier run left behind");
        }
    }
    let pacing = Pacing {
        warmup: Duration::from_secs(3),
        shortest: args.shortest_fault,
        longest: args.longest_fault.max(args.shortest_fault),
        shortest_gap: args.shortest_gap,
        longest_gap: args.longest_gap.max(args.shortest_gap),
        composite: args.composite,
    };
    let schedule = nemesis::plan(seed, &kinds, args.duration, pacing);
    let bounds = Bounds {
        recovery_ms: args
            .recovery
            .unwrap_or(match args.postgres {
                Postgres::Ha => Duration::from_secs(60),
                Postgres::Single => Duration::from_secs(20),
            })
            .as_secs_f64()
            * 1000.0,
        ..Bounds::default()
    };
    eprintln!(
        "chaos: run {run}, seed {seed}, {} faults over {} ({})",
        schedule.len(),
        humantime::format_duration(args.duration),
        kinds
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    );

    // The chain: started here, or given.
    let (chain, edge_url, admin, database_url) = match &args.edge {
        Some(edge) => {
            let mut admin = Vec::new();
            for url in &args.admin {
                let addr = retrychain_harness::ServiceAddr::external(url, Some(url));
                let channel = retrychain_harness::connect(&addr.admin_url).await?;
                let stats = retrychain_proto::v1::control_client::ControlClient::new(channel)
                    .get_stats(retrychain_proto::v1::GetStatsRequest {})
                    .await
                    .with_context(|| format!("asking {url} which service it is"))?;
                admin.push((stats.into_inner().service, addr.admin_url));
            }
            let database_url = args.database_url.clone().context("--database-url")?;
            (None, edge.clone(), admin, database_url)
        }
        None => {
            let mut spec = ChainSpec {
                postgres: args.postgres,
                replicas: usize::from(args.replicas),
                logs: if args.service_logs {
                    Logs::Prefixed
                } else {
                    Logs::Discard
                },
                ..ChainSpec::default()
            };
            spec.ledger().test_skip_key_claim = args.break_ledger;
            eprintln!(
                "chaos: starting a chain: {} replicas of each tier below the edge, {:?} Postgres",
                args.replicas, args.postgres
            );
            let chain = LocalChain::start(spec).await?;
            let edge_url = chain.addrs().edge.url.clone();
            let database_url = match chain.own_database() {
                Some(OwnDatabase::Ha(formation)) => formation.uri(),
                Some(database) => database.url(),
                None => anyhow::bail!("the chain started without its own database"),
            };
            (Some(chain), edge_url, Vec::new(), database_url)
        }
    };

    let edge = retrychain_harness::connect(&edge_url).await?;
    let start = Instant::now();
    let mix = Mix {
        clients: args.clients as usize,
        accounts: args.accounts as usize,
        deadline: Duration::from_millis(args.deadline_ms),
        resend: 0.2,
        reads: 0.1,
        every_layer: 0.1,
    };
    let workload = Workload::new(edge, &run, mix, seed, start);
    let mut lab = Lab::new(chain, &admin, workload.clone(), args.burst, seed, start)?;

    let clients = workload.start();
    let (faults, skipped) = nemesis::run(&mut lab, &schedule).await;
    let remaining = (start + args.duration).saturating_duration_since(Instant::now());
    tokio::time::sleep(remaining).await;
    clients.stop().await;
    let load_ended_ms = start.elapsed().as_secs_f64() * 1000.0;
    eprintln!(
        "chaos: {:>7.1} s  load stopped, every fault healed; settling the keys never answered OK",
        load_ended_ms / 1000.0
    );
    let unsettled = workload.settle(args.settle).await;

    let ledgers = lab.ledger_controls();
    let read_url = match lab.database() {
        // A formation's URL names both nodes; a plain connection takes the primary's.
        Some(OwnDatabase::Ha(formation)) => {
            let primary = tokio::task::block_in_place(|| formation.primary())?
                .context("the formation reports no primary after the run")?;
            formation.node_url(primary)
        }
        _ => database_url.clone(),
    };
    let observed = observe::observe(&read_url, &run, &ledgers).await?;
    let history = History {
        ops: workload.ops(),
        faults,
        load_ended_ms,
    };
    let verdict = check::check(&history, &observed, bounds);
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    if let Some(OwnDatabase::Ha(formation)) = lab.database() {
        keep_formation_story(formation, &args.out)?;
    }
    if let Some(chain) = lab.into_chain() {
        chain.stop().await;
    }

    let history_path = args.out.join("history.json");
    let verdict_path = args.out.join("verdict.json");
    let picture_path = args.out.join("timeline.svg");
    std::fs::write(&history_path, serde_json::to_vec(&history)?)
        .with_context(|| format!("writing {}", history_path.display()))?;
    let mut report = Report {
        run,
        seed,
        kinds,
        schedule,
        skipped,
        unsettled_after_settle: unsettled,
        bounds,
        verdict,
        files: vec![history_path, verdict_path.clone(), picture_path.clone()],
    };
    picture::draw(&picture_path, &history)?;
    std::fs::write(&verdict_path, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("writing {}", verdict_path.display()))?;
    report.files.retain(|f| f.exists());
    Ok(report)
}

/// Copies what explains the formation's failovers into `out/formation/` before the
/// formation (and its directory) goes: the monitor's events — each state it assigned, the
/// LSNs the nodes reported, why — and the monitor's and nodes' logs. A run that lost an
/// acknowledged charge across a failover is read from these.
fn keep_formation_story(formation: &tempgres::HaFormation, out: &Path) -> anyhow::Result<()> {
    let dir = out.join("formation");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let events = tokio::task::block_in_place(|| formation.events(10_000))?;
    std::fs::write(dir.join("events.txt"), events)?;
    for entry in std::fs::read_dir(formation.dir())? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "log")
            && let Some(name) = path.file_name()
        {
            std::fs::copy(&path, dir.join(name))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}

/// Prints the verdict as a user reads it.
pub fn print_report(report: &Report) {
    let summary = &report.verdict.summary;
    println!(
        "chaos run {} (seed {}): {}",
        report.run,
        report.seed,
        if report.verdict.valid {
            "every guarantee held"
        } else {
            "GUARANTEES BROKEN"
        }
    );
    println!(
        "  {} operations ({} during the faults): {} charges acknowledged, {} failed; {} keys, {} charges in the database",
        summary.operations,
        summary.load_operations,
        summary.acknowledged,
        summary.failed,
        summary.keys,
        summary.charges
    );
    let faults: Vec<String> = summary
        .faults
        .iter()
        .map(|(kind, n)| format!("{kind} {n}"))
        .collect();
    println!("  faults: {}", faults.join(", "));
    let codes: Vec<String> = summary
        .codes
        .iter()
        .map(|(code, n)| format!("{code} {n}"))
        .collect();
    println!("  failures by code: {}", codes.join(", "));
    println!(
        "  slowest failure {:.0} ms; longest time from a healing to the next success {:.0} ms (bound {:.0} ms)",
        summary.worst_failure_ms, summary.longest_recovery_ms, report.bounds.recovery_ms
    );
    let mut broken: std::collections::BTreeMap<&str, usize> = Default::default();
    for violation in &report.verdict.violations {
        *broken.entry(violation.kind.as_str()).or_default() += 1;
    }
    if !broken.is_empty() {
        let broken: Vec<String> = broken.iter().map(|(k, n)| format!("{k} {n}")).collect();
        println!("  violations by kind: {}", broken.join(", "));
    }
    for skipped in &report.skipped {
        println!("  skipped: {skipped}");
    }
    for violation in report.verdict.violations.iter().take(20) {
        let keys: Vec<&str> = violation.keys.iter().take(5).map(String::as_str).collect();
        println!(
            "  VIOLATION {}: {} [{}{}]",
            violation.kind,
            violation.detail,
            keys.join(", "),
            if violation.keys.len() > 5 {
                ", …"
            } else {
                ""
            }
        );
    }
    if report.verdict.violations.len() > 20 {
        println!(
            "  … and {} more violations (verdict.json has them all)",
            report.verdict.violations.len() - 20
        );
    }
    for file in &report.files {
        println!("  wrote {}", file.display());
    }
}
