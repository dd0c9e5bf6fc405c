//! `retrychain chaos` as users run it: a real process starting its own chain. The checker
//! must catch a ledger broken on purpose, and a run stopped midway must leave no fault
//! behind. (Its seeded two-minute runs, which must hold, are `scripts/chaos-ci`, in CI.)

use std::{path::Path, process::Stdio, time::Duration};

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::Command,
    sync::Mutex,
};

use crate::support::{BIN, missing_tool};

/// One chaos run at a time: a run starts by removing every rule tagged as a chaos run's.
static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

fn chaos(args: &[&str], out: &Path) -> Command {
    let mut command = Command::new(BIN);
    command
        .arg("chaos")
        .args(args)
        .arg("--out")
        .arg(out)
        .env_remove("DATABASE_URL")
        .env_remove("RETRYCHAIN_CHAOS_EDGE")
        .kill_on_drop(true);
    command
}

fn iptables_rules() -> Option<String> {
    let output = std::process::Command::new("iptables")
        .args(["-w", "-S", retrychain_chaos::net::CHAIN])
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_catches_a_ledger_that_skips_the_key_claim() {
    let _one = ONE_AT_A_TIME.lock().await;
    let out = tempfile::tempdir().unwrap();
    let output = chaos(
        &[
            "--duration",
            "8s",
            "--replicas",
            "1",
            "--clients",
            "8",
            "--faults",
            "latency",
            "--seed",
            "11",
            "--break-ledger",
        ],
        out.path(),
    )
    .output()
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "a broken ledger passed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("GUARANTEES BROKEN"), "{stdout}\n{stderr}");

    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("verdict.json")).unwrap()).unwrap();
    let run = report["run"].as_str().unwrap();
    assert_eq!(report["verdict"]["valid"], false);
    let violations = report["verdict"]["violations"].as_array().unwrap();
    for kind in ["double_charge", "replay_differs"] {
        let found: Vec<&serde_json::Value> =
            violations.iter().filter(|v| v["kind"] == kind).collect();
        assert!(!found.is_empty(), "no {kind} in {violations:?}");
        // Each names its key, one of this run's.
        for violation in found {
            let keys = violation["keys"].as_array().unwrap();
            assert_eq!(keys.len(), 1, "{violation}");
            assert!(keys[0].as_str().unwrap().starts_with(run), "{violation}");
        }
    }
    let history: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("history.json")).unwrap()).unwrap();
    assert!(history["ops"].as_array().unwrap().len() > 100);
    let svg = std::fs::read_to_string(out.path().join("timeline.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("latency"),
        "{}",
        &svg[..200.min(svg.len())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stopped_midway_heals_its_partition_and_stops_its_chain() {
    let Some(before) = iptables_rules() else {
        missing_tool("iptables -S needs iptables and root: the partition's healing is not checked");
        return;
    };
    let _one = ONE_AT_A_TIME.lock().await;
    let out = tempfile::tempdir().unwrap();
    let mut run = chaos(
        &[
            "--duration",
            "2m",
            "--replicas",
            "1",
            "--clients",
            "2",
            "--faults",
            "partition",
            "--shortest-fault",
            "60s",
            "--longest-fault",
            "60s",
        ],
        out.path(),
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(run.stderr.take().unwrap()).lines();
    let mut said = String::new();
    let began = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            said.push_str(&line);
            said.push('\n');
            if line.contains("began  partition") {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(began, Ok(true), "no partition began:\n{said}");
    let during = iptables_rules().unwrap();
    let tagged = |rules: &str| {
        rules
            .lines()
            .filter(|l| l.contains("retrychain-chaos"))
            .count()
    };
    assert!(
        tagged(&during) > 0,
        "no rule in force during the partition:\n{during}"
    );
    // The ports of the partitioned tier, to see its processes gone afterwards.
    let ports: Vec<u16> = during
        .lines()
        .filter(|l| l.contains("retrychain-chaos"))
        .filter_map(|l| {
            l.split("--dport ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    // And the processes listening there: after the run a port of the ephemeral range can be
    // taken by another test's listener, which must not read as the run's service.
    let owners: Vec<u32> = ports.iter().flat_map(|&port| listeners(port)).collect();
    assert!(
        !owners.is_empty(),
        "no process found listening on the partitioned ports {ports:?}"
    );

    let pid = run.id().unwrap();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(60), run.wait())
        .await
        .expect("the run did not stop within 60 s of SIGTERM")
        .unwrap();
    assert!(!status.success());
    let mut rest = String::new();
    while let Ok(Some(line)) = lines.next_line().await {
        rest.push_str(&line);
        rest.push('\n');
    }
    assert!(rest.contains("terminated (SIGTERM)"), "{rest}");
    let after = iptables_rules().unwrap();
    assert_eq!(
        tagged(&after),
        tagged(&before),
        "rules left behind:\n{after}"
    );
    for port in ports {
        let still: Vec<u32> = listeners(port)
            .into_iter()
            .filter(|pid| owners.contains(pid))
            .collect();
        assert!(
            still.is_empty(),
            "a service of the run still listens on {port} (pids {still:?})"
        );
    }
}

/// The pids listening on `port` on the loopback, from `ss` (iproute2).
fn listeners(port: u16) -> Vec<u32> {
    let out = std::process::Command::new("ss")
        .args(["-Hltnp", &format!("sport = :{port}")])
        .output()
        .expect("ss (iproute2)");
    String::from_utf8_lossy(&out.stdout)
        .split("pid=")
        .skip(1)
        .filter_map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}
