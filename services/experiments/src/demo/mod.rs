//! `retrychain demo`: the design notes' scenarios, measured on running services.
//!
//! Runs against a chain it starts (like `up`, on `--base-port`) or an existing one
//! (`--edge`, `--hop2` … `--ledger`, e.g. a `docker compose up` deployment started with its
//! demo settings). Scenarios a–c go through the chain's own edge. d–f need edges configured
//! in particular ways (a retry-mode override, no budget, a single attempt), so the demo
//! starts its own edges locally, pointed at the chain's hop2, and names the mode of every
//! request with `x-retry-mode`: the figures do not depend on how the chain was configured.
//! The chain must allow fault injection on its ledger. Scenario g ([`crate::metastable`])
//! loads the chain's own edge at 0.8× its measured capacity and slows the processor for
//! two seconds, once per retry mode.

mod args;
mod report;
mod scenarios;

pub use args::DemoArgs;
pub use report::{
    Concurrent, DemoReport, Effect, KeyReuse, Layered, Load, LostReply, ModeCounts, Outage, Storm,
    StormRun, print_report,
};

use scenarios::{LEDGER, Target, scenarios};

use anyhow::Context;
use retrychain_harness::{ChainAddrs, ChainSpec, ServiceAddr, with_chain};

/// Runs every scenario and returns the report.
pub async fn run(args: &DemoArgs) -> anyhow::Result<DemoReport> {
    let external = args
        .edge
        .as_ref()
        .map(|_| {
            [
                (&args.edge, &args.edge_admin),
                (&args.hop2, &args.hop2_admin),
                (&args.hop3, &args.hop3_admin),
                (&args.hop4, &args.hop4_admin),
                (&args.ledger, &args.ledger_admin),
            ]
            .map(|(url, admin)| {
                ServiceAddr::external(url.as_deref().unwrap_or_default(), admin.as_deref())
            })
        })
        .map(ChainAddrs::from_array);
    let spec = ChainSpec {
        database_url: args.database_url.clone(),
        base_port: args.base_port,
        ..ChainSpec::default()
    };
    with_chain(external, spec, |urls| async move {
        let target = Target::connect(urls).await?;
        target
            .chain
            .clear_faults(LEDGER)
            .await
            .context("the ledger must allow fault injection (--fault-injection)")?;
        let report = scenarios(&target, args).await;
        let _ = target.chain.clear_faults(LEDGER).await;
        report
    })
    .await
}
