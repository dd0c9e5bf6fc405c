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
