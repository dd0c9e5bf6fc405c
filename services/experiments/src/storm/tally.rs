//! What a storm counts as it runs: its own tally of answers and latencies, the
//! ledgers' bottom calls, and the per-second marks taken from both.

use crate::chart::Sample;
use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use retrychain_proto::v1::{GetStatsRequest, control_client::ControlClient};
use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};
use tonic::{Code, transport::Channel};

/// Counters the workers share.
#[derive(Debug, Default)]
pub(super) struct Tally {
    /// Requests started (for --requests).
    pub(super) started: AtomicU64,
    /// Requests completed OK.
    pub(super) ok: AtomicU64,
    /// Requests failed.
    pub(super) errors: AtomicU64,
    /// Requests answered OK within their deadline.
    pub(super) good: AtomicU64,
    /// Requests refused as overloaded.
    pub(super) shed: AtomicU64,
    /// Pushbacks waited out, and their sum in µs.
    pub(super) pushback_waits: AtomicU64,
    pub(super) pushback_wait_us: AtomicU64,
    /// Final codes.
    pub(super) codes: Mutex<BTreeMap<String, u64>>,
    /// Latencies in µs: all, OK, failed, shed.
    pub(super) latency: Mutex<Option<[Histogram<u64>; 4]>>,
}

/// The ledgers' Control clients: bottom calls are counted over all of them.
#[derive(Debug, Clone)]
pub(super) struct Ledgers(pub(super) Vec<ControlClient<Channel>>);

impl Ledgers {
    /// Processor calls made by every ledger, summed (`None` when one cannot be read).
    pub(super) async fn bottom_calls(&mut self) -> Option<u64> {
        let mut total = 0;
        for control in &mut self.0 {
            total += bottom(control).await?;
        }
        Some(total)
    }
}

impl Tally {
    /// One completed request: OK, or its code and whether it was refused as overloaded.
    pub(super) fn record(
        &self,
        result: Result<(), (Code, bool)>,
        latency: Duration,
        deadline: Duration,
    ) {
        let (code, which) = match result {
            Ok(()) => {
                self.ok.fetch_add(1, Ordering::Relaxed);
                if latency <= deadline {
                    self.good.fetch_add(1, Ordering::Relaxed);
                }
                ("OK", 1)
            }
            Err((code, overloaded)) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                if overloaded {
                    self.shed.fetch_add(1, Ordering::Relaxed);
                }
                (
                    resilience::wire::code_name(code),
                    if overloaded { 3 } else { 2 },
                )
            }
        };
        if let Ok(mut codes) = self.codes.lock() {
            *codes.entry(code.to_owned()).or_default() += 1;
        }
        if let Ok(mut histograms) = self.latency.lock()
            && let Some(histograms) = histograms.as_mut()
        {
            let us = latency.as_micros().max(1) as u64;
            let _ = histograms[0].record(us);
            let _ = histograms[which].record(us);
            if which == 3 {
                let _ = histograms[2].record(us);
            }
        }
    }
}

/// Running totals read once a second: (seconds since the start, ok, errors, bottom calls).
pub(super) type Marks = Arc<Mutex<Vec<(f64, u64, u64, u64)>>>;

/// Reads the running totals once a second until aborted.
/// The bar counts requests (`by_requests`) or seconds.
pub(super) async fn sample(
    tally: Arc<Tally>,
    mut ledger: Ledgers,
    start: Instant,
    marks: Marks,
    bar: ProgressBar,
    by_requests: bool,
) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await; // the first tick is immediate; the start mark is already taken
    loop {
        ticker.tick().await;
        mark(&tally, &mut ledger, start, &marks).await;
        let (ok, errors) = (
            tally.ok.load(Ordering::Relaxed),
            tally.errors.load(Ordering::Relaxed),
        );
        if by_requests {
            bar.set_position(ok + errors);
        } else {
            bar.set_position(start.elapsed().as_secs());
        }
        bar.set_message(format!("ok {ok}, errors {errors}"));
    }
}

pub(super) async fn mark(tally: &Tally, ledger: &mut Ledgers, start: Instant, marks: &Marks) {
    // A failed read carries the last value forward, so no interval gets a burst it did
    // not have.
    let calls = match ledger.bottom_calls().await {
        Some(calls) => calls,
        None => marks
            .lock()
            .ok()
            .and_then(|m| m.last().map(|last| last.3))
            .unwrap_or(0),
    };
    let entry = (
        start.elapsed().as_secs_f64(),
        tally.ok.load(Ordering::Relaxed),
        tally.errors.load(Ordering::Relaxed),
        calls,
    );
    if let Ok(mut marks) = marks.lock() {
        marks.push(entry);
    }
}

/// Per-second samples: the differences between consecutive marks (the last interval may
/// be shorter than a second).
pub(super) fn samples(marks: &Marks) -> Vec<Sample> {
    let marks = marks.lock().map(|m| m.clone()).unwrap_or_default();
    marks
        .windows(2)
        .map(|w| Sample {
            second: w[1].0,
            ok: w[1].1.saturating_sub(w[0].1),
            errors: w[1].2.saturating_sub(w[0].2),
            bottom_calls: w[1].3.saturating_sub(w[0].3),
        })
        .collect()
}

pub(super) async fn bottom(ledger: &mut ControlClient<Channel>) -> Option<u64> {
    ledger
        .get_stats(GetStatsRequest {})
        .await
        .ok()
        .map(|s| s.into_inner().downstream_attempts)
}
