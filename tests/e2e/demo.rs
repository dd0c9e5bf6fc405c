//! `retrychain demo` against a chain started here, addressed through the demo's
//! external-chain flags: every scenario runs and reports, and the lost reply — the demo's
//! first point — charges once with the same key and twice with a fresh one. (The figures
//! themselves are tested where they live: 243 and 3 in chain.rs, the outage loads in
//! chain.rs and sim.rs.)

use crate::support::*;
use retrychain_experiments::demo::{self, DemoArgs};

#[tokio::test]
async fn the_demo_runs_every_scenario_on_a_running_chain() {
    let chain = Chain::spawn(Options::default()).await;
    let mut flags = args(&[
        "--outage-requests",
        "100",
        "--storm-clients",
        "8",
        "--tick-ms",
        "5",
    ]);
    for (i, flag) in ["--edge", "--hop2", "--hop3", "--hop4", "--ledger"]
        .iter()
        .enumerate()
    {
        flags.extend([flag.to_string(), chain.addrs[i].clone()]);
        flags.extend([format!("{flag}-admin"), chain.admins[i].clone()]);
    }
    let args: DemoArgs = parse_flags(&flags);

    let r = demo::run(&args).await.unwrap();

    let lost = &r.lost_reply;
    assert_eq!(
        (lost.fresh_key.executions, lost.same_key.executions),
        (2, 1)
    );
    assert!(lost.same_charge_id && lost.replayed, "{lost:?}");
    assert_eq!(r.key_reuse.code, "FAILED_PRECONDITION");
    assert_eq!(r.concurrent.executions, 1);
    assert_eq!(r.layered.edge_only.received, [1, 3, 3, 3, 3]);
    assert_eq!(r.outage.no_budget.first, 100);
    assert_eq!(r.outage.budget.first, 100);
    let s = &r.storm;
    for run in [s.none, s.exponential, s.full, s.equal, s.decorrelated] {
        assert_eq!(run.succeeded, 8, "{s:?}");
    }
}
