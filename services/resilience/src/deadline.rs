//! Deadlines: the `grpc-timeout` header and the arithmetic that hands each downstream call a
//! strictly shorter deadline than the one received.
//!
//! A deadline is kept as an absolute [`Instant`] (tokio's, so tests can pause time) because
//! it is spent by everything that happens under it — queueing, backoff sleeps, earlier
//! attempts — and a duration would have to be re-derived after each of those.

use std::{fmt, time::Duration};

use tokio::time::Instant;

/// The largest number `grpc-timeout` may carry: at most eight ASCII digits (gRPC over HTTP/2).
const MAX_TIMEOUT_VALUE: u64 = 99_999_999;

/// Why a `grpc-timeout` value was refused; the caller answers INVALID_ARGUMENT with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimeoutParseError {
    /// The header was present but empty.
    #[error("grpc-timeout is empty")]
    Empty,
    /// The digits were absent, not ASCII digits, or more than eight.
    #[error("grpc-timeout {0:?} must be 1 to 8 ASCII digits followed by a unit")]
    BadDigits(String),
    /// The unit was not one of H M S m u n.
    #[error("grpc-timeout {0:?} has an unknown unit (expected one of H M S m u n)")]
    BadUnit(String),
}

/// Parses a `grpc-timeout` header value such as `1998548u` or `2S`.
pub fn parse_grpc_timeout(value: &str) -> Result<Duration, TimeoutParseError> {
    let Some((split, unit)) = value.char_indices().last() else {
        return Err(TimeoutParseError::Empty);
    };
    let digits = &value[..split];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(TimeoutParseError::BadDigits(value.to_owned()));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| TimeoutParseError::BadDigits(value.to_owned()))?;
    Ok(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return Err(TimeoutParseError::BadUnit(value.to_owned())),
    })
}

/// Formats a duration as a `grpc-timeout` value in the finest unit that fits eight digits.
///
/// The value is rounded down, never up: a hop promises its downstream no more time than it
/// has. Durations past 99,999,999 hours are clamped to that.
pub fn format_grpc_timeout(timeout: Duration) -> String {
    let nanos = timeout.as_nanos();
    // (unit, nanoseconds per unit), finest first.
    const UNITS: [(char, u128); 6] = [
        ('n', 1),
        ('u', 1_000),
        ('m', 1_000_000),
        ('S', 1_000_000_000),
        ('M', 60_000_000_000),
        ('H', 3_600_000_000_000),
    ];
    for (unit, per) in UNITS {
        let value = nanos / per;
        if value <= u128::from(MAX_TIMEOUT_VALUE) {
            return format!("{value}{unit}");
        }
    }
    format!("{MAX_TIMEOUT_VALUE}H")
}

/// The point in time by which a call must be answered.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline {
    /// When the call's time runs out.
    at: Instant,
}

impl fmt::Debug for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Deadline(in {:?})", self.remaining())
    }
}

/// There is too little time left to start another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("deadline leaves no room: {remaining:?} left, an attempt needs more than {needed:?}")]
pub struct NoRoom {
    /// Time left on the deadline when the attempt was considered.
    pub remaining: Duration,
    /// Margin plus the shortest attempt worth starting.
    pub needed: Duration,
}

impl Deadline {
    /// A deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Self {
        Self {
            at: Instant::now() + timeout,
        }
    }

    /// A deadline at a given instant.
    pub fn at(at: Instant) -> Self {
        Self { at }
    }

    /// The instant the deadline falls on.
    pub fn instant(&self) -> Instant {
        self.at
    }

    /// Time left; zero once spent.
    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// Whether the deadline has passed.
    pub fn is_spent(&self) -> bool {
        Instant::now() >= self.at
    }

    /// This deadline brought `by` earlier: the point a service stops working to, so that it
    /// can still answer before its caller's own deadline fires.
    pub fn earlier_by(&self, by: Duration) -> Self {
        Self {
            at: self.at.checked_sub(by).unwrap_or(self.at),
        }
    }

    /// The timeout to hand a downstream call: what remains minus `margin`, so it is strictly
    /// shorter than what this service has and the inner call fails first, while this service
    /// can still react. [`NoRoom`] when that would be shorter than `min_attempt`.
    pub fn downstream_timeout(
        &self,
        margin: Duration,
        min_attempt: Duration,
    ) -> Result<Duration, NoRoom> {
        let remaining = self.remaining();
        let needed = margin + min_attempt;
        match remaining.checked_sub(margin) {
            Some(timeout) if timeout >= min_attempt && !timeout.is_zero() => Ok(timeout),
            _ => Err(NoRoom { remaining, needed }),
        }
    }

    /// Whether `wait` can be slept and an attempt still started after it, by the same rule
    /// as [`Deadline::downstream_timeout`].
    pub fn has_room_after(&self, wait: Duration, margin: Duration, min_attempt: Duration) -> bool {
        self.remaining()
            .checked_sub(wait)
            .and_then(|left| left.checked_sub(margin))
            .is_some_and(|timeout| timeout >= min_attempt && !timeout.is_zero())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        let cases = [
            ("3H", Duration::from_secs(3 * 3600)),
            ("2M", Duration::from_secs(120)),
            ("7S", Duration::from_secs(7)),
            ("250m", Duration::from_millis(250)),
            ("1998548u", Duration::from_micros(1_998_548)),
            ("42n", Duration::from_nanos(42)),
            ("0m", Duration::ZERO),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_grpc_timeout(text), Ok(expected), "{text}");
        }
    }

    #[test]
    fn round_trips_every_unit() {
        for text in ["3H", "2M", "7S", "250m", "1998548u", "42n", "99999999n"] {
            let parsed = parse_grpc_timeout(text).expect("valid");
            let formatted = format_grpc_timeout(parsed);
            assert_eq!(
                parse_grpc_timeout(&formatted),
                Ok(parsed),
                "{text} -> {formatted}"
            );
        }
    }

    #[test]
    fn formats_in_the_finest_unit_that_fits_eight_digits() {
        assert_eq!(
            format_grpc_timeout(Duration::from_nanos(99_999_999)),
            "99999999n"
        );
        assert_eq!(
            format_grpc_timeout(Duration::from_nanos(100_000_000)),
            "100000u"
        );
        assert_eq!(format_grpc_timeout(Duration::from_secs(2)), "2000000u");
        assert_eq!(format_grpc_timeout(Duration::from_secs(100_000)), "100000S");
        assert_eq!(
            format_grpc_timeout(Duration::from_secs(3600 * 100_000_000)),
            "99999999H"
        );
        for value in [1u64, 999, 123_456_789, 98_765_432_109, 7_000_000_000_000] {
            let formatted = format_grpc_timeout(Duration::from_nanos(value));
            let digits = formatted.len() - 1;
            assert!(digits <= 8, "{formatted} has {digits} digits");
        }
    }

    #[test]
    fn formatting_never_rounds_up() {
        let d = Duration::from_nanos(123_456_789_123);
        let back = parse_grpc_timeout(&format_grpc_timeout(d)).expect("valid");
        assert!(back <= d);
        assert!(d - back < Duration::from_millis(1));
    }

    #[test]
    fn enforces_the_eight_digit_limit() {
        assert!(parse_grpc_timeout("99999999m").is_ok());
        assert!(matches!(
            parse_grpc_timeout("100000000m"),
            Err(TimeoutParseError::BadDigits(_))
        ));
    }

    #[test]
    fn rejects_malformed_values() {
        for bad in [
            "", "m", "10", "10x", "1.5S", "-5m", "+5m", " 5m", "5 m", "5mm", "five", "5µ", "0x10m",
        ] {
            assert!(
                parse_grpc_timeout(bad).is_err(),
                "{bad:?} should be rejected"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn downstream_timeout_is_strictly_shorter_or_no_room() {
        let deadline = Deadline::after(Duration::from_millis(100));
        let margin = Duration::from_millis(10);
        let min = Duration::from_millis(5);
        assert_eq!(
            deadline.downstream_timeout(margin, min),
            Ok(Duration::from_millis(90))
        );
        tokio::time::advance(Duration::from_millis(86)).await;
        assert!(deadline.downstream_timeout(margin, min).is_err());
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(deadline.is_spent());
        assert_eq!(deadline.remaining(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn room_after_a_wait_accounts_for_margin_and_minimum() {
        let deadline = Deadline::after(Duration::from_millis(100));
        let margin = Duration::from_millis(10);
        let min = Duration::from_millis(5);
        assert!(deadline.has_room_after(Duration::from_millis(85), margin, min));
        assert!(!deadline.has_room_after(Duration::from_millis(86), margin, min));
    }
}
