//! How fast a service drains its calls now, read off its answers (Little's law): the
//! prediction admission is made on.

use std::time::Duration;

use tokio::time::Instant;

use super::settings::AdmissionSettings;

/// The drain-rate estimate, without clocks of its own: [`Drain::answered`] is given the
/// time, so tests drive it exactly.
#[derive(Debug, Clone)]
pub struct Drain {
    /// Rates.
    settings: AdmissionSettings,
    /// Seconds of latency per call in flight, once a window has closed.
    per_call: Option<f64>,
    /// The window being filled.
    window: Window,
}

/// Answers of the current window.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// When it began.
    began: Instant,
    /// Sum of latencies, in seconds.
    latency: f64,
    /// Sum of the calls in flight when each answer's call was admitted.
    in_flight: f64,
    /// The most calls in flight when one of its answers' calls was admitted.
    most_in_flight: usize,
    /// Answers.
    answers: u32,
}

impl Window {
    fn new(began: Instant) -> Self {
        Self {
            began,
            latency: 0.0,
            in_flight: 0.0,
            most_in_flight: 0,
            answers: 0,
        }
    }
}

impl Drain {
    /// Nothing measured yet; the first window starts `now`.
    pub fn new(settings: AdmissionSettings, now: Instant) -> Self {
        Self {
            settings,
            per_call: None,
            window: Window::new(now),
        }
    }

    /// Seconds of latency each call in flight adds, once measured.
    pub fn per_call(&self) -> Option<f64> {
        self.per_call
    }

    /// An answer at `now` that took `latency`, its call admitted when `in_flight` calls
    /// (itself included) were being served; when it closed a window, the new estimate
    /// and the most calls in flight the window's answers were admitted with (how far
    /// the estimate has been seen to hold).
    pub fn answered(
        &mut self,
        now: Instant,
        latency: Duration,
        in_flight: usize,
    ) -> Option<(f64, usize)> {
        let w = &mut self.window;
        w.latency += latency.as_secs_f64();
        w.in_flight += in_flight.max(1) as f64;
        w.most_in_flight = w.most_in_flight.max(in_flight);
        w.answers += 1;
        if w.answers < self.settings.window_answers
            || now.saturating_duration_since(w.began) < self.settings.window
        {
            return None;
        }
        let window = std::mem::replace(&mut self.window, Window::new(now));
        let measured = window.latency / window.in_flight;
        // A slower drain is believed at once, a faster one gradually (a peak-EWMA, as the
        // balancer keeps its replicas' latency): admitting on a stale fast figure fills a
        // queue that will not be served in time, refusing on a stale slow one for a few
        // windows costs a few refusals.
        let s = self.settings.smoothing;
        let per_call = match self.per_call {
            Some(before) if measured < before => before * (1.0 - s) + measured * s,
            _ => measured,
        };
        self.per_call = Some(per_call);
        Some((per_call, window.most_in_flight))
    }
}
