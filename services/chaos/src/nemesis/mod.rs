//! The nemesis: faults on a seeded schedule ([`plan`], in `schedule`), put into a chain this
//! tool started and healed again ([`Lab`], in `lab`), by [`run`] (here).
//!
//! A schedule is rounds of every fault kind asked for, each round in a random order, so a
//! run of a few minutes meets every kind; a fault lasts a random time within bounds and is
//! followed by a quiet gap (its effect must end within the checker's recovery bound). Now
//! and then two faults of one round start together — a composite fault, such as a
//! partition while a replica is frozen. What each fault hits (which replica, which link)
//! is drawn when it starts, from the same seed.

mod lab;
mod schedule;
#[cfg(test)]
mod tests;

use std::time::Duration;

use tokio::time::Instant;

use lab::report;
pub use lab::{Active, Lab};
pub use schedule::{FaultKind, Pacing, Planned, plan};

use crate::history::FaultWindow;

/// Runs `schedule` on `lab` from `start`, then heals whatever is still in force; the fault
/// windows in the order they began, and the faults that could not be made (with why).
pub async fn run(lab: &mut Lab, schedule: &[Planned]) -> (Vec<FaultWindow>, Vec<String>) {
    let mut windows = Vec::new();
    let mut skipped = Vec::new();
    let mut active: Vec<(Instant, Active)> = Vec::new();
    let start = lab.start;
    for planned in schedule {
        let at = start + planned.at;
        heal_due(lab, &mut active, &mut windows, at).await;
        tokio::time::sleep_until(at).await;
        if planned.kind.on_postgres() {
            // One Postgres fault at a time, on a formation that has settled since the last
            // (waited for up to 30 s, healing the other faults on time meanwhile).
            let waited = Instant::now();
            while active.iter().any(|(_, a)| a.kind.on_postgres()) || !lab.formation_settled() {
                if waited.elapsed() > Duration::from_secs(30) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
                heal_due(lab, &mut active, &mut windows, Instant::now()).await;
            }
            if active.iter().any(|(_, a)| a.kind.on_postgres()) || !lab.formation_settled() {
                let why = format!(
                    "{} at {:.1} s: another Postgres fault, or the formation not settled after 30 s",
                    planned.kind.name(),
                    planned.at.as_secs_f64()
                );
                eprintln!("chaos: skipped {why}");
                skipped.push(why);
                continue;
            }
        }
        match lab.apply(planned.kind).await {
            Ok(fault) => {
                report("began", &fault.window, lab.ms());
                active.push((Instant::now() + planned.length, fault));
            }
            Err(error) => {
                let why = format!(
                    "{} at {:.1} s: {error:#}",
                    planned.kind.name(),
                    planned.at.as_secs_f64()
                );
                eprintln!("chaos: skipped {why}");
                skipped.push(why);
            }
        }
    }
    heal_due(
        lab,
        &mut active,
        &mut windows,
        Instant::now() + Duration::from_secs(3600),
    )
    .await;
    // Every service up again before the load stops (two minutes at most).
    let waited = Instant::now();
    while lab.restarts_pending() && waited.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        windows.extend(lab.retry_pending().await);
    }
    for (name, mut window) in std::mem::take(&mut lab.pending) {
        eprintln!("chaos: {name} did not start again within two minutes of its fault's end");
        window.healed_ms = lab.ms();
        windows.push(window);
    }
    windows.sort_by(|a, b| a.began_ms.total_cmp(&b.began_ms));
    (windows, skipped)
}

/// Heals every fault in `active` due by `by`, each at its time.
async fn heal_due(
    lab: &mut Lab,
    active: &mut Vec<(Instant, Active)>,
    windows: &mut Vec<FaultWindow>,
    by: Instant,
) {
    loop {
        active.sort_by_key(|(due, _)| *due);
        match active.first() {
            Some((due, _)) if *due <= by => {
                let (due, fault) = active.remove(0);
                tokio::time::sleep_until(due).await;
                if let Some(window) = lab.heal(fault).await {
                    report("healed", &window, lab.ms());
                    windows.push(window);
                }
            }
            _ => break,
        }
    }
    windows.extend(lab.retry_pending().await);
}
