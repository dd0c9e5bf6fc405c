//! The checker: from the history and a read of the database alone, whether every guarantee
//! held. A pure function ([`check`]), so it is tested against histories broken on purpose.
//!
//! | guarantee | violation | from |
//! |---|---|---|
//! | every acknowledged charge exists, once, as acknowledged | `lost_acknowledged` | OK replies against the `charges` rows |
//! | no key is charged twice | `double_charge` | `charges` grouped by key |
//! | every reply for a key is the same reply | `replay_differs` | the OK replies of each key |
//! | a key keeps the parameters of its first request | `parameters_changed` | an OK reply with another amount |
//! | balances equal the sum of their charges | `balance_off` | `accounts` against `charges` |
//! | the processor saw each key with one set of parameters | `processor_parameters` | `processor_charges` against the keys; the ledgers' `processor_conflicts` |
//! | nothing was charged that nobody asked for | `unexpected_charge` | `charges` rows under keys not in the history |
//! | every key settled once the faults were healed | `unsettled` | the settle phase |
//! | no call answered INTERNAL, UNKNOWN or CANCELLED | `bad_code` | every failure |
//! | no failure answered later than its deadline | `late_failure` | every failure's time (unless a fault silenced the edge meanwhile) |
//! | DEADLINE_EXCEEDED only once the caller's deadline has (all but) passed | `early_deadline_exceeded` | every DEADLINE_EXCEEDED's time: an attempt's timeout told as the call's deadline |
//! | the connection to the edge held | `connection_lost` | calls whose connection broke (allowed only while a fault silenced the edge) |
//! | every call answered | `unanswered` | calls the client gave up on (allowed only while a fault silenced the edge) |
//! | every fault's effect ended within a stated time of its healing | `not_recovered` | the first success after each healing |

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use crate::history::{History, Op, Outcome, Phase, Request, processor_key};

/// A `charges` row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChargeRow {
    /// Its id.
    pub charge_id: String,
    /// The account.
    pub account: String,
    /// The key it was made under.
    pub key: String,
    /// The amount.
    pub amount_cents: i64,
    /// The balance right after it.
    pub balance_cents: i64,
}

/// An `accounts` row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountRow {
    /// The account.
    pub account: String,
    /// Its balance.
    pub balance_cents: i64,
    /// Its number of charges.
    pub charges: i64,
}

/// A `processor_charges` row: the processor's own record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessorRow {
    /// The processor key.
    pub processor_key: String,
    /// The amount it was first charged with.
    pub amount_cents: i64,
    /// How often it was called.
    pub calls: i64,
}

/// What the database (and the ledgers' counters) held after the run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observed {
    /// Every charge.
    pub charges: Vec<ChargeRow>,
    /// Every account.
    pub accounts: Vec<AccountRow>,
    /// The processor's record.
    pub processor: Vec<ProcessorRow>,
    /// Processor calls refused because their key came with other parameters, summed over
    /// the ledgers (their Control stats).
    pub processor_conflicts: u64,
}

/// How long the checker allows.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Bounds {
    /// A failure may complete this much after its deadline (the client's own scheduling).
    pub deadline_slack_ms: f64,
    /// A DEADLINE_EXCEEDED may come this much before the caller's deadline: the edge
    /// answers a little early by design (its reserve, and a retry that would start with
    /// less than the shortest attempt), never seconds early.
    pub deadline_early_ms: f64,
    /// A fault's effect must have ended — a call answered OK — within this long of its
    /// healing.
    pub recovery_ms: f64,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            deadline_slack_ms: 1_000.0,
            deadline_early_ms: 250.0,
            recovery_ms: 15_000.0,
        }
    }
}

/// One guarantee broken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// Which (see the module docs' table).
    pub kind: String,
    /// The keys involved (`account/key`), or the fault.
    pub keys: Vec<String>,
    /// What was seen.
    pub detail: String,
}

/// The checker's figures beside its verdict.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Operations in all, and during the load.
    pub operations: usize,
    /// …
    pub load_operations: usize,
    /// Charges answered OK during the load, and failed.
    pub acknowledged: usize,
    /// …
    pub failed: usize,
    /// Distinct keys sent.
    pub keys: usize,
    /// Charges in the database.
    pub charges: usize,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, usize>,
    /// Failures by code.
    pub codes: BTreeMap<String, usize>,
    /// The slowest failure, ms.
    pub worst_failure_ms: f64,
    /// The longest time from a healing to the next success, ms.
    pub longest_recovery_ms: f64,
}

/// The verdict: valid when no guarantee was broken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// Every guarantee held.
    pub valid: bool,
    /// What broke, if anything.
    pub violations: Vec<Violation>,
    /// The figures.
    pub summary: Summary,
}

/// `account/key`, as violations name keys.
fn name(account: &str, key: &str) -> String {
    format!("{account}/{key}")
}

/// Decides from `history` and `observed` whether every guarantee held; see the module docs.
pub fn check(history: &History, observed: &Observed, bounds: Bounds) -> Verdict {
    let mut violations = Vec::new();
    let mut add = |kind: &str, keys: Vec<String>, detail: String| {
        violations.push(Violation {
            kind: kind.to_owned(),
            keys,
            detail,
        });
    };

    // The first request of each key fixes its parameters.
    let mut first_amount: HashMap<(&str, &str), i64> = HashMap::new();
    let mut replies: HashMap<(&str, &str), Vec<&Op>> = HashMap::new();
    let mut settled: BTreeSet<(&str, &str)> = BTreeSet::new();
    for op in &history.ops {
        if let Request::Charge {
            account,
            key,
            amount_cents,
            ..
        } = &op.request
        {
            first_amount.entry((account, key)).or_insert(*amount_cents);
            if op.outcome.ok() {
                replies.entry((account, key)).or_default().push(op);
                settled.insert((account, key));
            }
        }
    }

    // The database's charges, by key.
    let mut charges_by_key: HashMap<(&str, &str), Vec<&crate::check::ChargeRow>> = HashMap::new();
    for row in &observed.charges {
        charges_by_key
            .entry((&row.account, &row.key))
            .or_default()
            .push(row);
    }
    for ((account, key), rows) in &charges_by_key {
        if rows.len() > 1 {
            add(
                "double_charge",
                vec![name(account, key)],
                format!(
                    "{} charges under one key: {}",
                    rows.len(),
                    rows.iter()
                        .map(|r| r.charge_id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        }
        if !first_amount.contains_key(&(*account, *key)) {
            add(
                "unexpected_charge",
                vec![name(account, key)],
                "a charge under a key no operation sent".to_owned(),
            );
        }
    }

    // Every acknowledged charge is there, as acknowledged; every reply is the same reply;
    // a key keeps its first parameters.
    for ((account, key), ops) in &replies {
        let first = first_amount[&(*account, *key)];
        let mut ids = BTreeSet::new();
        let mut balances = BTreeSet::new();
        for op in ops {
            let Outcome::Charged {
                charge_id,
                amount_cents,
                balance_cents,
                ..
            } = &op.outcome
            else {
                continue;
            };
            ids.insert(charge_id.as_str());
            balances.insert(*balance_cents);
            let asked = match &op.request {
                Request::Charge { amount_cents, .. } => *amount_cents,
                Request::Read { .. } => first,
            };
            if *amount_cents != first || asked != first {
                add(
                    "parameters_changed",
                    vec![name(account, key)],
                    format!(
                        "first sent with {first}; op {} asked {asked} and was answered OK for {amount_cents}",
                        op.id
                    ),
                );
            }
            let stored = charges_by_key.get(&(*account, *key));
            if !stored.is_some_and(|rows| rows.iter().any(|r| r.charge_id == *charge_id)) {
                add(
                    "lost_acknowledged",
                    vec![name(account, key)],
                    format!(
                        "op {} was answered OK with charge {charge_id}, which the database does not hold{}",
                        op.id,
                        match stored {
                            Some(rows) => format!(" (it holds {})", rows[0].charge_id),
                            None => " (no charge at all under the key)".to_owned(),
                        }
                    ),
                );
            }
        }
        if ids.len() > 1 || balances.len() > 1 {
            add(
                "replay_differs",
                vec![name(account, key)],
                format!("replies disagree: charge ids {ids:?}, balances {balances:?}"),
            );
        }
    }

    // Balances equal the sum of their charges.
    let mut sums: HashMap<&str, (i64, i64)> = HashMap::new();
    for row in &observed.charges {
        let sum = sums.entry(&row.account).or_default();
        sum.0 += row.amount_cents;
        sum.1 += 1;
    }
    for account in &observed.accounts {
        let (sum, count) = sums
            .get(account.account.as_str())
            .copied()
            .unwrap_or_default();
        if account.balance_cents != sum || account.charges != count {
            add(
                "balance_off",
                vec![account.account.clone()],
                format!(
                    "balance {} and {} charges, against {sum} in {count} charge rows",
                    account.balance_cents, account.charges
                ),
            );
        }
    }

    // The processor saw each key with one set of parameters.
    let processor: HashMap<&str, &ProcessorRow> = observed
        .processor
        .iter()
        .map(|row| (row.processor_key.as_str(), row))
        .collect();
    for ((account, key), first) in &first_amount {
        if let Some(row) = processor.get(processor_key(account, key).as_str())
            && row.amount_cents != *first
        {
            add(
                "processor_parameters",
                vec![name(account, key)],
                format!(
                    "the processor was charged {} under the key, first sent with {first}",
                    row.amount_cents
                ),
            );
        }
    }
    if observed.processor_conflicts > 0 {
        add(
            "processor_parameters",
            Vec::new(),
            format!(
                "the processor refused {} calls whose key came with other parameters",
                observed.processor_conflicts
            ),
        );
    }

    // Every key settled once the faults were healed.
    let unsettled: Vec<String> = first_amount
        .keys()
        .filter(|k| !settled.contains(*k))
        .map(|(account, key)| name(account, key))
        .collect();
    if !unsettled.is_empty() {
        add(
            "unsettled",
            unsettled.clone(),
            format!(
                "{} keys never answered OK, even after healing",
                unsettled.len()
            ),
        );
    }

    // Codes and times of the failures. A call may go unanswered, or be answered after its
    // deadline, only while a fault silenced the edge itself: below the edge, every tier's
    // deadline is the edge's to enforce.
    let edge_silenced = |op: &Op| {
        history
            .faults
            .iter()
            .any(|f| f.silences_edge && f.overlaps(op.invoked_ms, op.completed_ms))
    };
    let mut codes: BTreeMap<String, usize> = BTreeMap::new();
    let mut worst_failure_ms: f64 = 0.0;
    for op in &history.ops {
        if op.outcome.ok() {
            continue;
        }
        *codes.entry(op.outcome.code().to_owned()).or_default() += 1;
        if let Outcome::ConnectionLost { detail } = &op.outcome {
            if !edge_silenced(op) {
                add(
                    "connection_lost",
                    op_keys(op),
                    format!(
                        "op {}: the connection to the edge broke ({detail}) and nothing silenced the edge",
                        op.id
                    ),
                );
            }
            continue;
        }
        if op.outcome == Outcome::Unanswered {
            if !edge_silenced(op) {
                add(
                    "unanswered",
                    op_keys(op),
                    format!(
                        "op {} had no answer {:.0} ms after it was sent, its deadline {} ms, and nothing silenced the edge",
                        op.id,
                        op.took_ms(),
                        op.deadline_ms
                    ),
                );
            }
            continue;
        }
        worst_failure_ms = worst_failure_ms.max(op.took_ms());
        if matches!(op.outcome.code(), "INTERNAL" | "UNKNOWN" | "CANCELLED") {
            add(
                "bad_code",
                op_keys(op),
                format!(
                    "op {} answered {}: {}",
                    op.id,
                    op.outcome.code(),
                    message(op)
                ),
            );
        }
        if op.outcome.code() == "DEADLINE_EXCEEDED"
            && op.took_ms() < op.deadline_ms as f64 - bounds.deadline_early_ms
        {
            add(
                "early_deadline_exceeded",
                op_keys(op),
                format!(
                    "op {} answered DEADLINE_EXCEEDED after {:.0} ms of its {} ms deadline: {}",
                    op.id,
                    op.took_ms(),
                    op.deadline_ms,
                    message(op)
                ),
            );
        }
        if op.took_ms() > op.deadline_ms as f64 + bounds.deadline_slack_ms && !edge_silenced(op) {
            add(
                "late_failure",
                op_keys(op),
                format!(
                    "op {} failed after {:.0} ms, its deadline {} ms",
                    op.id,
                    op.took_ms(),
                    op.deadline_ms
                ),
            );
        }
    }

    // Every fault's effect ended: a success within the bound of its healing — or of the
    // healing of the last fault in force with it (a composite fault ends when all of it
    // does).
    let mut longest_recovery_ms: f64 = 0.0;
    for fault in &history.faults {
        let mut healed_ms = fault.healed_ms;
        loop {
            let later = history
                .faults
                .iter()
                .filter(|other| other.overlaps(fault.began_ms, healed_ms))
                .map(|other| other.healed_ms)
                .fold(healed_ms, f64::max);
            if later == healed_ms {
                break;
            }
            healed_ms = later;
        }
        let next_success = history
            .ops
            .iter()
            .filter(|op| op.outcome.ok() && op.completed_ms >= healed_ms)
            .map(|op| op.completed_ms)
            .fold(f64::INFINITY, f64::min);
        let recovery = next_success - healed_ms;
        if recovery.is_finite() {
            longest_recovery_ms = longest_recovery_ms.max(recovery);
        }
        // No success at all (infinite) counts as not recovered.
        if recovery.is_nan() || recovery > bounds.recovery_ms {
            add(
                "not_recovered",
                vec![format!("{} {}", fault.kind, fault.target)],
                format!(
                    "no call answered OK within {:.0} ms of healing it (at {:.0} ms)",
                    bounds.recovery_ms, healed_ms
                ),
            );
        }
    }

    let mut faults: BTreeMap<String, usize> = BTreeMap::new();
    for fault in &history.faults {
        *faults.entry(fault.kind.clone()).or_default() += 1;
    }
    let load: Vec<&Op> = history
        .ops
        .iter()
        .filter(|op| op.phase == Phase::Load)
        .collect();
    let summary = Summary {
        operations: history.ops.len(),
        load_operations: load.len(),
        acknowledged: load
            .iter()
            .filter(|op| matches!(op.outcome, Outcome::Charged { .. }))
            .count(),
        failed: load.iter().filter(|op| !op.outcome.ok()).count(),
        keys: first_amount.len(),
        charges: observed.charges.len(),
        faults,
        codes,
        worst_failure_ms,
        longest_recovery_ms,
    };
    Verdict {
        valid: violations.is_empty(),
        violations,
        summary,
    }
}

fn op_keys(op: &Op) -> Vec<String> {
    match &op.request {
        Request::Charge { account, key, .. } => vec![name(account, key)],
        Request::Read { account } => vec![account.clone()],
    }
}

fn message(op: &Op) -> &str {
    match &op.outcome {
        Outcome::Failed { message, .. } => message,
        _ => "",
    }
}

#[cfg(test)]
mod tests;
