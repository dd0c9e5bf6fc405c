//! Retry policy as data: the gRPC service config, the JSON document grpc-go, grpc-java and
//! gRPC core accept (gRFC A6), parsed and validated.
//!
//! ```json
//! {
//!   "methodConfig": [{
//!     "name": [{"service": "retrychain.v1.Payments", "method": "Charge"}],
//!     "timeout": "10s",
//!     "retryPolicy": {
//!       "maxAttempts": 3,
//!       "initialBackoff": "0.01s",
//!       "maxBackoff": "1s",
//!       "backoffMultiplier": 2,
//!       "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]
//!     }
//!   }],
//!   "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
//! }
//! ```
//!
//! Validation follows gRFC A6 and grpc-go's parser: `maxAttempts` must be at least 2 and is
//! capped at 5; durations are proto3 JSON strings (`"1.5s"`); backoffs and the multiplier
//! must be positive; `retryableStatusCodes` must name at least one code other than OK; a
//! method may have a retry policy or a hedging policy, not both; a `name` with a method
//! needs its service, and no name may appear twice; `retryThrottling.maxTokens` is in
//! (0, 1000] and `tokenRatio` positive. Anything else is refused with the field's path and
//! the reason — a service must not start on a policy it half understood. Unknown fields
//! are ignored, as grpc-go ignores them.
//!
//! Three extensions, which other gRPC clients ignore:
//! - `retryPolicy.retrychainJitter` picks one of this crate's jitter kinds (`full`,
//!   `equal`, `decorrelated`, `exponential`, `none`); A6's own formula is `full`.
//! - `methodConfig[].retrychainPerTryTimeout` (Envoy's `per_try_timeout`): the longest one
//!   attempt may take at one replica before it is given up (UNAVAILABLE, retryable
//!   elsewhere), e.g. `"0.3s"`; it overrides `--per-try-timeout-ms` for those methods.
//! - `adaptiveThrottling: {"k": 2, "window": "10s"}`: Google SRE's client-side throttling
//!   ([`AdaptiveThrottle`]) instead of A6's `retryThrottling` (not both); `k` at least 1,
//!   the window between 1 s and 10 min.
//!
//! [`AdaptiveThrottle`]: crate::throttle::AdaptiveThrottle

use std::{collections::HashSet, sync::Arc, time::Duration};

use serde_json::{Map, Value};
use tonic::Code;

use crate::{
    backoff::BackoffKind,
    throttle::{A6Throttle, AdaptiveThrottle, Throttle},
};

/// The longest protobuf `Duration`, in seconds (about 10,000 years): no longer one is read.
const MAX_DURATION_SECONDS: u64 = 315_576_000_000;

/// The most attempts a policy may ask for; more is silently capped (gRFC A6).
pub const MAX_ATTEMPTS_CAP: u32 = 5;

/// A parsed, valid service config.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ServiceConfig {
    /// Per-method settings, in document order.
    pub method_configs: Vec<MethodConfig>,
    /// The channel-wide retry throttle, if any.
    pub retry_throttling: Option<RetryThrottling>,
    /// Adaptive client-side throttling instead (an extension), if any.
    pub adaptive_throttling: Option<AdaptiveThrottling>,
}

/// Settings for the methods `names` matches.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MethodConfig {
    /// Which methods: a service and method, a whole service, or (empty) every method.
    pub names: Vec<MethodName>,
    /// The deadline for calls that carry none.
    pub timeout: Option<Duration>,
    /// How calls are retried or hedged.
    pub policy: Option<CallPolicy>,
    /// The longest one attempt may take at one replica (extension
    /// `retrychainPerTryTimeout`).
    pub per_try_timeout: Option<Duration>,
}

/// One `name` entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct MethodName {
    /// `package.Service`; `None` matches every service (the default config).
    pub service: Option<String>,
    /// The method; `None` matches every method of the service.
    pub method: Option<String>,
}

/// A method's retry or hedging policy (never both).
#[derive(Debug, Clone, PartialEq)]
pub enum CallPolicy {
    /// Retry after a failure.
    Retry(RetryPolicyConfig),
    /// Send copies after a delay; the first answer wins.
    Hedging(HedgingPolicy),
}

/// `retryPolicy`. Parsed, `max_attempts` is at most 5 (gRFC A6); built in code, it is what
/// the program says.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicyConfig {
    /// Attempts in all, first included: 2 to 5.
    pub max_attempts: u32,
    /// The first backoff's upper bound.
    pub initial_backoff: Duration,
    /// No backoff is longer.
    pub max_backoff: Duration,
    /// Each backoff's bound grows by this factor.
    pub backoff_multiplier: f64,
    /// The codes worth another attempt.
    pub retryable_status_codes: Vec<Code>,
    /// The jitter formula (extension; A6's is full jitter).
    pub jitter: BackoffKind,
}

impl RetryPolicyConfig {
    /// One attempt, no retries: a method without a `retryPolicy`.
    pub const SINGLE_ATTEMPT: Self = Self {
        max_attempts: 1,
        initial_backoff: Duration::ZERO,
        max_backoff: Duration::ZERO,
        backoff_multiplier: 1.0,
        retryable_status_codes: Vec::new(),
        jitter: BackoffKind::None,
    };

    /// The waits between attempts this policy describes.
    pub fn backoff(&self) -> crate::Backoff {
        crate::Backoff::new(self.jitter, self.initial_backoff, self.max_backoff)
            .with_multiplier(self.backoff_multiplier)
    }

    /// Up to `max_attempts` attempts, waiting as `backoff` says between them, retrying
    /// the failures whose code is in `retryable`.
    pub fn new(max_attempts: u32, backoff: crate::Backoff, retryable: Vec<Code>) -> Self {
        Self {
            max_attempts,
            initial_backoff: backoff.base,
            max_backoff: backoff.cap,
            backoff_multiplier: backoff.multiplier,
            retryable_status_codes: retryable,
            jitter: backoff.kind,
        }
    }
}

/// `hedgingPolicy`.
#[derive(Debug, Clone, PartialEq)]
pub struct HedgingPolicy {
    /// Copies in all, first included: 2 to 5.
    pub max_attempts: u32,
    /// The wait before each further copy.
    pub hedging_delay: Duration,
    /// Codes that do not end the call (the other copies go on).
    pub non_fatal_status_codes: Vec<Code>,
}

/// `retryThrottling`: gRFC A6's token bucket for a channel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryThrottling {
    /// Tokens the bucket starts with and never exceeds.
    pub max_tokens: f64,
    /// Tokens each success adds back.
    pub token_ratio: f64,
}

/// `adaptiveThrottling` (extension): Google SRE's client-side throttling for a channel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveThrottling {
    /// Requests tolerated per accepted one before rejecting locally.
    pub k: f64,
    /// How far back requests and accepts are counted.
    pub window: Duration,
}

/// Why a service config was refused: where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("service config: {field}: {reason}")]
pub struct ConfigError {
    /// The JSON path of the offending field, e.g. `methodConfig[0].retryPolicy.maxAttempts`.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

fn error(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_owned(),
        reason: reason.into(),
    }
}

impl ServiceConfig {
    /// Parses and validates a service config document; see the module docs.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(json)
            .map_err(|e| error("(document)", format!("not valid JSON: {e}")))?;
        let root = value
            .as_object()
            .ok_or_else(|| error("(document)", "must be a JSON object"))?;
        let mut config = ServiceConfig::default();
        let mut seen = HashSet::new();
        if let Some(list) = root.get("methodConfig") {
            let list = list
                .as_array()
                .ok_or_else(|| error("methodConfig", "must be a list"))?;
            for (i, entry) in list.iter().enumerate() {
                let path = format!("methodConfig[{i}]");
                config
                    .method_configs
                    .push(method_config(&path, entry, &mut seen)?);
            }
        }
        if let Some(throttling) = root.get("retryThrottling") {
            config.retry_throttling = Some(retry_throttling(throttling)?);
        }
        if let Some(throttling) = root.get("adaptiveThrottling") {
            if config.retry_throttling.is_some() {
                return Err(error(
                    "adaptiveThrottling",
                    "a service config takes retryThrottling or adaptiveThrottling, not both",
                ));
            }
            config.adaptive_throttling = Some(adaptive_throttling(throttling)?);
        }
        Ok(config)
    }

    /// The throttle the config asks for (`retryThrottling` or `adaptiveThrottling`), new
    /// and shared by the calls of whoever asks: one per channel or service.
    pub fn throttle(&self) -> Option<Arc<dyn Throttle>> {
        if let Some(t) = self.retry_throttling {
            return Some(Arc::new(A6Throttle::new(t.max_tokens, t.token_ratio)));
        }
        self.adaptive_throttling
            .map(|t| Arc::new(AdaptiveThrottle::new(t.k, t.window)) as Arc<dyn Throttle>)
    }

    /// A config that gives every method `policy` (retries or hedging), without
    /// throttling: what a program builds from its own flags.
    pub fn every_method(policy: CallPolicy) -> Self {
        Self {
            method_configs: vec![MethodConfig {
                names: vec![MethodName {
                    service: None,
                    method: None,
                }],
                timeout: None,
                policy: Some(policy),
                per_try_timeout: None,
            }],
            retry_throttling: None,
            adaptive_throttling: None,
        }
    }

    /// The settings for `service`/`method`: an exact match first, then the service's,
    /// then the default (a config whose name is `{}`), as grpc-go resolves them.
    pub fn for_method(&self, service: &str, method: &str) -> Option<&MethodConfig> {
        // Compared borrowed: this runs on every call.
        let find = |service: Option<&str>, method: Option<&str>| {
            self.method_configs.iter().find(|config| {
                config.names.iter().any(|name| {
                    name.service.as_deref() == service && name.method.as_deref() == method
                })
            })
        };
        find(Some(service), Some(method))
            .or_else(|| find(Some(service), None))
            .or_else(|| find(None, None))
    }
}

fn object<'v>(path: &str, value: &'v Value) -> Result<&'v Map<String, Value>, ConfigError> {
    value
        .as_object()
        .ok_or_else(|| error(path, "must be a JSON object"))
}

fn method_config(
    path: &str,
    value: &Value,
    seen: &mut HashSet<MethodName>,
) -> Result<MethodConfig, ConfigError> {
    let entry = object(path, value)?;
    let mut config = MethodConfig::default();
    if let Some(names) = entry.get("name") {
        let names_path = format!("{path}.name");
        let names = names
            .as_array()
            .ok_or_else(|| error(&names_path, "must be a list"))?;
        for (j, name) in names.iter().enumerate() {
            let name_path = format!("{names_path}[{j}]");
            let name_obj = object(&name_path, name)?;
            let text = |key: &str| -> Result<Option<String>, ConfigError> {
                match name_obj.get(key) {
                    None => Ok(None),
                    Some(Value::String(s)) if s.is_empty() => Ok(None),
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    Some(_) => Err(error(&format!("{name_path}.{key}"), "must be a string")),
                }
            };
            let parsed = MethodName {
                service: text("service")?,
                method: text("method")?,
            };
            if parsed.service.is_none() && parsed.method.is_some() {
                return Err(error(
                    &format!("{name_path}.service"),
                    "a method needs its service",
                ));
            }
            if !seen.insert(parsed.clone()) {
                return Err(error(&name_path, "this name appears twice"));
            }
            config.names.push(parsed);
        }
    }
    if let Some(timeout) = entry.get("timeout") {
        let field = format!("{path}.timeout");
        config.timeout = Some(positive(&field, duration(&field, timeout)?)?);
    }
    if let Some(per_try) = entry.get("retrychainPerTryTimeout") {
        let field = format!("{path}.retrychainPerTryTimeout");
        config.per_try_timeout = Some(positive(&field, duration(&field, per_try)?)?);
    }
    let retry = entry.get("retryPolicy");
    let hedging = entry.get("hedgingPolicy");
    config.policy = match (retry, hedging) {
        (Some(_), Some(_)) => {
            return Err(error(
                path,
                "retryPolicy and hedgingPolicy are mutually exclusive",
            ));
        }
        (Some(retry), None) => Some(CallPolicy::Retry(retry_policy(
            &format!("{path}.retryPolicy"),
            retry,
        )?)),
        (None, Some(hedging)) => Some(CallPolicy::Hedging(hedging_policy(
            &format!("{path}.hedgingPolicy"),
            hedging,
        )?)),
        (None, None) => None,
    };
    Ok(config)
}

fn max_attempts(path: &str, value: Option<&Value>) -> Result<u32, ConfigError> {
    let path = format!("{path}.maxAttempts");
    let value = value.ok_or_else(|| error(&path, "is required"))?;
    let n = value
        .as_u64()
        .ok_or_else(|| error(&path, "must be a whole number"))?;
    if n < 2 {
        return Err(error(&path, format!("must be at least 2, got {n}")));
    }
    Ok(n.min(u64::from(MAX_ATTEMPTS_CAP)) as u32)
}

fn retry_policy(path: &str, value: &Value) -> Result<RetryPolicyConfig, ConfigError> {
    let policy = object(path, value)?;
    let required = |key: &str| {
        policy
            .get(key)
            .ok_or_else(|| error(&format!("{path}.{key}"), "is required"))
    };
    let initial_backoff = positive(
        &format!("{path}.initialBackoff"),
        duration(
            &format!("{path}.initialBackoff"),
            required("initialBackoff")?,
        )?,
    )?;
    let max_backoff = positive(
        &format!("{path}.maxBackoff"),
        duration(&format!("{path}.maxBackoff"), required("maxBackoff")?)?,
    )?;
    let multiplier_path = format!("{path}.backoffMultiplier");
    let backoff_multiplier = required("backoffMultiplier")?
        .as_f64()
        .ok_or_else(|| error(&multiplier_path, "must be a number"))?;
    if !(backoff_multiplier > 0.0 && backoff_multiplier.is_finite()) {
        return Err(error(
            &multiplier_path,
            format!("must be above 0, got {backoff_multiplier}"),
        ));
    }
    let codes_path = format!("{path}.retryableStatusCodes");
    let retryable_status_codes = codes(&codes_path, required("retryableStatusCodes")?)?;
    if retryable_status_codes.is_empty() {
        return Err(error(&codes_path, "must name at least one code"));
    }
    let jitter = match policy.get("retrychainJitter") {
        None => BackoffKind::Full,
        Some(Value::String(name)) => name
            .parse()
            .map_err(|e| error(&format!("{path}.retrychainJitter"), format!("{e}")))?,
        Some(_) => {
            return Err(error(
                &format!("{path}.retrychainJitter"),
                "must be a string",
            ));
        }
    };
    Ok(RetryPolicyConfig {
        max_attempts: max_attempts(path, policy.get("maxAttempts"))?,
        initial_backoff,
        max_backoff,
        backoff_multiplier,
        retryable_status_codes,
        jitter,
    })
}

fn hedging_policy(path: &str, value: &Value) -> Result<HedgingPolicy, ConfigError> {
    let policy = object(path, value)?;
    let hedging_delay = match policy.get("hedgingDelay") {
        None => Duration::ZERO,
        Some(value) => duration(&format!("{path}.hedgingDelay"), value)?,
    };
    let non_fatal_status_codes = match policy.get("nonFatalStatusCodes") {
        None => Vec::new(),
        Some(value) => codes(&format!("{path}.nonFatalStatusCodes"), value)?,
    };
    Ok(HedgingPolicy {
        max_attempts: max_attempts(path, policy.get("maxAttempts"))?,
        hedging_delay,
        non_fatal_status_codes,
    })
}

fn retry_throttling(value: &Value) -> Result<RetryThrottling, ConfigError> {
    let path = "retryThrottling";
    let throttling = object(path, value)?;
    let number = |key: &str| {
        let field = format!("{path}.{key}");
        throttling
            .get(key)
            .ok_or_else(|| error(&field, "is required"))?
            .as_f64()
            .ok_or_else(|| error(&field, "must be a number"))
    };
    let max_tokens = number("maxTokens")?;
    if !(max_tokens > 0.0 && max_tokens <= 1000.0) {
        return Err(error(
            "retryThrottling.maxTokens",
            format!("must be above 0 and at most 1000, got {max_tokens}"),
        ));
    }
    let given = number("tokenRatio")?;
    // A6: up to three decimal places are honoured; what is left must still refill.
    let token_ratio = (given * 1000.0).trunc() / 1000.0;
    if !(token_ratio > 0.0 && token_ratio.is_finite()) {
        return Err(error(
            "retryThrottling.tokenRatio",
            format!("must be at least 0.001 (three decimals are honoured), got {given}"),
        ));
    }
    Ok(RetryThrottling {
        max_tokens,
        token_ratio,
    })
}

fn adaptive_throttling(value: &Value) -> Result<AdaptiveThrottling, ConfigError> {
    let path = "adaptiveThrottling";
    let throttling = object(path, value)?;
    let k = match throttling.get("k") {
        None => crate::throttle::ADAPTIVE_K,
        Some(k) => k
            .as_f64()
            .ok_or_else(|| error("adaptiveThrottling.k", "must be a number"))?,
    };
    if !(k.is_finite() && k >= 1.0) {
        return Err(error(
            "adaptiveThrottling.k",
            format!("must be at least 1 (below 1 it rejects a healthy server's calls), got {k}"),
        ));
    }
    let window = match throttling.get("window") {
        None => crate::throttle::ADAPTIVE_WINDOW,
        Some(window) => duration("adaptiveThrottling.window", window)?,
    };
    if !(Duration::from_secs(1)..=Duration::from_secs(600)).contains(&window) {
        return Err(error(
            "adaptiveThrottling.window",
            format!("must be between 1s and 600s, got {window:?}"),
        ));
    }
    Ok(AdaptiveThrottling { k, window })
}

fn positive(path: &str, duration: Duration) -> Result<Duration, ConfigError> {
    if duration.is_zero() {
        Err(error(path, "must be above 0s"))
    } else {
        Ok(duration)
    }
}

/// A proto3 JSON duration: decimal seconds with an `s` suffix, e.g. `"1.5s"`, `"0.010s"`.
fn duration(path: &str, value: &Value) -> Result<Duration, ConfigError> {
    let text = value
        .as_str()
        .ok_or_else(|| error(path, "must be a string such as \"1.5s\""))?;
    let seconds = text.strip_suffix('s').ok_or_else(|| {
        error(
            path,
            format!("{text:?} is not a duration: it must end in \"s\", e.g. \"1.5s\""),
        )
    })?;
    let (whole, fraction) = seconds.split_once('.').unwrap_or((seconds, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    // grpc-go also takes a bare fraction (".01s"), as in its own retry example.
    let whole = if whole.is_empty() && !fraction.is_empty() {
        "0"
    } else {
        whole
    };
    if whole.is_empty() || !digits(whole) || !digits(fraction) || fraction.len() > 9 {
        return Err(error(
            path,
            format!(
                "{text:?} is not a duration: decimal seconds, at most 9 decimals, e.g. \"1.5s\""
            ),
        ));
    }
    let whole: u64 = whole
        .parse()
        .ok()
        .filter(|&w| w <= MAX_DURATION_SECONDS)
        .ok_or_else(|| {
            error(
                path,
                format!("{text:?} is longer than a protobuf Duration (10,000 years)"),
            )
        })?;
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}")
            .parse()
            .map_err(|_| error(path, format!("{text:?} is not a duration")))?
    };
    Ok(Duration::new(whole, nanos))
}

/// Status codes by name (`"UNAVAILABLE"`, any case) or number; OK is not a failure.
fn codes(path: &str, value: &Value) -> Result<Vec<Code>, ConfigError> {
    let list = value
        .as_array()
        .ok_or_else(|| error(path, "must be a list of status codes"))?;
    let mut codes = Vec::new();
    for (i, code) in list.iter().enumerate() {
        let field = format!("{path}[{i}]");
        let parsed = match code {
            Value::String(name) => crate::wire::code_by_name(name)
                .ok_or_else(|| error(&field, format!("{name:?} is not a gRPC status code")))?,
            Value::Number(n) => n
                .as_i64()
                .filter(|n| (1..=16).contains(n))
                .map(|n| Code::from_i32(n as i32))
                .ok_or_else(|| error(&field, format!("{n} is not a gRPC status code")))?,
            _ => return Err(error(&field, "must be a code name or number")),
        };
        if parsed == Code::Ok {
            return Err(error(&field, "OK is not a failure"));
        }
        if !codes.contains(&parsed) {
            codes.push(parsed);
        }
    }
    Ok(codes)
}

#[cfg(test)]
mod tests;
