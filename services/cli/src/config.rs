//! The command line. Every flag can also be set through the environment variable named in
//! `--help`, which is how docker-compose configures the services. A leaf: it imports none
//! of its sibling modules (a service's flags come from `retrychain-serve`, the experiments'
//! from their crate).

use clap::{Args, Parser, Subcommand};
use retrychain_domain::RetryMode;
use retrychain_harness::Postgres;
use retrychain_serve::{ServiceCommand, args::LogFormatArg};

/// Five chained gRPC services that show how to retry safely: idempotency keys, shrinking
/// deadlines, jittered backoff and retry budgets.
#[derive(Debug, Parser)]
#[command(name = "retrychain", version, about, propagate_version = true)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
// Parsed once, at start-up, and never moved around: a variant's size costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// edge, relay, ledger: one service (`retrychain-serve`).
    #[command(flatten)]
    Serve(ServiceCommand),
    /// Run the whole chain here: Postgres (unless DATABASE_URL), five services on 50051..50055.
    Up(UpArgs),
    /// Run the design notes' scenarios against a chain and print measured figures.
    Demo(retrychain_experiments::demo::DemoArgs),
    /// Load a chain and report success, amplification, throughput and latency.
    Storm(retrychain_experiments::storm::StormArgs),
    /// Run the design notes' simulations on the project's own backoff and budget code.
    Sim(retrychain_experiments::sim::SimArgs),
    /// Exit 0 when the service at --addr reports SERVING (for container health checks).
    Health(HealthArgs),
    /// Issue a deployment's certificates into a directory: one per tier, the operator and
    /// Postgres, from an authority kept there (made the first time), and callers' tokens.
    Certs(CertsArgs),
    /// A live terminal view of the five services' admin ports: rates, retries, amplification.
    Top(retrychain_top::TopArgs),
    /// Random faults under load against a chain, then a check that every charge happened
    /// exactly once and every other guarantee held (exit 0 only then).
    Chaos(retrychain_chaos::ChaosArgs),
}

/// Flags of `up`.
#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Postgres URL for the ledger; unset: a throwaway cluster from the binaries on PATH.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
    /// The Postgres started when `DATABASE_URL` is unset: one throwaway cluster, or a
    /// pg_auto_failover formation (a monitor, a primary, a synchronous standby) to fail
    /// over while the chain runs. `ha` with `DATABASE_URL` set is refused (which one was
    /// meant?).
    #[arg(long, env = "RETRYCHAIN_POSTGRES", value_enum, default_value_t = Postgres::Single)]
    pub postgres: Postgres,
    /// The retry mode of all five services.
    #[arg(long, env = "RETRYCHAIN_RETRY_MODE", value_enum, default_value_t = RetryMode::EdgeOnly)]
    pub retry_mode: RetryMode,
    /// How many replicas of each relay and of the ledger (the edge is one); each tier
    /// balances over the replicas below it. Replica r of a service listens ten ports up
    /// per replica: hop3's are 50053, 50063, 50073, …
    #[arg(long, env = "RETRYCHAIN_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=9))]
    pub replicas: u16,
    /// The edge's port; hop2, hop3, hop4 and the ledger take the next four.
    #[arg(long, env = "RETRYCHAIN_BASE_PORT", default_value_t = 50051)]
    pub base_port: u16,
    /// Log format of the services.
    #[arg(long, env = "RETRYCHAIN_LOG_FORMAT", value_enum, default_value_t = LogFormatArg::Text)]
    pub log_format: LogFormatArg,
    /// TLS: a throwaway CA and a certificate for every tier and for you (the operator),
    /// TLS 1.3 to the edge and mutual TLS between tiers, each tier accepting only the one
    /// above it; the grpcurl lines printed name the files. Removed when `up` stops.
    #[arg(long, env = "RETRYCHAIN_UP_TLS", value_parser = clap::builder::BoolishValueParser::new())]
    pub tls: bool,
}

/// Flags of `certs`.
#[derive(Debug, Clone, Args)]
pub struct CertsArgs {
    /// Where to write: `<dir>/<name>/` (tls.crt, tls.key, ca.crt) for edge, hop2, hop3,
    /// hop4, ledger, operator and postgres; `<dir>/ca/` keeps the authority (ca.crt,
    /// ca.key), `<dir>/callers/` the token issuer's key, the edge's jwks.json and a token
    /// for alice and bob. Run again, it renews every certificate and token from the kept
    /// authority and issuer, so what peers trust does not change.
    #[arg(long, env = "RETRYCHAIN_CERTS_DIR")]
    pub dir: std::path::PathBuf,
}

/// Flags of `health`.
#[derive(Debug, Clone, Args)]
pub struct HealthArgs {
    /// The service to ask, e.g. http://127.0.0.1:50051.
    #[arg(
        long,
        env = "RETRYCHAIN_HEALTH_ADDR",
        default_value = "http://127.0.0.1:50051"
    )]
    pub addr: String,
    /// Give up after this many ms.
    #[arg(long, default_value_t = 2000, env = "RETRYCHAIN_HEALTH_TIMEOUT_MS")]
    pub timeout_ms: u64,
    /// Ask over TLS as the service whose tls.crt, tls.key and ca.crt are here (the same
    /// variable the service reads, so a container's check needs no flag of its own); the
    /// address is then https://.
    #[arg(long, env = "RETRYCHAIN_TLS_DIR")]
    pub tls_dir: Option<std::path::PathBuf>,
}
