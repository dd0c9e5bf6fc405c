//! How calls are admitted: the operator's settings, checked.

use std::time::Duration;

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
    /// The share of a call's time a first attempt that does not fit at once may wait at
    /// the door for a place (0: refused at once); only at the door, only when it would go
    /// in within it, and then it is served unless the chain stalled while it waited (see
    /// [`ConcurrencyLimit::enter`](super::ConcurrencyLimit::enter)).
    pub wait_share: f64,
    /// Whether this service is where calls enter (a lone server; in a chain, its edge).
    /// At the door a call is admitted only while it is predicted to fit its time; a
    /// refusal from below that the door relays counts as a sample (a drop, see
    /// [`Admitted::dropped`](super::Admitted::dropped)), so that it learns what the services behind it cannot take
    /// and refuses that itself; and its estimate is trusted only as far as it was
    /// measured (see [`GROWTH`](super::GROWTH)). Behind the door (`false`) a service serves what the door
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
            wait_share: 0.0,
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
        if !(s.wait_share >= 0.0 && s.headroom + s.wait_share <= 1.0) {
            return Err(InvalidAdmission::Out(
                "the wait share must be at least 0 and leave the headroom room (their sum at most 1)",
            ));
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
