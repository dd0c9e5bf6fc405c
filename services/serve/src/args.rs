//! The flags of `edge`, `relay` and `ledger`. Every flag can also be set through the
//! environment variable named in `--help`, which is how docker-compose configures the
//! services; the binary and the in-process chains of the harness parse the same flags.

use std::{net::SocketAddr, time::Duration};

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use resilience::{
    Backoff, BackoffKind, ServiceConfig,
    service_config::{CallPolicy, RetryPolicyConfig},
};
use retrychain_node::{RetryMode, telemetry::LogFormat};
use serde::{Serialize, Serializer};

/// The share of a call's time the edge lets it be predicted to take before refusing it:
/// the rest is for the services below, so that what the edge admits they admit too.
const EDGE_HEADROOM: f64 = 0.25;

/// One service's command line, `edge|relay|ledger <flags>`: what the harness parses to
/// start a service in process from the same argv it would give a child process.
#[derive(Debug, Parser)]
#[command(name = "retrychain", no_binary_name = true)]
pub struct ServiceCli {
    /// The service to run.
    #[command(subcommand)]
    pub command: ServiceCommand,
}

/// The three kinds of service; the binary's `edge`, `relay` and `ledger` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum ServiceCommand {
    /// Run the edge: the service clients call (default port 50051).
    Edge(HopArgs),
    /// Run a relay (hop2, hop3 or hop4): forwards each call downstream.
    Relay(HopArgs),
    /// Run the ledger: charges accounts through the processor, keys in Postgres.
    Ledger(LedgerArgs),
}

impl ServiceCommand {
    /// The flags every service takes.
    pub fn service(&self) -> &ServiceArgs {
        match self {
            ServiceCommand::Edge(args) | ServiceCommand::Relay(args) => &args.service,
            ServiceCommand::Ledger(args) => &args.service,
        }
    }

    /// The service's name: `--name`, or its role's default (edge, hop2, ledger).
    pub fn name(&self) -> String {
        let default = match self {
            ServiceCommand::Edge(_) => "edge",
            ServiceCommand::Relay(_) => "hop2",
            ServiceCommand::Ledger(_) => "ledger",
        };
        self.service()
            .name
            .clone()
            .unwrap_or_else(|| default.to_owned())
    }
}

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

/// `--in-flight` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InFlightArg {
    /// A same-key request waits for the first, then replays its reply.
    Wait,
    /// A same-key request is refused with ABORTED while the first runs.
    Reject,
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
    /// ceiling (`--max-in-flight 4` alone is a fixed limit of 4). At the edge a call is
    /// admitted only while it is predicted to take at most 80% of its time: the rest is the
    /// services' below, which then admit what the edge did (docs/overload.md).
    pub fn admission(
        &self,
        edge: bool,
    ) -> Result<resilience::AdmissionSettings, resilience::admission::InvalidAdmission> {
        let max = self.max_in_flight as usize;
        let min = (self.min_concurrency as usize).min(max);
        resilience::AdmissionSettings {
            min_limit: min,
            max_limit: max,
            initial_limit: (self.initial_concurrency as usize).clamp(min, max.max(min)),
            headroom: if edge { EDGE_HEADROOM } else { 1.0 },
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

/// Flags of `edge` and `relay`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct HopArgs {
    /// Flags every service takes.
    #[command(flatten)]
    #[serde(flatten)]
    pub service: ServiceArgs,
    /// The next service: one URL, several comma-separated (its replicas), or
    /// dns:///host:port (every address the name resolves to, resolved again every 5 s)
    /// [default: http://127.0.0.1:50052 for the edge; required for a relay].
    #[arg(long, env = "RETRYCHAIN_DOWNSTREAM")]
    pub downstream: Option<String>,
    /// TLS: the identity the service below must present [default: the tier below in the
    /// chain (the edge expects spiffe://retrychain/hop2)].
    #[arg(long, env = "RETRYCHAIN_TLS_DOWNSTREAM_IDENTITY")]
    pub tls_downstream_identity: Option<String>,
    /// The edge: a JWKS file (public keys only) against which callers' bearer tokens
    /// (`authorization: Bearer <JWT>`) are checked; read again when it changes. A token's
    /// caller is `jwt:<sub>`.
    #[arg(long, env = "RETRYCHAIN_JWKS")]
    pub jwks: Option<std::path::PathBuf>,
    /// The edge: the issuer (`iss`) a bearer token must name [default: any].
    #[arg(long, env = "RETRYCHAIN_JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// The edge: the audience (`aud`) a bearer token must name [default: none; a token
    /// that names one is refused].
    #[arg(long, env = "RETRYCHAIN_JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
    /// The edge: who may call — `authenticated` (a client certificate or a bearer token,
    /// else UNAUTHENTICATED) or `anyone` (a call without credentials is the anonymous
    /// caller's) [default: authenticated with TLS or --jwks, else anyone].
    #[arg(long, env = "RETRYCHAIN_CALLERS", value_enum)]
    #[serde(serialize_with = "as_optional_value_name")]
    pub callers: Option<CallersArg>,
    /// The edge: the most calls one identified caller may hold at once; past it,
    /// RESOURCE_EXHAUSTED with a pushback: a fixed bound beside admission's fair shares,
    /// which follow what the chain can answer in time.
    #[arg(long, env = "RETRYCHAIN_CALLER_MAX_IN_FLIGHT", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub caller_max_in_flight: u32,
    /// The longest one attempt may take at one replica, in ms; past it the attempt fails
    /// UNAVAILABLE and may be retried at another (Envoy's per_try_timeout). Unset: 1000 ms
    /// when --downstream names several replicas or a dns:/// name (one frozen replica then
    /// costs a call about a second, not its whole deadline), else each attempt may take
    /// the call's whole remaining deadline. The 1 s default does not apply in every-layer
    /// mode, where one attempt holds every retry below it.
    #[arg(long, env = "RETRYCHAIN_PER_TRY_TIMEOUT_MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub per_try_timeout_ms: Option<u64>,
    /// A replica below is ejected after this many failures of its own in a row (gRFC A50's
    /// consecutive-failures detection; 0: never).
    #[arg(long, env = "RETRYCHAIN_EJECT_AFTER_FAILURES", default_value_t = 5)]
    pub eject_after_failures: u32,
    /// How long a replica's first ejection lasts, in ms; the n-th lasts n times as long.
    #[arg(long, env = "RETRYCHAIN_EJECTION_BASE_MS", default_value_t = 30_000)]
    pub ejection_base_ms: u64,
    /// The longest an ejection lasts, in ms.
    #[arg(long, env = "RETRYCHAIN_EJECTION_MAX_MS", default_value_t = 300_000)]
    pub ejection_max_ms: u64,
    /// The most replicas below ejected at once, in percent (one may always be, unless 0:
    /// then none is).
    #[arg(long, env = "RETRYCHAIN_MAX_EJECTION_PERCENT", default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub max_ejection_percent: u32,
    /// A replica below whose own failures exceed this percentage of its attempts in an
    /// interval is ejected (gRFC A50's failure-percentage detection; 100: never).
    #[arg(long, env = "RETRYCHAIN_FAILURE_PERCENTAGE_THRESHOLD", default_value_t = 85, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub failure_percentage_threshold: u32,
    /// Failure percentages are judged only when at least this many replicas had enough
    /// attempts in the interval.
    #[arg(
        long,
        env = "RETRYCHAIN_FAILURE_PERCENTAGE_MINIMUM_HOSTS",
        default_value_t = 5
    )]
    pub failure_percentage_minimum_hosts: u32,
    /// A replica's failure percentage is judged only with at least this many attempts in
    /// the interval.
    #[arg(
        long,
        env = "RETRYCHAIN_FAILURE_PERCENTAGE_REQUEST_VOLUME",
        default_value_t = 50
    )]
    pub failure_percentage_request_volume: u32,
    /// How often failure percentages are judged, in ms.
    #[arg(long, env = "RETRYCHAIN_EJECTION_INTERVAL_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub ejection_interval_ms: u64,
}

/// `--callers`: who the edge lets call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CallersArg {
    /// Only callers with a valid client certificate or bearer token.
    Authenticated,
    /// Anyone; a call without credentials is the anonymous caller's.
    Anyone,
}

/// The per-attempt timeout a hop takes over replicas when none is given: long enough for
/// a healthy chain below (milliseconds) and a slowish processor, short enough that a
/// frozen replica costs a call about a second of its 5 s default deadline.
pub const REPLICATED_PER_TRY_TIMEOUT_MS: u64 = 1000;

impl HopArgs {
    /// The identity the service below the hop named `name` must present over TLS:
    /// `--tls-downstream-identity`, else the tier below it in the chain.
    pub fn tls_downstream_identity(&self, name: &str) -> anyhow::Result<retrychain_tls::Identity> {
        match &self.tls_downstream_identity {
            Some(id) => retrychain_tls::Identity::parse(id.trim())
                .map_err(|error| anyhow::anyhow!("--tls-downstream-identity: {error}")),
            None => retrychain_tls::callee_of(name).ok_or_else(|| {
                anyhow::anyhow!(
                    "--tls-downstream-identity is needed: {name:?} is not one of the chain's tiers ({}), so the tier below it is not known",
                    retrychain_tls::CHAIN.join(", ")
                )
            }),
        }
    }

    /// How the edge tells its callers apart (`tls`: whether it speaks TLS); an error for
    /// a relay given any of the edge's caller flags, or for a JWKS that cannot be read.
    pub fn callers(
        &self,
        edge: bool,
        tls: bool,
    ) -> anyhow::Result<Option<retrychain_node::callers::CallersSettings>> {
        if !edge {
            anyhow::ensure!(
                self.jwks.is_none()
                    && self.jwt_issuer.is_none()
                    && self.jwt_audience.is_none()
                    && self.callers.is_none(),
                "--jwks, --jwt-issuer, --jwt-audience and --callers are the edge's: a relay takes the caller the edge names"
            );
            return Ok(None);
        }
        let tokens = match &self.jwks {
            Some(path) => {
                let tokens = retrychain_tls::Tokens::load(retrychain_tls::TokenRules {
                    jwks: path.clone(),
                    issuer: self.jwt_issuer.clone(),
                    audience: self.jwt_audience.clone(),
                })
                .map_err(|error| anyhow::anyhow!("--jwks: {error}"))?;
                Some(tokens)
            }
            None => {
                anyhow::ensure!(
                    self.jwt_issuer.is_none() && self.jwt_audience.is_none(),
                    "--jwt-issuer and --jwt-audience need --jwks"
                );
                None
            }
        };
        let require = match self.callers {
            Some(CallersArg::Authenticated) => true,
            Some(CallersArg::Anyone) => false,
            None => tls || tokens.is_some(),
        };
        anyhow::ensure!(
            !require || tls || tokens.is_some(),
            "--callers authenticated needs a way to authenticate: TLS (client certificates) or --jwks (bearer tokens)"
        );
        Ok(Some(retrychain_node::callers::CallersSettings {
            tokens,
            require,
            max_in_flight: self.caller_max_in_flight as usize,
        }))
    }

    /// Whether `--downstream` names replicas (several URLs, or a DNS name that may resolve
    /// to several).
    pub fn replicated(&self) -> bool {
        self.downstream
            .as_deref()
            .is_some_and(|d| d.contains(',') || d.trim().starts_with("dns:"))
    }

    /// How the hop's balancer bounds attempts and ejects replicas.
    pub fn balance(&self) -> resilience::balance::BalanceSettings {
        let per_try = self
            .per_try_timeout_ms
            .or_else(|| self.replicated().then_some(REPLICATED_PER_TRY_TIMEOUT_MS));
        resilience::balance::BalanceSettings {
            per_try_timeout: per_try.map(std::time::Duration::from_millis),
            consecutive_failures: self.eject_after_failures,
            base_ejection: std::time::Duration::from_millis(self.ejection_base_ms),
            max_ejection: std::time::Duration::from_millis(self.ejection_max_ms),
            max_ejection_percent: self.max_ejection_percent,
            failure_percentage_threshold: self.failure_percentage_threshold,
            failure_percentage_minimum_hosts: self.failure_percentage_minimum_hosts,
            failure_percentage_request_volume: self.failure_percentage_request_volume,
            interval: std::time::Duration::from_millis(self.ejection_interval_ms),
        }
    }
}

/// Flags of `ledger`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct LedgerArgs {
    /// Flags every service takes.
    #[command(flatten)]
    #[serde(flatten)]
    pub service: ServiceArgs,
    /// Postgres URL, e.g. postgres://user:pass@host:5432/db.
    #[arg(long, env = "DATABASE_URL")]
    /// Never on a command line: see [`ServiceCommand::to_args`].
    #[serde(skip)]
    pub database_url: String,
    /// What a request does while another with the same key is running.
    #[arg(long, env = "RETRYCHAIN_IN_FLIGHT", value_enum, default_value_t = InFlightArg::Wait)]
    #[serde(serialize_with = "as_value_name")]
    pub in_flight: InFlightArg,
    /// How long idempotency keys are kept (e.g. 24h, 90m, 30s); a later retry is a new request.
    #[arg(long, env = "RETRYCHAIN_KEY_RETENTION", default_value = "24h", value_parser = humantime::parse_duration)]
    #[serde(serialize_with = "as_humantime")]
    pub key_retention: Duration,
    /// Database connections.
    #[arg(long, env = "RETRYCHAIN_DB_POOL_SIZE", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub db_pool_size: u32,
    /// Longest wait for a database connection (opening one included) during which no
    /// connection comes back to the pool, in ms; past it a call answers UNAVAILABLE at once
    /// instead of holding the chain until its deadline. While connections come back (a
    /// busy database), a call waits as long as its deadline allows.
    #[arg(long, env = "RETRYCHAIN_DB_ACQUIRE_TIMEOUT_MS", default_value_t = 250, value_parser = clap::value_parser!(u64).range(1..))]
    pub db_acquire_timeout_ms: u64,
    /// Longest one opening of a database connection may take, in ms. The pool opens
    /// connections on its own clock, never a caller's: a caller that stops waiting does
    /// not cut an opening short, so the pool refills under load.
    #[arg(long, env = "RETRYCHAIN_DB_CONNECT_TIMEOUT_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub db_connect_timeout_ms: u64,
    /// Longest wait for one database round trip (a statement, BEGIN, COMMIT), in ms, by the
    /// ledger's own clock: past it the charge answers UNAVAILABLE, its connection is closed
    /// and never reused, and the key is left for a retry to resolve. A frozen or
    /// unreachable database cannot enforce its own statement_timeout; this bound holds
    /// anyway. Too low, and a slow but live database fails charges it would have committed
    /// (docs/reliability.md).
    #[arg(long, env = "RETRYCHAIN_DB_ROUND_TRIP_TIMEOUT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..))]
    pub db_round_trip_timeout_ms: u64,
    /// Whose signed statement names each call's caller, or `none`. With it, a call is
    /// served only with a statement this identity signed for that very call
    /// (x-caller-statement-bin, checked against --tls-ca), so a stolen relay key cannot
    /// charge as another caller; with `none`, the ledger believes the caller the tier
    /// above names (x-caller) [default: with TLS, spiffe://retrychain/edge; without,
    /// none].
    #[arg(long, env = "RETRYCHAIN_CALLER_SIGNER")]
    pub caller_signer: Option<String>,
    /// Testing only, and wrong on purpose (hidden): every charge first forgets what its
    /// key recorded, so a retry charges again. `retrychain chaos` must catch a ledger
    /// started this way; its own test does.
    #[arg(long, hide = true, env = "RETRYCHAIN_TEST_SKIP_KEY_CLAIM", value_parser = clap::builder::BoolishValueParser::new())]
    pub test_skip_key_claim: bool,
}

impl LedgerArgs {
    /// What the ledger does with the edge's statements of callers: `--caller-signer`, else
    /// (with TLS, `tls`) checks the edge's, else (plaintext) none.
    pub fn statements(&self, tls: bool) -> anyhow::Result<retrychain_node::Statements> {
        use retrychain_node::Statements;
        match self.caller_signer.as_deref().map(str::trim) {
            Some("none") => Ok(Statements::Off),
            Some(identity) => {
                anyhow::ensure!(
                    tls,
                    "--caller-signer needs this service's TLS material to check statements with (--tls-dir, or --tls-cert, --tls-key and --tls-ca)"
                );
                let identity = retrychain_tls::Identity::parse(identity)
                    .map_err(|error| anyhow::anyhow!("--caller-signer: {error}"))?;
                Ok(Statements::Check(identity))
            }
            None if tls => Ok(Statements::Check(retrychain_tls::Identity::of_service(
                "edge",
            ))),
            None => Ok(Statements::Off),
        }
    }
}

/// The flags of one service as a command line: the way a service's typed settings cross a
/// process boundary, and only there (`retrychain-harness` starts in-process services from
/// the typed values). Every field is written, so the command reads the same whatever the
/// child's environment says — but the ledger's database URL, which may hold a password and
/// a command line is readable by every local user: the child gets it as `DATABASE_URL`.
///
/// Nothing here names a flag. The settings are serialized (serde) into their fields'
/// values, and clap's own description of the command says which flag each field is and
/// whether it takes a value: a flag added to the structs is on the command line with no
/// change here (a field of a type without a command-line form fails the round-trip test).
impl ServiceCommand {
    /// `edge|relay|ledger` and every flag but the database URL, as `retrychain` parses
    /// them back.
    pub fn to_args(&self) -> Vec<String> {
        let (role, fields) = match self {
            ServiceCommand::Edge(hop) => ("edge", serde_json::to_value(hop)),
            ServiceCommand::Relay(hop) => ("relay", serde_json::to_value(hop)),
            ServiceCommand::Ledger(ledger) => ("ledger", serde_json::to_value(ledger)),
        };
        // Strings, numbers and booleans only: nothing in them can fail to serialize.
        let Ok(serde_json::Value::Object(fields)) = fields else {
            unreachable!("a service's flags serialize to an object")
        };
        let cli = ServiceCli::command();
        let command = cli
            .find_subcommand(role)
            .unwrap_or_else(|| unreachable!("{role} is a subcommand"));
        let mut args = vec![role.to_owned()];
        for arg in command.get_arguments() {
            let (Some(long), Some(value)) = (arg.get_long(), fields.get(arg.get_id().as_str()))
            else {
                continue; // --help, and the database URL
            };
            let flag = format!("--{long}");
            match value {
                serde_json::Value::Null => {}
                serde_json::Value::Bool(on) if !arg.get_action().takes_values() => {
                    if *on {
                        args.push(flag);
                    }
                }
                serde_json::Value::Bool(on) => args.extend([flag, on.to_string()]),
                serde_json::Value::Number(number) => args.extend([flag, number.to_string()]),
                serde_json::Value::String(text) => args.extend([flag, text.clone()]),
                other => unreachable!("{flag} has no command-line form: {other}"),
            }
        }
        args
    }

    /// A role's command with every flag at its default (as `--help` shows them), the
    /// ledger's database at `database_url`: what a chain's typed settings start from.
    pub fn defaults(role: &str, database_url: &str) -> Result<Self, clap::Error> {
        let mut argv = vec![role.to_owned()];
        if role == "ledger" {
            argv.extend(["--database-url".to_owned(), database_url.to_owned()]);
        }
        ServiceCli::try_parse_from(argv).map(|cli| cli.command)
    }

    /// The flags every service takes, to change them.
    pub fn service_mut(&mut self) -> &mut ServiceArgs {
        match self {
            ServiceCommand::Edge(args) | ServiceCommand::Relay(args) => &mut args.service,
            ServiceCommand::Ledger(args) => &mut args.service,
        }
    }
}

/// A value's name on the command line (`edge-only`, `full`), for serde.
fn as_value_name<S: Serializer>(value: &impl ValueEnum, to: S) -> Result<S::Ok, S::Error> {
    match value.to_possible_value() {
        Some(name) => to.serialize_str(name.get_name()),
        None => to.serialize_none(),
    }
}

/// [`as_value_name`] of a value that may be absent.
fn as_optional_value_name<S: Serializer>(
    value: &Option<impl ValueEnum>,
    to: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(value) => as_value_name(value, to),
        None => to.serialize_none(),
    }
}

/// A duration as the command line takes it (`24h`, `90s`), for serde.
fn as_humantime<S: Serializer>(value: &Duration, to: S) -> Result<S::Ok, S::Error> {
    to.collect_str(&humantime::format_duration(*value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field set away from its default survives the trip to argv and back.
    #[test]
    fn a_command_reads_back_as_it_was_written() {
        let mut ledger = ServiceCommand::defaults("ledger", "postgres://x@h/db").expect("parses");
        let ServiceCommand::Ledger(args) = &mut ledger else {
            unreachable!()
        };
        args.in_flight = InFlightArg::Reject;
        args.key_retention = Duration::from_secs(5400);
        args.db_pool_size = 7;
        args.db_acquire_timeout_ms = 99;
        args.db_connect_timeout_ms = 999;
        args.db_round_trip_timeout_ms = 1234;
        args.caller_signer = Some("spiffe://retrychain/edge".into());
        let s = &mut args.service;
        s.listen = Some("127.0.0.1:1".parse().expect("addr"));
        s.admin_listen = Some("127.0.0.1:2".parse().expect("addr"));
        s.name = Some("ledger-b".into());
        s.retry_mode = RetryMode::EveryLayer;
        s.max_attempts = 4;
        s.backoff = BackoffKind::Decorrelated;
        s.backoff_base_ms = 3;
        s.backoff_cap_ms = 30;
        s.budget_tokens = 2.5;
        s.budget_refund = 0.25;
        s.no_budget = true;
        s.adaptive_throttling = true;
        s.adaptive_throttling_k = 1.5;
        s.adaptive_throttling_window_ms = 4000;
        s.default_deadline_ms = 1500;
        s.max_deadline_ms = 9000;
        s.deadline_margin_ms = 7;
        s.min_attempt_ms = 11;
        s.fault_injection = true;
        s.service_config = Some("/tmp/c.json".into());
        s.allow_retry_mode_override = true;
        s.log_format = LogFormatArg::Json;
        s.max_connections = 10;
        s.max_connections_per_peer = 3;
        s.max_in_flight = 12;
        s.min_concurrency = 5;
        s.initial_concurrency = 6;
        s.tls_dir = Some("/tmp/tls".into());
        s.tls_cert = Some("/tmp/tls/a.crt".into());
        s.tls_key = Some("/tmp/tls/a.key".into());
        s.tls_ca = Some("/tmp/tls/ca.pem".into());
        s.tls_accept = Some("spiffe://retrychain/hop4".into());
        s.latency_objective_ms = Some(250);
        let mut argv = ledger.to_args();
        assert!(!argv.iter().any(|a| a.contains("postgres://")), "{argv:?}");
        argv.extend(["--database-url".to_owned(), "postgres://x@h/db".to_owned()]);
        let back = ServiceCli::try_parse_from(argv)
            .expect("reads back")
            .command;
        assert_eq!(format!("{back:?}"), format!("{ledger:?}"));

        let mut edge = ServiceCommand::defaults("edge", "").expect("parses");
        if let ServiceCommand::Edge(args) = &mut edge {
            args.downstream = Some("http://127.0.0.1:3".into());
            args.per_try_timeout_ms = Some(250);
            args.eject_after_failures = 3;
            args.ejection_base_ms = 1000;
            args.ejection_max_ms = 9000;
            args.max_ejection_percent = 50;
            args.failure_percentage_threshold = 60;
            args.failure_percentage_minimum_hosts = 2;
            args.failure_percentage_request_volume = 20;
            args.ejection_interval_ms = 3000;
            args.jwks = Some("/tmp/jwks.json".into());
            args.jwt_issuer = Some("https://issuer.example".into());
            args.jwt_audience = Some("retrychain".into());
            args.callers = Some(CallersArg::Anyone);
            args.caller_max_in_flight = 17;
            args.tls_downstream_identity = Some("spiffe://retrychain/hop2".into());
        }
        let back = ServiceCli::try_parse_from(edge.to_args())
            .expect("reads back")
            .command;
        assert_eq!(format!("{back:?}"), format!("{edge:?}"));
    }

    /// Every flag of every role is a field `to_args` writes: a flag whose field serde
    /// skipped or renamed would silently fall off the command lines of child processes.
    #[test]
    fn every_flag_is_written_for_a_child() {
        for role in ["edge", "relay", "ledger"] {
            let command = ServiceCommand::defaults(role, "postgres://x@h/db").expect("parses");
            let fields = match &command {
                ServiceCommand::Edge(hop) | ServiceCommand::Relay(hop) => serde_json::to_value(hop),
                ServiceCommand::Ledger(ledger) => serde_json::to_value(ledger),
            }
            .expect("serializes");
            let cli = ServiceCli::command();
            let arguments = cli.find_subcommand(role).expect("a role").get_arguments();
            for arg in arguments {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "database_url") {
                    continue;
                }
                assert!(
                    fields.get(id).is_some(),
                    "{role}: --{} is not written for a child",
                    arg.get_long().unwrap_or(id)
                );
            }
        }
    }
}
