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

use anyhow::Context;
use retrychain_harness::{ChainSpec, ChainTls, LocalChain, Logs, Postgres};
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
    // Options that contradict each other are said, not swallowed: a database named and a
    // formation asked for cannot both be what the ledger uses.
    if let (Some(_), Postgres::Ha) = (&args.database_url, args.postgres) {
        anyhow::bail!(
            "--postgres ha starts a pg_auto_failover formation of its own, but a database is already named \
             (DATABASE_URL or --database-url, perhaps left in this shell from elsewhere): unset DATABASE_URL \
             to get the formation, or drop --postgres ha (RETRYCHAIN_POSTGRES) to use that database"
        );
    }
    // Every port of the layout before anything starts (Postgres included).
    ChainSpec {
        base_port: args.base_port,
        replicas: usize::from(args.replicas),
        ..ChainSpec::default()
    }
    .check_ports()?;
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
    // The certificates live as long as `up` does, in a directory of their own.
    let certificates = match args.tls {
        true => {
            let dir = tempfile::Builder::new()
                .prefix("retrychain-tls-")
                .tempdir()
                .context("a directory for the certificates")?;
            let tls = ChainTls::create(dir.path())?;
            say(&format!(
                "TLS: a throwaway CA and a certificate for each tier and for you, in {}",
                tls.dir.display()
            ));
            Some((dir, tls))
        }
        false => None,
    };
    let tls = certificates.as_ref().map(|(_, tls)| tls.clone());
    let spec = ChainSpec {
        tls: tls.clone(),
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
    say(&hints(
        args.base_port,
        usize::from(args.replicas),
        tls.as_ref(),
    ));
    tokio::select! {
        _ = &mut interrupted => {}
        _ = chain.supervise() => {}
    }
    say("stopping the chain…");
    chain.stop().await;
    Ok(())
}

/// What to try once the chain is up: the layout (every replica's port), then calls —
/// over TLS as the operator when the chain runs with `--tls`.
fn hints(base: u16, replicas: usize, tls: Option<&ChainTls>) -> String {
    let edge = format!("localhost:{base}");
    let credentials = match tls {
        None => "-plaintext".to_owned(),
        Some(tls) => {
            let files = tls.files_of(retrychain_tls::OPERATOR);
            format!(
                "-cacert {} -cert {} -key {}",
                files.ca.display(),
                files.cert.display(),
                files.key.display()
            )
        }
    };
    let secured = match tls {
        None => String::new(),
        Some(tls) => {
            let ca = tls.files_of(retrychain_tls::OPERATOR).ca;
            let token = |caller: &str| {
                format!(
                    "grpcurl -cacert {} -H \"authorization: Bearer $(cat {})\"",
                    ca.display(),
                    tls.token_file(caller).display()
                )
            };
            format!(
                "\nTLS 1.3 everywhere, Control for the operator alone; mutual TLS between tiers, each accepting only the tier above (a call to hop3 as the operator: PERMISSION_DENIED):\n  grpcurl {credentials} -d '{{\"account_id\":\"alice\",\"amount_cents\":1}}' localhost:{} retrychain.v1.Payments/Charge\nCallers: a client certificate (the operator's, above) or a bearer token checked against {}; an account is its creator's (another caller: PERMISSION_DENIED), no credentials: UNAUTHENTICATED:\n  {} -H 'idempotency-key: order-7' -d '{{\"account_id\":\"wallet-a\",\"amount_cents\":700}}' {edge} retrychain.v1.Payments/Charge\n  {} -d '{{\"account_id\":\"wallet-a\"}}' {edge} retrychain.v1.Payments/GetAccount",
                base + 2,
                tls.jwks().display(),
                token("alice"),
                token("bob"),
            )
        }
    };
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
  grpcurl {credentials} {edge} list
  grpcurl {credentials} -max-time 5 -H 'idempotency-key: order-1' -d '{{"account_id":"alice","amount_cents":500}}' {edge} retrychain.v1.Payments/Charge
  grpcurl {credentials} -d '{{"account_id":"alice"}}' {edge} retrychain.v1.Payments/GetAccount
  grpcurl {credentials} -d '{{"fail_rate":1}}' {ledger} retrychain.v1.Control/SetFaults
  grpcurl {credentials} -max-time 30 -H 'x-retry-mode: every-layer' -d '{{"account_id":"alice","amount_cents":100}}' {edge} retrychain.v1.Payments/Charge
  grpcurl {credentials} {ledger} retrychain.v1.Control/GetStats{secured}
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
