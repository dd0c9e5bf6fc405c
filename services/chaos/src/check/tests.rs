//! Tests of [`super`]: `check`.

use super::*;
use crate::history::FaultWindow;

fn charge_op(id: u64, key: &str, amount: i64, outcome: Outcome, phase: Phase) -> Op {
    Op {
        id,
        worker: 0,
        request: Request::Charge {
            account: "acct".into(),
            key: key.into(),
            amount_cents: amount,
            mode: None,
        },
        invoked_ms: id as f64 * 10.0,
        completed_ms: id as f64 * 10.0 + 5.0,
        deadline_ms: 5_000,
        outcome,
        phase,
    }
}

fn charged(id: &str, amount: i64, balance: i64) -> Outcome {
    Outcome::Charged {
        charge_id: id.into(),
        amount_cents: amount,
        balance_cents: balance,
        replayed: false,
    }
}

fn failed(code: &str) -> Outcome {
    Outcome::Failed {
        code: code.into(),
        message: "…".into(),
    }
}

fn row(id: &str, key: &str, amount: i64, balance: i64) -> ChargeRow {
    ChargeRow {
        charge_id: id.into(),
        account: "acct".into(),
        key: key.into(),
        amount_cents: amount,
        balance_cents: balance,
    }
}

/// Two keys charged once each, one of them re-sent (replayed), everything consistent.
fn good() -> (History, Observed) {
    let history = History {
        ops: vec![
            charge_op(1, "k1", 100, charged("c1", 100, 100), Phase::Load),
            charge_op(2, "k2", 50, failed("UNAVAILABLE"), Phase::Load),
            charge_op(3, "k1", 100, charged("c1", 100, 100), Phase::Load),
            charge_op(4, "k2", 50, charged("c2", 50, 150), Phase::Settle),
        ],
        faults: vec![FaultWindow {
            kind: "kill".into(),
            target: "hop3".into(),
            began_ms: 0.0,
            healed_ms: 10.0,
            silences_edge: false,
        }],
        load_ended_ms: 35.0,
    };
    let observed = Observed {
        charges: vec![row("c1", "k1", 100, 100), row("c2", "k2", 50, 150)],
        accounts: vec![AccountRow {
            account: "acct".into(),
            balance_cents: 150,
            charges: 2,
        }],
        processor: vec![
            ProcessorRow {
                processor_key: processor_key("acct", "k1"),
                amount_cents: 100,
                calls: 1,
            },
            ProcessorRow {
                processor_key: processor_key("acct", "k2"),
                amount_cents: 50,
                calls: 2,
            },
        ],
        processor_conflicts: 0,
    };
    (history, observed)
}

fn kinds(verdict: &Verdict) -> Vec<(&str, Vec<String>)> {
    verdict
        .violations
        .iter()
        .map(|v| (v.kind.as_str(), v.keys.clone()))
        .collect()
}

#[test]
fn a_consistent_history_is_valid() {
    let (history, observed) = good();
    let verdict = check(&history, &observed, Bounds::default());
    assert!(verdict.valid, "{:?}", verdict.violations);
    assert_eq!(verdict.summary.acknowledged, 2);
    assert_eq!(verdict.summary.keys, 2);
}

#[test]
fn a_double_charge_is_reported_with_its_key() {
    let (history, mut observed) = good();
    observed.charges.push(row("c3", "k1", 100, 250));
    observed.accounts[0].balance_cents = 250;
    observed.accounts[0].charges = 3;
    let verdict = check(&history, &observed, Bounds::default());
    assert!(!verdict.valid);
    assert!(kinds(&verdict).contains(&("double_charge", vec!["acct/k1".into()])));
}

#[test]
fn a_lost_acknowledged_charge_is_reported_with_its_key() {
    let (history, mut observed) = good();
    observed.charges.retain(|r| r.key != "k1");
    observed.accounts[0].balance_cents = 50;
    observed.accounts[0].charges = 1;
    let verdict = check(&history, &observed, Bounds::default());
    assert!(kinds(&verdict).contains(&("lost_acknowledged", vec!["acct/k1".into()])));
}

#[test]
fn a_replay_that_differs_is_reported_with_its_key() {
    let (mut history, observed) = good();
    history.ops[2].outcome = charged("c9", 100, 100);
    let verdict = check(&history, &observed, Bounds::default());
    assert!(kinds(&verdict).contains(&("replay_differs", vec!["acct/k1".into()])));
}

#[test]
fn a_balance_off_by_one_is_reported_with_its_account() {
    let (history, mut observed) = good();
    observed.accounts[0].balance_cents = 151;
    let verdict = check(&history, &observed, Bounds::default());
    assert_eq!(
        kinds(&verdict),
        vec![("balance_off", vec!["acct".to_owned()])]
    );
}

#[test]
fn a_processor_key_with_two_amounts_is_reported_with_its_key() {
    let (history, mut observed) = good();
    observed.processor[1].amount_cents = 51;
    let verdict = check(&history, &observed, Bounds::default());
    assert_eq!(
        kinds(&verdict),
        vec![("processor_parameters", vec!["acct/k2".to_owned()])]
    );
    let (history, mut observed) = good();
    observed.processor_conflicts = 1;
    assert!(!check(&history, &observed, Bounds::default()).valid);
}

#[test]
fn bad_codes_late_failures_unsettled_keys_and_slow_recoveries_are_reported() {
    let (mut history, observed) = good();
    history.ops[1].outcome = failed("INTERNAL");
    history.ops[1].completed_ms = history.ops[1].invoked_ms + 7_000.0;
    let verdict = check(&history, &observed, Bounds::default());
    let found = kinds(&verdict);
    assert!(
        found.contains(&("bad_code", vec!["acct/k2".into()])),
        "{found:?}"
    );
    assert!(
        found.contains(&("late_failure", vec!["acct/k2".into()])),
        "{found:?}"
    );

    let (mut history, observed) = good();
    history.ops.pop(); // k2 never settled
    let mut observed = observed;
    observed.charges.pop();
    observed.accounts[0].balance_cents = 100;
    observed.accounts[0].charges = 1;
    let found_unsettled = check(&history, &observed, Bounds::default());
    assert!(kinds(&found_unsettled).contains(&("unsettled", vec!["acct/k2".into()])));

    let (mut history, observed) = good();
    history.faults[0].healed_ms = 100.0; // no success after it
    let verdict = check(
        &history,
        &observed,
        Bounds {
            recovery_ms: 20.0,
            ..Bounds::default()
        },
    );
    assert!(kinds(&verdict).contains(&("not_recovered", vec!["kill hop3".into()])));
}

/// A DEADLINE_EXCEEDED seconds before the caller's 5 s deadline (an attempt's timeout
/// told as the call's) is a violation of its own; one at the deadline, or a few ms
/// before it as the edge answers by design, is not.
#[test]
fn deadline_exceeded_well_before_the_deadline_is_reported() {
    let (mut history, observed) = good();
    history.ops[1].outcome = failed("DEADLINE_EXCEEDED");
    history.ops[1].completed_ms = history.ops[1].invoked_ms + 930.0;
    let verdict = check(&history, &observed, Bounds::default());
    let found = kinds(&verdict);
    assert!(
        found.contains(&("early_deadline_exceeded", vec!["acct/k2".into()])),
        "{found:?}"
    );
    assert!(!found.iter().any(|(kind, _)| *kind == "late_failure"));

    for took in [5_000.0 - 20.0, 5_000.0, 5_000.0 + 50.0] {
        let (mut history, observed) = good();
        history.ops[1].outcome = failed("DEADLINE_EXCEEDED");
        history.ops[1].completed_ms = history.ops[1].invoked_ms + took;
        let verdict = check(&history, &observed, Bounds::default());
        let found = kinds(&verdict);
        assert!(
            !found
                .iter()
                .any(|(kind, _)| *kind == "early_deadline_exceeded"),
            "after {took} ms: {found:?}"
        );
    }
}

#[test]
fn a_charge_nobody_asked_for_and_changed_parameters_are_reported() {
    let (mut history, mut observed) = good();
    observed.charges.push(ChargeRow {
        charge_id: "c7".into(),
        account: "other".into(),
        key: "k7".into(),
        amount_cents: 5,
        balance_cents: 5,
    });
    observed.accounts.push(AccountRow {
        account: "other".into(),
        balance_cents: 5,
        charges: 1,
    });
    history.ops[2].outcome = charged("c1", 101, 100);
    let verdict = check(&history, &observed, Bounds::default());
    let found = kinds(&verdict);
    assert!(
        found.contains(&("unexpected_charge", vec!["other/k7".into()])),
        "{found:?}"
    );
    assert!(
        found.contains(&("parameters_changed", vec!["acct/k1".into()])),
        "{found:?}"
    );
}

#[test]
fn silence_and_lateness_are_allowed_only_while_the_edge_is_silenced() {
    let (mut history, observed) = good();
    history.ops[1].outcome = Outcome::Unanswered;
    history.ops[1].completed_ms = history.ops[1].invoked_ms + 7_000.0;
    let verdict = check(&history, &observed, Bounds::default());
    let found = kinds(&verdict);
    assert!(
        found.contains(&("unanswered", vec!["acct/k2".into()])),
        "{found:?}"
    );

    // The edge frozen from 0 to 25 ms, while op 2 (sent at 20 ms) waited.
    history.faults[0].silences_edge = true;
    history.faults[0].healed_ms = 25.0;
    let verdict = check(&history, &observed, Bounds::default());
    assert!(verdict.valid, "{:?}", verdict.violations);
    assert_eq!(verdict.summary.codes.get("NO_ANSWER"), Some(&1));

    // A connection broken under the call: reported, unless the edge was down.
    let (mut history, observed) = good();
    history.ops[1].outcome = Outcome::ConnectionLost {
        detail: "UNKNOWN: transport error".into(),
    };
    let verdict = check(&history, &observed, Bounds::default());
    let found = kinds(&verdict);
    assert!(
        found.contains(&("connection_lost", vec!["acct/k2".into()])),
        "{found:?}"
    );
    history.faults[0].silences_edge = true;
    history.faults[0].healed_ms = 25.0;
    let verdict = check(&history, &observed, Bounds::default());
    assert!(verdict.valid, "{:?}", verdict.violations);

    // Late, with the edge silenced only before the call was made: reported.
    let (mut history, observed) = good();
    history.faults[0].silences_edge = true;
    history.faults[0].healed_ms = 1.0;
    history.ops[1].outcome = failed("UNAVAILABLE");
    history.ops[1].completed_ms = history.ops[1].invoked_ms + 7_000.0;
    let verdict = check(&history, &observed, Bounds::default());
    let found = kinds(&verdict);
    assert!(
        found.contains(&("late_failure", vec!["acct/k2".into()])),
        "{found:?}"
    );
}

#[test]
fn a_composite_fault_is_recovered_from_when_its_last_part_heals() {
    let (mut history, observed) = good();
    // A second fault overlapping the first, healed at 40 ms: both are measured from
    // then, to the first success after it (op 4, at 45 ms).
    history.faults.push(FaultWindow {
        kind: "partition".into(),
        target: "hop2 → hop3".into(),
        began_ms: 5.0,
        healed_ms: 40.0,
        silences_edge: false,
    });
    let verdict = check(
        &history,
        &observed,
        Bounds {
            recovery_ms: 30.0,
            ..Bounds::default()
        },
    );
    assert!(verdict.valid, "{:?}", verdict.violations);
    assert_eq!(verdict.summary.longest_recovery_ms, 5.0);
}
