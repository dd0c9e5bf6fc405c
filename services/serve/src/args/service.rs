//! The flags every service takes: listening, retries, deadlines, limits, TLS.

use std::{net::SocketAddr, time::Duration};

use clap::{Args, ValueEnum};
use resilience::{
    Backoff, BackoffKind, ServiceConfig,
    service_config::{CallPolicy, RetryPolicyConfig},
};
use retrychain_domain::RetryMode;
use retrychain_node::telemetry::LogFormat;
use serde::Serialize;

use super::value::as_value_name;

/// The share of a call's time the edge lets it be predicted to take before refusing it:
/// the other half is room for a prediction that was too fast and for a stall after
/// admission (a ledger session killed, a starved core). A quarter, as before, refused
/// calls that would have been served in time: at 1,500 calls in flight, closed loop, it
/// served 0.86 of admitting everything where a half served 0.99, side by side
/// (docs/overload.md).
pub const EDGE_HEADROOM: f64 = 0.5;

/// `--log-format` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormatArg {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl From<LogFormatArg> for LogFormat {
    fn from(arg: LogFormatArg) -> Self {
        match arg {
            LogFormatArg::Text => LogFormat::Text,
            LogFormatArg::Json => LogFormat::Json,
        }
    }
}

/// Flags every service takes.
#[derive(Debug, Clone, Args, Serialize)]
pub struct ServiceArgs {
    /// Address to listen on for Payments [default: 0.0.0.0:50051 edge, 0.0.0.0:50052 relay, 0.0.0.0:50055 ledger].
    #[arg(long, env = "RETRYCHAIN_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Address to listen on for Control (and health, reflection) [default: 127.0.0.1:<listen port + 1000>; port 0 when --listen's port is 0].
    #[arg(long, env = "RETRYCHAIN_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Service name in logs and Stats [default: edge, hop2, ledger by role].
    #[arg(long, env = "RETRYCHAIN_NAME")]
    pub name: Option<String>,
    /// Where retries happen when a request does not say.
    #[arg(long, env = "RETRYCHAIN_RETRY_MODE", value_enum, default_value_t = RetryMode::EdgeOnly)]
    #[serde(serialize_with = "as_value_name")]
    pub retry_mode: RetryMode,
    /// Attempts per call (first included) wherever this service retries.
    #[arg(long, env = "RETRYCHAIN_MAX_ATTEMPTS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub max_attempts: u32,
    /// Backoff between attempts.
    #[arg(long, env = "RETRYCHAIN_BACKOFF", value_enum, default_value_t = BackoffKind::Full)]
    #[serde(serialize_with = "as_value_name")]
    pub backoff: BackoffKind,
    /// First exponential backoff step, in ms.
    #[arg(long, env = "RETRYCHAIN_BACKOFF_BASE_MS", default_value_t = 10)]
    pub backoff_base_ms: u64,
    /// Longest backoff, in ms.
    #[arg(long, env = "RETRYCHAIN_BACKOFF_CAP_MS", default_value_t = 1000)]
    pub backoff_cap_ms: u64,
    /// Retry budget capacity, in tokens (a retry costs one).
    #[arg(long, env = "RETRYCHAIN_BUDGET_TOKENS", default_value_t = 10.0)]
    pub budget_tokens: f64,
    /// Tokens each first attempt refunds to the budget.
    #[arg(long, env = "RETRYCHAIN_BUDGET_REFUND", default_value_t = 0.1)]
    pub budget_refund: f64,
    /// Retry without a budget: retries limited only by --max-attempts.
    #[arg(long, env = "RETRYCHAIN_NO_BUDGET", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_budget: bool,
    /// Adaptive client-side throttling (Google SRE) instead of the retry budget: every
    /// attempt, first ones too, is rejected locally with probability
    /// max(0, (requests - K*accepts) / (requests + 1)) over a sliding window, so that a
    /// service below that accepts nothing receives almost nothing. A --service-config's
    /// `retryThrottling` or `adaptiveThrottling` takes its place.
    #[arg(long, env = "RETRYCHAIN_ADAPTIVE_THROTTLING", value_parser = clap::builder::BoolishValueParser::new())]
    pub adaptive_throttling: bool,
    /// Adaptive throttling's K: requests tolerated per accepted one (at least 1).
    #[arg(long, env = "RETRYCHAIN_ADAPTIVE_THROTTLING_K", default_value_t = resilience::throttle::ADAPTIVE_K)]
    pub adaptive_throttling_k: f64,
    /// Adaptive throttling's window, in ms: how far back requests and accepts count.
    #[arg(long, env = "RETRYCHAIN_ADAPTIVE_THROTTLING_WINDOW_MS", default_value_t = resilience::throttle::ADAPTIVE_WINDOW.as_millis() as u64, value_parser = clap::value_parser!(u64).range(1000..=600_000))]
    pub adaptive_throttling_window_ms: u64,
    /// Deadline applied to a request that carries none, in ms (a --service-config method's
    /// `timeout` takes its place for that method).
    #[arg(long, env = "RETRYCHAIN_DEFAULT_DEADLINE_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub default_deadline_ms: u64,
    /// Longest deadline honoured, in ms; a longer incoming deadline is cut to this. The
    /// ledger's --key-retention must be at least this long.
    #[arg(long, env = "RETRYCHAIN_MAX_DEADLINE_MS", default_value_t = 300_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_deadline_ms: u64,
    /// Taken off the remaining time for each downstream deadline, in ms; the service
    /// answers DEADLINE_EXCEEDED itself at half this margin before its own deadline.
    #[arg(long, env = "RETRYCHAIN_DEADLINE_MARGIN_MS", default_value_t = 20, value_parser = clap::value_parser!(u64).range(2..))]
    pub deadline_margin_ms: u64,
    /// Shortest downstream attempt worth starting, in ms.
    #[arg(long, env = "RETRYCHAIN_MIN_ATTEMPT_MS", default_value_t = 20)]
    pub min_attempt_ms: u64,
    /// Allow Control.SetFaults (a demo setting; production leaves it off).
    #[arg(long, env = "RETRYCHAIN_FAULT_INJECTION", value_parser = clap::builder::BoolishValueParser::new())]
    pub fault_injection: bool,
    /// A gRPC service config JSON file (gRFC A6), in place of --max-attempts and
    /// --backoff*: each method's `retryPolicy` or `hedgingPolicy` applies to that method's
    /// calls (a method without one is not retried), its `timeout` bounds them, and
    /// `retryThrottling` replaces the edge's budget. Refused at start-up, with the field and
    /// the reason, if invalid.
    #[arg(long, env = "RETRYCHAIN_SERVICE_CONFIG")]
    pub service_config: Option<std::path::PathBuf>,
    /// Honour (and pass on) a caller's x-retry-mode header. It can multiply load 81-fold,
    /// so it is off by default on every service (a demo setting, like --fault-injection).
    #[arg(long, env = "RETRYCHAIN_ALLOW_RETRY_MODE_OVERRIDE", value_parser = clap::builder::BoolishValueParser::new())]
    pub allow_retry_mode_override: bool,
    /// Log format.
    #[arg(long, env = "RETRYCHAIN_LOG_FORMAT", value_enum, default_value_t = LogFormatArg::Text)]
    #[serde(serialize_with = "as_value_name")]
    pub log_format: LogFormatArg,
    /// Connections the public port holds at once; more wait in the kernel's accept queue
    /// until one closes. A connection that has not sent the HTTP/2 preface 10 s after
    /// connecting is closed.
    #[arg(long, env = "RETRYCHAIN_MAX_CONNECTIONS", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Connections the public port holds at once from one IP address; more are closed as
    /// they come (one client cannot take every slot).
    #[arg(long, env = "RETRYCHAIN_MAX_CONNECTIONS_PER_PEER", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections_per_peer: u32,
    /// The most Payments calls served at once, over all connections: the bound on the
    /// memory unfinished calls can hold. Below it a call is admitted while it can be
    /// answered within its deadline at the rate this service drains its calls now (see
    /// docs/overload.md); a call that cannot is answered UNAVAILABLE at once, as
    /// overloaded, with grpc-retry-pushback-ms.
    #[arg(long, env = "RETRYCHAIN_MAX_IN_FLIGHT", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_in_flight: u32,
    /// Up to this many Payments calls at once are always admitted, whatever is predicted
    /// (at most --max-in-flight: a lower ceiling lowers it too). Set it equal to
    /// --max-in-flight for a fixed limit.
    #[arg(long, env = "RETRYCHAIN_MIN_CONCURRENCY", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub min_concurrency: u32,
    /// The most calls at once before this service has measured how fast it drains them
    /// (kept within --min-concurrency and --max-in-flight).
    #[arg(long, env = "RETRYCHAIN_INITIAL_CONCURRENCY", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub initial_concurrency: u32,
    /// A bound, in ms, on the time a call may be predicted to wait and be served here
    /// before it is refused as overloaded, whatever its deadline: shorter queues, at the
    /// price of refusing calls that a long deadline would have let wait. Unset: the
    /// call's deadline alone decides.
    #[arg(long, env = "RETRYCHAIN_LATENCY_OBJECTIVE_MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub latency_objective_ms: Option<u64>,
    /// Threads that serve calls. 1: one, on tokio's current-thread scheduler — every
    /// connection and call on it, nothing handed between threads (a relay forwards a call
    /// for a third less CPU than with a worker per core: docs/benchmarks.md, section 2); it
    /// uses at most one core. More: tokio's multi-thread scheduler with that many workers,
    /// for a service that needs more than a core. 0: a worker per core. (The log writer
    /// has a thread of its own either way.) A service started in process by the harness
    /// runs on its caller's runtime instead.
    #[arg(long, env = "RETRYCHAIN_WORKER_THREADS", default_value_t = 1)]
    pub worker_threads: usize,
    /// TLS: a directory holding tls.crt, tls.key and ca.crt (a Kubernetes TLS secret, as
    /// cert-manager writes it). With it, or the three files below, the public port speaks
    /// TLS 1.3 only, every downstream call is TLS with this service's certificate, and the
    /// files are read again when they change.
    #[arg(long, env = "RETRYCHAIN_TLS_DIR")]
    pub tls_dir: Option<std::path::PathBuf>,
    /// TLS: this service's certificate chain, PEM; its one URI SAN names the service
    /// (spiffe://retrychain/<tier>) [default: <--tls-dir>/tls.crt].
    #[arg(long, env = "RETRYCHAIN_TLS_CERT")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// TLS: the certificate's private key, PEM [default: <--tls-dir>/tls.key].
    #[arg(long, env = "RETRYCHAIN_TLS_KEY")]
    pub tls_key: Option<std::path::PathBuf>,
    /// TLS: the authorities trusted for peers' certificates, PEM, one or several (old and
    /// new during a CA rotation) [default: <--tls-dir>/ca.crt].
    #[arg(long, env = "RETRYCHAIN_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// TLS: the identities that may call Payments, comma-separated, or `any`
    /// [default: the tier above in the chain (hop3 accepts spiffe://retrychain/hop2); the
    /// edge: any caller, with or without a certificate].
    #[arg(long, env = "RETRYCHAIN_TLS_ACCEPT")]
    pub tls_accept: Option<String>,
}

impl ServiceArgs {
    /// Where this service's TLS material is, when it has TLS: `--tls-dir`'s files, each
    /// replaced by its own flag when given. Without `--tls-dir`, all three files must be
    /// named.
    pub fn tls_files(&self) -> anyhow::Result<Option<retrychain_tls::TlsFiles>> {
        let (cert, key, ca) = (&self.tls_cert, &self.tls_key, &self.tls_ca);
        let base = match (&self.tls_dir, cert, key, ca) {
            (None, None, None, None) => return Ok(None),
            (Some(dir), ..) => retrychain_tls::TlsFiles::in_dir(dir),
            (None, Some(cert), Some(key), Some(ca)) => retrychain_tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            },
            _ => anyhow::bail!(
                "TLS needs --tls-dir, or all three of --tls-cert, --tls-key and --tls-ca"
            ),
        };
        Ok(Some(retrychain_tls::TlsFiles {
            cert: cert.clone().unwrap_or(base.cert),
            key: key.clone().unwrap_or(base.key),
            ca: ca.clone().unwrap_or(base.ca),
        }))
    }

    /// Who may call the Payments of the service named `name` over TLS: `--tls-accept`,
    /// else the tier above it in the chain, else (the edge) anyone.
    pub fn tls_accept(
        &self,
        name: &str,
        edge: bool,
    ) -> anyhow::Result<retrychain_node::authz::Accept> {
        use retrychain_node::authz::Accept;
        match self.tls_accept.as_deref().map(str::trim) {
            Some("any") => Ok(Accept::Anyone),
            Some(list) => {
                let identities = list
                    .split(',')
                    .map(str::trim)
                    .filter(|id| !id.is_empty())
                    .map(|id| retrychain_tls::Identity::parse(id).map_err(anyhow::Error::from))
                    .collect::<anyhow::Result<Vec<_>>>()
                    .map_err(|error| anyhow::anyhow!("--tls-accept: {error}"))?;
                anyhow::ensure!(
                    !identities.is_empty(),
                    "--tls-accept names no identity (use `any` for anyone)"
                );
                Ok(Accept::Only(identities))
            }
            None if edge => Ok(Accept::Anyone),
            None => match retrychain_tls::caller_of(name) {
                Some(caller) => Ok(Accept::Only(vec![caller])),
                None => anyhow::bail!(
                    "--tls-accept is needed: {name:?} is not one of the chain's tiers ({}), so the tier that calls it is not known",
                    retrychain_tls::CHAIN.join(", ")
                ),
            },
        }
    }

    /// The admission the flags describe: the floor and the starting point kept under the
    /// ceiling (`--max-in-flight 4` alone is a fixed limit of 4). `door`: this service is
    /// the edge, whose first attempts that do not fit may wait that share of their time
    /// (`--door-wait-share`). At the edge a call is admitted only while it is predicted to
    /// take at most half its time ([`EDGE_HEADROOM`]; the services below then admit what
    /// the edge did); see docs/overload.md.
    pub fn admission(
        &self,
        door: Option<f64>,
    ) -> Result<resilience::AdmissionSettings, resilience::admission::InvalidAdmission> {
        let edge = door.is_some();
        let max = self.max_in_flight as usize;
        let min = (self.min_concurrency as usize).min(max);
        resilience::AdmissionSettings {
            min_limit: min,
            max_limit: max,
            initial_limit: (self.initial_concurrency as usize).clamp(min, max.max(min)),
            headroom: if edge { EDGE_HEADROOM } else { 1.0 },
            wait_share: door.unwrap_or(0.0),
            door: edge,
            latency_objective: self.latency_objective_ms.map(Duration::from_millis),
            ..resilience::AdmissionSettings::default()
        }
        .validated()
    }

    /// The backoff the flags describe.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(
            self.backoff,
            Duration::from_millis(self.backoff_base_ms),
            Duration::from_millis(self.backoff_cap_ms),
        )
    }

    /// The per-hop deadline margin.
    pub fn margin(&self) -> Duration {
        Duration::from_millis(self.deadline_margin_ms)
    }

    /// How long before its deadline a service answers DEADLINE_EXCEEDED itself.
    pub fn reserve(&self) -> Duration {
        self.margin() / 2
    }

    /// The shortest attempt worth starting.
    pub fn min_attempt(&self) -> Duration {
        Duration::from_millis(self.min_attempt_ms)
    }

    /// The retry policy the flags describe, for every method: what stands in for a
    /// `--service-config` document when none is given.
    pub fn retry_policy(&self) -> ServiceConfig {
        ServiceConfig::every_method(CallPolicy::Retry(RetryPolicyConfig::new(
            self.max_attempts,
            self.backoff(),
            resilience::classify::RETRYABLE.to_vec(),
        )))
    }
}
