//! The nemesis: faults on a seeded schedule ([`plan`]), put into a chain this tool started
//! and healed again ([`Lab`]).
//!
//! A schedule is rounds of every fault kind asked for, each round in a random order, so a
//! run of a few minutes meets every kind; a fault lasts a random time within bounds and is
//! followed by a quiet gap (its effect must end within the checker's recovery bound). Now
//! and then two faults of one round start together — a composite fault, such as a
//! partition while a replica is frozen. What each fault hits (which replica, which link)
//! is drawn when it starts, from the same seed.

use std::{collections::BTreeSet, process::Command, time::Duration};

use anyhow::Context;
use rand::{RngExt, SeedableRng, rngs::SmallRng, seq::SliceRandom};
use retrychain_harness::{ChildService, LocalChain, NAMES, OwnDatabase};
use retrychain_proto::v1::{Faults, control_client::ControlClient};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use crate::{
    history::FaultWindow,
    net::{Disturbance, Rules},
    workload::{Burst, Workload},
};

/// A kind of fault.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    clap::ValueEnum,
    Serialize,
    Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL a service (any replica, the edge included); started again on the same
    /// ports when healed.
    Kill,
    /// SIGSTOP a service; SIGCONT when healed.
    Freeze,
    /// SIGTERM a service (it drains); started again when healed.
    Stop,
    /// Postgres restarted (`pg_ctl restart -m fast`); with `--postgres ha`, the primary's
    /// host killed (the monitor fails over) and started again when healed.
    PgRestart,
    /// Postgres's processes (the primary's, with `--postgres ha`) SIGSTOPped; SIGCONT when
    /// healed.
    PgFreeze,
    /// `pg_autoctl perform failover` (`--postgres ha` only).
    PgFailover,
    /// `pg_autoctl perform switchover` (`--postgres ha` only).
    PgSwitchover,
    /// Every packet from one tier to the next dropped (iptables).
    Partition,
    /// Every packet from the ledger to Postgres dropped (iptables; with `--postgres ha` the
    /// standby's and the monitor's as well: one host cut off).
    DbPartition,
    /// 20–50% of the packets on one link dropped (iptables `statistic`).
    Loss,
    /// 100–500 ms added to every call over one link, by the calling tier's own fault knob
    /// (this kernel has no `tc netem`).
    Latency,
    /// A burst of extra clients sending new charges as fast as they are answered.
    Overload,
}

impl FaultKind {
    /// Every kind.
    pub const ALL: [FaultKind; 12] = [
        FaultKind::Kill,
        FaultKind::Freeze,
        FaultKind::Stop,
        FaultKind::PgRestart,
        FaultKind::PgFreeze,
        FaultKind::PgFailover,
        FaultKind::PgSwitchover,
        FaultKind::Partition,
        FaultKind::DbPartition,
        FaultKind::Loss,
        FaultKind::Latency,
        FaultKind::Overload,
    ];

    /// Its name on the command line and in the history.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Freeze => "freeze",
            FaultKind::Stop => "stop",
            FaultKind::PgRestart => "pg-restart",
            FaultKind::PgFreeze => "pg-freeze",
            FaultKind::PgFailover => "pg-failover",
            FaultKind::PgSwitchover => "pg-switchover",
            FaultKind::Partition => "partition",
            FaultKind::DbPartition => "db-partition",
            FaultKind::Loss => "loss",
            FaultKind::Latency => "latency",
            FaultKind::Overload => "overload",
        }
    }

    /// Only a pg_auto_failover formation can do it.
    pub fn needs_formation(self) -> bool {
        matches!(self, FaultKind::PgFailover | FaultKind::PgSwitchover)
    }

    /// It changes the kernel's packet filter.
    pub fn needs_iptables(self) -> bool {
        matches!(
            self,
            FaultKind::Partition | FaultKind::DbPartition | FaultKind::Loss
        )
    }

    /// It acts on Postgres (two such faults are never paired).
    fn on_postgres(self) -> bool {
        matches!(
            self,
            FaultKind::PgRestart
                | FaultKind::PgFreeze
                | FaultKind::PgFailover
                | FaultKind::PgSwitchover
                | FaultKind::DbPartition
        )
    }
}

/// How faults are paced.
#[derive(Debug, Clone, Copy)]
pub struct Pacing {
    /// Calm before the first fault.
    pub warmup: Duration,
    /// A fault lasts between these.
    pub shortest: Duration,
    /// …
    pub longest: Duration,
    /// The calm after a fault lasts between these.
    pub shortest_gap: Duration,
    /// …
    pub longest_gap: Duration,
    /// The chance that a fault starts together with the next one of its round.
    pub composite: f64,
}

/// One fault of the schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Planned {
    /// When it starts, from the start of the run.
    pub at: Duration,
    /// Its kind.
    pub kind: FaultKind,
    /// How long it lasts.
    pub length: Duration,
}

/// The schedule for a run of `run` with `kinds`, from `seed`: the same three give the same
/// schedule.
pub fn plan(seed: u64, kinds: &[FaultKind], run: Duration, pacing: Pacing) -> Vec<Planned> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut faults = Vec::new();
    if kinds.is_empty() {
        return faults;
    }
    let between = |rng: &mut SmallRng, low: Duration, high: Duration| {
        Duration::from_millis(
            rng.random_range(low.as_millis()..=high.as_millis().max(low.as_millis())) as u64,
        )
    };
    let mut at = pacing.warmup;
    'rounds: loop {
        let mut round = kinds.to_vec();
        round.shuffle(&mut rng);
        let mut i = 0;
        while i < round.len() {
            let length = between(&mut rng, pacing.shortest, pacing.longest);
            if at + length + pacing.shortest_gap > run {
                break 'rounds;
            }
            faults.push(Planned {
                at,
                kind: round[i],
                length,
            });
            let mut end = at + length;
            if let Some(&next) = round.get(i + 1)
                && rng.random_bool(pacing.composite.clamp(0.0, 1.0))
                && !(round[i].on_postgres() && next.on_postgres())
            {
                let length = between(&mut rng, pacing.shortest, pacing.longest);
                if at + length + pacing.shortest_gap <= run {
                    faults.push(Planned {
                        at,
                        kind: next,
                        length,
                    });
                    end = end.max(at + length);
                    i += 1;
                }
            }
            i += 1;
            at = end + between(&mut rng, pacing.shortest_gap, pacing.longest_gap);
        }
    }
    faults
}

/// How to undo a fault.
#[derive(Debug)]
enum Undo {
    /// Start the named service again.
    Restart(String),
    /// SIGCONT the named service.
    Continue(String),
    /// SIGCONT these Postgres processes.
    ContinuePids(Vec<u32>),
    /// Start formation node `i` again.
    RestartNode(usize),
    /// Remove these packet filter rules.
    Rules(Rules),
    /// Clear the fault knobs of the named services.
    ClearFaults(Vec<String>),
    /// Stop the extra clients.
    StopBurst(Burst),
    /// Nothing: the fault was an act (a restart, a failover) that ended by itself.
    Nothing,
}

/// A fault in force.
#[derive(Debug)]
pub struct Active {
    /// Its kind.
    kind: FaultKind,
    /// What it is, for the history.
    window: FaultWindow,
    /// How to heal it.
    undo: Undo,
}

/// The chain under test and what the nemesis needs to fault it.
#[derive(Debug)]
pub struct Lab {
    /// The chain, when this tool started it (its processes and its database); `None` for
    /// a chain given by address, which only Control and the workload can reach.
    chain: Option<LocalChain>,
    /// Control of every replica by name, connected lazily (a replica may be down).
    controls: Vec<(String, ControlClient<Channel>)>,
    /// Extra clients for overload bursts.
    workload: Workload,
    /// How many extra clients a burst adds.
    burst: usize,
    /// Draws targets.
    rng: SmallRng,
    /// Postgres processes frozen now.
    frozen_postgres: Thaw,
    /// Services killed or stopped whose fault is over but which have not started again yet
    /// (another fault in force may keep them from starting: a ledger cannot start while
    /// Postgres is cut off), with their fault's window; tried again as the nemesis goes on.
    pending: Vec<(String, FaultWindow)>,
    /// When the run started.
    start: Instant,
}

/// The port of a `http://host:port` address.
fn port_of(url: &str) -> Option<u16> {
    url.rsplit_once(':')?.1.trim_end_matches('/').parse().ok()
}

/// The tier (index into [`NAMES`]) of a replica named `hop3` or `hop3.2`.
fn tier_of(name: &str) -> usize {
    let base = name.split('.').next().unwrap_or(name);
    NAMES.iter().position(|n| *n == base).unwrap_or(0)
}

/// Sends `signal` to each of `pids`, the first (a server's postmaster) included: an error
/// only when that one could not be signalled. The others may have ended since they were
/// listed (a backend whose client left), and a process that is gone needs no signal.
fn kill(signal: &str, pids: &[u32]) -> anyhow::Result<()> {
    let Some((first, rest)) = pids.split_first() else {
        return Ok(());
    };
    let send = |pid: &u32| {
        Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .stderr(std::process::Stdio::null())
            .status()
    };
    let status = send(first).context("running kill")?;
    anyhow::ensure!(status.success(), "kill -{signal} {first}: {status}");
    for pid in rest {
        let _ = send(pid);
    }
    Ok(())
}

impl Lab {
    /// A lab over `chain` — one this tool started, or (`None`) one whose services' admin
    /// addresses are `admin` — and `workload`, which makes the overload bursts of `burst`
    /// clients.
    pub fn new(
        chain: Option<LocalChain>,
        admin: &[(String, String)],
        workload: Workload,
        burst: usize,
        seed: u64,
        start: Instant,
    ) -> anyhow::Result<Self> {
        let mut controls = Vec::new();
        let started = chain
            .iter()
            .flat_map(|chain| chain.services.iter().chain(&chain.replicas))
            .map(|service| (service.name.clone(), service.addr.admin_url.clone()));
        for (name, url) in started.chain(admin.iter().cloned()) {
            let channel = Endpoint::from_shared(url)?
                .connect_timeout(Duration::from_secs(1))
                .connect_lazy();
            controls.push((name, ControlClient::new(channel)));
        }
        Ok(Self {
            chain,
            controls,
            workload,
            burst,
            // Another stream than the schedule's: targets never shift the schedule.
            rng: SmallRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
            frozen_postgres: Thaw::default(),
            pending: Vec::new(),
            start,
        })
    }

    /// The chain, to read from or stop after the run.
    pub fn into_chain(self) -> Option<LocalChain> {
        // Dropping the rest thaws any Postgres process still frozen.
        self.chain
    }

    /// The chain's own database.
    pub fn database(&self) -> Option<&OwnDatabase> {
        self.chain.as_ref()?.own_database()
    }

    fn database_mut(&mut self) -> Option<&mut OwnDatabase> {
        self.chain.as_mut()?.own_database_mut()
    }

    /// The Control clients of the ledger replicas.
    pub fn ledger_controls(&self) -> Vec<ControlClient<Channel>> {
        self.controls
            .iter()
            .filter(|(name, _)| tier_of(name) == NAMES.len() - 1)
            .map(|(_, client)| client.clone())
            .collect()
    }

    fn ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0
    }

    fn processes(&mut self) -> Vec<&mut ChildService> {
        match &mut self.chain {
            Some(chain) => chain
                .services
                .iter_mut()
                .chain(chain.replicas.iter_mut())
                .collect(),
            None => Vec::new(),
        }
    }

    fn process(&mut self, name: &str) -> Option<&mut ChildService> {
        self.processes().into_iter().find(|s| s.name == name)
    }

    fn pick_process(&mut self) -> anyhow::Result<String> {
        let names: Vec<String> = self.processes().iter().map(|s| s.name.clone()).collect();
        anyhow::ensure!(
            !names.is_empty(),
            "process faults need a chain this tool started"
        );
        Ok(names[self.rng.random_range(0..names.len())].clone())
    }

    /// The public ports of every replica of tier `i`.
    fn tier_ports(&mut self, i: usize) -> Vec<u16> {
        self.processes()
            .iter()
            .filter(|s| tier_of(&s.name) == i)
            .filter_map(|s| port_of(&s.addr.url))
            .collect()
    }

    /// The ports Postgres listens on (both nodes of a formation).
    fn postgres_ports(&self) -> Vec<u16> {
        match self.database() {
            Some(OwnDatabase::Single(cluster)) => vec![cluster.port()],
            Some(OwnDatabase::Ha(formation)) => formation.ports().to_vec(),
            None => Vec::new(),
        }
    }

    /// A link: `(label, destination ports)`, one of the four between tiers or the
    /// ledger's to Postgres (when `with_database`).
    fn pick_link(&mut self, with_database: bool) -> (String, Vec<u16>) {
        let links = NAMES.len() - 1 + usize::from(with_database);
        let link = self.rng.random_range(0..links);
        if link == NAMES.len() - 1 {
            ("ledger → postgres".to_owned(), self.postgres_ports())
        } else {
            (
                format!("{} → {}", NAMES[link], NAMES[link + 1]),
                self.tier_ports(link + 1),
            )
        }
    }

    /// Whether the formation has a primary and a secondary, each in the state the monitor
    /// assigned — as a failover or switchover needs, and as a fault on the primary should
    /// find it (`true` when the database is not a formation).
    fn formation_settled(&self) -> bool {
        let Some(OwnDatabase::Ha(formation)) = self.database() else {
            return true;
        };
        let Ok(nodes) = tokio::task::block_in_place(|| formation.state()) else {
            return false;
        };
        let settled = |state: &str| {
            nodes
                .iter()
                .any(|n| n.reported == state && n.assigned == state)
        };
        settled("primary") && settled("secondary")
    }

    /// The formation's primary node.
    fn primary(&self) -> anyhow::Result<usize> {
        let Some(OwnDatabase::Ha(formation)) = self.database() else {
            anyhow::bail!("not a pg_auto_failover formation");
        };
        tokio::task::block_in_place(|| formation.primary())?
            .context("the formation reports no primary")
    }

    /// Starts `kind`; what to heal later.
    pub async fn apply(&mut self, kind: FaultKind) -> anyhow::Result<Active> {
        let began_ms = self.ms();
        let mut silences_edge = false;
        let (target, undo) = match kind {
            FaultKind::Kill => {
                let name = self.pick_process()?;
                if let Some(service) = self.process(&name) {
                    service.crash().await;
                }
                silences_edge = name == NAMES[0];
                (name.clone(), Undo::Restart(name))
            }
            FaultKind::Freeze => {
                let name = self.pick_process()?;
                if let Some(service) = self.process(&name) {
                    service.signal("STOP").await?;
                }
                silences_edge = name == NAMES[0];
                (name.clone(), Undo::Continue(name))
            }
            FaultKind::Stop => {
                let name = self.pick_process()?;
                if let Some(service) = self.process(&name) {
                    service.terminate(Duration::from_secs(10)).await;
                }
                silences_edge = name == NAMES[0];
                (name.clone(), Undo::Restart(name))
            }
            FaultKind::PgRestart => match self.database_mut() {
                Some(OwnDatabase::Single(cluster)) => {
                    tokio::task::block_in_place(|| cluster.restart_server())?;
                    ("postgres".to_owned(), Undo::Nothing)
                }
                Some(OwnDatabase::Ha(_)) => {
                    let primary = self.primary()?;
                    if let Some(OwnDatabase::Ha(formation)) = self.database_mut() {
                        tokio::task::block_in_place(|| formation.kill_node(primary))?;
                    }
                    (
                        format!("postgres node{} (the primary)", primary + 1),
                        Undo::RestartNode(primary),
                    )
                }
                None => anyhow::bail!("the chain's database is not this tool's"),
            },
            FaultKind::PgFreeze => {
                let (target, pids) = match self.database() {
                    Some(OwnDatabase::Single(cluster)) => {
                        ("postgres".to_owned(), cluster.server_pids()?)
                    }
                    Some(OwnDatabase::Ha(formation)) => {
                        let primary = self.primary()?;
                        (
                            format!("postgres node{} (the primary)", primary + 1),
                            formation.server_pids(primary)?,
                        )
                    }
                    None => anyhow::bail!("the chain's database is not this tool's"),
                };
                if let Err(error) = kill("STOP", &pids) {
                    let _ = kill("CONT", &pids);
                    return Err(error);
                }
                self.frozen_postgres.0.extend(&pids);
                (target, Undo::ContinuePids(pids))
            }
            FaultKind::PgFailover | FaultKind::PgSwitchover => {
                let Some(OwnDatabase::Ha(formation)) = self.database() else {
                    anyhow::bail!("not a pg_auto_failover formation");
                };
                tokio::task::block_in_place(|| {
                    if kind == FaultKind::PgFailover {
                        formation.failover()
                    } else {
                        formation.switchover()
                    }
                })?;
                ("postgres".to_owned(), Undo::Nothing)
            }
            FaultKind::Partition | FaultKind::DbPartition => {
                let (link, ports) = if kind == FaultKind::DbPartition {
                    ("ledger → postgres".to_owned(), self.postgres_ports())
                } else {
                    let link = self.rng.random_range(0..NAMES.len() - 1);
                    (
                        format!("{} → {}", NAMES[link], NAMES[link + 1]),
                        self.tier_ports(link + 1),
                    )
                };
                let mut rules = Rules::default();
                rules.disturb(&ports, Disturbance::Partition)?;
                (link, Undo::Rules(rules))
            }
            FaultKind::Loss => {
                let (link, ports) = self.pick_link(true);
                let share = self.rng.random_range(20..=50) as f64 / 100.0;
                let mut rules = Rules::default();
                rules.disturb(&ports, Disturbance::Loss(share))?;
                (
                    format!("{link}, {:.0}% lost", share * 100.0),
                    Undo::Rules(rules),
                )
            }
            FaultKind::Latency => {
                let caller = self.rng.random_range(0..NAMES.len() - 1);
                let delay_ms = self.rng.random_range(100..=500);
                let mut names = Vec::new();
                for (name, control) in &mut self.controls {
                    if tier_of(name) != caller {
                        continue;
                    }
                    let faults = Faults {
                        delay_ms,
                        ..Faults::default()
                    };
                    // A frozen or dead replica cannot take it; the others still do.
                    if let Ok(Ok(_)) =
                        tokio::time::timeout(Duration::from_secs(2), control.set_faults(faults))
                            .await
                    {
                        names.push(name.clone());
                    }
                }
                (
                    format!("{} → {}, +{delay_ms} ms", NAMES[caller], NAMES[caller + 1]),
                    Undo::ClearFaults(names),
                )
            }
            FaultKind::Overload => (
                format!("{} extra clients", self.burst),
                Undo::StopBurst(self.workload.burst(self.burst)),
            ),
        };
        Ok(Active {
            kind,
            window: FaultWindow {
                kind: kind.name().to_owned(),
                target,
                began_ms,
                healed_ms: began_ms,
                silences_edge,
            },
            undo,
        })
    }

    /// Ends `active`; its window, with the time it was healed — or `None` when the
    /// service it stopped did not start again yet ([`Lab::retry_pending`] tries again).
    pub async fn heal(&mut self, active: Active) -> Option<FaultWindow> {
        let Active {
            mut window, undo, ..
        } = active;
        let result: anyhow::Result<()> = match undo {
            Undo::Restart(name) => {
                if let Err(error) = self.try_restart(&name).await {
                    eprintln!("chaos: {name} did not start again yet ({error:#}); trying again");
                    self.pending.push((name, window));
                    return None;
                }
                Ok(())
            }
            Undo::Continue(name) => match self.process(&name) {
                Some(service) => service.signal("CONT").await,
                None => Ok(()),
            },
            Undo::ContinuePids(pids) => {
                for pid in &pids {
                    self.frozen_postgres.0.remove(pid);
                }
                kill("CONT", &pids)
            }
            Undo::RestartNode(i) => match self.database_mut() {
                Some(OwnDatabase::Ha(formation)) => {
                    tokio::task::block_in_place(|| formation.restart_node(i)).map_err(Into::into)
                }
                _ => Ok(()),
            },
            Undo::Rules(mut rules) => rules.heal(),
            Undo::ClearFaults(names) => {
                for (name, control) in &mut self.controls {
                    if names.contains(name) {
                        let _ = tokio::time::timeout(
                            Duration::from_secs(2),
                            control.set_faults(Faults::default()),
                        )
                        .await;
                    }
                }
                Ok(())
            }
            Undo::StopBurst(burst) => {
                burst.stop().await;
                Ok(())
            }
            Undo::Nothing => Ok(()),
        };
        if let Err(error) = result {
            eprintln!(
                "chaos: healing {} {}: {error:#}",
                window.kind, window.target
            );
        }
        window.healed_ms = self.ms();
        Some(window)
    }

    /// Starts `name` again on its ports, giving up on this try after [`RESTART_TRY`].
    async fn try_restart(&mut self, name: &str) -> anyhow::Result<()> {
        let Some(service) = self.process(name) else {
            return Ok(());
        };
        tokio::time::timeout(RESTART_TRY, service.restart())
            .await
            .map_err(|_| anyhow::anyhow!("not ready within {RESTART_TRY:?}"))?
    }

    /// Tries once more to start every service still down after its fault; the windows of
    /// those that started (healed now).
    pub async fn retry_pending(&mut self) -> Vec<FaultWindow> {
        let mut healed = Vec::new();
        for (name, mut window) in std::mem::take(&mut self.pending) {
            match self.try_restart(&name).await {
                Ok(()) => {
                    window.healed_ms = self.ms();
                    report("healed", &window, window.healed_ms);
                    healed.push(window);
                }
                Err(_) => self.pending.push((name, window)),
            }
        }
        healed
    }

    /// Whether a service is still down after its fault.
    pub fn restarts_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}

/// One try at starting a service again: a ledger that cannot reach Postgres does not
/// become ready, and the nemesis must go on healing meanwhile.
const RESTART_TRY: Duration = Duration::from_secs(8);

/// Postgres processes frozen now: sent SIGCONT when this is dropped — a run stopped early
/// (Ctrl-C, an error) must not leave Postgres frozen, or removing it would wait for good.
#[derive(Debug, Default)]
struct Thaw(BTreeSet<u32>);

impl Drop for Thaw {
    fn drop(&mut self) {
        let pids: Vec<u32> = std::mem::take(&mut self.0).into_iter().collect();
        let _ = kill("CONT", &pids);
    }
}

/// Runs `schedule` on `lab` from `start`, then heals whatever is still in force; the fault
/// windows in the order they began, and the faults that could not be made (with why).
pub async fn run(lab: &mut Lab, schedule: &[Planned]) -> (Vec<FaultWindow>, Vec<String>) {
    let mut windows = Vec::new();
    let mut skipped = Vec::new();
    let mut active: Vec<(Instant, Active)> = Vec::new();
    let start = lab.start;
    for planned in schedule {
        let at = start + planned.at;
        heal_due(lab, &mut active, &mut windows, at).await;
        tokio::time::sleep_until(at).await;
        if planned.kind.on_postgres() {
            // One Postgres fault at a time, on a formation that has settled since the last
            // (waited for up to 30 s, healing the other faults on time meanwhile).
            let waited = Instant::now();
            while active.iter().any(|(_, a)| a.kind.on_postgres()) || !lab.formation_settled() {
                if waited.elapsed() > Duration::from_secs(30) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
                heal_due(lab, &mut active, &mut windows, Instant::now()).await;
            }
            if active.iter().any(|(_, a)| a.kind.on_postgres()) || !lab.formation_settled() {
                let why = format!(
                    "{} at {:.1} s: another Postgres fault, or the formation not settled after 30 s",
                    planned.kind.name(),
                    planned.at.as_secs_f64()
                );
                eprintln!("chaos: skipped {why}");
                skipped.push(why);
                continue;
            }
        }
        match lab.apply(planned.kind).await {
            Ok(fault) => {
                report("began", &fault.window, lab.ms());
                active.push((Instant::now() + planned.length, fault));
            }
            Err(error) => {
                let why = format!(
                    "{} at {:.1} s: {error:#}",
                    planned.kind.name(),
                    planned.at.as_secs_f64()
                );
                eprintln!("chaos: skipped {why}");
                skipped.push(why);
            }
        }
    }
    heal_due(
        lab,
        &mut active,
        &mut windows,
        Instant::now() + Duration::from_secs(3600),
    )
    .await;
    // Every service up again before the load stops (two minutes at most).
    let waited = Instant::now();
    while lab.restarts_pending() && waited.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        windows.extend(lab.retry_pending().await);
    }
    for (name, mut window) in std::mem::take(&mut lab.pending) {
        eprintln!("chaos: {name} did not start again within two minutes of its fault's end");
        window.healed_ms = lab.ms();
        windows.push(window);
    }
    windows.sort_by(|a, b| a.began_ms.total_cmp(&b.began_ms));
    (windows, skipped)
}

/// Heals every fault in `active` due by `by`, each at its time.
async fn heal_due(
    lab: &mut Lab,
    active: &mut Vec<(Instant, Active)>,
    windows: &mut Vec<FaultWindow>,
    by: Instant,
) {
    loop {
        active.sort_by_key(|(due, _)| *due);
        match active.first() {
            Some((due, _)) if *due <= by => {
                let (due, fault) = active.remove(0);
                tokio::time::sleep_until(due).await;
                if let Some(window) = lab.heal(fault).await {
                    report("healed", &window, lab.ms());
                    windows.push(window);
                }
            }
            _ => break,
        }
    }
    windows.extend(lab.retry_pending().await);
}

fn report(what: &str, window: &FaultWindow, now_ms: f64) {
    eprintln!(
        "chaos: {:>7.1} s  {what:<6} {} {}",
        now_ms / 1000.0,
        window.kind,
        window.target
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pacing() -> Pacing {
        Pacing {
            warmup: Duration::from_secs(3),
            shortest: Duration::from_secs(1),
            longest: Duration::from_secs(5),
            shortest_gap: Duration::from_secs(2),
            longest_gap: Duration::from_secs(4),
            composite: 0.3,
        }
    }

    #[test]
    fn a_seed_makes_one_schedule() {
        let kinds = FaultKind::ALL;
        let run = Duration::from_secs(120);
        assert_eq!(
            plan(7, &kinds, run, pacing()),
            plan(7, &kinds, run, pacing())
        );
        assert_ne!(
            plan(7, &kinds, run, pacing()),
            plan(8, &kinds, run, pacing())
        );
    }

    #[test]
    fn two_minutes_meet_every_kind_and_end_in_time() {
        let kinds = FaultKind::ALL;
        let run = Duration::from_secs(120);
        for seed in 0..50 {
            let schedule = plan(seed, &kinds, run, pacing());
            let met: BTreeSet<FaultKind> = schedule.iter().map(|p| p.kind).collect();
            assert_eq!(met.len(), kinds.len(), "seed {seed}: {schedule:?}");
            for fault in &schedule {
                assert!(fault.at >= pacing().warmup);
                assert!(fault.at + fault.length + pacing().shortest_gap <= run);
            }
            for pair in schedule.windows(2) {
                if pair[0].at == pair[1].at {
                    assert!(!(pair[0].kind.on_postgres() && pair[1].kind.on_postgres()));
                }
            }
        }
    }

    #[test]
    fn names_match_the_command_line() {
        use clap::ValueEnum;
        for kind in FaultKind::ALL {
            let value = kind.to_possible_value().expect("every kind has a name");
            assert_eq!(value.get_name(), kind.name());
        }
    }
}
