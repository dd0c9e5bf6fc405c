//! `retrychain up`: the whole chain on this machine, as a playground.
//!
//! Starts a throwaway Postgres unless `DATABASE_URL` is set, then the five services as child
//! processes of this binary, bottom-up, each waiting for the one below to report SERVING.
//! Their logs are interleaved on stdout, each line prefixed by its service. Ctrl-C (or
//! SIGTERM) stops them all and removes the throwaway cluster.

use std::{process::Stdio, time::Duration};

use anyhow::Context;
use clap::Args;
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, BufReader},
    process::{Child, Command},
};

use crate::{
    config::{LogFormatArg, ModeArg},
    health,
};

/// Flags of `up`.
#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Postgres URL for the ledger; unset: a throwaway cluster from the binaries on PATH.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
    /// The retry mode of all five services.
    #[arg(long, env = "RETRYCHAIN_RETRY_MODE", value_enum, default_value_t = ModeArg::EdgeOnly)]
    pub retry_mode: ModeArg,
    /// The edge's port; hop2, hop3, hop4 and the ledger take the next four.
    #[arg(long, env = "RETRYCHAIN_BASE_PORT", default_value_t = 50051)]
    pub base_port: u16,
    /// Log format of the services.
    #[arg(long, env = "RETRYCHAIN_LOG_FORMAT", value_enum, default_value_t = LogFormatArg::Text)]
    pub log_format: LogFormatArg,
}

/// One service of the chain, as `up` starts it.
struct Spec {
    /// Its name.
    name: &'static str,
    /// Its subcommand.
    role: &'static str,
    /// Its port.
    port: u16,
}

/// Runs the chain until Ctrl-C or SIGTERM, or until a service exits.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let (cluster, database_url) = match &args.database_url {
        Some(url) => (None, url.clone()),
        None => {
            println!("starting a throwaway Postgres (set DATABASE_URL to use your own)…");
            let cluster = tokio::task::spawn_blocking(tempgres::TempCluster::start)
                .await?
                .context("starting a throwaway Postgres")?;
            let url = cluster.url("postgres");
            println!("postgres | listening on 127.0.0.1:{}", cluster.port());
            (Some(cluster), url)
        }
    };
    let base = args.base_port;
    let specs = [
        Spec {
            name: "ledger",
            role: "ledger",
            port: base + 4,
        },
        Spec {
            name: "hop4",
            role: "relay",
            port: base + 3,
        },
        Spec {
            name: "hop3",
            role: "relay",
            port: base + 2,
        },
        Spec {
            name: "hop2",
            role: "relay",
            port: base + 1,
        },
        Spec {
            name: "edge",
            role: "edge",
            port: base,
        },
    ];
    let exe = std::env::current_exe().context("locating this binary")?;
    let mode = args.retry_mode.to_possible_value_name();
    let format = match args.log_format {
        LogFormatArg::Text => "text",
        LogFormatArg::Json => "json",
    };
    let mut children: Vec<(&str, Child)> = Vec::new();
    let result = async {
        for (i, spec) in specs.iter().enumerate() {
            let mut command = Command::new(&exe);
            command
                .arg(spec.role)
                .args(["--listen", &format!("127.0.0.1:{}", spec.port)])
                .args(["--name", spec.name])
                .args(["--retry-mode", mode])
                .args(["--log-format", format])
                .arg("--fault-injection")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true);
            if spec.role == "ledger" {
                command.env("DATABASE_URL", &database_url);
            } else {
                let below = &specs[i - 1];
                command.args(["--downstream", &format!("http://127.0.0.1:{}", below.port)]);
            }
            if spec.role == "edge" {
                command.arg("--allow-retry-mode-override");
            }
            let mut child = command
                .spawn()
                .with_context(|| format!("starting {}", spec.name))?;
            if let Some(out) = child.stdout.take() {
                tokio::spawn(prefix_lines(spec.name, out));
            }
            if let Some(err) = child.stderr.take() {
                tokio::spawn(prefix_lines(spec.name, err));
            }
            children.push((spec.name, child));
            wait_serving(spec.name, spec.port).await?;
        }
        print_hints(base);
        tokio::select! {
            _ = crate::serve::shutdown_signal() => Ok(()),
            exited = first_exit(&mut children) => Err(anyhow::anyhow!("{exited}; stopping the chain")),
        }
    }
    .await;
    println!("stopping the chain…");
    for (name, child) in children.iter_mut().rev() {
        stop(name, child).await;
    }
    if let Some(cluster) = cluster {
        tokio::task::spawn_blocking(move || cluster.stop()).await?;
    }
    result
}

async fn prefix_lines(name: &'static str, stream: impl AsyncRead + Unpin) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        println!("{name:>6} | {line}");
    }
}

async fn wait_serving(name: &str, port: u16) -> anyhow::Result<()> {
    let args = health::HealthArgs {
        addr: format!("http://127.0.0.1:{port}"),
        timeout_ms: 500,
    };
    for _ in 0..120 {
        if let Ok(true) = health::check(&args).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    anyhow::bail!("{name} did not report SERVING on port {port} within 30 s")
}

async fn first_exit(children: &mut [(&str, Child)]) -> String {
    let waits = children.iter_mut().map(|(name, child)| {
        Box::pin(async move {
            let status = child.wait().await;
            format!("{name} exited ({status:?})")
        })
    });
    futures::future::select_all(waits).await.0
}

/// SIGTERM, then SIGKILL if it has not exited within five seconds.
async fn stop(name: &str, child: &mut Child) {
    if let Some(pid) = child.id() {
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await;
    }
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        eprintln!("{name} did not stop on SIGTERM; killing it");
        let _ = child.kill().await;
    }
}

fn print_hints(base: u16) {
    let edge = format!("127.0.0.1:{base}");
    println!(
        r#"
retrychain is up: edge {edge} -> hop2 :{} -> hop3 :{} -> hop4 :{} -> ledger :{}
Try:
  grpcurl -plaintext {edge} list
  grpcurl -plaintext -max-time 5 -H 'idempotency-key: order-1' -d '{{"account_id":"alice","amount_cents":500}}' {edge} retrychain.v1.Payments/Charge
  grpcurl -plaintext -d '{{"account_id":"alice"}}' {edge} retrychain.v1.Payments/GetAccount
  grpcurl -plaintext -d '{{"fail_rate":1}}' 127.0.0.1:{} retrychain.v1.Control/SetFaults
  grpcurl -plaintext -H 'x-retry-mode: every-layer' -d '{{"account_id":"alice","amount_cents":500}}' {edge} retrychain.v1.Payments/Charge
  grpcurl -plaintext 127.0.0.1:{} retrychain.v1.Control/GetStats
Ctrl-C stops everything.
"#,
        base + 1,
        base + 2,
        base + 3,
        base + 4,
        base + 4,
        base + 4,
    );
}

trait PossibleValueName {
    fn to_possible_value_name(&self) -> &'static str;
}

impl PossibleValueName for ModeArg {
    fn to_possible_value_name(&self) -> &'static str {
        retrychain_node::RetryMode::from(*self).as_str()
    }
}
