//! `retrychain sim`: the design notes' figures, reproduced on our own backoff and budget
//! code — the typed report, and the table the command prints beside the notes'.

use std::process::Command;

use retrychain_experiments::sim;

fn within(value: f64, expected: f64, tolerance: f64) -> bool {
    (value - expected).abs() <= expected * tolerance
}

#[test]
fn sim_reproduces_the_design_notes() {
    let report = sim::run(sim::DEFAULT_SEEDS).unwrap();

    assert_eq!(report.layered, [3, 9, 27, 81, 243]);

    let storm = &report.storm;
    assert_eq!(storm.none.calls, 5050.0);
    assert_eq!(storm.exponential.calls, 5050.0);
    for (policy, result, notes) in [
        ("full", storm.full, 643.0),
        ("equal", storm.equal, 657.0),
        ("decorrelated", storm.decorrelated, 576.0),
    ] {
        assert!(
            within(result.calls, notes, 0.15),
            "{policy}: {} calls, notes {notes}",
            result.calls
        );
        assert!(result.ticks > 100.0, "{policy}");
    }

    let outage = &report.outage;
    assert_eq!(
        (outage.no_budget.first, outage.no_budget.backend),
        (6000, 24000)
    );
    assert_eq!(outage.no_budget.load, 4.0);
    assert_eq!(outage.budget.backend, 6609);
    assert!(
        within(outage.budget.load, 1.10, 0.01),
        "{}",
        outage.budget.load
    );

    // The three throttles through the same outage, on the real engine: the budget and
    // A6 cap retries (about 1.1x and 1.0x) and recover at once; adaptive throttling sheds
    // the first attempts too (the backend gets almost nothing) and pays with the seconds
    // it takes to open again.
    let t = &report.throttles;
    assert_eq!((t.none.backend, t.none.load), (24_000, 4.0));
    assert_eq!(t.budget.backend, 6609);
    assert!(
        (6000..=6010).contains(&t.a6.backend),
        "A6: {}",
        t.a6.backend
    );
    for run in [t.none, t.budget, t.a6] {
        assert_eq!(
            (run.rejected_locally, run.recovery_s, run.failed_after),
            (0, 0.0, 0)
        );
    }
    assert!(t.adaptive.backend < 100, "adaptive: {}", t.adaptive.backend);
    // Seeded, so exact: the figures docs/replicas.md's table shows.
    assert_eq!(
        (
            t.adaptive.backend,
            t.adaptive.rejected_locally,
            t.adaptive.recovery_s,
            t.adaptive.failed_after
        ),
        (13, 5987, 52.0, 4660)
    );
    assert!(t.adaptive.rejected_locally > 5900);
    assert!(
        t.adaptive.recovery_s > 0.0 && t.adaptive.recovery_s < 120.0,
        "adaptive recovered after {} s",
        t.adaptive.recovery_s
    );
}

#[test]
fn sim_prints_the_notes_beside_our_figures() {
    let output = Command::new(env!("CARGO_BIN_EXE_retrychain"))
        .arg("sim")
        .output()
        .expect("run retrychain sim");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("adaptive K=2, 10 s"), "{text}");
    // The measured column, not only the notes': five layers made 243 bottom calls.
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["5", "243", "243"]),
        "{text}"
    );
    for expected in ["design notes", "243", "5050", "6609", "4.00x", "1.10x"] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}
