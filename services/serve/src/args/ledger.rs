//! The ledger's flags: the database, the key store's bounds, who signs a caller's
//! statement.

use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::Serialize;

use super::{
    service::ServiceArgs,
    value::{as_humantime, as_value_name},
};

/// `--in-flight` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InFlightArg {
    /// A same-key request waits for the first, then replays its reply.
    Wait,
    /// A same-key request is refused with ABORTED while the first runs.
    Reject,
}

/// `--standby-copy` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StandbyCopyArg {
    /// `required` when `DATABASE_URL` names several hosts (a replicated database the
    /// ledger follows), else `off`.
    Auto,
    /// Answer a charge only once a standby has flushed its commit.
    Required,
    /// Answer once the server the ledger writes to has committed.
    Off,
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
    /// Whether a charge is answered only once a standby has it: `required` closes the
    /// window in which a failover takes back answered charges (pg_auto_failover writes
    /// without its standby whenever it finds it unhealthy), at the price of charging
    /// nothing while no standby is connected; `auto` is `required` for a multi-host
    /// DATABASE_URL. The role needs pg_monitor (or superuser) to see the standbys.
    #[arg(long, env = "RETRYCHAIN_STANDBY_COPY", value_enum, default_value_t = StandbyCopyArg::Auto)]
    #[serde(serialize_with = "as_value_name")]
    pub standby_copy: StandbyCopyArg,
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
