//! The flags of `storm`.

use clap::Args;
use std::{path::PathBuf, time::Duration};

/// Flags of `storm`.
#[derive(Debug, Clone, Args)]
pub struct StormArgs {
    /// An existing chain's edge (with --ledger). Unset: start a chain here.
    #[arg(long, env = "RETRYCHAIN_EDGE", requires = "ledger")]
    pub edge: Option<String>,
    /// The existing chain's ledger, for its counters and faults: one address, several
    /// comma-separated (every replica: bottom calls are counted on each), or
    /// dns:///host:port (every address the name resolves to).
    #[arg(long, env = "RETRYCHAIN_LEDGER")]
    pub ledger: Option<String>,
    /// The existing edge's admin address (Control) [default: --edge's port + 1000].
    #[arg(long, env = "RETRYCHAIN_EDGE_ADMIN")]
    pub edge_admin: Option<String>,
    /// The ledgers' admin addresses, comma-separated in --ledger's order [default: each
    /// ledger's port + 1000].
    #[arg(long, env = "RETRYCHAIN_LEDGER_ADMIN")]
    pub ledger_admin: Option<String>,
    /// HTTP/2 connections to the edge, calls spread over them in turn [default: one per
    /// 100 calls in flight, at most 200]. One connection carries at most the edge's stream
    /// limit (512) at once; more calls would wait in this client, not at the edge. The edge
    /// holds at most `--max-connections-per-peer` (256) from one address: past that it
    /// refuses each new one with a GOAWAY (it evicts only connections idle for a second,
    /// and this client's are not), and the calls this client sends on a refused one fail
    /// here: UNAVAILABLE, or CANCELLED for those tonic had queued on it, unsent.
    #[arg(long, env = "RETRYCHAIN_STORM_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    pub connections: Option<u32>,
    /// Requests in flight at once (closed loop); with --rate, the most in flight.
    #[arg(long, default_value_t = 32, env = "RETRYCHAIN_STORM_CONCURRENCY")]
    pub concurrency: usize,
    /// Open loop: start this many requests a second, whatever the latency.
    #[arg(long, env = "RETRYCHAIN_STORM_RATE")]
    pub rate: Option<f64>,
    /// How long to send (e.g. 10s, 1m).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, env = "RETRYCHAIN_STORM_DURATION")]
    pub duration: Duration,
    /// Stop after this many requests instead of after --duration.
    #[arg(long, env = "RETRYCHAIN_STORM_REQUESTS")]
    pub requests: Option<u64>,
    /// A call refused with a grpc-retry-pushback-ms holds its worker (closed loop) or its
    /// place in flight (open loop) for that long before the next call: a client that
    /// listens. The next call is a new charge (a new key), not a retry of the refused one;
    /// in closed loop a waiting worker sends nothing, so fewer than --concurrency calls are
    /// in flight while workers wait (the report says how long they waited, in
    /// worker-seconds: divided by the run's seconds, the workers it kept idle on average).
    /// Unset, the next call goes at once, as a hostile client's would.
    #[arg(long, env = "RETRYCHAIN_STORM_HONOUR_PUSHBACK", value_parser = clap::builder::BoolishValueParser::new())]
    pub honour_pushback: bool,
    /// Send `x-retry-mode` (honoured by services started with --allow-retry-mode-override).
    #[arg(long, value_enum, env = "RETRYCHAIN_STORM_RETRY_MODE")]
    pub retry_mode: Option<retrychain_domain::RetryMode>,
    /// Ledger fault during the run: probability that a processor call fails.
    #[arg(long, default_value_t = 0.0, env = "RETRYCHAIN_STORM_FAIL_RATE")]
    pub fail_rate: f64,
    /// Ledger fault: the code of those failures.
    #[arg(long, default_value = "", env = "RETRYCHAIN_STORM_FAIL_CODE")]
    pub fail_code: String,
    /// Ledger fault: processor latency, in ms.
    #[arg(long, default_value_t = 0, env = "RETRYCHAIN_STORM_DELAY_MS")]
    pub delay_ms: u32,
    /// Ledger fault: probability that a reply is lost after commit.
    #[arg(long, default_value_t = 0.0, env = "RETRYCHAIN_STORM_DROP_REPLY_RATE")]
    pub drop_reply_rate: f64,
    /// Deadline of each request, in ms.
    #[arg(long, default_value_t = 5000, env = "RETRYCHAIN_STORM_DEADLINE_MS")]
    pub deadline_ms: u64,
    /// Spread charges over this many accounts.
    #[arg(long, default_value_t = 1000, env = "RETRYCHAIN_STORM_ACCOUNTS")]
    pub accounts: u64,
    /// For a chain started here: backoff of its services.
    #[arg(long, value_enum, default_value_t = resilience::BackoffKind::Full, env = "RETRYCHAIN_STORM_BACKOFF")]
    pub backoff: resilience::BackoffKind,
    /// For a chain started here: Postgres URL (unset: a throwaway cluster).
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
    /// For a chain started here: the edge's port; the others take the next four.
    #[arg(long, default_value_t = 50071, env = "RETRYCHAIN_STORM_BASE_PORT")]
    pub base_port: u16,
    /// TLS: the operator's certificate, key and CA — a directory holding tls.crt, tls.key
    /// and ca.crt, as `up --tls` makes under `operator/` — for an existing chain given by
    /// https:// addresses (the edge's per-caller limit applies to the operator too).
    #[arg(long, env = "RETRYCHAIN_STORM_TLS_DIR", requires = "edge")]
    pub tls_dir: Option<PathBuf>,
    /// Print one JSON object instead of the report.
    #[arg(long, env = "RETRYCHAIN_STORM_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub json: bool,
    /// Write per-second samples to this CSV file.
    #[arg(long, env = "RETRYCHAIN_STORM_CSV")]
    pub csv: Option<PathBuf>,
    /// Draw throughput, errors and bottom calls per second into this SVG file.
    #[arg(long, env = "RETRYCHAIN_STORM_SVG")]
    pub svg: Option<PathBuf>,
}

/// The most connections storm opens unless told (`--connections`): under the edge's
/// default `--max-connections-per-peer` (256), which would refuse the rest, and still room
/// for 102,400 calls at once at the edge's 512 streams a connection. Measured before the
/// bound: `--rate 2900 --concurrency 100000` opened 1,000 connections, and 10,629 of the
/// 14,475 calls of 5 s failed in storm itself, as CANCELLED (5,557) and UNKNOWN (5,072).
pub const MOST_DEFAULT_CONNECTIONS: usize = 200;

impl StormArgs {
    /// The connections to open: `--connections`, else one per 100 calls in flight, at
    /// most [`MOST_DEFAULT_CONNECTIONS`].
    pub fn connections_to_open(&self) -> usize {
        self.connections.map_or_else(
            || {
                self.concurrency
                    .div_ceil(100)
                    .clamp(1, MOST_DEFAULT_CONNECTIONS)
            },
            |n| n as usize,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        storm: StormArgs,
    }

    fn connections(args: &[&str]) -> usize {
        let argv = std::iter::once("storm").chain(args.iter().copied());
        Cli::try_parse_from(argv)
            .unwrap()
            .storm
            .connections_to_open()
    }

    #[test]
    fn one_connection_per_100_calls_stays_under_what_the_edge_holds_from_one_address() {
        assert_eq!(connections(&[]), 1);
        assert_eq!(connections(&["--concurrency", "1500"]), 15);
        assert_eq!(connections(&["--concurrency", "100000"]), 200);
        // Under what the edge holds from one address by default.
        let per_peer = retrychain_node::limits::ConnectionLimits::default().max_per_peer;
        assert!(connections(&["--concurrency", "1000000"]) < per_peer);
        // Asked for, it is what was asked.
        assert_eq!(
            connections(&["--concurrency", "100000", "--connections", "300"]),
            300
        );
    }
}
