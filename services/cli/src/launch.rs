//! Starting retrychain services as child processes of this binary: the whole chain (for
//! `up` and `demo`) or a single extra service on a free port (the demo's own edges).

use std::{process::Stdio, time::Duration};

use anyhow::Context;
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, BufReader},
    process::{Child, Command},
    sync::oneshot,
};

use crate::health;

/// Runs `work` against a chain — the one at `external` (edge first, ledger last) if given,
/// else a [`LocalChain`] started with `options` and stopped afterwards — and gives up on
/// Ctrl-C or SIGTERM, stopping the local chain and clearing the ledger's faults (`work`
/// may have set some) rather than leaving either behind.
pub async fn with_chain<T, F, Fut>(
    external: Option<Vec<String>>,
    options: ChainOptions,
    work: F,
) -> anyhow::Result<T>
where
    F: FnOnce(Vec<String>) -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let interrupted = crate::serve::shutdown_signal();
    tokio::pin!(interrupted);
    let local = match external {
        Some(_) => None,
        None => tokio::select! {
            chain = LocalChain::start(options) => Some(chain?),
            _ = &mut interrupted => anyhow::bail!("interrupted while starting the chain"),
        },
    };
    let urls = match (&local, external) {
        (Some(chain), _) => chain.urls(),
        (None, Some(urls)) => urls,
        (None, None) => unreachable!("a chain is either external or local"),
    };
    let ledger = urls.get(4).cloned();
    let result = tokio::select! {
        result = work(urls) => result,
        _ = &mut interrupted => {
            if let Some(ledger) = ledger
                && let Ok(channel) = connect(&ledger).await
            {
                let _ = retrychain_proto::v1::control_client::ControlClient::new(channel)
                    .set_faults(retrychain_proto::v1::Faults::default())
                    .await;
            }
            Err(anyhow::anyhow!("interrupted"))
        }
    };
    if let Some(chain) = local {
        chain.stop().await;
    }
    result
}

/// Connects to a service at `url` (`http://` is assumed when no scheme is given).
pub async fn connect(url: &str) -> anyhow::Result<tonic::transport::Channel> {
    let url = if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    };
    tonic::transport::Endpoint::from_shared(url.clone())
        .with_context(|| format!("URL {url:?}"))?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connecting to {url}"))
}

/// Where a child's log lines go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logs {
    /// To our stdout, each line prefixed by the service's name.
    Prefixed,
    /// Nowhere (the demo prints its own report).
    Discard,
}

/// A retrychain service running as our child.
#[derive(Debug)]
pub struct ChildService {
    /// Its name.
    pub name: String,
    /// Its address, `http://host:port`.
    pub url: String,
    /// The process.
    child: Child,
}

impl ChildService {
    /// Starts `retrychain <args>`; `--listen` must be among `args`. Waits for its ready line
    /// on stderr, which names the address (so port 0 works).
    pub async fn start(
        name: &str,
        args: &[String],
        env: &[(&str, &str)],
        logs: Logs,
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating this binary")?;
        let mut command = Command::new(exe);
        command
            .args(args)
            .env("RETRYCHAIN_LOG_FORMAT", "text")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let (tx, rx) = oneshot::channel();
        if let Some(out) = child.stdout.take() {
            tokio::spawn(follow(name.to_owned(), out, logs, None));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(follow(name.to_owned(), err, logs, Some(tx)));
        }
        let address = tokio::time::timeout(Duration::from_secs(60), rx)
            .await
            .map_err(|_| anyhow::anyhow!("{name} did not start listening within 60 s"))?
            .map_err(|_| anyhow::anyhow!("{name} exited before listening"))?;
        Ok(Self {
            name: name.to_owned(),
            url: format!("http://{address}"),
            child,
        })
    }

    /// SIGTERM, then SIGKILL if it has not exited within ten seconds.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("{} did not stop on SIGTERM; killing it", self.name);
            let _ = self.child.kill().await;
        }
    }
}

async fn follow(
    name: String,
    stream: impl AsyncRead + Unpin,
    logs: Logs,
    mut listening: Option<oneshot::Sender<String>>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(address) = line.strip_prefix(retrychain_node::READY_PREFIX)
            && let Some(tx) = listening.take()
        {
            let _ = tx.send(address.trim().to_owned());
            continue;
        }
        if logs == Logs::Prefixed {
            println!("{name:>6} | {line}");
        }
    }
}

/// The five services of a chain, with a throwaway Postgres when no database URL is given.
#[derive(Debug)]
pub struct LocalChain {
    /// The throwaway cluster, if we started one.
    cluster: Option<tempgres::TempCluster>,
    /// Edge first, ledger last.
    pub services: Vec<ChildService>,
}

/// How [`LocalChain::start`] starts a chain.
#[derive(Debug, Clone)]
pub struct ChainOptions {
    /// Postgres URL; `None` starts a throwaway cluster.
    pub database_url: Option<String>,
    /// The edge's port; hop2..ledger take the next four.
    pub base_port: u16,
    /// Flags for all five (retry mode, log format, …).
    pub flags: Vec<String>,
    /// Where their logs go.
    pub logs: Logs,
}

impl LocalChain {
    /// Starts Postgres if needed, then the ledger, hop4, hop3, hop2 and the edge, each
    /// after the one below reports SERVING. Fault injection is on and the edge honours
    /// `x-retry-mode`: a local chain is a playground.
    pub async fn start(options: ChainOptions) -> anyhow::Result<Self> {
        let (cluster, database_url) = match &options.database_url {
            Some(url) => (None, url.clone()),
            None => {
                let cluster = tokio::task::spawn_blocking(tempgres::TempCluster::start)
                    .await?
                    .context("starting a throwaway Postgres (or set DATABASE_URL)")?;
                let url = cluster.url("postgres");
                (Some(cluster), url)
            }
        };
        let mut chain = LocalChain {
            cluster,
            services: Vec::new(),
        };
        let names = ["edge", "hop2", "hop3", "hop4", "ledger"];
        let mut downstream = String::new();
        for (i, name) in names.iter().enumerate().rev() {
            let port = options.base_port + i as u16;
            let role = match i {
                0 => "edge",
                4 => "ledger",
                _ => "relay",
            };
            let mut args: Vec<String> = vec![
                role.into(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--name".into(),
                name.to_string(),
                "--fault-injection".into(),
            ];
            if role != "ledger" {
                args.extend(["--downstream".into(), downstream.clone()]);
            }
            if role == "edge" {
                args.push("--allow-retry-mode-override".into());
            }
            args.extend(options.flags.iter().cloned());
            let env = [("DATABASE_URL", database_url.as_str())];
            let env: &[(&str, &str)] = if role == "ledger" { &env } else { &[] };
            let started = ChildService::start(name, &args, env, options.logs).await;
            let service = match started {
                Ok(service) => service,
                Err(error) => {
                    chain.stop().await;
                    return Err(error);
                }
            };
            if let Err(error) = wait_serving(&service).await {
                chain.services.insert(0, service);
                chain.stop().await;
                return Err(error);
            }
            downstream = service.url.clone();
            chain.services.insert(0, service);
        }
        Ok(chain)
    }

    /// The services' URLs, edge first.
    pub fn urls(&self) -> Vec<String> {
        self.services.iter().map(|s| s.url.clone()).collect()
    }

    /// The throwaway Postgres port, if one was started.
    pub fn postgres_port(&self) -> Option<u16> {
        self.cluster.as_ref().map(|c| c.port())
    }

    /// Completes when any service exits, naming it.
    pub async fn first_exit(&mut self) -> String {
        let waits = self.services.iter_mut().map(|service| {
            Box::pin(async move {
                let status = service.child.wait().await;
                format!("{} exited ({status:?})", service.name)
            })
        });
        futures::future::select_all(waits).await.0
    }

    /// Stops the services top-down, then removes the throwaway cluster.
    pub async fn stop(mut self) {
        for service in std::mem::take(&mut self.services) {
            service.stop().await;
        }
        if let Some(cluster) = self.cluster.take() {
            let _ = tokio::task::spawn_blocking(move || cluster.stop()).await;
        }
    }
}

async fn wait_serving(service: &ChildService) -> anyhow::Result<()> {
    let args = health::HealthArgs {
        addr: service.url.clone(),
        timeout_ms: 500,
    };
    for _ in 0..120 {
        if let Ok(true) = health::check(&args).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    anyhow::bail!("{} did not report SERVING within 30 s", service.name)
}
