use std::collections::BTreeSet;

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
