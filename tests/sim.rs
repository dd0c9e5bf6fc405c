//! `retrychain sim --json`: the design notes' figures, reproduced on our own code.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::process::Command;

fn within(value: f64, expected: f64, tolerance: f64) -> bool {
    (value - expected).abs() <= expected * tolerance
}

#[test]
fn sim_reproduces_the_design_notes() {
    let output = Command::new(env!("CARGO_BIN_EXE_retrychain"))
        .args(["sim", "--json"])
        .output()
        .expect("run retrychain sim");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON object");

    assert_eq!(report["layered"], serde_json::json!([3, 9, 27, 81, 243]));

    let storm = &report["storm"];
    assert_eq!(storm["none"]["calls"], 5050.0);
    assert_eq!(storm["exponential"]["calls"], 5050.0);
    for (policy, notes) in [("full", 643.0), ("equal", 657.0), ("decorrelated", 576.0)] {
        let calls = storm[policy]["calls"].as_f64().expect("calls");
        assert!(
            within(calls, notes, 0.15),
            "{policy}: {calls} calls, notes {notes}"
        );
        assert!(
            storm[policy]["ticks"].as_f64().expect("ticks") > 100.0,
            "{policy}"
        );
    }

    let outage = &report["outage"];
    assert_eq!(outage["no_budget"]["first"], 6000);
    assert_eq!(outage["no_budget"]["backend"], 24000);
    assert_eq!(outage["no_budget"]["load"], 4.0);
    let backend = outage["budget"]["backend"].as_u64().expect("backend");
    assert_eq!(backend, 6609);
    let load = outage["budget"]["load"].as_f64().expect("load");
    assert!(within(load, 1.10, 0.01), "{load}");
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
