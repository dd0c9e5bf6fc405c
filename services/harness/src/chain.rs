//! Whole chains: the five services started bottom-up, each pointed at the one below, on a
//! database of their own — as child processes ([`LocalChain`], for `up`, the experiments
//! and the tests that crash or signal a service) or in this runtime ([`InProcessChain`],
//! for the other tests). Both are started from the same flags ([`ChainOptions`]).

use std::{path::PathBuf, time::Duration};

use anyhow::Context;

use retrychain_proto::v1::{Faults, control_client::ControlClient};

use crate::{
    addr::{ChainAddrs, NAMES, ServiceAddr, connect, wait_serving},
    in_process::InProcessService,
    process::{ChildService, Launch, Logs, say},
};

/// How to start a chain.
#[derive(Debug, Clone)]
pub struct ChainOptions {
    /// Postgres URL; `None` starts a throwaway cluster for the chain.
    pub database_url: Option<String>,
    /// The edge's port; hop2..ledger take the next four. 0: any free ports.
    pub base_port: u16,
    /// Flags for all five (retry mode, log format, backoff, …); by default
    /// [`ChainOptions::PLAYGROUND`].
    pub flags: Vec<String>,
    /// Flags for the edge only, after `flags`.
    pub edge_flags: Vec<String>,
    /// Flags for the ledger only, after `flags`.
    pub ledger_flags: Vec<String>,
    /// Environment of the child processes (e.g. `OTEL_*`); not for in-process chains,
    /// which share this process's environment.
    pub env: Vec<(String, String)>,
    /// Where child processes' logs go.
    pub logs: Logs,
    /// The `retrychain` binary of child processes; `None`: this process's executable.
    pub program: Option<PathBuf>,
}

impl Default for ChainOptions {
    /// A throwaway database, free ports, the playground's flags, logs discarded, this
    /// binary.
    fn default() -> Self {
        Self {
            database_url: None,
            base_port: 0,
            flags: Self::PLAYGROUND.map(String::from).into(),
            edge_flags: Vec::new(),
            ledger_flags: Vec::new(),
            env: Vec::new(),
            logs: Logs::Discard,
            program: None,
        }
    }
}

impl ChainOptions {
    /// A local chain is a playground: fault injection is on and every service honours
    /// `x-retry-mode` (both off by default in a service of its own).
    pub const PLAYGROUND: [&str; 2] = ["--fault-injection", "--allow-retry-mode-override"];

    /// The command line of service `i` (0 the edge … 4 the ledger) over `downstream`.
    fn args(&self, i: usize, downstream: &str) -> Vec<String> {
        let role = match i {
            0 => "edge",
            4 => "ledger",
            _ => "relay",
        };
        let listen = match self.base_port {
            0 => "127.0.0.1:0".to_owned(),
            base => format!("127.0.0.1:{}", base + i as u16),
        };
        let mut args: Vec<String> = [role, "--listen", &listen, "--name", NAMES[i]]
            .map(String::from)
            .into();
        if role != "ledger" {
            args.extend(["--downstream".to_owned(), downstream.to_owned()]);
        }
        args.extend(self.flags.iter().cloned());
        match role {
            "edge" => args.extend(self.edge_flags.iter().cloned()),
            "ledger" => args.extend(self.ledger_flags.iter().cloned()),
            _ => {}
        }
        args
    }
}

/// A throwaway Postgres cluster, when no database URL was given, and the URL to use.
async fn database(
    options: &ChainOptions,
) -> anyhow::Result<(Option<tempgres::TempCluster>, String)> {
    Ok(match &options.database_url {
        Some(url) => (None, url.clone()),
        None => {
            let cluster = tokio::task::spawn_blocking(tempgres::TempCluster::start)
                .await?
                .context("starting a throwaway Postgres (or set DATABASE_URL)")?;
            let url = cluster.url("postgres");
            (Some(cluster), url)
        }
    })
}

/// Runs `work` against a chain — the one at `external` if given, else a [`LocalChain`]
/// started with `options` and stopped afterwards — and gives up on Ctrl-C or SIGTERM,
/// stopping the local chain and clearing the ledger's faults (`work` may have set some)
/// rather than leaving either behind.
pub async fn with_chain<T, F, Fut>(
    external: Option<ChainAddrs>,
    options: ChainOptions,
    work: F,
) -> anyhow::Result<T>
where
    F: FnOnce(ChainAddrs) -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let interrupted = retrychain_node::shutdown_signal();
    tokio::pin!(interrupted);
    let (local, addrs) = match external {
        Some(addrs) => (None, addrs),
        None => tokio::select! {
            chain = LocalChain::start(options) => {
                let chain = chain?;
                let addrs = chain.addrs();
                (Some(chain), addrs)
            }
            _ = &mut interrupted => anyhow::bail!("interrupted while starting the chain"),
        },
    };
    let result = tokio::select! {
        result = work(addrs.clone()) => result,
        _ = &mut interrupted => {
            // The ledger alone: the others may be down, or unknown (storm knows two).
            if let Ok(channel) = connect(&addrs.ledger.admin_url).await {
                let _ = ControlClient::new(channel).set_faults(Faults::default()).await;
            }
            Err(anyhow::anyhow!("interrupted"))
        }
    };
    if let Some(chain) = local {
        chain.stop().await;
    }
    result
}

/// The five services of a chain as child processes, with a throwaway Postgres when no
/// database URL is given.
#[derive(Debug)]
pub struct LocalChain {
    /// The throwaway cluster, if we started one.
    cluster: Option<tempgres::TempCluster>,
    /// Edge first, ledger last.
    pub services: Vec<ChildService>,
}

impl LocalChain {
    /// Starts Postgres if needed, then the ledger, hop4, hop3, hop2 and the edge, each
    /// after the one below reports SERVING.
    pub async fn start(options: ChainOptions) -> anyhow::Result<Self> {
        let (cluster, database_url) = database(&options).await?;
        let mut chain = LocalChain {
            cluster,
            services: Vec::new(),
        };
        let mut downstream = String::new();
        for i in (0..NAMES.len()).rev() {
            let mut env = options.env.clone();
            if i == 4 {
                env.push(("DATABASE_URL".to_owned(), database_url.clone()));
            }
            let launch = Launch {
                program: options.program.clone(),
                args: options.args(i, &downstream),
                env,
                logs: options.logs,
            };
            let service = match ChildService::start(NAMES[i], launch).await {
                Ok(service) => service,
                Err(error) => {
                    chain.stop().await;
                    return Err(error);
                }
            };
            let serving = wait_serving(&service.name, service.url()).await;
            downstream = service.addr.url.clone();
            chain.services.insert(0, service);
            if let Err(error) = serving {
                chain.stop().await;
                return Err(error);
            }
        }
        Ok(chain)
    }

    /// The services' addresses.
    pub fn addrs(&self) -> ChainAddrs {
        addrs_of(self.services.iter().map(|s| s.addr.clone()))
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
        let waits = self
            .services
            .iter_mut()
            .enumerate()
            .map(|(i, service)| Box::pin(async move { (i, service.exited().await) }));
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

/// The five services of a chain in this runtime, each on listeners of its own, with a
/// throwaway Postgres when no database URL is given. Dropping it stops them accepting
/// calls (as [`InProcessService`]'s drop does) and removes the cluster.
#[derive(Debug)]
pub struct InProcessChain {
    /// Edge first, ledger last.
    pub services: Vec<InProcessService>,
    /// The throwaway cluster, if we started one: held to be removed on drop, after the
    /// services (fields drop in order).
    _cluster: Option<tempgres::TempCluster>,
}

impl InProcessChain {
    /// Starts Postgres if needed, then the ledger, hop4, hop3, hop2 and the edge from the
    /// same flags a [`LocalChain`] gives its processes (`options.env`, `logs` and `program`
    /// do not apply).
    pub async fn start(options: ChainOptions) -> anyhow::Result<Self> {
        let (cluster, database_url) = database(&options).await?;
        let mut services = Vec::new();
        let mut downstream = String::new();
        for i in (0..NAMES.len()).rev() {
            let mut args = options.args(i, &downstream);
            if i == 4 {
                args.extend(["--database-url".to_owned(), database_url.clone()]);
            }
            let service = InProcessService::start(NAMES[i], &args).await?;
            downstream = service.addr.url.clone();
            services.insert(0, service);
        }
        Ok(Self {
            services,
            _cluster: cluster,
        })
    }

    /// The services' addresses.
    pub fn addrs(&self) -> ChainAddrs {
        addrs_of(self.services.iter().map(|s| s.addr.clone()))
    }
}

fn addrs_of(addrs: impl Iterator<Item = ServiceAddr>) -> ChainAddrs {
    let addrs: Vec<ServiceAddr> = addrs.collect();
    match <[ServiceAddr; 5]>::try_from(addrs) {
        Ok(addrs) => ChainAddrs::from_array(addrs),
        Err(addrs) => unreachable!("a chain has five services, not {}", addrs.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_service_gets_its_role_port_name_and_downstream_then_the_flags() {
        let options = ChainOptions {
            base_port: 50051,
            edge_flags: vec!["--max-attempts".into(), "4".into()],
            ledger_flags: vec!["--db-pool-size".into(), "8".into()],
            ..ChainOptions::default()
        };
        let edge = options.args(0, "http://127.0.0.1:50052");
        assert_eq!(
            edge,
            [
                "edge",
                "--listen",
                "127.0.0.1:50051",
                "--name",
                "edge",
                "--downstream",
                "http://127.0.0.1:50052",
                "--fault-injection",
                "--allow-retry-mode-override",
                "--max-attempts",
                "4",
            ]
        );
        let hop3 = options.args(2, "http://127.0.0.1:50054");
        assert_eq!(
            hop3[..5],
            ["relay", "--listen", "127.0.0.1:50053", "--name", "hop3"]
        );
        let ledger = options.args(4, "");
        assert!(!ledger.contains(&"--downstream".to_owned()), "{ledger:?}");
        assert!(ledger.ends_with(&["--db-pool-size".to_owned(), "8".to_owned()]));
        let any_port = ChainOptions::default().args(4, "");
        assert_eq!(any_port[2], "127.0.0.1:0");
    }
}
