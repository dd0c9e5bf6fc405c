//! The concurrency limit itself: whether one more call is admitted, in which class,
//! refused with what, and what its answer teaches the estimate.

use std::{
    collections::VecDeque,
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};
use tonic::Status;

use super::{
    drain::{Drain, Outcome},
    fairness::{CallerKey, Holdings, Priority},
    settings::AdmissionSettings,
};
use crate::wire;

/// How far past the calls in flight its drain rate was last measured at the estimate is
/// trusted (see [`ConcurrencyLimit::judge`]).
pub const GROWTH: usize = 2;

/// How much slower than its whole budget a call refused below counts (see
/// [`Admitted::dropped`]).
pub const DROP_PENALTY: f64 = 2.0;

/// Past this share of `max_limit`, only callers under their share are admitted.
const RESERVED_FOR_LIGHT_CALLERS: f64 = 0.9;

/// How much one place given while calls wait at the door moves the line's share of them
/// (see [`ConcurrencyLimit::line_share`]): about the last 32 places given count.
const LINE_SHARE_WEIGHT: f64 = 1.0 / 32.0;

/// The least share of places a line is predicted to get, so that a line passed by every
/// call for a while is still predicted to move (slowly: 64 places a turn).
const LEAST_LINE_SHARE: f64 = 1.0 / 64.0;

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
    /// [`Drain::per_call`] in nanoseconds (0: not measured, or only failures measured since
    /// a start: see [`Drain::idle`]), readable without the lock.
    pub(super) per_call_ns: AtomicU64,
    /// [`Drain::of_failures`], readable without the lock.
    of_failures: AtomicBool,
    /// The most calls in flight the last window's answers were admitted with: the
    /// estimate is trusted up to [`GROWTH`] times that, no further.
    pub(super) measured_at: AtomicUsize,
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
    pub(super) on_refusal: Option<RefusalObserver>,
    /// First attempts waiting at the door for a place (see [`ConcurrencyLimit::enter`]).
    waiting: AtomicUsize,
    /// Calls served since start (answered, not failed below): how far the line at the door
    /// moved while a call waited in it.
    answers: AtomicU64,
    /// Where they wait, first come first served: only the first is woken as a place is
    /// given back, and it keeps its place while it does not fit (a queue of its own, not
    /// a `Notify` every waiter listens to, so that a call woken too early does not go to
    /// the back of the line).
    queue: Mutex<VecDeque<Arc<Notify>>>,
    /// [`ConcurrencyLimit::line_share`] (an `f64`'s bits).
    line_share: AtomicU64,
}

/// What the door does with a call (see [`ConcurrencyLimit::enter`]).
#[derive(Debug)]
pub enum Entry {
    /// In, now.
    Admitted(Admitted),
    /// Refused, now.
    Refused(Box<Status>),
    /// It does not fit now but will within the time it may wait: wait for a place with
    /// [`ConcurrencyLimit::wait_for_place`].
    Wait,
}

/// What [`ConcurrencyLimit::observing_refusals`] tells.
pub(super) struct RefusalObserver(pub(super) Box<dyn Fn(Duration) + Send + Sync>);

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
    /// Behind the calls in flight and `waiting` calls in a line that gets `share` of the
    /// places given while it waits, it would take `predicted`, more than `may`.
    Line {
        waiting: usize,
        share: f64,
        predicted: Duration,
        may: Duration,
    },
    /// Past what the estimate was measured at (see [`GROWTH`]); `round`: how long the
    /// calls measured took.
    Unproven { measured_at: usize, round: Duration },
    /// Let wait at the door, its wait over: at the pace the chain answered calls while
    /// it waited (`answered` in `waited`), it would take `predicted` (none: nothing was
    /// answered), more than `may`.
    Stalled {
        answered: u64,
        predicted: Option<Duration>,
        may: Duration,
    },
}

impl ConcurrencyLimit {
    /// Admission with `settings` (validated by the caller: see
    /// [`AdmissionSettings::validated`]).
    pub fn new(settings: AdmissionSettings) -> Self {
        Self {
            settings,
            in_flight: AtomicUsize::new(0),
            per_call_ns: AtomicU64::new(0),
            of_failures: AtomicBool::new(false),
            measured_at: AtomicUsize::new(0),
            drain: Mutex::new(Drain::new(settings, Instant::now())),
            callers: Holdings::new(),
            typical_budget: AtomicU64::new(0),
            shed_first: AtomicU64::new(0),
            shed_retries: AtomicU64::new(0),
            on_refusal: None,
            waiting: AtomicUsize::new(0),
            answers: AtomicU64::new(0),
            queue: Mutex::new(VecDeque::new()),
            line_share: AtomicU64::new(1f64.to_bits()),
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

    /// Calls waiting at the door for a place now (see [`ConcurrencyLimit::enter`]).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
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

    /// The time a call with `time` here is judged by: the shorter of it and the latency
    /// objective.
    fn judged_time(&self, time: Option<Duration>) -> Option<Duration> {
        match (time, self.settings.latency_objective) {
            (Some(time), Some(objective)) => Some(time.min(objective)),
            (time, objective) => time.or(objective),
        }
    }

    /// The budget of a call with `time` here: the share of it a prediction may take.
    fn budget(&self, time: Option<Duration>) -> Option<Duration> {
        Some(self.judged_time(time)?.mul_f64(self.settings.headroom))
    }

    /// How long a first attempt with `time` here may wait at the door for a place.
    fn wait_allowance(&self, time: Option<Duration>) -> Duration {
        self.judged_time(time)
            .map_or(Duration::ZERO, |t| t.mul_f64(self.settings.wait_share))
    }

    /// A place for `ask`, or the answer refusing it, now.
    pub fn try_admit(self: &Arc<Self>, ask: Ask) -> Result<Admitted, Box<Status>> {
        self.admit(ask, false)
            .map_err(|(full, n)| self.refuse(ask, n, full))
    }

    /// At the door: a place for `ask` now, its refusal now, or — when it does not fit now
    /// (its prediction, by an estimate measured this deep, is over its budget) but
    /// it would go in within the time it may wait ([`AdmissionSettings::wait_share`]),
    /// judged by the time it will have left — [`Entry::Wait`]. Queueing is
    /// not overload: a call that can be served in time waits at the door, where it holds
    /// nothing below and costs no CPU, rather than being refused and sent again at once
    /// by a client that does not wait out the pushback. The chain below still holds no
    /// more than the budget's worth, so a stall after admission leaves the admitted calls
    /// room. A first attempt arriving while others wait goes behind them, unless its
    /// caller is under its fair share; its turn is predicted with the share of places
    /// the line gets ([`ConcurrencyLimit::line_share`]).
    pub fn enter(self: &Arc<Self>, ask: Ask) -> Entry {
        let behind = self.waiting.load(Ordering::Acquire) > 0;
        match self.admit(ask, behind) {
            Ok(admitted) => {
                if behind {
                    self.place_given(false);
                }
                Entry::Admitted(admitted)
            }
            // Only a call late by an estimate measured at this depth may wait: one past what
            // the estimate was measured at (a cold start's few answers) would be let wait on
            // a figure that may be far too fast (measured, when such calls were let wait and
            // then admitted together after it: 281 calls waited out their deadlines at the
            // start of the 1,500-in-flight overload test). It is refused at once.
            Err((Full::Late { .. }, n)) if self.may_wait(&ask) => {
                let per_call = self.per_call_ns.load(Ordering::Relaxed) as f64 / 1e9;
                // The calls in flight drain at the estimate's rate; the line ahead of it
                // moves only at the share of the places that come free which the line
                // gets (callers under their fair share and retries go in past it). The
                // first to wait is judged by the calls in flight alone, so that a line can
                // always form and measure its share again.
                let waiting = self.waiting.load(Ordering::Acquire);
                let share = self.line_share();
                let in_flight_alone = seconds(per_call * n as f64);
                let predicted = seconds(per_call * (n as f64 + waiting as f64 / share));
                // Waiting w, it goes in once what is ahead of it has drained to its budget
                // of the time left, headroom × (time − w): it fits if w ≤ its allowance,
                // that is if all ahead drain within budget + (1 − headroom) × allowance.
                let may = self.budget(ask.time).unwrap_or_default()
                    + self
                        .wait_allowance(ask.time)
                        .mul_f64(1.0 - self.settings.headroom);
                if predicted <= may {
                    Entry::Wait
                } else if in_flight_alone > may {
                    Entry::Refused(self.refuse(
                        ask,
                        n,
                        Full::Late {
                            predicted: in_flight_alone,
                            budget: may,
                        },
                    ))
                } else {
                    Entry::Refused(self.refuse(
                        ask,
                        n,
                        Full::Line {
                            waiting,
                            share,
                            predicted,
                            may,
                        },
                    ))
                }
            }
            Err((full, n)) => Entry::Refused(self.refuse(ask, n, full)),
        }
    }

    /// Waits at the door, after [`ConcurrencyLimit::enter`] said [`Entry::Wait`], for a
    /// place that fits the budget of the time `ask` has left: woken as places are given
    /// back, only the first in line trying. Once its time to wait is over it goes in,
    /// first in line or not, if the chain still answers calls at a pace that serves it in
    /// time — judged by how many it answered while this call waited, not by the estimate,
    /// which learns of a stall only from answers that do not come (see
    /// [`ConcurrencyLimit::admit_after_waiting`]). In line, a call that meets the reserve
    /// kept for light callers or the bound of what the estimate was measured at keeps
    /// waiting: both clear as calls drain.
    pub fn wait_for_place(
        self: Arc<Self>,
        ask: Ask,
    ) -> impl Future<Output = Result<Admitted, Box<Status>>> + Send + 'static {
        // In line from now, not from the first poll: a call arriving meanwhile goes behind.
        let waiting = Waiting::new(self, ask.caller);
        let arrived = Instant::now();
        let answers_before = waiting.limit.answers.load(Ordering::Relaxed);
        async move {
            let this = &waiting.limit;
            let until = arrived + this.wait_allowance(ask.time);
            // Judged by the time it has left: what waiting took is not there for the
            // services below, nor for a stall after admission.
            let now = || Ask {
                time: ask.time.map(|time| time.saturating_sub(arrived.elapsed())),
                ..ask
            };
            loop {
                // Only the first in line tries; the others wait their turn.
                if waiting.first() {
                    match this.admit(now(), false) {
                        // Out of the line as `waiting` drops, which wakes the next.
                        Ok(admitted) => {
                            this.place_given(true);
                            return Ok(admitted);
                        }
                        // The reserve kept for light callers clears as calls drain: wait.
                        Err((Full::Late { .. } | Full::Unproven { .. } | Full::Reserved, _)) => {}
                        Err((full, n)) => return Err(this.refuse(ask, n, full)),
                    }
                }
                if tokio::time::timeout_at(until, waiting.woken.notified())
                    .await
                    .is_err()
                {
                    let answered = this.answers.load(Ordering::Relaxed) - answers_before;
                    return this.admit_after_waiting(ask, arrived.elapsed(), answered);
                }
            }
        }
    }

    /// A place for `ask`, which waited `waited` at the door, `answered` calls answered
    /// meanwhile, and whose time to wait is over. Its prediction by the estimate did not
    /// come true, and the estimate cannot say by how much: it moves only with answers,
    /// and a stall (a database session ended, a frozen service below) is answers that do
    /// not come. The pace the line moved at says it: the call goes in if, behind the calls
    /// in flight at `waited / answered` each, it would be answered within half the time
    /// it has left (the other half for a stall after it goes in); otherwise it is refused
    /// now, after its wait. Forcing it in instead carried calls past their deadlines
    /// (measured: 14 calls in a run of the 1,500-in-flight overload test with a database
    /// session ended); refusing it costs the contract's refusals in milliseconds, and
    /// the chain answers slower than its estimate often enough for that to show (the
    /// same test: over 1% of refusals after a wait) — why a door's wait is its operator's
    /// choice. Refused at the ceiling, the memory bound, too.
    pub(super) fn admit_after_waiting(
        self: &Arc<Self>,
        ask: Ask,
        waited: Duration,
        answered: u64,
    ) -> Result<Admitted, Box<Status>> {
        let n = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let left = ask.time.map(|time| time.saturating_sub(waited));
        let full = if n > self.settings.max_limit {
            Some(Full::Ceiling)
        } else if n <= self.settings.min_limit {
            None
        } else {
            self.judged_time(left).and_then(|time| {
                let may = time / 2;
                let predicted = (answered > 0).then(|| {
                    Duration::from_nanos(
                        (waited.as_nanos() * n as u128 / u128::from(answered))
                            .min(u128::from(u64::MAX)) as u64,
                    )
                });
                predicted.is_none_or(|p| p > may).then_some(Full::Stalled {
                    answered,
                    predicted,
                    may,
                })
            })
        };
        if let Some(full) = full {
            self.leave();
            return Err(self.refuse_after(ask, n, full, waited));
        }
        if let Some(caller) = ask.caller {
            self.callers.take(caller);
        }
        self.place_given(true);
        Ok(Admitted {
            limit: Arc::clone(self),
            admitted: Instant::now(),
            in_flight: n,
            budget: self.budget(left),
            caller: ask.caller,
            done: false,
        })
    }

    /// Of the places given while calls waited at the door, the share that went to them —
    /// a moving average over about the last 32 (kept from one line to the next: a line that
    /// formed after a low share gets its second and later calls refused at once until
    /// its first calls' places raise it), 1 until a line has formed. The others
    /// went to calls admitted at once past the line: callers under their fair share
    /// (which the line must not hold back: see [`Holdings`]) and retries. A call told to
    /// wait is behind the line ahead of it at this share of the drain rate: measured on
    /// the 1,500-in-flight overload test with a quarter to wait, such callers took 45–81%
    /// of the places while the line waited, and a turn predicted as if the line had them
    /// all ran out before it came (refusals after a wait: 96 to 387 in a run).
    pub fn line_share(&self) -> f64 {
        f64::from_bits(self.line_share.load(Ordering::Relaxed)).max(LEAST_LINE_SHARE)
    }

    /// A place given while calls waited: to one of them (`to_line`) or past them.
    fn place_given(&self, to_line: bool) {
        let given = if to_line { 1.0 } else { 0.0 };
        let _ = self
            .line_share
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let share = f64::from_bits(bits);
                Some((share + (given - share) * LINE_SHARE_WEIGHT).to_bits())
            });
    }

    /// Whether `ask` may wait at the door rather than be refused at once: a first attempt,
    /// at a door that lets calls wait, with a time to be judged by, once the drain rate
    /// is known.
    fn may_wait(&self, ask: &Ask) -> bool {
        self.settings.door
            && self.settings.wait_share > 0.0
            && ask.priority == Priority::First
            && self.judged_time(ask.time).is_some()
            && self.per_call_ns.load(Ordering::Relaxed) > 0
    }

    /// A place for `ask`, or why not with the calls in flight it saw; `behind`: others
    /// wait at the door, so it fits only under its caller's fair share.
    fn admit(self: &Arc<Self>, ask: Ask, behind: bool) -> Result<Admitted, (Full, usize)> {
        let n = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let budget = self.budget(ask.time);
        if let Some(budget) = budget {
            self.typical_budget
                .store(budget.as_nanos() as u64, Ordering::Relaxed);
        }
        let verdict = match self.judge(&ask, n, budget) {
            Verdict::Admit if behind && self.may_wait(&ask) => {
                let per_call = self.per_call_ns.load(Ordering::Relaxed);
                Verdict::IfUnderShare {
                    full: Full::Late {
                        predicted: Duration::from_nanos(per_call.saturating_mul(n as u64)),
                        budget: budget.unwrap_or_default(),
                    },
                    fit: budget.map_or(self.settings.max_limit, |b| {
                        (b.as_nanos() / u128::from(per_call.max(1)))
                            .min(self.settings.max_limit as u128) as usize
                    }),
                }
            }
            verdict => verdict,
        };
        let verdict = match (verdict, ask.caller) {
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
                // Not `release`: a refused try frees no place, so wakes no one waiting.
                self.leave();
                Err((full, n))
            }
        }
    }

    /// Counts `ask`'s refusal (it saw `n` calls in flight, itself included) and words it.
    fn refuse(&self, ask: Ask, n: usize, full: Full) -> Box<Status> {
        self.refuse_after(ask, n, full, Duration::ZERO)
    }

    /// [`Self::refuse`], after `waited` at the door.
    fn refuse_after(&self, ask: Ask, n: usize, full: Full, waited: Duration) -> Box<Status> {
        let shed = match ask.priority {
            Priority::First => &self.shed_first,
            Priority::Retry => &self.shed_retries,
        };
        shed.fetch_add(1, Ordering::Relaxed);
        Box::new(refusal(ask.priority, n - 1, full, waited))
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
            // reserve itself. Not of the depth the estimate was measured at (`proven`):
            // at the edge every call has a caller, and holding shares to that bound made a
            // burst of 256 closed-loop clients refuse 6,592 of 16,871 calls that admission
            // off served in time (docs/overload.md, "The bound and the fair share").
            (fits, Priority::First, true) => Verdict::IfUnderShare {
                full: fits.err().unwrap_or(Full::Reserved),
                fit: fit.min((s.max_limit as f64 * RESERVED_FOR_LIGHT_CALLERS) as usize),
            },
            (fits, _, _) => Verdict::Refuse(fits.err().unwrap_or(Full::Reserved)),
        }
    }

    /// A sample from an answered call, ended as `outcome`.
    fn sample(&self, latency: Duration, in_flight: usize, outcome: Outcome) {
        if outcome == Outcome::Served {
            self.answers.fetch_add(1, Ordering::Relaxed);
        }
        let now = Instant::now();
        let mut drain = self.drain.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((per_call, most_in_flight)) = drain.answered(now, latency, in_flight, outcome) {
            self.store_estimate(Some((per_call, most_in_flight)));
            self.of_failures
                .store(drain.of_failures(), Ordering::Release);
        }
    }

    /// Makes `estimate` (seconds a call in flight, and the most calls in flight it was
    /// measured with; `None`: not measured) the one calls are judged by.
    fn store_estimate(&self, estimate: Option<(f64, usize)>) {
        let (per_call_ns, measured_at) = match estimate {
            Some((per_call, most_in_flight)) => (((per_call * 1e9) as u64).max(1), most_in_flight),
            None => (0, 0),
        };
        // The depth first: a call judged between the two stores pairs the old figure with
        // the new depth, not the new figure with an old depth it was not measured at.
        self.measured_at.store(measured_at, Ordering::Relaxed);
        self.per_call_ns.store(per_call_ns, Ordering::Relaxed);
    }

    /// One call fewer in flight, admitted or only tried (its try counted it): the last to
    /// leave while the estimate is a figure of failures forgets it (see [`Drain::idle`]).
    /// Every way out of `in_flight` comes here, or a refused try that happened to leave
    /// last would keep a figure of failures until calls were served again.
    fn leave(&self) {
        let before = self.in_flight.fetch_sub(1, Ordering::AcqRel);
        if before == 1 && self.of_failures.load(Ordering::Acquire) {
            let mut drain = self.drain.lock().unwrap_or_else(|p| p.into_inner());
            // Still idle under the lock: a call admitted meanwhile may have measured a
            // figure of its own.
            if self.in_flight.load(Ordering::Acquire) == 0
                && let Some(estimate) = drain.idle()
            {
                self.store_estimate(estimate);
                self.of_failures.store(false, Ordering::Release);
            }
        }
    }

    fn release(&self, caller: Option<CallerKey>) {
        self.leave();
        if let Some(caller) = caller {
            self.callers.give_back(caller);
        }
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.wake_first();
        }
    }

    /// Wakes the first call waiting at the door (a wake-up it is not yet listening for is
    /// kept for it).
    fn wake_first(&self) {
        let queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(first) = queue.front() {
            first.notify_one();
        }
    }
}

/// A call's place in line at the door while it lives. It counts among its caller's
/// holdings: a caller's share is of the calls it holds in flight and at the door, or a
/// caller with calls in line would go past them with each call it sends as one of its calls
/// is answered, and those in line would never be reached. Dropped — admitted, refused, or
/// its caller gone — it leaves the line and wakes the next, which tries in turn.
struct Waiting {
    limit: Arc<ConcurrencyLimit>,
    caller: Option<CallerKey>,
    /// Told when it is first in line and a place may have come free.
    woken: Arc<Notify>,
}

impl Waiting {
    fn new(limit: Arc<ConcurrencyLimit>, caller: Option<CallerKey>) -> Self {
        let woken = Arc::new(Notify::new());
        {
            let mut queue = limit.queue.lock().unwrap_or_else(|p| p.into_inner());
            queue.push_back(Arc::clone(&woken));
            limit.waiting.store(queue.len(), Ordering::Release);
        }
        if let Some(caller) = caller {
            limit.callers.take(caller);
        }
        Self {
            limit,
            caller,
            woken,
        }
    }

    /// Whether it is first in line.
    fn first(&self) -> bool {
        let queue = self.limit.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue
            .front()
            .is_some_and(|first| Arc::ptr_eq(first, &self.woken))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(caller) = self.caller {
            self.limit.callers.give_back(caller);
        }
        let mut queue = self.limit.queue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = queue.iter().position(|w| Arc::ptr_eq(w, &self.woken)) {
            queue.remove(at);
            if at == 0
                && let Some(next) = queue.front()
            {
                next.notify_one();
            }
        }
        self.limit.waiting.store(queue.len(), Ordering::Release);
    }
}

/// `secs` as a duration, the longest one past what a duration holds (a prediction that
/// long is refused whatever it is compared with).
fn seconds(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

/// "1 call", "2 calls": counts in a refusal's message, read by people (written into the
/// message itself: a refusal allocates nothing more for it).
struct Calls(u64);

impl std::fmt::Display for Calls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            1 => f.write_str("1 call"),
            n => write!(f, "{n} calls"),
        }
    }
}

/// UNAVAILABLE, overloaded, with when to come back (and, if it waited at the door first,
/// for how long).
fn refusal(priority: Priority, in_flight: usize, full: Full, waited: Duration) -> Status {
    let which = match priority {
        Priority::First => "",
        Priority::Retry => " (retries are refused before first attempts)",
    };
    let in_flight = Calls(in_flight as u64);
    let (pushback, message) = match full {
        Full::Ceiling => (
            Duration::from_millis(100),
            format!("overloaded: this service is serving {in_flight}, its most at once{which}"),
        ),
        Full::Reserved => (
            Duration::from_millis(100),
            format!(
                "overloaded: this service is serving {in_flight}; the rest of its room is kept for callers holding less than their share{which}"
            ),
        ),
        Full::Unproven { measured_at, round } => (
            round,
            format!(
                "overloaded: this service is serving {in_flight} and has been measured draining at most {measured_at} at once{which}"
            ),
        ),
        Full::Late { predicted, budget } => (
            predicted.saturating_sub(budget).min(budget),
            format!(
                "overloaded: behind the {in_flight} in flight this one would take about {} ms, more than the {} ms it may{which}",
                predicted.as_millis(),
                budget.as_millis()
            ),
        ),
        Full::Line {
            waiting,
            share,
            predicted,
            may,
        } => (
            predicted.saturating_sub(may).min(may),
            format!(
                "overloaded: behind the {in_flight} in flight and {} waiting at the door, which gets {:.0}% of the places that come free (callers under their share go in first), this one would take about {} ms, more than the {} ms it may{which}",
                Calls(waiting as u64),
                share * 100.0,
                predicted.as_millis(),
                may.as_millis()
            ),
        ),
        Full::Stalled {
            answered,
            predicted: Some(predicted),
            may,
        } => (
            predicted.saturating_sub(may).min(may),
            format!(
                "overloaded: {} answered while this one waited; at that pace, behind the {in_flight} in flight it would take about {} ms, more than the {} ms it may{which}",
                Calls(answered),
                predicted.as_millis(),
                may.as_millis()
            ),
        ),
        Full::Stalled {
            predicted: None, ..
        } => (
            waited,
            format!(
                "overloaded: no call was answered while this one waited, behind {in_flight} in flight{which}"
            ),
        ),
    };
    let pushback_ms = (pushback.as_millis() as i64).max(1);
    let waited = if waited.is_zero() {
        String::new()
    } else {
        format!(" (after waiting {} ms at the door)", waited.as_millis())
    };
    let mut status =
        Status::unavailable(format!("{message}{waited}; come back in {pushback_ms} ms"));
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
        // The sample first: the place given back wakes the first call waiting at the
        // door, which is judged by the estimate this answer updates.
        self.limit
            .sample(self.admitted.elapsed(), self.in_flight, Outcome::Served);
        self.release();
    }

    /// The call was answered now with a failure of the chain below (unavailable, out of
    /// time, broken): its time is a sample that counts only in a window where failures
    /// are most of the answers (see [`Drain::answered`]), and the line at the door did
    /// not move by it — a
    /// stall whose calls fail or time out is still a stall (see
    /// [`ConcurrencyLimit::wait_for_place`]).
    pub fn failed(mut self) {
        self.limit
            .sample(self.admitted.elapsed(), self.in_flight, Outcome::Failed);
        self.release();
    }

    /// The call was answered now with a service below's refusal for overload: a drop, a
    /// sample [`DROP_PENALTY`] times as slow as its whole budget (it did not fit below; a
    /// sample of the budget itself would leave the next such call predicted just inside
    /// it).
    pub fn dropped(mut self) {
        if self.limit.settings.door {
            let elapsed = self.admitted.elapsed();
            let latency = self
                .budget
                .unwrap_or(elapsed)
                .max(elapsed)
                .mul_f64(DROP_PENALTY);
            self.limit.sample(latency, self.in_flight, Outcome::Dropped);
        }
        self.release();
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
