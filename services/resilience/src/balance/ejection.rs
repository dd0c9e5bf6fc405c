//! Outlier ejection (gRFC A50): a replica whose own failures reach a run, or a share of
//! its attempts, is taken out of rotation for a while, then re-admitted; never the last
//! one in rotation (Envoy's healthy-panic idea at its limit).
//!
//! | state | moved by | to |
//! |---|---|---|
//! | in rotation | `record`: own failures reach `consecutive_failures` in a row, or `sweep`: its interval's failure share passes the threshold | ejected (`eject`: within the max ejection percent, never the last in rotation) |
//! | ejected | `readmit`: its time is over (base × ejections, capped) | in rotation, with a fresh load estimate |
//! | in rotation | `record`: an answer | its run of failures starts again; one past ejection forgiven per base time without one |

use std::sync::Arc;

use tokio::time::Instant;

use super::{
    replica::{Outcome, Replica},
    settings::BalanceSettings,
};
use std::sync::Mutex;

/// Outlier ejection over a hop's replicas: its settings, and when failure percentages were
/// last judged.
#[derive(Debug)]
pub(super) struct Ejector {
    /// Ejection's thresholds and times (and the per-attempt timeout, which the balancer
    /// reads from here too).
    pub(super) settings: BalanceSettings,
    /// When failure percentages were last judged.
    swept: Mutex<Instant>,
    /// What `--downstream` said, for the log.
    downstream: String,
}

impl Ejector {
    /// Ejection with `settings` over the replicas of `downstream`.
    pub(super) fn new(settings: BalanceSettings, downstream: String) -> Self {
        Self {
            settings,
            swept: Mutex::new(Instant::now()),
            downstream,
        }
    }
    /// Puts back into rotation every replica whose ejection is over.
    pub(super) fn readmit(&self, replicas: &[Arc<Replica>], now: Instant) {
        for replica in replicas {
            let Ok(mut health) = replica.health.lock() else {
                continue;
            };
            if health.ejected_until.is_some_and(|until| until <= now) {
                health.ejected_until = None;
                health.consecutive = 0;
                health.readmitted = Some(now);
                // A fresh start: the slow answers that led to the ejection are not held
                // against it once more by the load estimate.
                if let Ok(mut load) = replica.load.lock() {
                    load.forget(now);
                }
                tracing::info!(
                    downstream = %self.downstream,
                    replica = %replica.url,
                    "replica re-admitted after its ejection"
                );
            }
        }
    }

    /// Records how an attempt at `replica` ended; ejects it after too many own failures
    /// in a row, and judges failure percentages once an interval is over.
    pub(super) fn record(
        &self,
        replicas: &[Arc<Replica>],
        replica: &Replica,
        outcome: Outcome,
        now: Instant,
    ) {
        let settings = &self.settings;
        let Ok(mut health) = replica.health.lock() else {
            return;
        };
        health.calls_total += 1;
        health.interval_calls = health.interval_calls.saturating_add(1);
        match outcome {
            Outcome::Answered => {
                health.consecutive = 0;
                health.spared = false;
                // One ejection forgiven per base time gone by without one.
                if let Some(readmitted) = health.readmitted
                    && now.saturating_duration_since(readmitted) >= settings.base_ejection
                {
                    health.ejections = health.ejections.saturating_sub(1);
                    health.readmitted = (health.ejections > 0).then_some(now);
                }
                drop(health);
            }
            // Neither a success nor a failure of its own: the run of failures stands.
            Outcome::Shed => drop(health),
            Outcome::Failed => {
                health.consecutive += 1;
                health.failures_total += 1;
                health.interval_failures = health.interval_failures.saturating_add(1);
                let due = settings.consecutive_failures > 0
                    && health.consecutive >= settings.consecutive_failures
                    && health.ejected_until.is_none();
                let failures = health.consecutive;
                drop(health);
                if due {
                    self.eject(
                        replicas,
                        replica,
                        now,
                        &format!("{failures} failures of its own in a row"),
                    );
                }
            }
        }
        self.sweep(replicas, now);
    }

    /// gRFC A50's failure-percentage detection, once per interval: among the replicas
    /// with enough attempts, when there are enough of them, those whose own failures
    /// exceed the threshold are ejected; then every replica's interval counts restart.
    fn sweep(&self, replicas: &[Arc<Replica>], now: Instant) {
        let settings = &self.settings;
        {
            // Whoever holds it is judging this interval already.
            let Ok(mut swept) = self.swept.try_lock() else {
                return;
            };
            if now.saturating_duration_since(*swept) < settings.interval {
                return;
            }
            *swept = now;
        }
        let counts: Vec<(u32, u32)> = replicas
            .iter()
            .map(|r| {
                r.health.lock().map_or((0, 0), |mut h| {
                    let counts = (h.interval_calls, h.interval_failures);
                    (h.interval_calls, h.interval_failures) = (0, 0);
                    counts
                })
            })
            .collect();
        let judged = counts
            .iter()
            .filter(|(calls, _)| *calls >= settings.failure_percentage_request_volume)
            .count();
        if settings.failure_percentage_threshold > 100
            || judged < settings.failure_percentage_minimum_hosts as usize
        {
            return;
        }
        for (replica, (calls, failures)) in replicas.iter().zip(counts) {
            let over = calls >= settings.failure_percentage_request_volume
                && u64::from(failures) * 100
                    > u64::from(settings.failure_percentage_threshold) * u64::from(calls);
            if over {
                self.eject(
                    replicas,
                    replica,
                    now,
                    &format!("{failures} of its {calls} attempts failed on its own"),
                );
            }
        }
    }

    /// Takes `replica` out of rotation for its next ejection time, unless it is out
    /// already or the limit on ejected replicas is reached.
    fn eject(&self, replicas: &[Arc<Replica>], replica: &Replica, now: Instant, why: &str) {
        let settings = &self.settings;
        let ejected = replicas
            .iter()
            .filter(|r| r.health.lock().is_ok_and(|h| h.ejected_until.is_some()))
            .count();
        // At least one may be ejected, unless the percentage is 0 (ejection off, as A50).
        let allowed = match replicas.len() * settings.max_ejection_percent as usize / 100 {
            0 if settings.max_ejection_percent > 0 => 1,
            allowed => allowed,
        };
        if ejected >= allowed || !replicas.iter().any(|r| r.id == replica.id) {
            return; // at the limit, or the replica has left the set
        }
        let Ok(mut health) = replica.health.lock() else {
            return;
        };
        if health.ejected_until.is_some() {
            return;
        }
        // Envoy's healthy-panic idea at its limit: ejecting the last replica in rotation
        // helps nobody — every call would go to an ejected replica anyway — and would hide
        // the failures in the log as a decision. It stays, and the log says so, once.
        if ejected + 1 >= replicas.len() {
            if !health.spared {
                health.spared = true;
                tracing::warn!(
                    downstream = %self.downstream,
                    replica = %replica.url,
                    why,
                    in_rotation = replicas.len() - ejected,
                    "replica not ejected: it is the last one in rotation (panic threshold); calls go on to it"
                );
            }
            return;
        }
        health.ejections += 1;
        health.ejections_total += 1;
        let longest = settings.max_ejection.max(settings.base_ejection);
        let time = (settings.base_ejection * health.ejections).min(longest);
        health.ejected_until = Some(now + time);
        tracing::warn!(
            downstream = %self.downstream,
            replica = %replica.url,
            why,
            ejected_for_s = time.as_secs_f64(),
            "replica ejected"
        );
    }
}
