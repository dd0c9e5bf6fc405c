//! The flags of the edge and the relays: where to forward, who may call, how replicas
//! are ejected.

use clap::{Args, ValueEnum};
use serde::Serialize;

use super::{service::ServiceArgs, value::as_optional_value_name};

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
    /// The edge: the share of a call's time that a first attempt which does not fit now
    /// may wait at the door for a place, instead of being refused at once (0: refused at
    /// once; at most 0.5, what the edge's half of a call's time for its prediction leaves).
    /// It goes in once it fits the time it has left, or, its wait over, if the chain
    /// answered calls meanwhile at a pace that serves it in time; else it is refused then,
    /// after its wait.
    /// Fewer refusals for clients that send again at once, some refusals late when the
    /// chain slows (docs/overload.md).
    #[arg(long, env = "RETRYCHAIN_DOOR_WAIT_SHARE", default_value_t = 0.0, value_parser = door_wait_share)]
    pub door_wait_share: f64,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CallersArg {
    /// Only callers with a valid client certificate or bearer token.
    Authenticated,
    /// Anyone; a call without credentials is the anonymous caller's.
    Anyone,
}

/// The most of a call's time `--door-wait-share` may give to waiting: what the edge's
/// headroom (half of it for the prediction) leaves.
pub const MOST_DOOR_WAIT_SHARE: f64 = 1.0 - super::service::EDGE_HEADROOM;

/// `--door-wait-share`: a number from 0 to [`MOST_DOOR_WAIT_SHARE`].
fn door_wait_share(value: &str) -> Result<f64, String> {
    let share: f64 = value
        .parse()
        .map_err(|_| format!("{value:?} is not a number"))?;
    if (0.0..=MOST_DOOR_WAIT_SHARE).contains(&share) {
        Ok(share)
    } else {
        Err(format!(
            "{value} is not a share from 0 to {MOST_DOOR_WAIT_SHARE} (the edge keeps the rest of a call's time for its prediction)"
        ))
    }
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

    /// The per-attempt timeout of an edge-only or single call: `--per-try-timeout-ms`, or
    /// over replicas the default.
    pub fn per_try(&self) -> Option<std::time::Duration> {
        self.per_try_timeout_ms
            .or_else(|| self.replicated().then_some(REPLICATED_PER_TRY_TIMEOUT_MS))
            .map(std::time::Duration::from_millis)
    }

    /// The per-attempt timeout of an every-layer call: only `--per-try-timeout-ms` (see
    /// `HopSettings::every_layer_per_try`).
    pub fn every_layer_per_try(&self) -> Option<std::time::Duration> {
        self.per_try_timeout_ms
            .map(std::time::Duration::from_millis)
    }

    /// How the hop's balancer ejects replicas.
    pub fn balance(&self) -> resilience::balance::BalanceSettings {
        resilience::balance::BalanceSettings {
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
