//! The lab: the chain under test, and how each fault is made in it and healed.

use std::{collections::BTreeSet, process::Command, time::Duration};

use anyhow::Context;
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use retrychain_harness::{ChildService, LocalChain, NAMES, OwnDatabase};
use retrychain_proto::v1::{Faults, control_client::ControlClient};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use super::schedule::FaultKind;
use crate::{
    history::FaultWindow,
    net::{Disturbance, Rules},
    workload::{Burst, Workload},
};

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
    pub(super) kind: FaultKind,
    /// What it is, for the history.
    pub(super) window: FaultWindow,
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
    pub(super) pending: Vec<(String, FaultWindow)>,
    /// When the run started.
    pub(super) start: Instant,
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

    pub(super) fn ms(&self) -> f64 {
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
    pub(super) fn formation_settled(&self) -> bool {
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

/// Prints a fault's beginning or end, at `now_ms` into the run.
pub(super) fn report(what: &str, window: &FaultWindow, now_ms: f64) {
    eprintln!(
        "chaos: {:>7.1} s  {what:<6} {} {}",
        now_ms / 1000.0,
        window.kind,
        window.target
    );
}
