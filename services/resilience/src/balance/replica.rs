//! One replica as the balancer knows it: its connection, its load estimate (peak-EWMA of
//! response times × calls in flight), its health (outlier ejection's view), and the
//! guard that counts a call in flight to it.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::time::Instant;

use super::connection::Connection;

/// The response time a replica is assumed to have before its first answer: optimistic, so
/// that a replica that joins (or comes back) is tried at once and its real time learnt.
pub(super) const DEFAULT_RTT: Duration = Duration::from_millis(1);

/// How fast the estimate forgets a slow answer: a sample's weight halves in about 7 s.
pub(super) const DECAY: Duration = Duration::from_secs(10);

/// One replica: its connection and what the balancer has seen of it.
#[derive(Debug)]
pub(super) struct Replica {
    /// Unique for the life of the process: a replica that leaves and comes back at the same
    /// address is a new one, its history not inherited.
    pub(super) id: u64,
    /// `http://host:port`.
    pub(super) url: String,
    /// Opened on first use, again after it closes.
    pub(super) connection: Connection,
    /// The load estimate.
    pub(super) load: Mutex<Load>,
    /// Outlier ejection's view of it.
    pub(super) health: Mutex<Health>,
}

/// A replica's own failures in a row, and its ejection.
#[derive(Debug, Default)]
pub(super) struct Health {
    /// Own failures since its last good answer.
    pub(super) consecutive: u32,
    /// Out of rotation until then.
    pub(super) ejected_until: Option<Instant>,
    /// How many times it has been ejected (the ejection time's multiplier); one is
    /// forgiven for each base ejection time it then goes without one.
    pub(super) ejections: u32,
    /// When it was last re-admitted.
    pub(super) readmitted: Option<Instant>,
    /// Attempts and own failures in the current interval (failure-percentage detection).
    pub(super) interval_calls: u32,
    pub(super) interval_failures: u32,
    /// Since it joined: attempts, own failures, ejections (for `/metrics`).
    pub(super) calls_total: u64,
    pub(super) failures_total: u64,
    pub(super) ejections_total: u64,
    /// Whether it was spared an ejection (the last replica in rotation) since its last
    /// good answer: the decision is logged once, not at every failure.
    pub(super) spared: bool,
}

/// How an attempt at a replica ended, for its health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// It answered, well or with a failure of its own making not held against it.
    Answered,
    /// A failure of its own: no connection, no answer in time, or a server failure it
    /// did not relay.
    Failed,
    /// It refused the call as overloaded ([`wire::OVERLOADED`]): load, not a fault — not
    /// held against it, but its cost doubles, so the next calls go elsewhere.
    Shed,
}

/// A replica's calls in flight and its peak-EWMA response time.
#[derive(Debug)]
pub(super) struct Load {
    pub(super) pending: u32,
    /// Nanoseconds.
    pub(super) rtt_ns: f64,
    pub(super) updated: Instant,
    /// Whether `rtt_ns` was measured (an answer came since it joined or was re-admitted),
    /// not the default it starts from.
    pub(super) sampled: bool,
}

impl Load {
    pub(super) fn new() -> Self {
        Self {
            pending: 0,
            rtt_ns: DEFAULT_RTT.as_nanos() as f64,
            updated: Instant::now(),
            sampled: false,
        }
    }

    /// Back to knowing nothing (a replica re-admitted after its ejection).
    pub(super) fn forget(&mut self, now: Instant) {
        self.rtt_ns = DEFAULT_RTT.as_nanos() as f64;
        self.updated = now;
        self.sampled = false;
    }

    /// The cost of sending one more call here, `now`: the estimate decayed for the time
    /// since its last sample (as `tower::load::PeakEwma` does), so that a replica not
    /// chosen for a while — its last answers slow, or its first one slowed by the
    /// connection's set-up — looks cheaper until it is tried again and measured afresh.
    ///
    /// A replica not yet measured takes one call at a time until its first answer: its
    /// default estimate (1 ms) is a guess, and a replica 50× slower than the others would
    /// otherwise take a third of the calls until that answer came (over 1% of a 20,000
    /// call run at 16 in flight: its p99).
    pub(super) fn cost(&self, now: Instant) -> f64 {
        if !self.sampled && self.pending > 0 {
            return f64::MAX;
        }
        let idle = now.saturating_duration_since(self.updated).as_secs_f64();
        let estimate = self.rtt_ns * (-idle / DECAY.as_secs_f64()).exp();
        estimate * f64::from(self.pending + 1)
    }

    /// A refusal for overload: the estimate doubles (at least `rtt`), as a slow answer
    /// would raise it, and decays from there like any other.
    pub(super) fn shed(&mut self, rtt: Duration, now: Instant) {
        self.rtt_ns = (self.rtt_ns * 2.0).max(rtt.as_nanos() as f64);
        self.updated = now;
        self.sampled = true;
    }

    /// A new sample: taken at once if slower (the peak), else averaged in with a weight
    /// that grows with the time since the last sample.
    pub(super) fn observe(&mut self, rtt: Duration, now: Instant) {
        let sample = rtt.as_nanos() as f64;
        if sample > self.rtt_ns || !self.sampled {
            self.rtt_ns = sample;
        } else {
            let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
            let keep = (-elapsed / DECAY.as_secs_f64()).exp();
            self.rtt_ns = self.rtt_ns * keep + sample * (1.0 - keep);
        }
        self.updated = now;
        self.sampled = true;
    }
}

/// A call in flight to a replica: counted in its load until dropped.
pub(super) struct InFlight {
    pub(super) replica: Arc<Replica>,
    pub(super) sent: Instant,
}

impl InFlight {
    pub(super) fn start(replica: Arc<Replica>) -> Self {
        if let Ok(mut load) = replica.load.lock() {
            load.pending += 1;
        }
        Self {
            replica,
            sent: Instant::now(),
        }
    }

    /// The answer came: its time is a sample.
    pub(super) fn answered(&self) {
        let now = Instant::now();
        if let Ok(mut load) = self.replica.load.lock() {
            load.observe(now - self.sent, now);
        }
    }

    /// The replica refused the call as overloaded.
    pub(super) fn shed(&self) {
        let now = Instant::now();
        if let Ok(mut load) = self.replica.load.lock() {
            load.shed(now - self.sent, now);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut load) = self.replica.load.lock() {
            load.pending = load.pending.saturating_sub(1);
        }
    }
}
