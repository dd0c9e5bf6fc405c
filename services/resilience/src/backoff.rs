//! How long to wait before the next attempt.
//!
//! Capped exponential backoff spaces retries out, but clients that failed together and wait
//! the same time collide again; random jitter is what spreads them. The five policies are
//! the design notes' definitions, with `e = min(cap, base · multiplier^retry)` (the
//! multiplier is 2 unless a service config's `backoffMultiplier` says otherwise) and `retry`
//! counting the retries already made (0 before the first retry):
//!
//! | policy         | wait                              |
//! |----------------|-----------------------------------|
//! | `none`         | 0                                 |
//! | `exponential`  | e                                 |
//! | `full`         | U(0, e)                           |
//! | `equal`        | e/2 + U(0, e/2)                   |
//! | `decorrelated` | min(cap, U(base, previous · 3))   |

use std::{fmt, str::FromStr, time::Duration};

use rand::{Rng, RngExt};

/// Which backoff formula to use; see the module docs. With the `clap` feature, also a
/// `--backoff` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum BackoffKind {
    /// Retry at once.
    None,
    /// Capped exponential backoff without jitter: synchronised clients stay synchronised.
    Exponential,
    /// U(0, e): the most spread, the AWS recommendation.
    Full,
    /// e/2 + U(0, e/2): keeps at least half the exponential wait.
    Equal,
    /// min(cap, U(base, previous · 3)): grows from the previous wait, not the attempt count.
    Decorrelated,
}

impl BackoffKind {
    /// Every policy, in the order the design notes list them.
    pub const ALL: [BackoffKind; 5] = [
        BackoffKind::None,
        BackoffKind::Exponential,
        BackoffKind::Full,
        BackoffKind::Equal,
        BackoffKind::Decorrelated,
    ];

    /// The name used on the command line and in reports.
    pub fn as_str(&self) -> &'static str {
        match self {
            BackoffKind::None => "none",
            BackoffKind::Exponential => "exponential",
            BackoffKind::Full => "full",
            BackoffKind::Equal => "equal",
            BackoffKind::Decorrelated => "decorrelated",
        }
    }
}

impl fmt::Display for BackoffKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown backoff policy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backoff {0:?}: expected none, exponential, full, equal or decorrelated")]
pub struct UnknownBackoff(String);

impl FromStr for BackoffKind {
    type Err = UnknownBackoff;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BackoffKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| UnknownBackoff(s.to_owned()))
    }
}

/// A backoff policy: the formula and its two parameters. Cheap to copy; per-call state lives
/// in a [`BackoffSchedule`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// The formula.
    pub kind: BackoffKind,
    /// The first exponential step, and decorrelated jitter's lower bound.
    pub base: Duration,
    /// No wait is ever longer than this.
    pub cap: Duration,
    /// How much each exponential step grows (gRFC A6's `backoffMultiplier`).
    pub multiplier: f64,
}

impl Backoff {
    /// A policy doubling each step; `cap` below `base` is raised to `base`.
    pub fn new(kind: BackoffKind, base: Duration, cap: Duration) -> Self {
        Self {
            kind,
            base,
            cap: cap.max(base),
            multiplier: 2.0,
        }
    }

    /// The same policy growing by `multiplier` per step (a positive, finite number;
    /// anything else keeps doubling).
    pub fn with_multiplier(mut self, multiplier: f64) -> Self {
        if multiplier > 0.0 && multiplier.is_finite() {
            self.multiplier = multiplier;
        }
        self
    }

    /// Fresh state for one logical call's retries.
    pub fn schedule(&self) -> BackoffSchedule {
        BackoffSchedule {
            backoff: *self,
            retries: 0,
            previous: self.base,
        }
    }

    /// `e = min(cap, base · multiplier^retry)`, saturating rather than overflowing.
    pub fn exponential(&self, retry: u32) -> Duration {
        if self.multiplier == 2.0 {
            // Exact integer arithmetic for the common case (the simulations rely on it).
            let grown = match 2u32.checked_pow(retry) {
                Some(factor) => self.base.saturating_mul(factor),
                None if self.base.is_zero() => Duration::ZERO,
                None => Duration::MAX,
            };
            return grown.min(self.cap);
        }
        let factor = self.multiplier.powi(retry.min(i32::MAX as u32) as i32);
        let seconds = self.base.as_secs_f64() * factor;
        if seconds.is_finite() && seconds < self.cap.as_secs_f64() {
            Duration::from_secs_f64(seconds)
        } else {
            self.cap
        }
    }
}

/// The waits of one call, in order. Decorrelated jitter needs the previous wait and the
/// others the retry count, so the state is per call, never shared.
#[derive(Debug, Clone)]
pub struct BackoffSchedule {
    /// The policy.
    backoff: Backoff,
    /// Waits handed out so far.
    retries: u32,
    /// The last wait handed out (the base before the first), for decorrelated jitter.
    previous: Duration,
}

impl BackoffSchedule {
    /// The wait before the next retry.
    pub fn next_delay<R: Rng + ?Sized>(&mut self, rng: &mut R) -> Duration {
        let Backoff {
            kind, base, cap, ..
        } = self.backoff;
        let e = self.backoff.exponential(self.retries);
        let delay = match kind {
            BackoffKind::None => Duration::ZERO,
            BackoffKind::Exponential => e,
            BackoffKind::Full => uniform(rng, Duration::ZERO, e),
            BackoffKind::Equal => e / 2 + uniform(rng, Duration::ZERO, e / 2),
            BackoffKind::Decorrelated => {
                uniform(rng, base, self.previous.saturating_mul(3)).min(cap)
            }
        };
        self.retries = self.retries.saturating_add(1);
        self.previous = delay;
        delay
    }

    /// Waits handed out so far.
    pub fn retries(&self) -> u32 {
        self.retries
    }
}

/// U(low, high) over durations; `low` when the range is empty.
fn uniform<R: Rng + ?Sized>(rng: &mut R, low: Duration, high: Duration) -> Duration {
    if high <= low {
        return low;
    }
    let unit: f64 = rng.random();
    low + (high - low).mul_f64(unit)
}

#[cfg(test)]
mod tests {
    use rand::{SeedableRng, rngs::SmallRng};

    use super::*;

    const BASE: Duration = Duration::from_millis(2);
    const CAP: Duration = Duration::from_millis(64);

    fn samples(kind: BackoffKind, seed: u64) -> Vec<Vec<Duration>> {
        let backoff = Backoff::new(kind, BASE, CAP);
        let mut rng = SmallRng::seed_from_u64(seed);
        (0..500)
            .map(|_| {
                let mut schedule = backoff.schedule();
                (0..12).map(|_| schedule.next_delay(&mut rng)).collect()
            })
            .collect()
    }

    #[test]
    fn none_never_waits() {
        for run in samples(BackoffKind::None, 1) {
            assert!(run.iter().all(|d| d.is_zero()));
        }
    }

    #[test]
    fn exponential_is_deterministic_and_capped() {
        let expected: Vec<Duration> = [2, 4, 8, 16, 32, 64, 64, 64, 64, 64, 64, 64]
            .into_iter()
            .map(Duration::from_millis)
            .collect();
        for run in samples(BackoffKind::Exponential, 7) {
            assert_eq!(run, expected);
        }
    }

    #[test]
    fn full_jitter_stays_within_zero_and_e() {
        let backoff = Backoff::new(BackoffKind::Full, BASE, CAP);
        let mut seen_small = false;
        for run in samples(BackoffKind::Full, 3) {
            for (retry, d) in run.iter().enumerate() {
                let e = backoff.exponential(retry as u32);
                assert!(*d <= e, "retry {retry}: {d:?} > {e:?}");
                seen_small |= *d < e / 4;
            }
        }
        assert!(
            seen_small,
            "full jitter should sometimes wait far less than e"
        );
    }

    #[test]
    fn equal_jitter_keeps_half_of_e() {
        let backoff = Backoff::new(BackoffKind::Equal, BASE, CAP);
        for run in samples(BackoffKind::Equal, 4) {
            for (retry, d) in run.iter().enumerate() {
                let e = backoff.exponential(retry as u32);
                assert!(
                    *d >= e / 2 && *d <= e,
                    "retry {retry}: {d:?} outside [e/2, e]"
                );
            }
        }
    }

    #[test]
    fn decorrelated_stays_between_base_and_cap_and_three_times_previous() {
        for run in samples(BackoffKind::Decorrelated, 5) {
            let mut previous = BASE;
            for d in run {
                assert!(d >= BASE && d <= CAP, "{d:?} outside [base, cap]");
                assert!(d <= previous * 3, "{d:?} > 3 × {previous:?}");
                previous = d;
            }
        }
    }

    #[test]
    fn same_seed_same_waits() {
        for kind in BackoffKind::ALL {
            assert_eq!(samples(kind, 11), samples(kind, 11), "{kind}");
        }
    }

    #[test]
    fn a_multiplier_other_than_2_grows_by_that_factor() {
        let b = Backoff::new(
            BackoffKind::Exponential,
            Duration::from_millis(100),
            Duration::from_secs(1),
        )
        .with_multiplier(1.5);
        assert_eq!(b.exponential(0), Duration::from_millis(100));
        assert_eq!(b.exponential(2), Duration::from_millis(225));
        assert_eq!(b.exponential(40), Duration::from_secs(1), "capped");
        let same = Backoff::new(
            BackoffKind::Exponential,
            Duration::from_millis(10),
            Duration::from_secs(1),
        )
        .with_multiplier(1.0);
        assert_eq!(
            same.exponential(5),
            Duration::from_millis(10),
            "grpc-go's example: 1.0"
        );
        assert_eq!(
            same.with_multiplier(-1.0).multiplier,
            1.0,
            "a bad multiplier changes nothing"
        );
    }

    #[test]
    fn exponential_saturates_instead_of_overflowing() {
        let backoff = Backoff::new(BackoffKind::Exponential, BASE, Duration::MAX);
        assert_eq!(backoff.exponential(200), Duration::MAX);
    }

    #[test]
    fn names_round_trip() {
        for kind in BackoffKind::ALL {
            assert_eq!(kind.as_str().parse::<BackoffKind>(), Ok(kind));
        }
        assert!("jittery".parse::<BackoffKind>().is_err());
    }
}
