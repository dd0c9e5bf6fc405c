//! Starting retrychain services as child processes of this binary: the whole chain (for
//! `up` and the experiments) or a single extra service on a free port (the demo's own
//! edges); waiting until they serve; and keeping them running (`up` restarts a service that
//! exits, as docker-compose's `restart: unless-stopped` does).

use std::{process::Stdio, time::Duration};

use anyhow::Context;
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, BufReader},
    process::{Child, Command},
    sync::oneshot,
};

use retrychain_node::ReadyAddrs;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// Where one service answers: Payments on `url`, Control on `admin_url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAddr {
    /// The public address, `http://host:port`.
    pub url: String,
    /// The admin address, `http://host:port`.
    pub admin_url: String,
}

impl ServiceAddr {
    /// A service someone else started at `url`, with Control at `admin` — by default the
    /// public port + 1000, as `up` and docker-compose publish them.
    pub fn external(url: &str, admin: Option<&str>) -> Self {
        let url = with_scheme(url);
        if let Some(admin) = admin {
            return Self {
                admin_url: with_scheme(admin),
                url,
            };
        }
        let admin_url = match url.rsplit_once(':') {
            Some((host, port)) => match port.trim_end_matches('/').parse::<u16>() {
                Ok(port) => format!("{host}:{}", port.saturating_add(1000)),
                Err(_) => url.clone(),
            },
            None => url.clone(),
        };
        Self { url, admin_url }
    }
}

fn with_scheme(url: &str) -> String {
    if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    }
}

/// Runs `work` against a chain — the one at `external` (edge first, ledger last) if given,
/// else a [`LocalChain`] started with `options` and stopped afterwards — and gives up on
/// Ctrl-C or SIGTERM, stopping the local chain and clearing the ledger's faults (`work`
/// may have set some) rather than leaving either behind.
pub async fn with_chain<T, F, Fut>(
    external: Option<Vec<ServiceAddr>>,
    options: ChainOptions,
    work: F,
) -> anyhow::Result<T>
where
    F: FnOnce(Vec<ServiceAddr>) -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let interrupted = retrychain_node::shutdown_signal();
    tokio::pin!(interrupted);
    let local = match external {
        Some(_) => None,
        None => tokio::select! {
            chain = LocalChain::start(options) => Some(chain?),
            _ = &mut interrupted => anyhow::bail!("interrupted while starting the chain"),
        },
    };
    let addrs = match (&local, external) {
        (Some(chain), _) => chain.addrs(),
        (None, Some(addrs)) => addrs,
        (None, None) => unreachable!("a chain is either external or local"),
    };
    let ledger = addrs.get(4).map(|ledger| ledger.admin_url.clone());
    let result = tokio::select! {
        result = work(addrs) => result,
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
    let url = with_scheme(url);
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
    /// Its addresses.
    pub addr: ServiceAddr,
    /// The process.
    child: Child,
    /// How it was started, to start it again the same way.
    launch: Launch,
}

/// The command line, environment and log routing of a child, kept for restarts.
#[derive(Debug, Clone)]
struct Launch {
    /// `retrychain` arguments.
    args: Vec<String>,
    /// Extra environment.
    env: Vec<(String, String)>,
    /// Where its logs go.
    logs: Logs,
}

impl ChildService {
    /// Starts `retrychain <args>`; `--listen` must be among `args`. Waits for its ready line
    /// on stderr, which names both addresses (so port 0 works).
    pub async fn start(
        name: &str,
        args: &[String],
        env: &[(&str, &str)],
        logs: Logs,
    ) -> anyhow::Result<Self> {
        let launch = Launch {
            args: args.to_vec(),
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            logs,
        };
        let (child, addr) = spawn(name, &launch).await?;
        Ok(Self {
            name: name.to_owned(),
            addr,
            child,
            launch,
        })
    }

    /// The public address, `http://host:port`.
    pub fn url(&self) -> &str {
        &self.addr.url
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Starts the service again, the same way, after it exited.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        let (child, addr) = spawn(&self.name, &self.launch).await?;
        self.child = child;
        self.addr = addr;
        Ok(())
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

async fn spawn(name: &str, launch: &Launch) -> anyhow::Result<(Child, ServiceAddr)> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut command = Command::new(exe);
    command
        .args(&launch.args)
        .env("RETRYCHAIN_LOG_FORMAT", "text")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (key, value) in &launch.env {
        command.env(key, value);
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let (tx, rx) = oneshot::channel();
    if let Some(out) = child.stdout.take() {
        tokio::spawn(follow(name.to_owned(), out, launch.logs, None));
    }
    if let Some(err) = child.stderr.take() {
        tokio::spawn(follow(name.to_owned(), err, launch.logs, Some(tx)));
    }
    let ready = tokio::time::timeout(Duration::from_secs(60), rx)
        .await
        .map_err(|_| anyhow::anyhow!("{name} did not start listening within 60 s"))?
        .map_err(|_| anyhow::anyhow!("{name} exited before listening"))?;
    if launch.logs == Logs::Prefixed {
        say(
            name,
            &format!(
                "started, pid {}, on {} (admin {})",
                child.id().unwrap_or_default(),
                ready.public,
                ready.admin
            ),
        );
    }
    Ok((
        child,
        ServiceAddr {
            url: format!("http://{}", ready.public),
            admin_url: format!("http://{}", ready.admin),
        },
    ))
}

async fn follow(
    name: String,
    stream: impl AsyncRead + Unpin,
    logs: Logs,
    mut listening: Option<oneshot::Sender<ReadyAddrs>>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(ready) = ReadyAddrs::parse(&line)
            && let Some(tx) = listening.take()
        {
            let _ = tx.send(ready);
            continue;
        }
        if logs == Logs::Prefixed {
            say(&name, &line);
        }
    }
}

/// One line on stdout, prefixed by who says it. A closed stdout (`up | head`) is not
/// worth a panic in a log-forwarding task: the line is dropped.
fn say(who: &str, line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{who:>6} | {line}");
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
    /// after the one below reports SERVING. Fault injection is on and every service honours
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
                "--allow-retry-mode-override".into(),
            ];
            if role != "ledger" {
                args.extend(["--downstream".into(), downstream.clone()]);
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
            downstream = service.addr.url.clone();
            chain.services.insert(0, service);
        }
        Ok(chain)
    }

    /// The services' addresses, edge first.
    pub fn addrs(&self) -> Vec<ServiceAddr> {
        self.services.iter().map(|s| s.addr.clone()).collect()
    }

    /// The throwaway Postgres port, if one was started.
    pub fn postgres_port(&self) -> Option<u16> {
        self.cluster.as_ref().map(|c| c.port())
    }

    /// Keeps the services running: one that exits is started again after a short backoff
    /// (250 ms, doubling to 8 s while it keeps failing; back to 250 ms once it has run for
    /// 30 s), while the others go on serving and the Postgres cluster stays up. Runs until
    /// the caller stops waiting for it.
    pub async fn supervise(&mut self) {
        const FIRST: Duration = Duration::from_millis(250);
        const LONGEST: Duration = Duration::from_secs(8);
        const STEADY: Duration = Duration::from_secs(30);
        let mut waits = vec![FIRST; self.services.len()];
        let mut started = vec![tokio::time::Instant::now(); self.services.len()];
        loop {
            let (i, status) = self.first_exit().await;
            if started[i].elapsed() >= STEADY {
                waits[i] = FIRST;
            }
            let name = self.services[i].name.clone();
            say(
                "up",
                &format!("{name} exited ({status}); restarting in {:?}", waits[i]),
            );
            tokio::time::sleep(waits[i]).await;
            match self.services[i].restart().await {
                Ok(()) => say("up", &format!("{name} restarted")),
                Err(error) => say("up", &format!("{name} did not restart: {error:#}")),
            }
            started[i] = tokio::time::Instant::now();
            waits[i] = (waits[i] * 2).min(LONGEST);
        }
    }

    /// Completes when any service exits: its index and exit status.
    async fn first_exit(&mut self) -> (usize, String) {
        let waits = self.services.iter_mut().enumerate().map(|(i, service)| {
            Box::pin(async move {
                match service.child.wait().await {
                    Ok(status) => (i, status.to_string()),
                    Err(error) => (i, error.to_string()),
                }
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

/// Whether the service at `addr` reports SERVING for the whole server (""), asked with
/// the standard gRPC health check within `timeout`.
pub async fn serving(addr: &str, timeout: Duration) -> anyhow::Result<bool> {
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .with_context(|| format!("address {addr:?}"))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect()
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .context("health check")?;
    Ok(response.into_inner().status == ServingStatus::Serving as i32)
}

async fn wait_serving(service: &ChildService) -> anyhow::Result<()> {
    for _ in 0..120 {
        if let Ok(true) = serving(&service.addr.url, Duration::from_millis(500)).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    anyhow::bail!("{} did not report SERVING within 30 s", service.name)
}
