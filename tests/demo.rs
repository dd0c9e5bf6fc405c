//! `retrychain demo --json` against a chain spawned here, addressed through the demo's
//! external-chain flags: the design notes' scenarios a–e hold on the real services, and the
//! storm reports all five policies.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod support;

use support::*;

#[tokio::test]
async fn demo_reproduces_the_design_notes_on_the_running_chain() {
    let chain = Chain::spawn(Options::default()).await;
    let mut command = args(&["demo", "--json", "--storm-clients", "50", "--tick-ms", "5"]);
    for (i, flag) in ["--edge", "--hop2", "--hop3", "--hop4", "--ledger"]
        .iter()
        .enumerate()
    {
        command.extend([flag.to_string(), chain.addrs[i].clone()]);
        command.extend([format!("{flag}-admin"), chain.admins[i].clone()]);
    }
    let r = retrychain_json(command).await;
    println!("{}", serde_json::to_string_pretty(&r).unwrap());

    // a. A lost reply: a fresh key charges twice, the same key once.
    assert_eq!(r["lost_reply"]["fresh_key"]["executions"], 2);
    assert_eq!(r["lost_reply"]["fresh_key"]["balance_cents"], 1000);
    assert_eq!(r["lost_reply"]["same_key"]["executions"], 1);
    assert_eq!(r["lost_reply"]["same_key"]["balance_cents"], 500);
    assert_eq!(r["lost_reply"]["same_charge_id"], true);
    assert_eq!(r["lost_reply"]["replayed"], true);
    // b. Reuse with another amount.
    assert_eq!(r["key_reuse"]["code"], "FAILED_PRECONDITION");
    assert_eq!(r["key_reuse"]["before"], r["key_reuse"]["after"]);
    // c. Two at once, one key.
    assert_eq!(r["concurrent"]["executions"], 1);
    assert_eq!(r["concurrent"]["same_reply"], true);
    // d. 243 against 3.
    assert_eq!(r["layered"]["every_layer"]["bottom_calls"], 243);
    assert_eq!(
        r["layered"]["every_layer"]["received"],
        serde_json::json!([1, 3, 9, 27, 81])
    );
    assert_eq!(r["layered"]["edge_only"]["bottom_calls"], 3);
    assert_eq!(
        r["layered"]["edge_only"]["received"],
        serde_json::json!([1, 3, 3, 3, 3])
    );
    // e. 4.00x against 1.10x.
    assert_eq!(r["outage"]["no_budget"]["first"], 2000);
    assert_eq!(r["outage"]["no_budget"]["load"], 4.0);
    let load = r["outage"]["budget"]["load"].as_f64().unwrap();
    assert!((load - 1.10).abs() <= 0.02, "budgeted load {load}");
    // f. Every policy ran and every client got through.
    for policy in ["none", "exponential", "full", "equal", "decorrelated"] {
        let run = &r["storm"][policy];
        assert_eq!(run["succeeded"], 50, "{policy}: {run}");
        assert!(
            run["bottom_calls"].as_u64().unwrap() >= 50,
            "{policy}: {run}"
        );
    }
}
