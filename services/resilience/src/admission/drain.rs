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
    /// Failed below (unavailable, out of time, broken). Its time may be the drain's (a
    /// call that queued until its deadline) or mostly what failing took — a refused
    /// connection, the backoff between retries below — which does not grow with the calls
    /// in flight, and which Little's law would read as a drain rate it is not. So it
    /// counts only in a window of mostly failures (see [`Drain::answered`]).
    Failed,
}

/// The drain-rate estimate, without clocks of its own: [`Drain::answered`] is given the
/// time, so tests drive it exactly.
#[derive(Debug, Clone)]
pub struct Drain {
    /// Rates and bounds.
    settings: AdmissionSettings,
    /// Seconds of latency per call in flight, once a window has closed.
    per_call: Option<f64>,
    /// Whether `per_call` is a figure of failures: measured on a window of mostly failed
    /// calls.
    of_failures: bool,
    /// The last figure that was not of failures, and the most calls in flight its
    /// window's answers were admitted with: what [`Drain::idle`] goes back to.
    told: Option<(f64, usize)>,
    /// The window being filled.
    window: Window,
}

/// Answers of the current window.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// When it began.
    began: Instant,
    /// The calls served and dropped.
    told: Sums,
    /// The calls failed.
    failed: Sums,
}

/// Sums over some answers of a window.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    /// Answers.
    answers: u32,
    /// Of latencies, in seconds.
    latency: f64,
    /// Of the calls in flight when each answer's call was admitted.
    in_flight: f64,
    /// The most calls in flight when one of the answers' calls was admitted.
    most_in_flight: usize,
}

impl Sums {
    fn add(&mut self, latency: Duration, in_flight: usize) {
        self.answers += 1;
        self.latency += latency.as_secs_f64();
        self.in_flight += in_flight.max(1) as f64;
        self.most_in_flight = self.most_in_flight.max(in_flight);
    }

    fn and(self, other: Sums) -> Sums {
        Sums {
            answers: self.answers + other.answers,
            latency: self.latency + other.latency,
            in_flight: self.in_flight + other.in_flight,
            most_in_flight: self.most_in_flight.max(other.most_in_flight),
        }
    }
}

impl Window {
    fn new(began: Instant) -> Self {
        Self {
            began,
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
            told: None,
            window: Window::new(now),
        }
    }

    /// Seconds of latency each call in flight adds, once measured.
    pub fn per_call(&self) -> Option<f64> {
        self.per_call
    }

    /// Whether the estimate is a figure of failures.
    pub fn of_failures(&self) -> bool {
        self.of_failures
    }

    /// An answer at `now` that took `latency`, its call admitted when `in_flight` calls
    /// (itself included) were being served, ended as `outcome`; when it closed a window,
    /// the new estimate and the most calls in flight the window's answers were admitted
    /// with (how far the estimate has been seen to hold).
    ///
    /// A window of mostly calls served and dropped is measured on them alone: its failures
    /// are the chain failing, not draining. A window of mostly failures is measured on all
    /// its answers, and is a figure of failures: a stall or a slowdown, where calls queue
    /// until their deadlines, which admission must learn of — or an outage, whose failures
    /// say how long failing took. It is believed as any slower figure is, at once, but
    /// the first window of mostly calls served replaces it at once too (not an EWMA's
    /// step), and [`Drain::idle`] forgets it. Measured before: after 20 charges of 243
    /// failing calls each (every layer retrying a processor that is down), the edge's
    /// figure was about 0.44 s a call in flight, its limit fell from about
    /// 1,500 to 17, and it refused 453–998 of the next 5 s's charges at 32 in flight,
    /// which the chain then served in milliseconds.
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
        if w.told.answers + w.failed.answers < self.settings.window_answers
            || now.saturating_duration_since(w.began) < self.settings.window
        {
            return None;
        }
        let window = std::mem::replace(&mut self.window, Window::new(now));
        let of_failures = window.failed.answers > window.told.answers;
        let sums = if of_failures {
            window.told.and(window.failed)
        } else {
            window.told
        };
        let measured = sums.latency / sums.in_flight;
        // A slower drain is believed at once, a faster one gradually (a peak-EWMA, as the
        // balancer keeps its replicas' latency): admitting on a stale fast figure fills a
        // queue that will not be served in time, refusing on a stale slow one for a few
        // windows costs a few refusals. A figure of failures gives way at once: it said
        // how the chain failed, and the chain that serves again is measured anew.
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
            self.told = Some((per_call, sums.most_in_flight));
        }
        Some((per_call, sums.most_in_flight))
    }

    /// No call is in flight any more: a figure of failures goes back to the last figure
    /// that was not, which it returns with the calls in flight it is taken as measured
    /// at (`None`: nothing measured, as at a start); `None` if the estimate was not of
    /// failures (nothing changes). The failures of the window being filled are dropped
    /// with it: left there, a few of them beside the first call served after the outage
    /// would make a figure of failures again.
    ///
    /// A figure of failures describes calls that were failing; once none is left, nothing
    /// says the next ones will, and the load that arrives next — a burst, after an outage
    /// — would be judged by it until its first calls had been served. Measured without
    /// this: after 10 charges of 243 failing calls each, 147 of the next second's charges
    /// at 32 in flight were refused in its first 100 ms. The figure it goes back to is
    /// taken as measured at [`AdmissionSettings::min_limit`] calls in flight at most, so
    /// trusted to twice that ([`GROWTH`](super::GROWTH)), and the depth it was measured at
    /// has to be proven again, doubling each window (the outage may not be
    /// over: the service may be idle only because its callers back off between retries),
    /// as TCP starts slowly again after an idle time. A stall under load keeps calls in
    /// flight: it is believed there for as long as they stall.
    pub fn idle(&mut self) -> Option<Option<(f64, usize)>> {
        if !self.of_failures {
            return None;
        }
        self.of_failures = false;
        self.window.failed = Sums::default();
        self.per_call = self.told.map(|(per_call, _)| per_call);
        let min_limit = self.settings.min_limit;
        Some(
            self.told
                .map(|(per_call, most_in_flight)| (per_call, most_in_flight.min(min_limit))),
        )
    }
}
