//! The contract's request metadata as types: the idempotency key and the retry mode read
//! from a request, and W3C trace context. The header names are `resilience::wire`'s.

use std::{fmt, str::FromStr};

use rand::RngExt;
use tonic::{Status, metadata::MetadataMap};

use resilience::wire::names;

use crate::values::{Caller, IdempotencyKey};

pub use resilience::wire::{
    AUTHORIZATION, CALLER, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, RETRY_MODE, TRACE_ID, TRACEPARENT,
};

/// Where retries happen. With the `clap` feature, also a `--retry-mode` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum RetryMode {
    /// Every service retries its downstream call: load multiplies per layer (3^5 = 243).
    EveryLayer,
    /// Only the edge retries, under a retry budget; every other service tries once.
    EdgeOnly,
}

impl RetryMode {
    /// The name on the command line and in `x-retry-mode`.
    pub fn as_str(&self) -> &'static str {
        match self {
            RetryMode::EveryLayer => "every-layer",
            RetryMode::EdgeOnly => "edge-only",
        }
    }
}

impl fmt::Display for RetryMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown retry mode name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown retry mode {0:?}: expected every-layer or edge-only")]
pub struct UnknownRetryMode(pub String);

impl FromStr for RetryMode {
    type Err = UnknownRetryMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "every-layer" => Ok(RetryMode::EveryLayer),
            "edge-only" => Ok(RetryMode::EdgeOnly),
            other => Err(UnknownRetryMode(other.to_owned())),
        }
    }
}

/// The request's `idempotency-key`, parsed; `None` when absent, INVALID_ARGUMENT when bad:
/// not visible ASCII, empty, sent twice, or sent under another name a client could mean
/// for it (`idempotency-key-bin`, `x-idempotency-key`, `idempotency_key`, …; see
/// [`meant_as`]). Any of those, taken as "no key", would make the edge choose a fresh one
/// and charge a retried payment twice.
pub fn idempotency_key(metadata: &MetadataMap) -> Result<Option<IdempotencyKey>, Status> {
    refuse_other_spellings(metadata, IDEMPOTENCY_KEY)?;
    let mut values = metadata.as_ref().get_all(&names::IDEMPOTENCY_KEY).iter();
    let Some(raw) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Status::invalid_argument(
            "idempotency-key was sent more than once: send exactly one key per request",
        ));
    }
    let text = raw.to_str().map_err(|_| {
        Status::invalid_argument("idempotency-key must be visible ASCII characters")
    })?;
    Ok(Some(IdempotencyKey::parse(text)?))
}

/// The caller the edge authenticated, from `x-caller` (see [`CALLER`]): absent means the
/// anonymous caller; a value sent twice or not an identity is INVALID_ARGUMENT. Only the
/// edge writes it (dropping a client's), so below the edge it is the edge's word.
pub fn caller(metadata: &MetadataMap) -> Result<Caller, Status> {
    let mut values = metadata.as_ref().get_all(&names::CALLER).iter();
    let Some(raw) = values.next() else {
        return Ok(Caller::anonymous());
    };
    if values.next().is_some() {
        return Err(Status::invalid_argument("x-caller was sent more than once"));
    }
    raw.to_str()
        .ok()
        .and_then(|text| Caller::parse(text).ok())
        .ok_or_else(|| Status::invalid_argument("x-caller is not a caller identity"))
}

/// The request's `x-retry-mode`, parsed; `None` when absent, INVALID_ARGUMENT when bad,
/// sent twice, or sent under another name a client could mean for it (`retry-mode`,
/// `x-retry-mode-bin`, …).
pub fn retry_mode(metadata: &MetadataMap) -> Result<Option<RetryMode>, Status> {
    refuse_other_spellings(metadata, RETRY_MODE)?;
    if metadata.get_all(RETRY_MODE).iter().count() > 1 {
        return Err(Status::invalid_argument(
            "x-retry-mode was sent more than once: send it at most once",
        ));
    }
    metadata
        .get(RETRY_MODE)
        .map(|raw| {
            raw.to_str()
                .ok()
                .and_then(|text| text.parse().ok())
                .ok_or_else(|| {
                    Status::invalid_argument("x-retry-mode must be every-layer or edge-only")
                })
        })
        .transpose()
}

/// Which of the contract's request headers a metadata name that is not exactly it was
/// presumably meant as: the name with case, `-`, `_`, `.`, an `x-` prefix and a `-bin`
/// suffix set aside (`Idempotency_Key`, `x-idempotency-key`, `idempotency-key-bin`,
/// `idempotencykey`, `retry-mode`, `x-retry-mode-bin`).
pub fn meant_as(name: &str) -> Option<&'static str> {
    /// Longer names are no spelling of ours.
    const LONGEST: usize = 40;
    if name == IDEMPOTENCY_KEY || name == RETRY_MODE || name.len() > LONGEST {
        return None;
    }
    // Every header name of every request passes here: folded on the stack, not the heap.
    let mut folded = [0u8; LONGEST];
    let mut len = 0;
    for byte in name.bytes().filter(u8::is_ascii_alphanumeric) {
        folded[len] = byte.to_ascii_lowercase();
        len += 1;
    }
    let folded = &folded[..len];
    let bare = folded.strip_suffix(b"bin").unwrap_or(folded);
    let bare = bare.strip_prefix(b"x").unwrap_or(bare);
    match bare {
        b"idempotencykey" | b"idempotentkey" | b"idempotencyid" => Some(IDEMPOTENCY_KEY),
        b"retrymode" => Some(RETRY_MODE),
        _ => None,
    }
}

/// INVALID_ARGUMENT when `metadata` carries a header meant as `wanted` under another name
/// ([`meant_as`]).
fn refuse_other_spellings(metadata: &MetadataMap, wanted: &'static str) -> Result<(), Status> {
    for key in metadata.keys() {
        let name = match key {
            tonic::metadata::KeyRef::Ascii(key) => key.as_str(),
            tonic::metadata::KeyRef::Binary(key) => key.as_str(),
        };
        if meant_as(name) == Some(wanted) {
            return Err(Status::invalid_argument(format!(
                "{name} is not read: send it as {wanted} (visible ASCII, once); nothing was done"
            )));
        }
    }
    Ok(())
}

/// This hop's `traceparent`, formatted once per request for the calls it makes (each
/// attempt's request carries a cheap clone): the value the trace layer writes on the wire
/// when this request's spans are not exported.
#[derive(Debug, Clone)]
pub struct TraceParent {
    /// `00-<trace id>-<this hop's span id>-<flags>`.
    pub value: http::HeaderValue,
    /// Whether this request's spans go to the collector (exporting, and sampled): then
    /// the trace layer writes the attempt span's own context instead.
    pub exported: bool,
}

/// A trace or span id: `N` lowercase hex digits, held inline (ids are made and read on
/// every request; none of them needs the heap).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct HexId<const N: usize>([u8; N]);

impl<const N: usize> HexId<N> {
    /// `text`, if it is exactly `N` lowercase hex digits.
    pub fn parse(text: &str) -> Option<Self> {
        let bytes: [u8; N] = text.as_bytes().try_into().ok()?;
        bytes
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
            .then_some(Self(bytes))
    }

    /// A random id (never all zeros, which W3C trace context reserves for "invalid").
    fn random() -> Self {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut rng = rand::rng();
        loop {
            let mut value: u128 = rng.random();
            let mut digits = [0; N];
            for digit in &mut digits {
                *digit = DIGITS[(value & 0xf) as usize];
                value >>= 4;
            }
            if digits.iter().any(|&d| d != b'0') {
                return Self(digits);
            }
        }
    }

    /// The digits.
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits are ever stored.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl<const N: usize> fmt::Debug for HexId<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl<const N: usize> fmt::Display for HexId<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<const N: usize> PartialEq<&str> for HexId<N> {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A W3C trace id: 32 hex digits.
pub type TraceIdHex = HexId<32>;
/// A W3C span id: 16 hex digits.
pub type SpanIdHex = HexId<16>;

/// The part of W3C trace context every hop keeps: the trace id, this hop's span id (the
/// parent of the next hop's), the caller's, and the sampled flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// Shared by every hop of one request.
    pub trace_id: TraceIdHex,
    /// New at each hop.
    pub span_id: SpanIdHex,
    /// The caller's span id, when a valid `traceparent` came.
    pub parent_id: Option<SpanIdHex>,
    /// The W3C `sampled` flag this hop passes on: the caller's (set for a new trace),
    /// replaced by this hop's sampling decision when it exports spans.
    pub sampled: bool,
}

impl TraceContext {
    /// Continues the trace of an incoming `traceparent`, or starts a new one when it is
    /// absent or malformed (a bad trace header is not worth failing a payment for).
    pub fn continue_or_start(traceparent: Option<&str>) -> Self {
        let span_id = SpanIdHex::random();
        match traceparent.and_then(parse_traceparent) {
            Some((trace_id, parent_id, sampled)) => Self {
                trace_id,
                span_id,
                parent_id: Some(parent_id),
                sampled,
            },
            None => Self {
                trace_id: TraceIdHex::random(),
                span_id,
                parent_id: None,
                sampled: true,
            },
        }
    }

    /// The `traceparent` to send downstream, `00-<trace id>-<span id>-<flags>`: this
    /// trace, with this hop as parent.
    fn traceparent_bytes(&self) -> [u8; 55] {
        let mut out = [b'-'; 55];
        out[..2].copy_from_slice(b"00");
        out[3..35].copy_from_slice(&self.trace_id.0);
        out[36..52].copy_from_slice(&self.span_id.0);
        out[53..].copy_from_slice(if self.sampled { b"01" } else { b"00" });
        out
    }

    /// The `traceparent` to send downstream: this trace, with this hop as parent.
    pub fn traceparent(&self) -> String {
        String::from_utf8_lossy(&self.traceparent_bytes()).into_owned()
    }

    /// [`TraceContext::traceparent`] as the header value the calls of this hop carry;
    /// `exported`: whether this request's spans go to the collector.
    pub fn traceparent_header(&self, exported: bool) -> Option<TraceParent> {
        http::HeaderValue::from_bytes(&self.traceparent_bytes())
            .ok()
            .map(|mut value| {
                resilience::wire::never_indexed(&mut value);
                TraceParent { value, exported }
            })
    }
}

/// The trace id, parent span id and sampled flag of a version-00 `traceparent`, if well
/// formed and neither id is all zeros.
fn parse_traceparent(value: &str) -> Option<(TraceIdHex, SpanIdHex, bool)> {
    let mut parts = value.trim().split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let version = HexId::<2>::parse(version)?;
    // Version 00 is exactly four fields; a later version may add more.
    if version == "00" && parts.next().is_some() {
        return None;
    }
    let trace = TraceIdHex::parse(trace)?;
    let parent = SpanIdHex::parse(parent)?;
    let flags = HexId::<2>::parse(flags)?;
    let valid = version != "ff"
        && trace.0.iter().any(|&b| b != b'0')
        && parent.0.iter().any(|&b| b != b'0');
    let sampled = u8::from_str_radix(flags.as_str(), 16).ok()? & 1 == 1;
    valid.then_some((trace, parent, sampled))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_spellings_of_the_key_and_the_mode_are_refused_not_ignored() {
        for name in [
            "idempotency-key-bin",
            "x-idempotency-key",
            "idempotency_key",
            "idempotencykey",
            "idempotent-key",
            "x-idempotency-key-bin",
        ] {
            assert_eq!(meant_as(name), Some(IDEMPOTENCY_KEY), "{name}");
        }
        for name in ["retry-mode", "x-retry-mode-bin", "x_retry_mode"] {
            assert_eq!(meant_as(name), Some(RETRY_MODE), "{name}");
        }
        for name in [
            IDEMPOTENCY_KEY,
            RETRY_MODE,
            "traceparent",
            "key",
            "x-request-id",
        ] {
            assert_eq!(meant_as(name), None, "{name}");
        }
        let mut metadata = MetadataMap::new();
        metadata.insert_bin(
            "idempotency-key-bin",
            tonic::metadata::MetadataValue::from_bytes(b"order-1"),
        );
        let refused = idempotency_key(&metadata).expect_err("a binary key is not a key");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        let mut twice = MetadataMap::new();
        twice.append(IDEMPOTENCY_KEY, "a".parse().expect("ascii"));
        twice.append(IDEMPOTENCY_KEY, "b".parse().expect("ascii"));
        assert!(idempotency_key(&twice).is_err());
        let mut empty = MetadataMap::new();
        empty.insert(IDEMPOTENCY_KEY, "".parse().expect("ascii"));
        assert!(idempotency_key(&empty).is_err());
    }

    #[test]
    fn continues_a_valid_trace() {
        let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let ctx = TraceContext::continue_or_start(Some(incoming));
        assert_eq!(ctx.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(ctx.span_id, "00f067aa0ba902b7");
        assert_eq!(
            ctx.parent_id.map(|p| p.to_string()).as_deref(),
            Some("00f067aa0ba902b7")
        );
        assert!(ctx.sampled);
        let next = TraceContext::continue_or_start(Some(&ctx.traceparent()));
        assert_eq!(next.trace_id, ctx.trace_id);
        assert_eq!(next.parent_id, Some(ctx.span_id));
        let unsampled = TraceContext::continue_or_start(Some(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        ));
        assert!(!unsampled.sampled);
        assert!(
            unsampled.traceparent().ends_with("-00"),
            "passed on as it came"
        );
    }

    #[test]
    fn starts_a_new_trace_for_bad_headers() {
        for bad in [
            None,
            Some(""),
            Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"),
            Some("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("junk"),
        ] {
            let ctx = TraceContext::continue_or_start(bad);
            assert_eq!(ctx.trace_id.as_str().len(), 32);
            assert_ne!(ctx.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        }
    }

    #[test]
    fn ids_are_lowercase_hex_and_never_all_zeros() {
        for _ in 0..1000 {
            let ctx = TraceContext::continue_or_start(None);
            for id in [ctx.trace_id.as_str(), ctx.span_id.as_str()] {
                assert!(
                    id.bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                );
                assert!(id.bytes().any(|b| b != b'0'), "{id}");
            }
            assert_eq!(ctx.trace_id.as_str().len(), 32);
            assert_eq!(ctx.span_id.as_str().len(), 16);
        }
        assert!(
            TraceIdHex::parse("4bf92f3577b34da6a3ce929d0e0e473").is_none(),
            "31 digits"
        );
        assert!(SpanIdHex::parse("00f067aa0ba902b7a").is_none(), "17 digits");
        assert!(SpanIdHex::parse("00f067aa0ba902bg").is_none(), "not hex");
        assert!(SpanIdHex::parse("00F067AA0BA902B7").is_none(), "upper case");
    }

    #[test]
    fn the_traceparent_header_is_the_traceparent() {
        for flags in ["00", "01"] {
            let incoming = format!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}");
            let ctx = TraceContext::continue_or_start(Some(&incoming));
            let header = ctx.traceparent_header(false).expect("valid header");
            assert_eq!(header.value.to_str().ok(), Some(ctx.traceparent().as_str()));
            assert_eq!(
                ctx.traceparent(),
                format!(
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-{}-{flags}",
                    ctx.span_id
                )
            );
            assert!(header.value.is_sensitive());
        }
    }

    #[test]
    fn retry_modes_parse() {
        assert_eq!("every-layer".parse(), Ok(RetryMode::EveryLayer));
        assert_eq!("edge-only".parse(), Ok(RetryMode::EdgeOnly));
        assert!("sometimes".parse::<RetryMode>().is_err());
    }
}
