//! `retrychain up`: the whole chain on this machine, as a playground.
//!
//! Starts a throwaway Postgres unless `DATABASE_URL` is set (with `--postgres ha`, a
//! pg_auto_failover formation to fail over, its commands printed), then the five services as child
//! processes of this binary, bottom-up, each waiting for the one below to report SERVING.
//! Their logs are interleaved on stdout, each line prefixed by its service — or, with
//! `--log-format json`, as they are (each line a JSON object naming its service), with
//! everything `up` says itself on stderr, so that `up --log-format json | jq` reads every
//! line of stdout. A service that
//! exits (a crash, a kill) is started again on the same ports while the others go on
//! serving. Ctrl-C (or SIGTERM) stops them all and removes the throwaway cluster.

use retrychain_harness::{ChainSpec, LocalChain, Logs, Postgres};
use retrychain_serve::args::LogFormatArg;

use crate::config::UpArgs;

/// Runs the chain until Ctrl-C or SIGTERM, restarting services that exit.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let json = args.log_format == LogFormatArg::Json;
    // What `up` says itself: beside the prefixed logs, or out of JSON's way on stderr.
    let say = |line: &str| {
        if json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    if args.database_url.is_none() {
        say(match args.postgres {
            Postgres::Single => "starting a throwaway Postgres (set DATABASE_URL to use your own)…",
            Postgres::Ha => {
                "starting a pg_auto_failover formation: a monitor, a primary and a synchronous standby…"
            }
        });
    }
    // Listen for Ctrl-C and SIGTERM from the start: a signal while the chain is starting
    // must still stop what was started.
    let interrupted = retrychain_node::shutdown_signal();
    tokio::pin!(interrupted);
    let spec = ChainSpec {
        database_url: args.database_url.clone(),
        postgres: args.postgres,
        base_port: args.base_port,
        replicas: usize::from(args.replicas),
        logs: if json { Logs::Raw } else { Logs::Prefixed },
        ..ChainSpec::default()
    }
    .each(|service| {
        service.retry_mode = args.retry_mode;
        service.log_format = args.log_format;
    });
    let starting = LocalChain::start(spec);
    let mut chain = tokio::select! {
        chain = starting => chain?,
        _ = &mut interrupted => {
            say("interrupted while starting; stopped what had started");
            return Ok(());
        }
    };
    if let Some(database) = chain.own_database() {
        say(&format!("postgres | {}", database.describe()));
    }
    say(&hints(args.base_port, usize::from(args.replicas)));
    tokio::select! {
        _ = &mut interrupted => {}
        _ = chain.supervise() => {}
    }
    say("stopping the chain…");
    chain.stop().await;
    Ok(())
}

/// What to try once the chain is up: the layout (every replica's port), then calls.
fn hints(base: u16, replicas: usize) -> String {
    let edge = format!("localhost:{base}");
    let ledger = format!("localhost:{}", base + 1004);
    let tier = |i: u16| {
        let count = if i == 0 { 1 } else { replicas };
        (0..count as u16)
            .map(|r| format!(":{}", base + i + 10 * r))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let balanced = if replicas > 1 {
        format!(
            "\n{replicas} replicas of each relay and of the ledger; each tier balances over the one below (admin ports: each + 1000)"
        )
    } else {
        String::new()
    };
    format!(
        r#"
retrychain is up: edge {} -> hop2 {} -> hop3 {} -> hop4 {} -> ledger {}{balanced}
Control (admin ports, this machine only): edge :{} … ledger :{}
Try:
  grpcurl -plaintext {edge} list
  grpcurl -plaintext -max-time 5 -H 'idempotency-key: order-1' -d '{{"account_id":"alice","amount_cents":500}}' {edge} retrychain.v1.Payments/Charge
  grpcurl -plaintext -d '{{"account_id":"alice"}}' {edge} retrychain.v1.Payments/GetAccount
  grpcurl -plaintext -d '{{"fail_rate":1}}' {ledger} retrychain.v1.Control/SetFaults
  grpcurl -plaintext -max-time 30 -H 'x-retry-mode: every-layer' -d '{{"account_id":"alice","amount_cents":100}}' {edge} retrychain.v1.Payments/Charge
  grpcurl -plaintext {ledger} retrychain.v1.Control/GetStats
Ctrl-C stops everything.
"#,
        tier(0),
        tier(1),
        tier(2),
        tier(3),
        tier(4),
        base + 1000,
        base + 1004,
    )
}
