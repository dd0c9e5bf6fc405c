//! Kernel network faults on the loopback, as Jepsen makes them: iptables rules in the
//! INPUT chain, each scoped to the destination ports of one link and tagged with a comment
//! ([`TAG`]) so that every rule this tool made — and only those — can be found and removed:
//! when a fault heals, when the run ends, on Ctrl-C, when this value is dropped (a panic),
//! and at the start of the next run (a run killed outright leaves its rules until then, or
//! until `retrychain chaos --clean`).
//!
//! A partition drops every packet to the ports (a black hole: callers see silence, not a
//! refusal); packet loss drops a random share of them (`-m statistic`), which TCP turns into
//! retransmissions and latency. Added latency would need `tc netem`, which this kernel does
//! not have; the nemesis adds it with the caller's own fault knob instead (see
//! `nemesis/lab.rs`).
//!
//! Why INPUT, where the packet arrives, and not OUTPUT, where it leaves: a packet dropped
//! on its way out is an error its sender's kernel sees. It keeps the data as unsent and
//! tries again about every half second, so a connection resumes within a fraction of a
//! second of the healing. A packet lost in a network was sent: its sender waits for an
//! acknowledgement that does not come and retransmits at doubling intervals (after a 14 s
//! partition, its next try comes some 25 s in). Dropped on arrival, the loopback's packets
//! are lost the way a network loses them. (Rules in OUTPUT, made by this tool before
//! 2026-12-05, are still found and removed.)

use std::process::Command;

use anyhow::Context;

/// The comment on every rule this tool makes.
pub const TAG: &str = "retrychain-chaos";

/// The chain this tool's rules go in (see the module's documentation).
pub const CHAIN: &str = "INPUT";

/// One way to disturb a link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Disturbance {
    /// Every packet dropped.
    Partition,
    /// This share of the packets dropped (0..1).
    Loss(f64),
}

/// The rules in force, removed on [`Rules::heal`] and on drop.
#[derive(Debug, Default)]
pub struct Rules {
    /// Each rule's arguments after `-I`/`-D INPUT`.
    active: Vec<Vec<String>>,
}

/// Whether iptables can be used here (present, and we may change rules): network faults
/// are offered only when it can.
pub fn available() -> bool {
    Command::new("iptables")
        .args(["-w", "-S", CHAIN])
        .output()
        .is_ok_and(|out| out.status.success())
}

/// Removes every rule tagged [`TAG`], whoever left it (a run that was killed); how many.
pub fn clean() -> anyhow::Result<usize> {
    let mut removed = 0;
    for chain in [CHAIN, "OUTPUT"] {
        let listing = Command::new("iptables")
            .args(["-w", "-S", chain])
            .output()
            .context("running iptables -S (network faults need iptables and root)")?;
        anyhow::ensure!(
            listing.status.success(),
            "iptables -S {chain}: {}",
            String::from_utf8_lossy(&listing.stderr).trim()
        );
        let added = format!("-A {chain} ");
        for line in String::from_utf8_lossy(&listing.stdout).lines() {
            let Some(rule) = line.strip_prefix(&added) else {
                continue;
            };
            if !rule.contains(TAG) {
                continue;
            }
            // `-S` prints a rule as it was added; the same words delete it. The comment is
            // one word with no quoting needed (TAG has no spaces).
            let args: Vec<&str> = rule.split_whitespace().collect();
            iptables(chain, "-D", &args)?;
            removed += 1;
        }
    }
    Ok(removed)
}

fn iptables(chain: &str, action: &str, rule: &[impl AsRef<str>]) -> anyhow::Result<()> {
    let output = Command::new("iptables")
        .args(["-w", action, chain])
        .args(rule.iter().map(AsRef::as_ref))
        .output()
        .context("running iptables")?;
    anyhow::ensure!(
        output.status.success(),
        "iptables {action} {chain} {}: {}",
        rule.iter().map(AsRef::as_ref).collect::<Vec<_>>().join(" "),
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(())
}

impl Rules {
    /// Disturbs every TCP packet that arrives over the loopback for any of `ports`.
    pub fn disturb(&mut self, ports: &[u16], how: Disturbance) -> anyhow::Result<()> {
        anyhow::ensure!(
            !ports.is_empty(),
            "no ports to disturb (network faults need a chain this tool started)"
        );
        for port in ports {
            let mut rule: Vec<String> = ["-i", "lo", "-p", "tcp", "--dport"]
                .iter()
                .map(|s| (*s).to_owned())
                .collect();
            rule.push(port.to_string());
            if let Disturbance::Loss(share) = how {
                rule.extend(
                    ["-m", "statistic", "--mode", "random", "--probability"]
                        .iter()
                        .map(|s| (*s).to_owned()),
                );
                rule.push(format!("{share:.3}"));
            }
            rule.extend(
                ["-m", "comment", "--comment", TAG, "-j", "DROP"]
                    .iter()
                    .map(|s| (*s).to_owned()),
            );
            iptables(CHAIN, "-I", &rule)?;
            self.active.push(rule);
        }
        Ok(())
    }

    /// Removes every rule this value made.
    pub fn heal(&mut self) -> anyhow::Result<()> {
        let mut first_error = None;
        for rule in std::mem::take(&mut self.active) {
            if let Err(error) = iptables(CHAIN, "-D", &rule) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for Rules {
    fn drop(&mut self) {
        if let Err(error) = self.heal() {
            eprintln!("chaos: removing its iptables rules: {error:#}");
        }
    }
}
