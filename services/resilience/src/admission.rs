//! Admission: refuse at the door, at once, only what cannot be served within its deadline,
//! fairly between callers, retries before first attempts.
//!
//! # Why
//!
//! A server that admits everything up to a fixed, generous number queues the excess of an
//! overload inside itself, where each queued call holds memory and everything below it,
//! and fails only when its deadline runs out; retries of those failures arrive on top.
//! That is the metastable failure this project is about. But a limit that follows latency
//! (Netflix's Gradient2, which this module used before, and Envoy's adaptive concurrency
//! filter) refuses as soon as calls queue at all, and queueing is not by itself overload:
//! measured on this chain, with 256 charges in flight and 5 s deadlines it served 47% where
//! admitting everything served 100% at a third more charges a second, every one well within
//! its deadline. What makes a call worth refusing is that it cannot be answered in time.
//!
//! # The decision
//!
//! Each call is predicted its time here from how fast this server drains its calls now, and
//! admitted when the prediction fits the time it has (CoDel's question — how long has the
//! queue made calls wait? — asked before the call joins it, as DAGOR and Breakwater do):
//!
//! ```text
//! every window (≥ 10 ms and ≥ 8 answers):
//!   per_call ← Σ latency / Σ calls in flight when each was admitted, if higher (at once);
//!              else an EWMA toward it (seconds each call in flight adds: 1 / drain rate)
//! a call arriving with n − 1 in flight:
//!   predicted = n × per_call
//!   budget    = min(its timeout − the server's reserve, the latency objective) × headroom
//!   admit when predicted ≤ budget (a retry or hedge: ≤ budget × retry_share),
//!   always while n ≤ min_limit, never past max_limit (the memory bound)
//! ```
//!
//! `per_call` is Little's law read off the calls themselves: a saturated server that drains
//! X calls a second answers a call admitted behind n others after about n / X; one that is
//! not saturated answers in its base latency whatever n is, and the estimate says so (its
//! ratio is base / n̄). Nothing has to be tuned to the machine or the load, and a deadline
//! that leaves room is never a reason to refuse.
//!
//! **At the door.** The edge admits with `headroom` 0.8, the services behind it with 1.0:
//! the edge's prediction includes every service below it (its latency is theirs plus its
//! own), so what it admits fits their deadlines too, and a service below refuses only what
//! the edge misjudged. A refusal from below that the edge relays is a **drop**: a sample as
//! slow as the call's whole budget (it did not fit), which raises `per_call` so that the
//! edge refuses the next such call itself.
//!
//! **Fairly.** At the edge each call carries a caller key (the caller's credentials, or
//! without any its connection: see `AdmissionLayer::keyed_by`). While the server is full
//! (a call's prediction does not fit), a caller holding fewer calls than its share —
//! `budget / per_call` calls (what fits) divided among the callers holding calls now — is
//! still admitted, and a caller at or over its share is refused: a caller using less than
//! its share is never refused because another uses more, and shares follow the server's
//! capacity, not a fixed number. Past 90% of `max_limit`, only callers under their share
//! are admitted, so the memory bound is not reached by one caller either.
//!
//! **Retries and hedges** (an attempt carrying `grpc-previous-rpc-attempts` ≥ 1) are
//! admitted only while their prediction fits [`AdmissionSettings::retry_share`] of their
//! budget (75%), and never under the fair-share exception: under overload they go first.
//!
//! # The refusal
//!
//! UNAVAILABLE at once (the message says overloaded; an A6 client retries UNAVAILABLE), with
//! `grpc-retry-pushback-ms` set to how much longer than its budget the call was predicted
//! to take (at least 1 ms): when about that much of the backlog will have drained. The
//! answer is marked [`wire::OVERLOADED`] so that a balancer above takes it as load, not a
//! fault. It comes before the call is authorised, its caller's token verified, its
//! metadata checked or its message decoded: a refusal costs the server microseconds.
//!
//! "At once" needs care with the request's body. Answered while the request's stream is
//! still open (its message not yet read), and with the body dropped, HTTP/2 (the `h2`
//! crate) resets the stream — a reset the server makes, which it counts against the
//! connection's allowance for protocol errors (the defence against "rapid reset" floods).
//! Under a sustained overload that allowance runs out and the whole connection is closed
//! (ENHANCE_YOUR_CALM), failing every call on it. So a refusal reads the body to its end
//! first, in a task of its own, for at most [`DRAIN_WITHIN`], while the refusal goes out at
//! once.
//!
//! # What is a sample
//!
//! The time from admission to the answer's headers, with the calls in flight when it was
//! admitted, for every answer but CANCELLED (the caller left; the time says nothing about
//! the server) and an error of the layers below (no answer). A DEADLINE_EXCEEDED is a
//! sample: a call that ran out of time is the slowness the estimate must see.

use std::{
    future::Future,
    hash::{Hash, Hasher},
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::time::Instant;
use tonic::{Code, Status};

use crate::{server_deadline::DeadlineLayer, wire};

/// The longest a refused request's body is waited for (see the module docs); a client
/// that has not sent it by then has its stream reset.
pub const DRAIN_WITHIN: Duration = Duration::from_millis(250);

/// The most request body a refusal reads (and drops) before answering anyway.
const DRAIN_AT_MOST: usize = 1024 * 1024;

/// How far past the calls in flight its drain rate was last measured at the estimate is
/// trusted (see [`ConcurrencyLimit::judge`]).
pub const GROWTH: usize = 2;

/// How much slower than its whole budget a call refused below counts (see
/// [`Admitted::dropped`]).
pub const DROP_PENALTY: f64 = 2.0;

/// Past this share of `max_limit`, only callers under their share are admitted.
const RESERVED_FOR_LIGHT_CALLERS: f64 = 0.9;

/// How calls are admitted; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionSettings {
    /// Before anything was measured, at most this many calls at once.
    pub initial_limit: usize,
    /// Up to this many calls at once are always admitted.
    pub min_limit: usize,
    /// Never more than this many at once (also the memory bound: `--max-in-flight`).
    pub max_limit: usize,
    /// The share of a call's time left that its predicted time here may take: below 1 at
    /// the edge (what it admits must fit the services below it too), 1 behind it.
    pub headroom: f64,
    /// Whether this service is where calls enter (a lone server; in a chain, its edge).
    /// At the door a call is admitted only while it is predicted to fit its time; a
    /// refusal from below that the door relays counts as a sample (a drop, see
    /// [`Admitted::dropped`]), so that it learns what the services behind it cannot take
    /// and refuses that itself; and its estimate is trusted only as far as it was
    /// measured (see [`GROWTH`]). Behind the door (`false`) a service serves what the door
    /// admitted, refusing only past its ceiling: predicting there too made each service
    /// refuse for the one below it calls the door had admitted, and a refusal at the ledger
    /// climbed the chain as refusals at every hop, after their work.
    pub door: bool,
    /// An operator's bound on the time a call may be predicted to take, whatever its
    /// deadline: shorter queues, at the price of refusing calls a long deadline would
    /// have let wait.
    pub latency_objective: Option<Duration>,
    /// How far one window moves the estimate toward its own measure (0 < s ≤ 1).
    pub smoothing: f64,
    /// A window lasts at least this long ...
    pub window: Duration,
    /// ... and holds at least this many answers.
    pub window_answers: u32,
    /// Retries and hedges are admitted only while their prediction fits this share of
    /// their budget, and only while the calls in flight are under this share of
    /// `max_limit` (0 < share ≤ 1).
    pub retry_share: f64,
}

impl Default for AdmissionSettings {
    fn default() -> Self {
        Self {
            initial_limit: 256,
            min_limit: 16,
            max_limit: 4096,
            headroom: 1.0,
            door: true,
            latency_objective: None,
            smoothing: 0.2,
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
        if !(s.headroom > 0.0 && s.headroom <= 1.0) {
            return Err(InvalidAdmission::Out("the headroom must be in (0, 1]"));
        }
        if !(s.smoothing > 0.0 && s.smoothing <= 1.0) {
            return Err(InvalidAdmission::Out("the smoothing must be in (0, 1]"));
        }
        if !(s.retry_share > 0.0 && s.retry_share <= 1.0) {
            return Err(InvalidAdmission::Out("the retry share must be in (0, 1]"));
        }
        if s.window_answers == 0 {
            return Err(InvalidAdmission::Out(
                "the answers per window must be positive",
            ));
        }
        if s.latency_objective.is_some_and(|o| o.is_zero()) {
            return Err(InvalidAdmission::Out(
                "the latency objective must be positive",
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

/// A caller, as admission tells callers apart (a hash of its credentials or connection;
/// see [`AdmissionLayer::keyed_by`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallerKey(pub u64);

impl CallerKey {
    /// The key of anything hashable (a token's bytes, an identity, a connection's number).
    pub fn of(value: impl Hash) -> Self {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        value.hash(&mut hasher);
        Self(hasher.finish())
    }
}

/// How many counters [`Holdings`] keeps.
const HOLDING_SLOTS: usize = 4096;

/// Calls in flight per caller, without a lock: every admitted call and every answer
/// counts here, and a lock taken that often was where refusals waited (a holder
/// preempted on a busy core held up the refusals behind it: at 1,500 calls in flight the
/// edge's refusals took 5 ms at p99 instead of 0.1). A caller's key picks one of
/// [`HOLDING_SLOTS`] counters; two callers whose keys pick the same one share it, and its
/// share (one chance in 4,096 for two callers; more, as with any hash, for thousands).
#[derive(Debug)]
struct Holdings {
    /// Calls held, per slot.
    slots: Box<[AtomicU32]>,
    /// Slots holding at least one call: the callers competing now.
    active: AtomicUsize,
}

impl Holdings {
    fn new() -> Self {
        Self {
            slots: (0..HOLDING_SLOTS).map(|_| AtomicU32::new(0)).collect(),
            active: AtomicUsize::new(0),
        }
    }

    fn slot(&self, caller: CallerKey) -> &AtomicU32 {
        &self.slots[(caller.0 % HOLDING_SLOTS as u64) as usize]
    }

    fn held(&self, caller: CallerKey) -> u32 {
        self.slot(caller).load(Ordering::Acquire)
    }

    /// One more call of `caller`.
    fn take(&self, caller: CallerKey) {
        if self.slot(caller).fetch_add(1, Ordering::AcqRel) == 0 {
            self.active.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// One more call of `caller` if it holds fewer than its share of `fit` (divided among
    /// the callers holding calls, itself included); whether it was taken. Checked and
    /// counted in one compare-and-swap: two calls of one caller at once cannot both take
    /// its last place.
    fn take_if_under_share(&self, caller: CallerKey, fit: usize) -> bool {
        let slot = self.slot(caller);
        let mut held = slot.load(Ordering::Acquire);
        loop {
            let active = self.active.load(Ordering::Acquire) + usize::from(held == 0);
            if held as usize >= (fit / active.max(1)).max(1) {
                return false;
            }
            match slot.compare_exchange_weak(held, held + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    if held == 0 {
                        self.active.fetch_add(1, Ordering::AcqRel);
                    }
                    return true;
                }
                Err(now) => held = now,
            }
        }
    }

    /// One call of `caller` answered.
    fn give_back(&self, caller: CallerKey) {
        if self.slot(caller).fetch_sub(1, Ordering::AcqRel) == 1 {
            self.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One call asking to be admitted.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    /// Its class.
    pub priority: Priority,
    /// The time it has here: its timeout less the server's reserve; `None`: unbounded.
    pub time: Option<Duration>,
    /// Its caller, where callers are told apart.
    pub caller: Option<CallerKey>,
}

impl Ask {
    /// A first attempt with `time`, from nobody in particular.
    pub fn first(time: Option<Duration>) -> Self {
        Self {
            priority: Priority::First,
            time,
            caller: None,
        }
    }
}

/// One service's admission: calls in flight, the drain estimate, callers' holdings and what
/// was refused.
#[derive(Debug)]
pub struct ConcurrencyLimit {
    /// The bounds and shares.
    settings: AdmissionSettings,
    /// Calls admitted and not yet answered.
    in_flight: AtomicUsize,
    /// [`Drain::per_call`] in nanoseconds (0: not yet measured), readable without the lock.
    per_call_ns: AtomicU64,
    /// The most calls in flight the last window's answers were admitted with: the
    /// estimate is trusted up to [`GROWTH`] times that, no further.
    measured_at: AtomicUsize,
    /// Where the estimate is computed.
    drain: Mutex<Drain>,
    /// Calls in flight per caller, where callers are told apart.
    callers: Holdings,
    /// The budget of the last call asked (for [`ConcurrencyLimit::limit`]).
    typical_budget: AtomicU64,
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

/// What [`ConcurrencyLimit::judge`] decided.
#[derive(Debug, Clone, Copy)]
enum Verdict {
    /// In.
    Admit,
    /// In if its caller holds fewer calls than its share of `fit` (the calls that fit);
    /// else refused for `full`.
    IfUnderShare { full: Full, fit: usize },
    /// Refused.
    Refuse(Full),
}

/// Why a call was not admitted, for its refusal's message.
#[derive(Debug, Clone, Copy)]
enum Full {
    /// `max_limit` reached.
    Ceiling,
    /// Its predicted time does not fit its budget.
    Late {
        predicted: Duration,
        budget: Duration,
    },
    /// Past the reserve of `max_limit` kept for callers under their share.
    Reserved,
    /// Past what the estimate was measured at (see [`GROWTH`]); `round`: how long the
    /// calls measured took.
    Unproven { measured_at: usize, round: Duration },
}

impl ConcurrencyLimit {
    /// Admission with `settings` (validated by the caller: see
    /// [`AdmissionSettings::validated`]).
    pub fn new(settings: AdmissionSettings) -> Self {
        Self {
            settings,
            in_flight: AtomicUsize::new(0),
            per_call_ns: AtomicU64::new(0),
            measured_at: AtomicUsize::new(0),
            drain: Mutex::new(Drain::new(settings, Instant::now())),
            callers: Holdings::new(),
            typical_budget: AtomicU64::new(0),
            shed_first: AtomicU64::new(0),
            shed_retries: AtomicU64::new(0),
            on_refusal: None,
        }
    }

    /// The same admission, telling `observe` how long each refusal took to answer (from
    /// the call's arrival to the refusal, its body drained): the time an overloaded service
    /// costs the calls it does not serve.
    pub fn observing_refusals(
        mut self,
        observe: impl Fn(Duration) + Send + Sync + 'static,
    ) -> Self {
        self.on_refusal = Some(RefusalObserver(Box::new(observe)));
        self
    }

    /// How many calls at once fit the budget of the last call asked now (the concurrency
    /// this server admits to), within its bounds: what `Stats` and `/metrics` report as
    /// its concurrency limit.
    pub fn limit(&self) -> usize {
        let s = &self.settings;
        let per_call = self.per_call_ns.load(Ordering::Relaxed);
        let budget = self.typical_budget.load(Ordering::Relaxed);
        if per_call == 0 || budget == 0 {
            return s.initial_limit;
        }
        ((budget / per_call) as usize).clamp(s.min_limit, s.max_limit)
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

    /// Calls `caller` holds now (with any caller whose key shares its counter: see
    /// [`Holdings`]).
    pub fn held_by(&self, caller: CallerKey) -> u32 {
        self.callers.held(caller)
    }

    /// The budget of a call with `time` here: the share of it a prediction may take.
    fn budget(&self, time: Option<Duration>) -> Option<Duration> {
        let s = &self.settings;
        let time = match (time, s.latency_objective) {
            (Some(time), Some(objective)) => Some(time.min(objective)),
            (time, objective) => time.or(objective),
        }?;
        Some(time.mul_f64(s.headroom))
    }

    /// A place for `ask`, or the answer refusing it.
    pub fn try_admit(self: &Arc<Self>, ask: Ask) -> Result<Admitted, Box<Status>> {
        let n = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let budget = self.budget(ask.time);
        if let Some(budget) = budget {
            self.typical_budget
                .store(budget.as_nanos() as u64, Ordering::Relaxed);
        }
        let verdict = match (self.judge(&ask, n, budget), ask.caller) {
            (Verdict::Admit, Some(caller)) => {
                self.callers.take(caller);
                Ok(())
            }
            (Verdict::Admit, None) => Ok(()),
            (Verdict::IfUnderShare { full, fit }, Some(caller)) => {
                if self.callers.take_if_under_share(caller, fit) {
                    Ok(())
                } else {
                    Err(full)
                }
            }
            (Verdict::IfUnderShare { full, .. } | Verdict::Refuse(full), _) => Err(full),
        };
        match verdict {
            Ok(()) => Ok(Admitted {
                limit: Arc::clone(self),
                admitted: Instant::now(),
                in_flight: n,
                budget,
                caller: ask.caller,
                done: false,
            }),
            Err(full) => {
                self.in_flight.fetch_sub(1, Ordering::AcqRel);
                let shed = match ask.priority {
                    Priority::First => &self.shed_first,
                    Priority::Retry => &self.shed_retries,
                };
                shed.fetch_add(1, Ordering::Relaxed);
                Err(Box::new(refusal(ask.priority, n - 1, full)))
            }
        }
    }

    /// Whether the `n`th call in flight, `ask`, may be served; see the module docs.
    fn judge(&self, ask: &Ask, n: usize, budget: Option<Duration>) -> Verdict {
        let s = &self.settings;
        let share = match ask.priority {
            Priority::First => 1.0,
            Priority::Retry => s.retry_share,
        };
        let scaled = |limit: usize| ((limit as f64 * share) as usize).max(1);
        if n > scaled(s.max_limit) {
            return Verdict::Refuse(Full::Ceiling);
        }
        if n <= scaled(s.min_limit) {
            return Verdict::Admit;
        }
        // Behind the door, what the door admitted is served: only the ceiling refuses.
        if !s.door {
            return Verdict::Admit;
        }
        let per_call = self.per_call_ns.load(Ordering::Relaxed);
        // Nothing measured yet: the initial limit, for every caller.
        if per_call == 0 {
            return if n <= scaled(s.initial_limit) {
                Verdict::Admit
            } else {
                Verdict::Refuse(Full::Ceiling)
            };
        }
        // The estimate holds as far as it was measured, and a little further: a burst far
        // past that (1,500 calls at once on a service that answered 20 at a time) must not
        // be admitted on the strength of the small queue's latency, since the answers that
        // would show the deep one's arrive only after it has waited. Admitted calls then
        // measure it, and the bound doubles each time they do (TCP's slow start).
        let measured_at = self.measured_at.load(Ordering::Relaxed);
        let proven = scaled(s.min_limit.max(GROWTH * measured_at));
        // What fits: the calls in flight the budget covers at this drain rate (no deadline
        // and no objective: the ceiling alone bounds it).
        let (fits, fit) = match budget {
            None => (Ok(()), s.max_limit),
            Some(budget) => {
                let allowed = budget.mul_f64(share);
                let predicted = Duration::from_nanos(per_call.saturating_mul(n as u64));
                let fit = (budget.as_nanos() / u128::from(per_call)).min(s.max_limit as u128);
                let fits = if predicted <= allowed {
                    Ok(())
                } else {
                    Err(Full::Late {
                        predicted,
                        budget: allowed,
                    })
                };
                (fits, fit as usize)
            }
        };
        let fits = fits.and(if n <= proven {
            Ok(())
        } else {
            Err(Full::Unproven {
                measured_at,
                round: Duration::from_nanos(per_call.saturating_mul(measured_at as u64)),
            })
        });
        let reserved = n as f64 > s.max_limit as f64 * RESERVED_FOR_LIGHT_CALLERS;
        match (fits, ask.priority, ask.caller.is_some()) {
            (Ok(()), _, _) if !reserved => Verdict::Admit,
            (Ok(()), _, false) => Verdict::Admit,
            // Full, or in the reserve kept below the ceiling: a first attempt of a caller
            // under its share still goes in. The share is of what fits, and never of the
            // reserve itself.
            (fits, Priority::First, true) => Verdict::IfUnderShare {
                full: fits.err().unwrap_or(Full::Reserved),
                fit: fit.min((s.max_limit as f64 * RESERVED_FOR_LIGHT_CALLERS) as usize),
            },
            (fits, _, _) => Verdict::Refuse(fits.err().unwrap_or(Full::Reserved)),
        }
    }

    /// A sample from an answered call.
    fn answered(&self, latency: Duration, in_flight: usize) {
        let now = Instant::now();
        let mut drain = self.drain.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((per_call, most_in_flight)) = drain.answered(now, latency, in_flight) {
            self.per_call_ns
                .store(((per_call * 1e9) as u64).max(1), Ordering::Relaxed);
            self.measured_at.store(most_in_flight, Ordering::Relaxed);
        }
    }

    fn release(&self, caller: Option<CallerKey>) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        if let Some(caller) = caller {
            self.callers.give_back(caller);
        }
    }
}

/// UNAVAILABLE, overloaded, with when to come back.
fn refusal(priority: Priority, in_flight: usize, full: Full) -> Status {
    let which = match priority {
        Priority::First => "",
        Priority::Retry => " (retries are refused before first attempts)",
    };
    let (pushback, message) = match full {
        Full::Ceiling => (
            Duration::from_millis(100),
            format!(
                "overloaded: this service is serving {in_flight} calls, its most at once{which}"
            ),
        ),
        Full::Reserved => (
            Duration::from_millis(100),
            format!(
                "overloaded: this service is serving {in_flight} calls; the rest of its room is kept for callers holding less than their share{which}"
            ),
        ),
        Full::Unproven { measured_at, round } => (
            round,
            format!(
                "overloaded: this service is serving {in_flight} calls and has been measured draining at most {measured_at} at once{which}"
            ),
        ),
        Full::Late { predicted, budget } => (
            predicted.saturating_sub(budget).min(budget),
            format!(
                "overloaded: behind the {in_flight} calls in flight this one would take about {} ms, more than the {} ms it may{which}",
                predicted.as_millis(),
                budget.as_millis()
            ),
        ),
    };
    let pushback_ms = (pushback.as_millis() as i64).max(1);
    let mut status = Status::unavailable(format!("{message}; come back in {pushback_ms} ms"));
    wire::set_pushback(&mut status, pushback_ms);
    wire::mark_overloaded(status.metadata_mut());
    status
}

/// A call's place: given back when dropped; [`Admitted::answered`] also makes the call's
/// time a sample.
#[derive(Debug)]
pub struct Admitted {
    /// Whose place.
    limit: Arc<ConcurrencyLimit>,
    /// When the call was admitted.
    admitted: Instant,
    /// Calls in flight once this one was admitted.
    in_flight: usize,
    /// The share of its time it was allowed here.
    budget: Option<Duration>,
    /// Its caller, where callers are told apart.
    caller: Option<CallerKey>,
    /// Whether the place was already given back.
    done: bool,
}

impl Admitted {
    /// The call was answered now: its time is a sample.
    pub fn answered(mut self) {
        self.release();
        self.limit.answered(self.admitted.elapsed(), self.in_flight);
    }

    /// The call was answered now with a service below's refusal for overload: a drop, a
    /// sample [`DROP_PENALTY`] times as slow as its whole budget (it did not fit below; a
    /// sample of the budget itself would leave the next such call predicted just inside
    /// it).
    pub fn dropped(mut self) {
        self.release();
        if !self.limit.settings.door {
            return;
        }
        let elapsed = self.admitted.elapsed();
        let latency = self
            .budget
            .unwrap_or(elapsed)
            .max(elapsed)
            .mul_f64(DROP_PENALTY);
        self.limit.answered(latency, self.in_flight);
    }

    fn release(&mut self) {
        if !self.done {
            self.done = true;
            self.limit.release(self.caller);
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.release();
    }
}

/// How a caller is told apart from the request's headers and extensions (the connection's
/// peer, its credentials); `None`: not at all.
pub type KeyOf =
    Arc<dyn Fn(&http::HeaderMap, &http::Extensions) -> Option<CallerKey> + Send + Sync>;

/// The tower layer: every request through [`ConcurrencyLimit::try_admit`]; a refusal is
/// the layer's error (a `Status`, for tonic's `RecoverErrorLayer` to answer).
#[derive(Clone)]
pub struct AdmissionLayer {
    /// The limit, shared with whoever reports it.
    limit: Arc<ConcurrencyLimit>,
    /// Only this gRPC service's calls are limited (health checks and reflection must
    /// answer under overload: a probe that fails then restarts a busy service).
    only: Option<&'static str>,
    /// Each call's time, as the server's deadline layer will give it.
    deadlines: Option<DeadlineLayer>,
    /// Who the caller is, where callers are told apart.
    key_of: Option<KeyOf>,
}

impl std::fmt::Debug for AdmissionLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionLayer")
            .field("limit", &self.limit)
            .field("only", &self.only)
            .field("deadlines", &self.deadlines)
            .field("keyed", &self.key_of.is_some())
            .finish()
    }
}

impl AdmissionLayer {
    /// Admission under `limit`, for every call, with no deadline known.
    pub fn new(limit: Arc<ConcurrencyLimit>) -> Self {
        Self {
            limit,
            only: None,
            deadlines: None,
            key_of: None,
        }
    }

    /// Limits only the calls of the gRPC service named `service` (`package.Service`).
    pub fn only_service(mut self, service: &'static str) -> Self {
        self.only = Some(service);
        self
    }

    /// Each call's time is what `deadlines` (the server's own deadline layer, further in)
    /// will give it: its `grpc-timeout`, or the default, capped, less the reserve.
    pub fn deadlines(mut self, deadlines: DeadlineLayer) -> Self {
        self.deadlines = Some(deadlines);
        self
    }

    /// Tells callers apart by `key_of`, for fair shares (the edge: see the module docs).
    pub fn keyed_by(mut self, key_of: KeyOf) -> Self {
        self.key_of = Some(key_of);
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
            layer: self.clone(),
        }
    }
}

/// The service [`AdmissionLayer`] makes.
#[derive(Clone, Debug)]
pub struct Admission<S> {
    /// The server's services.
    inner: S,
    /// The limit and how calls are read.
    layer: AdmissionLayer,
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
        let layer = &self.layer;
        if let Some(service) = layer.only
            && !is_method_of(request.uri().path(), service)
        {
            return AdmissionFuture::Admitted {
                future: self.inner.call(request),
                admitted: None,
            };
        }
        let arrived = Instant::now();
        let time = layer.deadlines.as_ref().and_then(|deadlines| {
            let timeout = deadlines.timeout_for(request.uri().path(), request.headers())?;
            Some(timeout.saturating_sub(deadlines.reserve()))
        });
        let ask = Ask {
            priority: Priority::of(request.headers()),
            time,
            caller: layer
                .key_of
                .as_ref()
                .and_then(|key_of| key_of(request.headers(), request.extensions())),
        };
        match layer.limit.try_admit(ask) {
            Ok(admitted) => AdmissionFuture::Admitted {
                future: self.inner.call(request),
                admitted: Some(admitted),
            },
            Err(status) => {
                drain_soon(request.into_body());
                if let Some(observe) = &layer.limit.on_refusal {
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
                    if response
                        .extensions()
                        .get::<crate::server_deadline::Unserved>()
                        .is_some()
                    {
                        // Never served (its body never came): no sample.
                        return Poll::Ready(answer.map_err(Into::into));
                    }
                    match Status::from_header_map(headers).map(|status| status.code()) {
                        // A caller that left, or a call refused before any work (its
                        // credentials, its deadline header, its method), says nothing
                        // about how fast this server drains its calls.
                        Some(
                            Code::Cancelled
                            | Code::InvalidArgument
                            | Code::Unimplemented
                            | Code::Unauthenticated
                            | Code::PermissionDenied
                            | Code::ResourceExhausted,
                        ) => {}
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

/// Reads a refused request's body to its end, dropping it, in a task of its own (see the
/// module docs). Not inline: reading a stream's data takes its HTTP/2 connection's lock,
/// which the connection's own task holds while it reads frames, and a refusal waiting for
/// it behind a busy connection on a busy core took milliseconds (p99 5 ms at 1,500 calls
/// in flight, against 0.1 ms with the read in a task).
fn drain_soon<B>(body: B)
where
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: Send,
{
    if !body.is_end_stream() {
        tokio::spawn(drain(body, 0));
    }
}

/// Reads a refused request's body to its end, dropping it, for at most [`DRAIN_WITHIN`]
/// and [`DRAIN_AT_MOST`] bytes; see the module docs.
async fn drain<B>(mut body: B, mut read: usize)
where
    B: http_body::Body + Unpin,
{
    use http_body_util::BodyExt;
    let _ = tokio::time::timeout(DRAIN_WITHIN, async {
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

    /// Feeds `windows` windows of 8 answers each, 10 ms apart, at `latency`, each admitted
    /// with `in_flight` calls in flight; the estimate after, in seconds.
    fn run(
        d: &mut Drain,
        now: &mut Instant,
        windows: u32,
        latency: Duration,
        in_flight: usize,
    ) -> f64 {
        for _ in 0..windows {
            *now += Duration::from_millis(10);
            for _ in 0..8 {
                d.answered(*now, latency, in_flight);
            }
        }
        d.per_call().expect("measured")
    }

    #[test]
    fn a_saturated_server_is_measured_by_its_drain_rate() {
        // One call per 100 µs, whatever the queue: latency = calls in flight × 0.1 ms.
        let mut now = Instant::now();
        let mut d = Drain::new(AdmissionSettings::default(), now);
        for in_flight in [10, 100, 1000, 40] {
            let latency = Duration::from_micros(100 * in_flight as u64);
            let per_call = run(&mut d, &mut now, 30, latency, in_flight);
            assert!((per_call - 100e-6).abs() < 1e-6, "{per_call}");
            assert_eq!(d.per_call(), Some(per_call));
        }
    }

    #[test]
    fn an_unsaturated_server_predicts_its_own_latency() {
        // 2 ms whatever the load, 4 in flight: 0.5 ms a call in flight, so a fifth call is
        // predicted 2.5 ms — its latency and a little, not the queue of a busy server.
        let mut now = Instant::now();
        let mut d = Drain::new(AdmissionSettings::default(), now);
        let per_call = run(&mut d, &mut now, 50, Duration::from_millis(2), 4);
        assert!((per_call * 5.0 - 2.5e-3).abs() < 1e-5, "{per_call}");
    }

    /// As if `per_call` had been measured with calls up to the ceiling in flight.
    fn measured(limit: &ConcurrencyLimit, per_call: Duration) {
        limit
            .per_call_ns
            .store(per_call.as_nanos() as u64, Ordering::Relaxed);
        limit.measured_at.store(4096, Ordering::Relaxed);
    }

    #[test]
    fn a_burst_far_past_what_was_measured_is_admitted_as_it_is_measured() {
        let door = AdmissionSettings {
            door: true,
            ..AdmissionSettings::default()
        };
        let limit = Arc::new(ConcurrencyLimit::new(door));
        measured(&limit, Duration::from_millis(1));
        // Measured with 20 in flight: trusted to 40, though 4,000 would fit the budget.
        limit.measured_at.store(20, Ordering::Relaxed);
        let mut held: Vec<Admitted> = (0..40)
            .map(|_| {
                limit
                    .try_admit(first(5000))
                    .expect("within twice the measure")
            })
            .collect();
        let refused = limit.try_admit(first(5000)).expect_err("past it");
        assert!(
            refused.message().contains("measured"),
            "{}",
            refused.message()
        );
        assert_eq!(
            wire::pushback(&refused),
            wire::Pushback::RetryAfter(Duration::from_millis(20)),
            "come back when those measured have drained"
        );
        // The answers of calls admitted with 40 in flight move the bound to 80.
        limit.measured_at.store(40, Ordering::Relaxed);
        held.extend((40..80).map(|_| limit.try_admit(first(5000)).expect("measured further")));
        assert!(limit.try_admit(first(5000)).is_err());
        drop(held);
    }

    fn first(time_ms: u64) -> Ask {
        Ask::first(Some(Duration::from_millis(time_ms)))
    }

    #[test]
    fn everything_that_fits_its_deadline_is_admitted_however_deep_the_queue() {
        // 1,000 calls a second and a 5 s deadline: 1,500 at once wait 1.5 s each. Queueing,
        // not overload: every one is admitted (a latency target would have refused most).
        let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings::default()));
        measured(&limit, Duration::from_millis(1));
        let held: Vec<Admitted> = (0..1500)
            .map(|_| limit.try_admit(first(5000)).expect("fits its deadline"))
            .collect();
        assert_eq!(limit.in_flight(), 1500);
        assert_eq!(limit.shed(), (0, 0));
        drop(held);
        assert_eq!(limit.in_flight(), 0);
    }

    #[test]
    fn a_call_that_cannot_fit_its_deadline_is_refused_at_once_retries_first() {
        let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings::default()));
        // 10 ms a call in flight, 1 s each: 100 fit, retries until 75.
        measured(&limit, Duration::from_millis(10));
        let mut held: Vec<Admitted> = (0..75)
            .map(|_| limit.try_admit(first(1000)).expect("fits"))
            .collect();
        let retry = Ask {
            priority: Priority::Retry,
            ..first(1000)
        };
        let refused = limit
            .try_admit(retry)
            .expect_err("a retry is refused first");
        assert!(
            refused.message().contains("retries"),
            "{}",
            refused.message()
        );
        held.extend((75..100).map(|_| limit.try_admit(first(1000)).expect("first attempts fit")));
        let refused = limit
            .try_admit(first(1000))
            .expect_err("the 101st would take 1.01 s");
        assert_eq!(refused.code(), Code::Unavailable);
        assert!(
            refused.message().contains("overloaded"),
            "{}",
            refused.message()
        );
        assert!(wire::is_overloaded(
            &refused.metadata().clone().into_headers()
        ));
        assert_eq!(
            wire::pushback(&refused),
            wire::Pushback::RetryAfter(Duration::from_millis(10)),
            "come back when about that much more has drained"
        );
        // A call with a longer deadline still fits.
        held.push(limit.try_admit(first(2000)).expect("2 s leave room"));
        assert_eq!(limit.shed(), (1, 1));
        assert_eq!(limit.limit(), 200, "the last call's 2 s at 10 ms a call");
    }

    #[test]
    fn a_latency_objective_bounds_the_queue_whatever_the_deadline() {
        let settings = AdmissionSettings {
            latency_objective: Some(Duration::from_millis(100)),
            ..AdmissionSettings::default()
        };
        let limit = Arc::new(ConcurrencyLimit::new(settings));
        measured(&limit, Duration::from_millis(1));
        let held: Vec<Admitted> = (0..100)
            .map(|_| {
                limit
                    .try_admit(first(60_000))
                    .expect("within the objective")
            })
            .collect();
        assert!(limit.try_admit(first(60_000)).is_err());
        drop(held);
    }

    #[test]
    fn the_min_and_max_bound_it_whatever_is_measured() {
        let settings = AdmissionSettings {
            min_limit: 20,
            max_limit: 50,
            ..AdmissionSettings::default()
        };
        let limit = Arc::new(ConcurrencyLimit::new(settings));
        measured(&limit, Duration::from_secs(1));
        // 20 always go in, even predicted far past their deadline ...
        let mut held: Vec<Admitted> = (0..20)
            .map(|_| limit.try_admit(first(10)).expect("under the floor"))
            .collect();
        assert!(limit.try_admit(first(10)).is_err());
        // ... and never more than 50, however long the deadline.
        measured(&limit, Duration::from_nanos(1));
        held.extend((20..50).map(|_| limit.try_admit(first(10)).expect("fits")));
        let refused = limit.try_admit(first(60_000)).expect_err("the ceiling");
        assert!(
            refused.message().contains("most at once"),
            "{}",
            refused.message()
        );
    }

    #[test]
    fn a_caller_under_its_share_is_never_refused_because_another_holds_more() {
        let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings::default()));
        // 10 ms a call in flight and 1 s: 100 calls fit.
        measured(&limit, Duration::from_millis(10));
        let (greedy, light) = (CallerKey::of("greedy"), CallerKey::of("light"));
        let ask = |caller| Ask {
            caller: Some(caller),
            ..first(1000)
        };
        let mut held = Vec::new();
        let mut refused = 0;
        for _ in 0..600 {
            match limit.try_admit(ask(greedy)) {
                Ok(admitted) => held.push(admitted),
                Err(status) => {
                    assert_eq!(status.code(), Code::Unavailable);
                    assert!(matches!(
                        wire::pushback(&status),
                        wire::Pushback::RetryAfter(_)
                    ));
                    refused += 1;
                }
            }
        }
        assert_eq!(held.len(), 100, "the greedy caller fills what fits");
        assert_eq!(refused, 500);
        // Full, yet the light caller's calls, one at a time, all go in.
        for _ in 0..1000 {
            let call = limit.try_admit(ask(light)).expect("under its share");
            drop(call);
        }
        // While it holds one, the greedy caller (at 100, over its share of 50) is refused.
        let one = limit.try_admit(ask(light)).expect("under its share");
        assert!(limit.try_admit(ask(greedy)).is_err());
        assert_eq!(limit.held_by(light), 1);
        drop(one);
        drop(held);
        assert_eq!(limit.held_by(greedy), 0);
        assert_eq!(limit.in_flight(), 0);
    }

    #[test]
    fn retries_are_refused_before_first_attempts_under_a_fixed_limit() {
        let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings::fixed(8)));
        let retry = Ask {
            priority: Priority::Retry,
            ..Ask::first(None)
        };
        let mut held = Vec::new();
        // 6 = 75% of 8: retries fit until then.
        for _ in 0..6 {
            held.push(limit.try_admit(retry).expect("room for retries"));
        }
        let refused = limit.try_admit(retry).expect_err("retries shed first");
        assert_eq!(refused.code(), Code::Unavailable);
        assert!(matches!(
            wire::pushback(&refused),
            wire::Pushback::RetryAfter(_)
        ));
        held.push(
            limit
                .try_admit(Ask::first(None))
                .expect("first attempts fit"),
        );
        held.push(
            limit
                .try_admit(Ask::first(None))
                .expect("first attempts fit"),
        );
        assert!(limit.try_admit(Ask::first(None)).is_err());
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
        for bad in [
            AdmissionSettings {
                retry_share: 0.0,
                ..AdmissionSettings::default()
            },
            AdmissionSettings {
                headroom: 1.5,
                ..AdmissionSettings::default()
            },
            AdmissionSettings {
                latency_objective: Some(Duration::ZERO),
                ..AdmissionSettings::default()
            },
        ] {
            assert!(bad.validated().is_err(), "{bad:?}");
        }
    }
}
