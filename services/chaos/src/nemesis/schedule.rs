//! The schedule: which faults, when and for how long, drawn from a seed.

use std::time::Duration;

use rand::{RngExt, SeedableRng, rngs::SmallRng, seq::SliceRandom};
use serde::{Deserialize, Serialize};

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
    pub(super) fn on_postgres(self) -> bool {
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
