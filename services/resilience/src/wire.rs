//! Everything that is text on the wire: every header name the chain reads or writes, how
//! each value is parsed and formatted, and the status codes' names. Nothing else in the
//! workspace spells a header or parses one; inside a process a deadline is an `Instant`, a
//! pushback a [`Pushback`], a code a [`Code`].
//!
//! Where text is read and written:
//!
//! | header | read | written |
//! |---|---|---|
//! | [`TIMEOUT`] | by a server as a request arrives (`DeadlineLayer`, the first layer, once); by the retry engine as a call enters it, for a caller's own deadline (once per call) | by the retry engine, once per attempt (`replay`: the time left, or the per-attempt timeout where it ends first) |
//! | [`PREVIOUS_ATTEMPTS`] | by a server as a request arrives | by the retry engine, on each retry or hedge |
//! | [`PUSHBACK`] | by the retry engine, on each failed attempt | by a server (or a layer that gives up) on its failure |
//! | [`IDEMPOTENCY_KEY`], [`RETRY_MODE`], [`TRACEPARENT`] | by a service's handler | by a hop's handler, on its downstream call; [`TRACEPARENT`] per attempt while exporting traces |
//! | [`TRACE_ID`], [`IDEMPOTENT_REPLAYED`] | by the caller | by the service that answers |
//! | [`AUTHORIZATION`] | by the edge (`node::callers`) | by a client |
//! | [`CALLER`] | by the ledger's handler | by the edge (`node::callers`), passed on by each hop |

use std::time::Duration;

use http::HeaderMap;
use tonic::{Code, Status, metadata::MetadataValue};

/// Request: the call's deadline as a relative timeout (`250m`, `1998548u`), gRPC over HTTP/2.
pub const TIMEOUT: &str = "grpc-timeout";
/// Request: attempts made before this one for the same call (gRFC A6).
pub const PREVIOUS_ATTEMPTS: &str = "grpc-previous-rpc-attempts";
/// Response (trailer): how long the server asks the caller to wait before retrying;
/// negative or malformed means "do not retry" (gRFC A6).
pub const PUSHBACK: &str = "grpc-retry-pushback-ms";
/// Request and response: the client's name for one logical operation.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Request: overrides the retry mode for one request (honoured only where allowed).
pub const RETRY_MODE: &str = "x-retry-mode";
/// Request: W3C trace context.
pub const TRACEPARENT: &str = "traceparent";
/// Response: the request's trace id, for finding it in every service's log.
pub const TRACE_ID: &str = "trace-id";
/// Response: `true` when the ledger replayed a saved reply instead of charging.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// Request, inside the chain: the caller the edge authenticated (its certificate's
/// identity, or `jwt:` and its token's subject), passed on by every hop to the ledger,
/// which scopes accounts — and so keys — by it. The edge drops any value a client sends.
pub const CALLER: &str = "x-caller";
/// Request, at the edge: `Bearer <JWT>`, a caller's credentials (RFC 6750).
pub const AUTHORIZATION: &str = "authorization";
/// On a failure a service passes on from the service below it (its own downstream call
/// failed), not one of its own: the caller's balancer does not hold it against the
/// replica that relayed it (outlier ejection, `balance`).
pub const RELAYED: &str = "retrychain-relayed";
/// On a refusal by an overloaded service (`admission`): its load, not a fault, so the
/// caller's balancer sends it less rather than ejecting it.
pub const OVERLOADED: &str = "retrychain-overloaded";

/// The header names above, and gRPC's own that the chain reads, as [`http::HeaderName`]s
/// made at compile time. A lookup by `&str` parses and checks the name on every call; the
/// dozen a relay made per request were 4% of its instructions (counted with callgrind).
pub mod names {
    use http::HeaderName;

    /// [`super::TIMEOUT`].
    pub const TIMEOUT: HeaderName = HeaderName::from_static(super::TIMEOUT);
    /// [`super::PREVIOUS_ATTEMPTS`].
    pub const PREVIOUS_ATTEMPTS: HeaderName = HeaderName::from_static(super::PREVIOUS_ATTEMPTS);
    /// [`super::PUSHBACK`].
    pub const PUSHBACK: HeaderName = HeaderName::from_static(super::PUSHBACK);
    /// [`super::IDEMPOTENCY_KEY`].
    pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(super::IDEMPOTENCY_KEY);
    /// [`super::RETRY_MODE`].
    pub const RETRY_MODE: HeaderName = HeaderName::from_static(super::RETRY_MODE);
    /// [`super::TRACEPARENT`].
    pub const TRACEPARENT: HeaderName = HeaderName::from_static(super::TRACEPARENT);
    /// [`super::TRACE_ID`].
    pub const TRACE_ID: HeaderName = HeaderName::from_static(super::TRACE_ID);
    /// [`super::IDEMPOTENT_REPLAYED`].
    pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static(super::IDEMPOTENT_REPLAYED);
    /// [`super::CALLER`].
    pub const CALLER: HeaderName = HeaderName::from_static(super::CALLER);
    /// [`super::RELAYED`].
    pub const RELAYED: HeaderName = HeaderName::from_static(super::RELAYED);
    /// [`super::OVERLOADED`].
    pub const OVERLOADED: HeaderName = HeaderName::from_static(super::OVERLOADED);
    /// gRPC's status code (a trailer, or a header in a trailers-only answer).
    pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
    /// gRPC's status message.
    pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
    /// gRPC's rich status details.
    pub const GRPC_STATUS_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");
    /// How a gRPC message is compressed.
    pub const GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");
    /// Which compressions a gRPC peer accepts.
    pub const GRPC_ACCEPT_ENCODING: HeaderName = HeaderName::from_static("grpc-accept-encoding");
}

/// The largest number a timeout may carry: at most eight ASCII digits.
const MAX_TIMEOUT_VALUE: u64 = 99_999_999;

/// Why a timeout value was refused; the server answers INVALID_ARGUMENT with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimeoutParseError {
    /// The header was present but empty.
    #[error("grpc-timeout is empty")]
    Empty,
    /// The header was not visible ASCII.
    #[error("grpc-timeout is not ASCII")]
    NotAscii,
    /// The digits were absent, not ASCII digits, or more than eight.
    #[error("grpc-timeout {0:?} must be 1 to 8 ASCII digits followed by a unit")]
    BadDigits(String),
    /// The unit was not one of H M S m u n.
    #[error("grpc-timeout {0:?} has an unknown unit (expected one of H M S m u n)")]
    BadUnit(String),
}

/// Parses a timeout value such as `1998548u` or `2S`.
pub fn parse_timeout(value: &str) -> Result<Duration, TimeoutParseError> {
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

/// The request's timeout: `None` when it carries none, an error when it is malformed.
pub fn timeout_of(headers: &HeaderMap) -> Result<Option<Duration>, TimeoutParseError> {
    headers
        .get(&names::TIMEOUT)
        .map(|value| {
            value
                .to_str()
                .map_err(|_| TimeoutParseError::NotAscii)
                .and_then(parse_timeout)
        })
        .transpose()
}

/// Formats a duration as a timeout value in the finest unit that fits eight digits.
///
/// The value is rounded down, never up: a hop promises its downstream no more time than it
/// has. Durations past 99,999,999 hours are clamped to that.
pub fn format_timeout(timeout: Duration) -> String {
    let (value, unit) = timeout_in_units(timeout);
    format!("{value}{unit}")
}

/// The value and unit [`format_timeout`] writes.
fn timeout_in_units(timeout: Duration) -> (u64, char) {
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
            return (value as u64, unit);
        }
    }
    (MAX_TIMEOUT_VALUE, 'H')
}

/// Writes `timeout` as the request's timeout (formatted on the stack: this runs for every
/// attempt).
pub fn set_timeout(headers: &mut HeaderMap, timeout: Duration) {
    use std::io::Write as _;
    let (value, unit) = timeout_in_units(timeout);
    // At most eight digits and a unit.
    let mut text = [0u8; 16];
    let mut cursor = std::io::Cursor::new(&mut text[..]);
    if write!(cursor, "{value}{unit}").is_err() {
        return;
    }
    let len = cursor.position() as usize;
    if let Ok(mut value) = http::HeaderValue::from_bytes(&text[..len]) {
        never_indexed(&mut value);
        headers.insert(names::TIMEOUT, value);
    }
}

/// Marks a header value that is new on every call (a timeout counted down, a trace or span
/// id, an idempotency key) so that HPACK sends it as a literal "never indexed": it would
/// never be sent again, and inserting it into the connection's 4 KiB table would only
/// evict the headers that repeat on every call (`content-type`, `te`, `user-agent`, …),
/// which then stay indexed and cost a byte or two each.
pub fn never_indexed(value: &mut http::HeaderValue) {
    value.set_sensitive(true);
}

/// The attempts a request says came before it (0 for a first attempt or a malformed value).
pub fn previous_attempts(headers: &HeaderMap) -> u32 {
    parse_previous_attempts(
        headers
            .get(&names::PREVIOUS_ATTEMPTS)
            .and_then(|v| v.to_str().ok()),
    )
}

/// [`previous_attempts`] of a value read from gRPC metadata (`None`: absent).
pub fn parse_previous_attempts(value: Option<&str>) -> u32 {
    value.and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Marks a request as attempt number `previous + 1` (no mark on a first attempt).
pub fn set_previous_attempts(headers: &mut HeaderMap, previous: u32) {
    if previous > 0 {
        headers.insert(names::PREVIOUS_ATTEMPTS, http::HeaderValue::from(previous));
    } else {
        headers.remove(&names::PREVIOUS_ATTEMPTS);
    }
}

/// What a failure's pushback says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushback {
    /// No pushback: use the backoff policy.
    Absent,
    /// Wait exactly this long before the retry.
    RetryAfter(Duration),
    /// A negative or unparseable value, or more than one value: do not retry.
    DoNotRetry,
}

/// What the pushback values of an answer say: gRFC A6 reads a negative or malformed one as
/// "do not retry", and so does grpc-go an answer that carries two (a server cannot mean
/// both, and guessing would retry against its wish).
fn pushback_from<'a>(mut values: impl Iterator<Item = Option<&'a str>>) -> Pushback {
    let Some(first) = values.next() else {
        return Pushback::Absent;
    };
    if values.next().is_some() {
        return Pushback::DoNotRetry;
    }
    match first.map(|value| value.trim().parse::<i64>()) {
        Some(Ok(ms)) if ms >= 0 => Pushback::RetryAfter(Duration::from_millis(ms.unsigned_abs())),
        _ => Pushback::DoNotRetry,
    }
}

/// The pushback of a gRPC answer's headers (a Trailers-Only answer carries it there).
pub fn pushback_of(headers: &HeaderMap) -> Pushback {
    pushback_from(
        headers
            .get_all(&names::PUSHBACK)
            .iter()
            .map(|v| v.to_str().ok()),
    )
}

/// The pushback a failure carries in its metadata.
pub fn pushback(status: &Status) -> Pushback {
    pushback_from(
        status
            .metadata()
            .as_ref()
            .get_all(&names::PUSHBACK)
            .iter()
            .map(|v| v.to_str().ok()),
    )
}

/// Attaches a pushback of `ms` milliseconds (negative: do not retry) to a failure.
pub fn set_pushback(status: &mut Status, ms: i64) {
    status
        .metadata_mut()
        .insert(PUSHBACK, MetadataValue::from(ms));
}

/// The gRPC status codes by their names, as service configs and `Faults.fail_code` spell
/// them.
const CODE_NAMES: [(Code, &str); 17] = [
    (Code::Ok, "OK"),
    (Code::Cancelled, "CANCELLED"),
    (Code::Unknown, "UNKNOWN"),
    (Code::InvalidArgument, "INVALID_ARGUMENT"),
    (Code::DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (Code::NotFound, "NOT_FOUND"),
    (Code::AlreadyExists, "ALREADY_EXISTS"),
    (Code::PermissionDenied, "PERMISSION_DENIED"),
    (Code::ResourceExhausted, "RESOURCE_EXHAUSTED"),
    (Code::FailedPrecondition, "FAILED_PRECONDITION"),
    (Code::Aborted, "ABORTED"),
    (Code::OutOfRange, "OUT_OF_RANGE"),
    (Code::Unimplemented, "UNIMPLEMENTED"),
    (Code::Internal, "INTERNAL"),
    (Code::Unavailable, "UNAVAILABLE"),
    (Code::DataLoss, "DATA_LOSS"),
    (Code::Unauthenticated, "UNAUTHENTICATED"),
];

/// A code's name: `UNAVAILABLE`.
pub fn code_name(code: Code) -> &'static str {
    CODE_NAMES
        .iter()
        .find(|(c, _)| *c == code)
        .map_or("UNKNOWN", |(_, name)| name)
}

/// A code from its name, in any case.
pub fn code_by_name(name: &str) -> Option<Code> {
    CODE_NAMES
        .iter()
        .find(|(_, n)| n.eq_ignore_ascii_case(name))
        .map(|(code, _)| *code)
}

/// Marks a failure's metadata as relayed from below ([`RELAYED`]).
pub fn mark_relayed(metadata: &mut tonic::metadata::MetadataMap) {
    metadata.insert(
        tonic::metadata::MetadataKey::from_static(RELAYED),
        tonic::metadata::MetadataValue::from_static("1"),
    );
}

/// Marks a refusal as an overloaded service's ([`OVERLOADED`]).
pub fn mark_overloaded(metadata: &mut tonic::metadata::MetadataMap) {
    metadata.insert(
        tonic::metadata::MetadataKey::from_static(OVERLOADED),
        tonic::metadata::MetadataValue::from_static("1"),
    );
}

/// The gRPC status code `headers` carry (a trailers-only answer's headers, or trailers),
/// `None` when they carry none; the code [`status_in`] would read. For a caller that needs
/// only the code: the whole status also decodes the message and the details and copies the
/// whole map, and every answer's trailers carry a code (callgrind counted 1.5k
/// instructions a relayed call for reading a success's trailers that way). Only a status
/// with a message is read whole (rare for a success): tonic reads a status whose message
/// does not decode as UNKNOWN, whatever its code, and so does this.
pub fn status_code(headers: &HeaderMap) -> Option<Code> {
    let code = Code::from_bytes(headers.get(&names::GRPC_STATUS)?.as_bytes());
    if headers.contains_key(&names::GRPC_MESSAGE) {
        return status_in(headers).map(|status| status.code());
    }
    Some(code)
}

/// The failure `headers` carry, whole: `None` when they carry no status or OK (read as
/// [`status_code`] reads it, so a success costs no more).
pub fn failure_in(headers: &HeaderMap) -> Option<tonic::Status> {
    let code = Code::from_bytes(headers.get(&names::GRPC_STATUS)?.as_bytes());
    if code == Code::Ok && !headers.contains_key(&names::GRPC_MESSAGE) {
        return None;
    }
    status_in(headers).filter(|status| status.code() != Code::Ok)
}

/// The whole status `headers` carry, read as tonic's `Status::from_header_map` reads it,
/// except that a `grpc-status-details-bin` that is not base64 is left out: tonic panics on
/// it, and an answer from below is input like any other (the status keeps its code and
/// message).
pub fn status_in(headers: &HeaderMap) -> Option<tonic::Status> {
    use base64::Engine as _;
    const DETAILS: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let undecodable = headers
        .get(&names::GRPC_STATUS_DETAILS)
        .is_some_and(|details| DETAILS.decode(details.as_bytes()).is_err());
    if undecodable {
        let mut readable = headers.clone();
        readable.remove(&names::GRPC_STATUS_DETAILS);
        return tonic::Status::from_header_map(&readable);
    }
    tonic::Status::from_header_map(headers)
}

/// Whether a response's headers mark it as an overloaded service's refusal ([`OVERLOADED`]).
pub fn is_overloaded(headers: &HeaderMap) -> bool {
    headers.contains_key(&names::OVERLOADED)
}

/// Whether a response's headers mark its failure as relayed from below ([`RELAYED`]).
pub fn is_relayed(headers: &HeaderMap) -> bool {
    headers.contains_key(&names::RELAYED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_alone_is_read_as_tonic_reads_the_whole_status() {
        let messages = [None, Some("went%20wrong"), Some("%FF")];
        for value in ["0", "3", "14", "16", "17", "-1", "abc", "", "014"] {
            for message in messages {
                let mut headers = HeaderMap::new();
                headers.insert(&names::GRPC_STATUS, value.parse().unwrap());
                if let Some(message) = message {
                    headers.insert(&names::GRPC_MESSAGE, message.parse().unwrap());
                }
                let case = format!("{value:?} {message:?}");
                let whole = tonic::Status::from_header_map(&headers).expect("a status");
                assert_eq!(status_code(&headers), Some(whole.code()), "{case}");
                match failure_in(&headers) {
                    None => assert_eq!(whole.code(), Code::Ok, "{case}"),
                    Some(failure) => {
                        assert_ne!(whole.code(), Code::Ok, "{case}");
                        assert_eq!(failure.code(), whole.code(), "{case}");
                        assert_eq!(failure.message(), whole.message(), "{case}");
                    }
                }
            }
        }
        assert_eq!(status_code(&HeaderMap::new()), None);
        assert!(failure_in(&HeaderMap::new()).is_none());
    }

    #[test]
    fn details_that_are_not_base64_are_left_out_not_a_panic() {
        let mut headers = HeaderMap::new();
        headers.insert(&names::GRPC_STATUS, "14".parse().unwrap());
        headers.insert(&names::GRPC_MESSAGE, "down".parse().unwrap());
        headers.insert(&names::GRPC_STATUS_DETAILS, "not base64!".parse().unwrap());
        let status = failure_in(&headers).expect("a failure");
        assert_eq!(
            (status.code(), status.message(), status.details()),
            (Code::Unavailable, "down", &b""[..])
        );
        // Valid details, padded or not, are kept as tonic keeps them.
        for details in ["AQI=", "AQI"] {
            headers.insert(&names::GRPC_STATUS_DETAILS, details.parse().unwrap());
            assert_eq!(status_in(&headers).unwrap().details(), [1, 2]);
        }
    }

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
            assert_eq!(parse_timeout(text), Ok(expected), "{text}");
        }
    }

    #[test]
    fn round_trips_every_unit() {
        for text in ["3H", "2M", "7S", "250m", "1998548u", "42n", "99999999n"] {
            let parsed = parse_timeout(text).expect("valid");
            let formatted = format_timeout(parsed);
            assert_eq!(
                parse_timeout(&formatted),
                Ok(parsed),
                "{text} -> {formatted}"
            );
        }
    }

    #[test]
    fn formats_in_the_finest_unit_that_fits_eight_digits() {
        assert_eq!(
            format_timeout(Duration::from_nanos(99_999_999)),
            "99999999n"
        );
        assert_eq!(format_timeout(Duration::from_nanos(100_000_000)), "100000u");
        assert_eq!(format_timeout(Duration::from_secs(2)), "2000000u");
        assert_eq!(format_timeout(Duration::from_secs(100_000)), "100000S");
        assert_eq!(
            format_timeout(Duration::from_secs(3600 * 100_000_000)),
            "99999999H"
        );
        for value in [1u64, 999, 123_456_789, 98_765_432_109, 7_000_000_000_000] {
            let formatted = format_timeout(Duration::from_nanos(value));
            let digits = formatted.len() - 1;
            assert!(digits <= 8, "{formatted} has {digits} digits");
        }
    }

    #[test]
    fn the_header_written_is_the_formatted_timeout_and_never_indexed() {
        let mut headers = HeaderMap::new();
        for timeout in [
            Duration::ZERO,
            Duration::from_nanos(99_999_999),
            Duration::from_millis(1234),
            Duration::from_secs(3600 * 100_000_000),
            Duration::MAX,
        ] {
            set_timeout(&mut headers, timeout);
            let value = headers.get(TIMEOUT).expect("written");
            assert_eq!(value.to_str().ok(), Some(format_timeout(timeout).as_str()));
            assert!(value.is_sensitive());
            assert_eq!(
                headers.get_all(TIMEOUT).iter().count(),
                1,
                "replaced, not added"
            );
        }
    }

    #[test]
    fn formatting_never_rounds_up() {
        let d = Duration::from_nanos(123_456_789_123);
        let back = parse_timeout(&format_timeout(d)).expect("valid");
        assert!(back <= d);
        assert!(d - back < Duration::from_millis(1));
    }

    #[test]
    fn enforces_the_eight_digit_limit() {
        assert!(parse_timeout("99999999m").is_ok());
        assert!(matches!(
            parse_timeout("100000000m"),
            Err(TimeoutParseError::BadDigits(_))
        ));
    }

    #[test]
    fn rejects_malformed_values() {
        for bad in [
            "", "m", "10", "10x", "1.5S", "-5m", "+5m", " 5m", "5 m", "5mm", "five", "5µ", "0x10m",
        ] {
            assert!(parse_timeout(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn pushback_values() {
        let mut status = Status::resource_exhausted("busy");
        assert_eq!(pushback(&status), Pushback::Absent);
        set_pushback(&mut status, 200);
        assert_eq!(
            pushback(&status),
            Pushback::RetryAfter(Duration::from_millis(200))
        );
        set_pushback(&mut status, -1);
        assert_eq!(pushback(&status), Pushback::DoNotRetry);
        status
            .metadata_mut()
            .insert(PUSHBACK, MetadataValue::from_static("soon"));
        assert_eq!(pushback(&status), Pushback::DoNotRetry);
    }

    #[test]
    fn two_pushback_values_mean_do_not_retry() {
        let mut headers = HeaderMap::new();
        headers.append(PUSHBACK, http::HeaderValue::from_static("10"));
        assert_eq!(
            pushback_of(&headers),
            Pushback::RetryAfter(Duration::from_millis(10))
        );
        headers.append(PUSHBACK, http::HeaderValue::from_static("20"));
        assert_eq!(pushback_of(&headers), Pushback::DoNotRetry);
    }

    #[test]
    fn code_names_round_trip() {
        for (code, name) in CODE_NAMES {
            assert_eq!(code_name(code), name);
            assert_eq!(code_by_name(&name.to_lowercase()), Some(code));
        }
        assert_eq!(code_by_name("SOMETIMES"), None);
    }
}
