//! `retrychain storm`: load against a chain, with per-mode amplification and tail latency.
//!
//! Sends Charges with fresh keys (a closed loop of `--concurrency` workers, or an open loop
//! at `--rate` requests a second) over `--connections` HTTP/2 connections, for
//! `--duration` or `--requests`, optionally with faults set on the ledgers first, and
//! reports success, status codes, first attempts and bottom calls (from the edge's
//! counters and those of every ledger replica it is given), amplification, throughput,
//! goodput (OK within the deadline), the calls refused as overloaded, and latency
//! percentiles of all calls, of successes and of failures. `--csv` writes per-second
//! samples; `--svg` draws them.

mod args;
mod load;
mod report;
mod tally;

pub use args::{MOST_DEFAULT_CONNECTIONS, StormArgs};
pub use report::{Latency, StormReport, print_report};

use crate::chart;
use load::{ledger_addrs, storm};
use report::write_csv;
use retrychain_harness::{ChainAddrs, ChainSpec, ServiceAddr, with_chain};

/// Runs a storm per `args` and returns its report.
pub async fn run(args: &StormArgs) -> anyhow::Result<StormReport> {
    let external = args.edge.as_ref().map(|edge| {
        let edge = ServiceAddr::external(edge, args.edge_admin.as_deref());
        let ledger = ServiceAddr::external(
            args.ledger.as_deref().unwrap_or_default(),
            args.ledger_admin.as_deref(),
        );
        // with_chain wants five services, edge first and ledger last; storm uses those two.
        let unused = ServiceAddr::external("", None);
        ChainAddrs::from_array([edge, unused.clone(), unused.clone(), unused, ledger])
    });
    let spec = ChainSpec {
        database_url: args.database_url.clone(),
        base_port: args.base_port,
        ..ChainSpec::default()
    }
    .each(|service| service.backoff = args.backoff);
    let report = with_chain(external, spec, |addrs| async move {
        let ledgers = match &args.ledger {
            Some(ledger) => {
                ledger_addrs(ledger, args.ledger_admin.as_deref(), args.tls_dir.is_some()).await?
            }
            None => vec![addrs.ledger.clone()],
        };
        storm(args, &addrs.edge, &ledgers).await
    })
    .await?;
    if let Some(path) = &args.csv {
        write_csv(path, &report.samples)?;
    }
    if let Some(path) = &args.svg {
        chart::draw(path, &report.samples)?;
    }
    Ok(report)
}
