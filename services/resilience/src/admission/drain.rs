//! How fast a service drains its calls now, read off its answers (Little's law): the
//! prediction admission is made on.

use std::time::Duration;

use tokio::time::Instant;

use super::settings::AdmissionSettings;

/// What an answer tells the estimate, by how the call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Served: its time is what the service's drain made it.
    Served,
    /// Refused for overload by a service below: its time is a penalty standing for a call
    /// that did not fit (see [`Admitted::dropped`](super::Admitted::dropped)).
    Dropped,
    /// Failed below (unavailable, out of time, broken): its time is mostly what failing
    /// took — timeouts, and the backoff between retries below — which does not grow with
    /// the calls in flight, so Little's law reads it as a drain rate it is not. It is
    /// believed only when nothing else is answered (see [`Drain::answered`]).
    Failed,
}

/// The drain-rate estimate, without clocks of its own: [`Drain::answered`] is given the
/// time, so tests drive it exactly.
#[derive(Debug, Clone)]
pub struct Drain {
    /// Rates.
    settings: AdmissionSettings,
    /// Seconds of latency per call in flight, once a window has closed.
    per_call: Option<f64>,
    /// Whether `per_call` was measured on failures alone.
    of_failures: bool,
    /// The last figure measured with calls served, and the most calls in flight its
    /// window's answers were admitted with: what [`Drain::idle`] goes back to.
    served: Option<(f64, usize)>,
    /// The window being filled.
    window: Window,
}

/// Answers of the current window.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// When it began.
    began: Instant,
    /// Answers, of every outcome.
    answers: u32,
    /// The calls served and dropped.
    told: Sums,
    /// The calls failed.
    failed: Sums,
}

/// Sums over some answers of a window.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    /// Of latencies, in seconds.
    latency: f64,
    /// Of the calls in flight when each answer's call was admitted.
    in_flight: f64,
    /// The most calls in flight when one of the answers' calls was admitted.
    most_in_flight: usize,
}

impl Sums {
    fn add(&mut self, latency: Duration, in_flight: usize) {
        self.latency += latency.as_secs_f64();
        self.in_flight += in_flight.max(1) as f64;
        self.most_in_flight = self.most_in_flight.max(in_flight);
    }

    fn is_empty(&self) -> bool {
        self.in_flight == 0.0
    }
}

impl Window {
    fn new(began: Instant) -> Self {
        Self {
            began,
            answers: 0,
            told: Sums::default(),
            failed: Sums::default(),
        }
    }
}

impl Drain {
    /// Nothing measured yet; the first window starts `now`.
    pub fn new(settings: AdmissionSettings, now: Instant) -> Self {
        Self {
            settings,
            per_call: None,
            of_failures: false,
            served: None,
            window: Window::new(now),
        }
    }

    /// Seconds of latency each call in flight adds, once measured.
    pub fn per_call(&self) -> Option<f64> {
        self.per_call
    }

    /// An answer at `now` that took `latency`, its call admitted when `in_flight` calls
    /// (itself included) were being served, ended as `outcome`; when it closed a window,
    /// the new estimate and the most calls in flight the window's answers were admitted
    /// with (how far the estimate has been seen to hold).
    ///
    /// A window is measured on its served and dropped calls; its failures count only in a
    /// window of nothing else — a stall, whose calls all fail or time out, and which
    /// admission must still learn of. Measured otherwise: after 20 charges of 243 failing
    /// calls each (every layer retrying a processor that is down, 30 s deadlines), the
    /// edge's estimate said about 0.44 s a call in flight, its limit fell from about 1,500 to
    /// 17, and
    /// once the outage was over it refused 998 of the next 5 s's charges at 32 in flight,
    /// while the chain served them in milliseconds.
    pub fn answered(
        &mut self,
        now: Instant,
        latency: Duration,
        in_flight: usize,
        outcome: Outcome,
    ) -> Option<(f64, usize)> {
        let w = &mut self.window;
        match outcome {
            Outcome::Served | Outcome::Dropped => w.told.add(latency, in_flight),
            Outcome::Failed => w.failed.add(latency, in_flight),
        }
        w.answers += 1;
        if w.answers < self.settings.window_answers
            || now.saturating_duration_since(w.began) < self.settings.window
        {
            return None;
        }
        let window = std::mem::replace(&mut self.window, Window::new(now));
        let (sums, of_failures) = if window.told.is_empty() {
            (window.failed, true)
        } else {
            (window.told, false)
        };
        let measured = sums.latency / sums.in_flight;
        // A slower drain is believed at once, a faster one gradually (a peak-EWMA, as the
        // balancer keeps its replicas' latency): admitting on a stale fast figure fills a
        // queue that will not be served in time, refusing on a stale slow one for a few
        // windows costs a few refusals. A figure of failures alone gives way at once to
        // the first window with calls served: it said how long the chain took to fail,
        // not how fast it serves, and the chain that serves again is measured anew.
        let s = self.settings.smoothing;
        let per_call = match self.per_call {
            Some(before) if measured < before && !self.of_failures => {
                before * (1.0 - s) + measured * s
            }
            _ => measured,
        };
        self.per_call = Some(per_call);
        self.of_failures = of_failures;
        if !of_failures {
            self.served = Some((per_call, sums.most_in_flight));
        }
        Some((per_call, sums.most_in_flight))
    }

    /// Whether the estimate is a figure of failures alone.
    pub fn of_failures(&self) -> bool {
        self.of_failures
    }

    /// No call is in flight any more: a figure of failures goes back to the last one
    /// measured with calls served (none: nothing measured), which it returns with the
    /// most calls in flight that figure was measured with; `None` if the estimate was not
    /// of failures (nothing changes).
    ///
    /// A figure of failures describes calls that were failing; once none is left, nothing
    /// says the next ones will fail, and the load that arrives next — a burst, after an
    /// outage — would be judged by it until its first calls had been served. Measured
    /// without this: after 10 charges of 243 failing calls each, 147 of the first second's
    /// charges at 32 in flight refused in its first 100 ms. A stall under load (the case a
    /// figure of failures is believed for) keeps calls in flight: they are what stalls.
    pub fn idle(&mut self) -> Option<Option<(f64, usize)>> {
        if !self.of_failures {
            return None;
        }
        self.of_failures = false;
        self.per_call = self.served.map(|(per_call, _)| per_call);
        Some(self.served)
    }
}
