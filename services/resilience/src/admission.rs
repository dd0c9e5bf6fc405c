//! Admission: an adaptive concurrency limit in front of a server, answering at once what
//! it cannot serve, retries before first attempts.
//!
//! # Why
//!
//! A server that admits everything up to a fixed, generous number queues the excess of an
//! overload inside itself, where each queued call costs memory and, worse, time: it fails
//! only when its deadline runs out, after holding everything below it. Retries of those
//! failures arrive on top. Served that way, an overload that outlives its trigger is the
//! metastable failure this project is about. The answer (Netflix's concurrency-limits,
//! Envoy's adaptive concurrency filter, "Fail at Scale") is a limit that follows what the
//! server can do now, measured by its latency, and a refusal that costs the caller
//! microseconds, not a deadline.
//!
//! # The limit ([`Gradient`])
//!
//! Netflix's Gradient2, measured over short windows of time rather than per sample, so
//! that it behaves the same at 100 and at 30,000 calls a second:
//!
//! ```text
//! every window (≥ 10 ms and ≥ 8 answers):
//!   short    = mean latency of the window's answers
//!   long     = exponential average of `short`, time constant 10 s (long-term latency)
//!   if long > 2 × short: long ← 0.95 × long          (forget a slow spell quickly)
//!   if the window's most calls in flight < limit / 2: keep the limit (not limit-bound)
//!   gradient = clamp(tolerance × long / short, 0.5, 1)
//!   limit    ← limit × (1 − smoothing) + (limit × gradient + √limit) × smoothing
//!   limit    ∈ [min, max]
//! ```
//!
//! While latency stays within `tolerance` of its long-term level the limit grows by about
//! √limit a window (the headroom Envoy's filter keeps); as queueing pushes latency past
//! it, the limit falls, at most by half a window. A service whose latency rose for good
//! (a slower dependency) finds its new level as the long-term average follows.
//!
//! # Who is refused first
//!
//! 1. **Retries and hedges** (an attempt carrying `grpc-previous-rpc-attempts` ≥ 1) are
//!    admitted only while the calls in flight are under [`AdmissionSettings::retry_share`]
//!    of the limit (75% by default): under overload they are refused, while a first
//!    attempt still gets the slot that comes free. The retry budget's idea, applied by the
//!    server: a retry is worth less than a caller's first try.
//! 2. **First attempts** are admitted while the calls in flight are under the limit.
//!
//! Nothing queues: a call over the limit is answered UNAVAILABLE at once (the message says
//! overloaded; an A6 client retries UNAVAILABLE) with `grpc-retry-pushback-ms` set to the
//! latency of a call now (at least 1 ms): when a slot is likely to be free. The answer is
//! marked [`wire::OVERLOADED`] so that a balancer above takes it as load, not a fault.
//!
//! "At once" needs care with the request's body. Answered while the request's stream is
//! still open (its message not yet read), and with the body dropped, HTTP/2 (the `h2`
//! crate) resets the stream — a reset the server makes, which it counts against the
//! connection's allowance for protocol errors (the defence against "rapid reset" floods).
//! Under a sustained overload that allowance runs out and the whole connection is closed
//! (ENHANCE_YOUR_CALM), failing every call on it. So a refusal keeps the body: it is read
//! to its end (and dropped) by a task of its own, for at most [`DRAIN_WITHIN`], while the
//! refusal goes out at once.
//!
//! # What is a sample
//!
//! The time from admission to the answer's headers, for every answer but CANCELLED (the
//! caller left; the time says nothing about the server) and an error of the layers below
//! (no answer). A DEADLINE_EXCEEDED is a sample: a call that ran out of time is the
//! slowness the limit must see.
//!
//! An answer marked [`wire::OVERLOADED`] that this service relays (a service below refused
//! the call) is a **drop**: it counts as an answer [`DROP_PENALTY`] times slower than the
//! long-term latency, however fast it came. So backpressure climbs the chain in
//! proportion: a hop whose downstream sheds a few calls lowers its limit a little, one
//! whose downstream sheds most of them lowers it as it would for a latency that doubled,
//! until the excess is refused where it enters, at the edge, before four services have
//! worked on it. (Counted as the fast answer it is, the refusal below would raise this
//! service's limit instead; counted as a reason to cut the limit by a fixed share, a few
//! refusals below — noise, on a shared machine — ratchet every limit above down to its
//! floor.)

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::time::Instant;
use tonic::{Code, Status};

use crate::wire;

/// The longest a refused request's body is waited for (see the module docs); a client
/// that has not sent it by then has its stream reset.
pub const DRAIN_WITHIN: Duration = Duration::from_millis(250);

/// How much slower than the long-term latency a drop counts (see the module docs).
pub const DROP_PENALTY: f64 = 2.0;

/// The most request body a refusal reads (and drops) before answering anyway.
const DRAIN_AT_MOST: usize = 1024 * 1024;

/// How the limit is bounded and how it moves; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionSettings {
    /// The limit before anything was measured.
    pub initial_limit: usize,
    /// The limit never falls below this.
    pub min_limit: usize,
    /// Nor rises above this (also the memory bound: `--max-in-flight`).
    pub max_limit: usize,
    /// How much slower than its long-term level latency may be before the limit falls
    /// (1.5: 50% slower).
    pub tolerance: f64,
    /// How far one window moves the limit toward its new value (0 < s ≤ 1).
    pub smoothing: f64,
    /// The time constant of the long-term latency.
    pub long_term: Duration,
    /// A window lasts at least this long ...
    pub window: Duration,
    /// ... and holds at least this many answers.
    pub window_answers: u32,
    /// Retries and hedges are admitted only while the calls in flight are under this share
    /// of the limit (0 < share ≤ 1).
    pub retry_share: f64,
}

impl Default for AdmissionSettings {
    fn default() -> Self {
        Self {
            initial_limit: 256,
            min_limit: 16,
            max_limit: 4096,
            tolerance: 1.5,
            smoothing: 0.2,
            long_term: Duration::from_secs(10),
            window: Duration::from_millis(10),
            window_answers: 8,
            retry_share: 0.75,
        }
    }
}

/// Why admission settings were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidAdmission {
    /// The bounds are out of order or zero.
    #[error(
        "the concurrency limits must satisfy 1 ≤ min ≤ initial ≤ max (min {min}, initial {initial}, max {max})"
    )]
    Bounds {
        /// [`AdmissionSettings::min_limit`].
        min: usize,
        /// [`AdmissionSettings::initial_limit`].
        initial: usize,
        /// [`AdmissionSettings::max_limit`].
        max: usize,
    },
    /// A share, factor or duration is out of its range.
    #[error("{0}")]
    Out(&'static str),
}

impl AdmissionSettings {
    /// These settings, or why they cannot work.
    pub fn validated(self) -> Result<Self, InvalidAdmission> {
        let s = self;
        if !(1 <= s.min_limit && s.min_limit <= s.initial_limit && s.initial_limit <= s.max_limit) {
            return Err(InvalidAdmission::Bounds {
                min: s.min_limit,
                initial: s.initial_limit,
                max: s.max_limit,
            });
        }
        if !(s.tolerance >= 1.0 && s.tolerance.is_finite()) {
            return Err(InvalidAdmission::Out(
                "the latency tolerance must be at least 1",
            ));
        }
        if !(s.smoothing > 0.0 && s.smoothing <= 1.0) {
            return Err(InvalidAdmission::Out("the smoothing must be in (0, 1]"));
        }
        if !(s.retry_share > 0.0 && s.retry_share <= 1.0) {
            return Err(InvalidAdmission::Out("the retry share must be in (0, 1]"));
        }
        if s.long_term.is_zero() || s.window_answers == 0 {
            return Err(InvalidAdmission::Out(
                "the long-term time constant and the answers per window must be positive",
            ));
        }
        Ok(s)
    }

    /// A fixed limit: what tests of other behaviour use, so that their concurrency is
    /// never taken for an overload.
    pub fn fixed(limit: usize) -> Self {
        Self {
            initial_limit: limit,
            min_limit: limit,
            max_limit: limit,
            ..Self::default()
        }
    }
}

/// The limit's arithmetic, without clocks of its own: [`Gradient::answered`] is given the
/// time, so tests drive it exactly.
#[derive(Debug, Clone)]
pub struct Gradient {
    /// Bounds and rates.
    settings: AdmissionSettings,
    /// The limit now (fractional; admission uses its floor).
    limit: f64,
    /// The long-term latency, in seconds, once a window has closed.
    long: Option<f64>,
    /// When the long-term latency was last moved.
    long_at: Option<Instant>,
    /// The window being filled.
    window: Window,
    /// The mean latency of the last closed window, in seconds.
    recent: f64,
}

/// Answers of the current window.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// When it began.
    began: Instant,
    /// Sum of latencies, in seconds.
    sum: f64,
    /// Answers.
    answers: u32,
    /// The most calls in flight seen as one of its answers was admitted.
    most_in_flight: usize,
    /// Of the answers, overloads below (counted at [`DROP_PENALTY`] in `sum`).
    drops: u32,
}

impl Window {
    fn new(began: Instant) -> Self {
        Self {
            began,
            sum: 0.0,
            answers: 0,
            most_in_flight: 0,
            drops: 0,
        }
    }
}

impl Gradient {
    /// A limit at `settings.initial_limit`, its first window starting `now`.
    pub fn new(settings: AdmissionSettings, now: Instant) -> Self {
        Self {
            settings,
            limit: settings.initial_limit as f64,
            long: None,
            long_at: None,
            window: Window::new(now),
            recent: 0.0,
        }
    }

    /// The limit now.
    pub fn limit(&self) -> usize {
        self.limit as usize
    }

    /// The long-term latency, once measured.
    pub fn long_term(&self) -> Option<Duration> {
        self.long.map(Duration::from_secs_f64)
    }

    /// An answer at `now` that took `latency`, admitted when `in_flight` calls (itself
    /// included) were being served; the new limit when this answer closed a window.
    pub fn answered(&mut self, now: Instant, latency: Duration, in_flight: usize) -> Option<usize> {
        let w = &mut self.window;
        w.sum += latency.as_secs_f64();
        w.answers += 1;
        w.most_in_flight = w.most_in_flight.max(in_flight);
        self.close_window(now)
    }

    /// An answer at `now` that was an overload below ([`wire::OVERLOADED`]), admitted when
    /// `in_flight` calls were being served: an answer [`DROP_PENALTY`] times slower than
    /// the long-term latency (none before that is known). The new limit when it closed a
    /// window.
    pub fn dropped(&mut self, now: Instant, in_flight: usize) -> Option<usize> {
        let long = self.long?;
        self.window.drops += 1;
        self.answered(now, Duration::from_secs_f64(long * DROP_PENALTY), in_flight)
    }

    /// Closes the window if it is long and full enough; its answers' latency moves the
    /// limit.
    fn close_window(&mut self, now: Instant) -> Option<usize> {
        let w = &self.window;
        if w.answers < self.settings.window_answers
            || now.saturating_duration_since(w.began) < self.settings.window
        {
            return None;
        }
        let window = std::mem::replace(&mut self.window, Window::new(now));
        let short = window.sum / f64::from(window.answers);
        self.recent = short;
        self.update(now, short, window.most_in_flight);
        Some(self.limit())
    }

    /// One window's update; see the module docs.
    fn update(&mut self, now: Instant, short: f64, most_in_flight: usize) {
        let s = self.settings;
        let mut long = match (self.long, self.long_at) {
            (Some(long), Some(at)) => {
                let elapsed = now.saturating_duration_since(at).as_secs_f64();
                let weight = 1.0 - (-elapsed / s.long_term.as_secs_f64()).exp();
                long + (short - long) * weight
            }
            _ => short,
        };
        if long > 2.0 * short {
            long *= 0.95;
        }
        self.long = Some(long);
        self.long_at = Some(now);
        if (most_in_flight as f64) < self.limit / 2.0 {
            return;
        }
        let gradient = if short > 0.0 {
            (s.tolerance * long / short).clamp(0.5, 1.0)
        } else {
            1.0
        };
        let target = self.limit * gradient + self.limit.sqrt();
        let limit = self.limit * (1.0 - s.smoothing) + target * s.smoothing;
        self.limit = limit.clamp(s.min_limit as f64, s.max_limit as f64);
    }
}

/// Which class a call is admitted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// A caller's first attempt.
    First,
    /// A retry or a hedge (`grpc-previous-rpc-attempts` ≥ 1): refused first.
    Retry,
}

impl Priority {
    /// The class of a request by its headers.
    pub fn of(headers: &http::HeaderMap) -> Self {
        if wire::previous_attempts(headers) > 0 {
            Priority::Retry
        } else {
            Priority::First
        }
    }
}

/// One service's admission: calls in flight, the limit, and what was refused.
#[derive(Debug)]
pub struct ConcurrencyLimit {
    /// Calls admitted and not yet answered.
    in_flight: AtomicUsize,
    /// [`Gradient::limit`], readable without the lock.
    limit: AtomicUsize,
    /// The latency of a call now, in µs (the last window's mean): the pushback.
    recent_us: AtomicU64,
    /// Where the limit is computed.
    gradient: Mutex<Gradient>,
    /// The retry share, from the settings.
    retry_share: f64,
    /// First attempts refused, since start.
    shed_first: AtomicU64,
    /// Retries and hedges refused, since start.
    shed_retries: AtomicU64,
    /// Told how long each refusal took to answer (its body drained), for a histogram.
    on_refusal: Option<RefusalObserver>,
}

/// What [`ConcurrencyLimit::observing_refusals`] tells.
struct RefusalObserver(Box<dyn Fn(Duration) + Send + Sync>);

impl std::fmt::Debug for RefusalObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RefusalObserver")
    }
}

impl ConcurrencyLimit {
    /// A limit with `settings` (validated by the caller: see
    /// [`AdmissionSettings::validated`]).
    pub fn new(settings: AdmissionSettings) -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            limit: AtomicUsize::new(settings.initial_limit),
            recent_us: AtomicU64::new(0),
            gradient: Mutex::new(Gradient::new(settings, Instant::now())),
            retry_share: settings.retry_share,
            shed_first: AtomicU64::new(0),
            shed_retries: AtomicU64::new(0),
            on_refusal: None,
        }
    }

    /// The same limit, telling `observe` how long each refusal took to answer (from the
    /// call's arrival to the refusal, its body drained): the time an overloaded service
    /// costs the calls it does not serve.
    pub fn observing_refusals(
        mut self,
        observe: impl Fn(Duration) + Send + Sync + 'static,
    ) -> Self {
        self.on_refusal = Some(RefusalObserver(Box::new(observe)));
        self
    }

    /// The limit now.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Calls being served now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// First attempts and retries refused since start.
    pub fn shed(&self) -> (u64, u64) {
        (
            self.shed_first.load(Ordering::Relaxed),
            self.shed_retries.load(Ordering::Relaxed),
        )
    }

    /// A place for one call of `priority`, or the answer refusing it.
    pub fn try_admit(self: &Arc<Self>, priority: Priority) -> Result<Admitted, Box<Status>> {
        let limit = self.limit();
        let room = match priority {
            Priority::First => limit,
            Priority::Retry => ((limit as f64 * self.retry_share) as usize).max(1),
        };
        let before = self.in_flight.fetch_add(1, Ordering::AcqRel);
        if before >= room {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            let shed = match priority {
                Priority::First => &self.shed_first,
                Priority::Retry => &self.shed_retries,
            };
            shed.fetch_add(1, Ordering::Relaxed);
            return Err(Box::new(self.refusal(priority, before, limit)));
        }
        Ok(Admitted {
            limit: Arc::clone(self),
            admitted: Instant::now(),
            in_flight: before + 1,
            done: false,
        })
    }

    /// UNAVAILABLE, overloaded, with when to come back.
    fn refusal(&self, priority: Priority, in_flight: usize, limit: usize) -> Status {
        let pushback_ms = self.recent_us.load(Ordering::Relaxed).div_ceil(1000).max(1);
        let which = match priority {
            Priority::First => "",
            Priority::Retry => " (a retry is refused before first attempts are)",
        };
        let mut status = Status::unavailable(format!(
            "overloaded: this service is serving {in_flight} calls at its concurrency limit of {limit}{which}; come back in {pushback_ms} ms"
        ));
        wire::set_pushback(&mut status, pushback_ms as i64);
        wire::mark_overloaded(status.metadata_mut());
        status
    }

    /// A sample from an answered call.
    fn answered(&self, latency: Duration, in_flight: usize, overloaded_below: bool) {
        let now = Instant::now();
        let mut gradient = self.gradient.lock().unwrap_or_else(|p| p.into_inner());
        let closed = if overloaded_below {
            gradient.dropped(now, in_flight)
        } else {
            gradient.answered(now, latency, in_flight)
        };
        if let Some(limit) = closed {
            self.limit.store(limit, Ordering::Relaxed);
            self.recent_us
                .store(gradient.recent_us(), Ordering::Relaxed);
        }
    }
}

impl Gradient {
    /// The mean latency of the last closed window, in µs.
    fn recent_us(&self) -> u64 {
        (self.recent * 1e6) as u64
    }
}

/// A call's place under the limit: given back when dropped; [`Admitted::answered`] also
/// makes the call's time a sample.
#[derive(Debug)]
pub struct Admitted {
    /// Whose place.
    limit: Arc<ConcurrencyLimit>,
    /// When the call was admitted.
    admitted: Instant,
    /// Calls in flight once this one was admitted.
    in_flight: usize,
    /// Whether the place was already given back.
    done: bool,
}

impl Admitted {
    /// The call was answered now: its time is a sample.
    pub fn answered(mut self) {
        self.release();
        self.limit
            .answered(self.admitted.elapsed(), self.in_flight, false);
    }

    /// The call was answered now with a service below's refusal for overload: a drop.
    pub fn dropped(mut self) {
        self.release();
        self.limit.answered(Duration::ZERO, self.in_flight, true);
    }

    fn release(&mut self) {
        if !self.done {
            self.done = true;
            self.limit.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.release();
    }
}

/// The tower layer: every request through [`ConcurrencyLimit::try_admit`] by its
/// [`Priority`]; a refusal is the layer's error (a `Status`, for tonic's
/// `RecoverErrorLayer` to answer).
#[derive(Debug, Clone)]
pub struct AdmissionLayer {
    /// The limit, shared with whoever reports it.
    limit: Arc<ConcurrencyLimit>,
    /// Only this gRPC service's calls are limited (health checks and reflection must
    /// answer under overload: a probe that fails then restarts a busy service).
    only: Option<&'static str>,
}

impl AdmissionLayer {
    /// Admission under `limit`, for every call.
    pub fn new(limit: Arc<ConcurrencyLimit>) -> Self {
        Self { limit, only: None }
    }

    /// Limits only the calls of the gRPC service named `service` (`package.Service`).
    pub fn only_service(mut self, service: &'static str) -> Self {
        self.only = Some(service);
        self
    }
}

/// Whether `path` is `/<service>/<method>`.
fn is_method_of(path: &str, service: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|rest| rest.strip_prefix(service))
        .is_some_and(|rest| rest.starts_with('/'))
}

impl<S> tower::Layer<S> for AdmissionLayer {
    type Service = Admission<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Admission {
            inner,
            limit: Arc::clone(&self.limit),
            only: self.only,
        }
    }
}

/// The service [`AdmissionLayer`] makes.
#[derive(Debug, Clone)]
pub struct Admission<S> {
    /// The server's services.
    inner: S,
    /// The limit.
    limit: Arc<ConcurrencyLimit>,
    /// See [`AdmissionLayer::only_service`].
    only: Option<&'static str>,
}

impl<S, B, RB> tower::Service<http::Request<B>> for Admission<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Error: Into<tower::BoxError>,
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: Send,
{
    type Response = S::Response;
    type Error = tower::BoxError;
    type Future = AdmissionFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if let Some(service) = self.only
            && !is_method_of(request.uri().path(), service)
        {
            return AdmissionFuture::Admitted {
                future: self.inner.call(request),
                admitted: None,
            };
        }
        match self.limit.try_admit(Priority::of(request.headers())) {
            Ok(admitted) => AdmissionFuture::Admitted {
                future: self.inner.call(request),
                admitted: Some(admitted),
            },
            Err(status) => {
                let arrived = Instant::now();
                let body = request.into_body();
                if !body.is_end_stream() {
                    tokio::spawn(drain(body));
                }
                if let Some(observe) = &self.limit.on_refusal {
                    (observe.0)(arrived.elapsed());
                }
                AdmissionFuture::Refused {
                    status: Some(status),
                }
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`Admission`]: the call served under its place, or its refusal.
    #[project = AdmissionProj]
    #[allow(missing_docs)] // described above; the macro takes no field docs
    pub enum AdmissionFuture<F> {
        Admitted { #[pin] future: F, admitted: Option<Admitted> },
        Refused { status: Option<Box<Status>> },
    }
}

impl<F, RB, E> Future for AdmissionFuture<F>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
    E: Into<tower::BoxError>,
{
    type Output = Result<http::Response<RB>, tower::BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            AdmissionProj::Admitted { future, admitted } => {
                let answer = std::task::ready!(future.poll(cx));
                if let (Ok(response), Some(admitted)) = (&answer, admitted.take()) {
                    let headers = response.headers();
                    match Status::from_header_map(headers).map(|status| status.code()) {
                        // A caller that left says nothing about this server's speed.
                        Some(Code::Cancelled) => {}
                        Some(_) if wire::is_overloaded(headers) => admitted.dropped(),
                        _ => admitted.answered(),
                    }
                }
                Poll::Ready(answer.map_err(Into::into))
            }
            AdmissionProj::Refused { status } => match status.take() {
                Some(status) => Poll::Ready(Err(status)),
                None => Poll::Pending,
            },
        }
    }
}

/// Reads a refused request's body to its end, dropping it, for at most [`DRAIN_WITHIN`]
/// and [`DRAIN_AT_MOST`] bytes; see the module docs.
async fn drain<B>(mut body: B)
where
    B: http_body::Body + Unpin,
{
    use http_body_util::BodyExt;
    let _ = tokio::time::timeout(DRAIN_WITHIN, async {
        let mut read = 0;
        while read <= DRAIN_AT_MOST {
            match body.frame().await {
                Some(Ok(frame)) => read += frame.data_ref().map_or(0, bytes::Buf::remaining),
                _ => break,
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> AdmissionSettings {
        AdmissionSettings {
            initial_limit: 100,
            min_limit: 10,
            max_limit: 1000,
            ..AdmissionSettings::default()
        }
    }

    /// Feeds `windows` windows of answers at `latency`, `in_flight` at a time, each
    /// window 10 ms; the limit after.
    fn run(
        g: &mut Gradient,
        now: &mut Instant,
        windows: u32,
        latency: Duration,
        in_flight: usize,
    ) -> usize {
        for _ in 0..windows {
            *now += Duration::from_millis(10);
            for _ in 0..8 {
                g.answered(*now, latency, in_flight);
            }
        }
        g.limit()
    }

    #[test]
    fn a_limit_bound_service_at_steady_latency_grows() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now);
        let ms = Duration::from_millis(2);
        let after = run(&mut g, &mut now, 20, ms, 100);
        assert!(after > 100, "{after}");
        assert!(after <= 1000);
    }

    #[test]
    fn a_service_far_below_its_limit_keeps_it() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now);
        assert_eq!(run(&mut g, &mut now, 50, Duration::from_millis(2), 10), 100);
        // Even if it slows down: nothing queues, so the limit is not what to change.
        assert_eq!(
            run(&mut g, &mut now, 50, Duration::from_millis(20), 10),
            100
        );
    }

    #[test]
    fn queueing_latency_brings_the_limit_down_to_where_latency_is_within_tolerance() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now);
        run(&mut g, &mut now, 100, Duration::from_millis(2), 40);
        // A server that does 1 call per 100 µs: latency = in flight × 0.1 ms.
        let mut limit = g.limit();
        for _ in 0..300 {
            let latency = Duration::from_micros(100 * limit as u64);
            limit = run(&mut g, &mut now, 1, latency, limit);
        }
        // Latency stays within about tolerance × long-term (here 2 ms × 1.5 ≈ 3 ms) plus
        // the √limit headroom: well under the 10 ms of the initial limit.
        let latency_ms = limit as f64 * 0.1;
        assert!(latency_ms < 7.0, "limit {limit}, latency {latency_ms} ms");
        assert!(limit >= 10);
    }

    #[test]
    fn the_limit_never_leaves_its_bounds_and_falls_at_most_by_half_a_window() {
        let mut now = Instant::now();
        let mut g = Gradient::new(settings(), now);
        run(&mut g, &mut now, 10, Duration::from_millis(1), 100);
        let before = g.limit();
        let after = run(&mut g, &mut now, 1, Duration::from_secs(1), before);
        assert!(after as f64 >= before as f64 * 0.5 * 0.2 + before as f64 * 0.8 - 1.0);
        run(&mut g, &mut now, 500, Duration::from_secs(1), 1000);
        assert!(g.limit() >= 10);
    }

    #[test]
    fn retries_are_refused_before_first_attempts() {
        let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings::fixed(8)));
        let mut held = Vec::new();
        // 6 = 75% of 8: retries fit until then.
        for _ in 0..6 {
            held.push(limit.try_admit(Priority::Retry).expect("room for retries"));
        }
        let refused = limit
            .try_admit(Priority::Retry)
            .expect_err("retries shed first");
        assert_eq!(refused.code(), Code::Unavailable);
        assert!(
            refused.message().contains("overloaded"),
            "{}",
            refused.message()
        );
        assert!(matches!(
            wire::pushback(&refused),
            wire::Pushback::RetryAfter(_)
        ));
        held.push(
            limit
                .try_admit(Priority::First)
                .expect("first attempts still fit"),
        );
        held.push(
            limit
                .try_admit(Priority::First)
                .expect("first attempts still fit"),
        );
        assert!(limit.try_admit(Priority::First).is_err());
        assert_eq!(limit.shed(), (1, 1));
        drop(held);
        assert_eq!(limit.in_flight(), 0);
    }

    #[test]
    fn settings_out_of_order_are_refused() {
        let bad = AdmissionSettings {
            min_limit: 50,
            initial_limit: 10,
            ..AdmissionSettings::default()
        };
        assert!(bad.validated().is_err());
        assert!(AdmissionSettings::default().validated().is_ok());
        let share = AdmissionSettings {
            retry_share: 0.0,
            ..AdmissionSettings::default()
        };
        assert!(share.validated().is_err());
    }
}
