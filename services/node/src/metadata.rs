//! The contract's request metadata as types: the idempotency key and the retry mode read
//! from a request, and W3C trace context. The header names are `resilience::wire`'s.

use std::{fmt, str::FromStr};

use rand::RngExt;
use tonic::{Status, metadata::MetadataMap};

use crate::IdempotencyKey;

pub use resilience::wire::{
    IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, RETRY_MODE, TRACE_ID, TRACEPARENT,
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

/// The request's `idempotency-key`, parsed; `None` when absent, INVALID_ARGUMENT when bad.
pub fn idempotency_key(metadata: &MetadataMap) -> Result<Option<IdempotencyKey>, Status> {
    let Some(raw) = metadata.get(IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    let text = raw.to_str().map_err(|_| {
        Status::invalid_argument("idempotency-key must be visible ASCII characters")
    })?;
    Ok(Some(IdempotencyKey::parse(text)?))
}

/// The request's `x-retry-mode`, parsed; `None` when absent, INVALID_ARGUMENT when bad.
pub fn retry_mode(metadata: &MetadataMap) -> Result<Option<RetryMode>, Status> {
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

/// This hop's `traceparent`, formatted once per request for the calls it makes (each
/// attempt's request carries a cheap clone): the value the trace layer writes on the wire
/// when it is not exporting spans of its own.
#[derive(Debug, Clone)]
pub struct TraceParent(pub http::HeaderValue);

/// The part of W3C trace context every hop keeps: the trace id, and this hop's span id,
/// which becomes the parent of the next hop's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// 32 lowercase hex digits, shared by every hop of one request.
    pub trace_id: String,
    /// 16 lowercase hex digits, new at each hop.
    pub span_id: String,
}

impl TraceContext {
    /// Continues the trace of an incoming `traceparent`, or starts a new one when it is
    /// absent or malformed (a bad trace header is not worth failing a payment for).
    pub fn continue_or_start(traceparent: Option<&str>) -> Self {
        let trace_id = traceparent
            .and_then(parse_trace_id)
            .unwrap_or_else(|| random_hex(16));
        Self {
            trace_id,
            span_id: random_hex(8),
        }
    }

    /// The `traceparent` to send downstream: this trace, with this hop as parent.
    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-01", self.trace_id, self.span_id)
    }

    /// [`TraceContext::traceparent`] as the header value the calls of this hop carry.
    pub fn traceparent_header(&self) -> Option<TraceParent> {
        http::HeaderValue::try_from(self.traceparent())
            .ok()
            .map(TraceParent)
    }
}

/// The trace id of a version-00 `traceparent`, if well formed and not all zeros.
fn parse_trace_id(value: &str) -> Option<String> {
    let mut parts = value.trim().split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && hex(flags, 2);
    valid.then(|| trace.to_owned())
}

fn random_hex(bytes: usize) -> String {
    let value: u128 = rand::rng().random();
    let hex = format!("{value:032x}");
    hex[..bytes * 2].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_a_valid_trace() {
        let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let ctx = TraceContext::continue_or_start(Some(incoming));
        assert_eq!(ctx.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(ctx.span_id, "00f067aa0ba902b7");
        let next = TraceContext::continue_or_start(Some(&ctx.traceparent()));
        assert_eq!(next.trace_id, ctx.trace_id);
    }

    #[test]
    fn starts_a_new_trace_for_bad_headers() {
        for bad in [
            None,
            Some(""),
            Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
            Some("junk"),
        ] {
            let ctx = TraceContext::continue_or_start(bad);
            assert_eq!(ctx.trace_id.len(), 32);
            assert_ne!(ctx.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        }
    }

    #[test]
    fn retry_modes_parse() {
        assert_eq!("every-layer".parse(), Ok(RetryMode::EveryLayer));
        assert_eq!("edge-only".parse(), Ok(RetryMode::EdgeOnly));
        assert!("sometimes".parse::<RetryMode>().is_err());
    }
}
