//! Whole chains: the five services started bottom-up, each pointed at the one below, on a
//! database of their own — as child processes ([`LocalChain`], for `up`, the experiments
//! and the tests that crash or signal a service) or in this runtime ([`InProcessChain`],
//! for the other tests). Both are started from the same typed settings ([`ChainSpec`]).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use retrychain_proto::v1::{Faults, control_client::ControlClient};
use retrychain_serve::{
    ServiceCommand,
    args::{HopArgs, LedgerArgs, ServiceArgs},
};

use crate::{
    addr::{ChainAddrs, NAMES, ServiceAddr, connect, wait_serving},
    database::{OwnDatabase, Postgres},
    in_process::InProcessService,
    process::{ChildService, Launch, Logs, announce},
};

/// How to start a chain: each service's typed settings — the very values `retrychain
/// edge|relay|ledger` parses its flags into — and, for child processes, their environment,
/// logs and program. A chain in this runtime starts from the values themselves; only a
/// child process gets them as a command line ([`ServiceCommand::to_args`]).
#[derive(Debug, Clone)]
pub struct ChainSpec {
    /// Postgres URL; `None` starts a database for the chain, of the kind `postgres`.
    pub database_url: Option<String>,
    /// The database the chain starts when `database_url` is `None`.
    pub postgres: Postgres,
    /// The edge's port; hop2..ledger take the next four (replica r of service i:
    /// base + i + 10·r). 0: any free ports.
    pub base_port: u16,
    /// How many replicas of each relay and of the ledger (the edge is one): each tier's
    /// replicas are the `--downstream` list of the tier above, which balances over them.
    pub replicas: usize,
    /// Edge first, ledger last. Where each listens, its name, its downstream and the
    /// ledger's database are set by the chain as it starts them.
    pub services: [ServiceCommand; 5],
    /// Environment of the child processes (e.g. `OTEL_*`); not for in-process chains,
    /// which share this process's environment.
    pub env: Vec<(String, String)>,
    /// Where child processes' logs go.
    pub logs: Logs,
    /// The `retrychain` binary of child processes; `None`: this process's executable.
    pub program: Option<PathBuf>,
    /// TLS between every tier and at the edge, from these certificates (each service
    /// gets `--tls-dir <dir>/<tier>`); `None`: plaintext.
    pub tls: Option<crate::ChainTls>,
}

impl Default for ChainSpec {
    /// A playground chain: every flag at its default but fault injection and the
    /// retry-mode override, which are on (both off by default in a service of its own); a
    /// throwaway database, free ports, logs discarded, this binary.
    fn default() -> Self {
        let services = std::array::from_fn(|i| {
            // Parsing the defaults of a known role cannot fail; a flag that reads a
            // malformed environment variable would, and the chain says so when it starts.
            ServiceCommand::defaults(role(i), "")
                .unwrap_or_else(|error| panic!("the defaults of {}: {error}", NAMES[i]))
        });
        Self {
            database_url: None,
            postgres: Postgres::Single,
            base_port: 0,
            replicas: 1,
            services,
            env: Vec::new(),
            logs: Logs::Discard,
            program: None,
            tls: None,
        }
        .each(|service| {
            service.fault_injection = true;
            service.allow_retry_mode_override = true;
        })
    }
}

/// The role of service `i` of a chain.
fn role(i: usize) -> &'static str {
    match i {
        0 => "edge",
        4 => "ledger",
        _ => "relay",
    }
}

impl ChainSpec {
    /// These settings with `change` made to every service's common flags.
    pub fn each(mut self, change: impl Fn(&mut ServiceArgs)) -> Self {
        for service in &mut self.services {
            change(service.service_mut());
        }
        self
    }

    /// The edge's settings, to change them.
    pub fn edge(&mut self) -> &mut HopArgs {
        match &mut self.services[0] {
            ServiceCommand::Edge(args) | ServiceCommand::Relay(args) => args,
            ServiceCommand::Ledger(_) => unreachable!("service 0 is the edge"),
        }
    }

    /// The ledger's settings, to change them.
    pub fn ledger(&mut self) -> &mut LedgerArgs {
        match &mut self.services[4] {
            ServiceCommand::Ledger(args) => args,
            _ => unreachable!("service 4 is the ledger"),
        }
    }

    /// Replica `r` of service `i` as it is started: listening on its port of the chain
    /// (base + i + 10·r), named after its tier, pointed at `downstream` (the ledger at
    /// `database_url`).
    pub fn placed(
        &self,
        i: usize,
        r: usize,
        downstream: &str,
        database_url: &str,
    ) -> ServiceCommand {
        let mut command = self.services[i].clone();
        let listen = SocketAddr::from((
            [127, 0, 0, 1],
            match self.base_port {
                0 => 0,
                base => base + i as u16 + 10 * r as u16,
            },
        ));
        let service = command.service_mut();
        service.listen = Some(listen);
        service.name = Some(NAMES[i].to_owned());
        if let Some(tls) = &self.tls {
            service.tls_dir = Some(tls.dir.join(NAMES[i]));
        }
        match &mut command {
            ServiceCommand::Edge(args) => {
                args.downstream = Some(downstream.to_owned());
                if let Some(tls) = &self.tls
                    && args.jwks.is_none()
                {
                    args.jwks = Some(tls.jwks());
                }
            }
            ServiceCommand::Relay(args) => {
                args.downstream = Some(downstream.to_owned());
            }
            ServiceCommand::Ledger(args) => args.database_url = database_url.to_owned(),
        }
        command
    }

    /// Every port of the layout with what it is for (`hop3.2 admin`): each replica's public
    /// port and its admin port (+1000); none when the chain listens on port 0.
    pub fn ports(&self) -> Vec<(u16, String)> {
        let mut ports = Vec::new();
        if self.base_port == 0 {
            return ports;
        }
        for i in 0..NAMES.len() {
            for r in 0..self.replicas_of(i) {
                let port = self.base_port + i as u16 + 10 * r as u16;
                ports.push((port, replica_name(i, r)));
                ports.push((port + 1000, format!("{} admin", replica_name(i, r))));
            }
        }
        ports
    }

    /// Binds every port of the layout on 127.0.0.1 and lets it go: an error naming the
    /// first taken (and, where `ss` can tell, who holds it), before anything is started.
    /// A port in the kernel's ephemeral range (32768–60999 here) can be taken for a moment
    /// by any outgoing connection: the message says how to move the whole layout.
    pub fn check_ports(&self) -> anyhow::Result<()> {
        let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|range| {
                let mut bounds = range.split_whitespace().map(|n| n.parse::<u16>().ok());
                Some((bounds.next()??, bounds.next()??))
            })
            .unwrap_or((32768, 60999));
        for (port, what) in self.ports() {
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                continue;
            }
            let holder = port_holder(port)
                .map(|h| format!(", held by {h}"))
                .unwrap_or_default();
            let hint = if (ephemeral.0..=ephemeral.1).contains(&self.base_port) {
                format!(
                    " The layout lies in the kernel's range for outgoing connections ({}–{}), where any connection can hold a port for a moment: move it below, e.g. --base-port 20051.",
                    ephemeral.0, ephemeral.1
                )
            } else {
                " Move the whole layout with --base-port.".to_owned()
            };
            anyhow::bail!("port {port} ({what}) is taken{holder}; nothing was started.{hint}");
        }
        Ok(())
    }

    /// How many replicas service `i` runs: one edge, [`ChainSpec::replicas`] of the rest.
    pub fn replicas_of(&self, i: usize) -> usize {
        if i == 0 { 1 } else { self.replicas.max(1) }
    }
}

/// Who holds local port `port`, as `ss` shows it (`"postgres",pid=123`), when it can tell.
fn port_holder(port: u16) -> Option<String> {
    let output = std::process::Command::new("ss")
        .args(["-tanpH", &format!("( sport = :{port} )")])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().next()?;
    let state = line.split_whitespace().next().unwrap_or("?");
    let users = line
        .split("users:((")
        .nth(1)
        .and_then(|u| u.split(')').next())
        .unwrap_or("a process ss could not name");
    Some(format!("{users} ({state})"))
}

/// How a chain's replica `r` of service `i` is called in logs: `hop3`, then `hop3.2`, …
pub fn replica_name(i: usize, r: usize) -> String {
    match r {
        0 => NAMES[i].to_owned(),
        r => format!("{}.{}", NAMES[i], r + 1),
    }
}

/// The database the chain starts for itself when no URL was given, and the URL to use.
async fn database(spec: &ChainSpec) -> anyhow::Result<(Option<OwnDatabase>, String)> {
    Ok(match &spec.database_url {
        Some(url) => (None, url.clone()),
        None => {
            let (kind, tls) = (spec.postgres, spec.tls.clone());
            let database =
                tokio::task::spawn_blocking(move || OwnDatabase::start(kind, tls.as_ref()))
                    .await??;
            let url = database.url();
            (Some(database), url)
        }
    })
}

/// Runs `work` against a chain — the one at `external` if given, else a [`LocalChain`]
/// started from `spec` and stopped afterwards — and gives up on Ctrl-C or SIGTERM,
/// stopping the local chain and clearing the ledger's faults (`work` may have set some)
/// rather than leaving either behind.
pub async fn with_chain<T, F, Fut>(
    external: Option<ChainAddrs>,
    spec: ChainSpec,
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
            chain = LocalChain::start(spec) => {
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

/// The five services of a chain as child processes, with a database of their own when no
/// database URL is given.
#[derive(Debug)]
pub struct LocalChain {
    /// The database, if we started one.
    database: Option<OwnDatabase>,
    /// The first replica of each service, edge first, ledger last.
    pub services: Vec<ChildService>,
    /// The other replicas ([`ChainSpec::replicas`]), tier by tier from the ledger up.
    pub replicas: Vec<ChildService>,
    /// Where the services' logs go, and so what the chain says itself.
    logs: Logs,
}

impl LocalChain {
    /// Starts Postgres if needed, then the ledger's replicas, hop4's, hop3's, hop2's and
    /// the edge, each after those below report SERVING.
    pub async fn start(spec: ChainSpec) -> anyhow::Result<Self> {
        // Every port the layout needs, checked before anything starts: a chain that dies
        // half-started on its thirtieth port helps nobody.
        spec.check_ports()?;
        let (database, database_url) = database(&spec).await?;
        let mut chain = LocalChain {
            database,
            services: Vec::new(),
            replicas: Vec::new(),
            logs: spec.logs,
        };
        let mut downstream = String::new();
        for i in (0..NAMES.len()).rev() {
            // The database URL goes in the environment, not on the command line, which
            // every local user can read.
            let mut env = spec.env.clone();
            if i == 4 {
                env.push(("DATABASE_URL".to_owned(), database_url.clone()));
            }
            let mut urls = Vec::new();
            for r in 0..spec.replicas_of(i) {
                let launch = Launch {
                    program: spec.program.clone(),
                    args: spec.placed(i, r, &downstream, &database_url).to_args(),
                    env: env.clone(),
                    logs: spec.logs,
                };
                let service = match ChildService::start(&replica_name(i, r), launch).await {
                    Ok(service) => service,
                    Err(error) => {
                        chain.stop().await;
                        return Err(error);
                    }
                };
                let mut service = service;
                if spec.tls.is_some() {
                    // The ready line names addresses; over TLS both ports are https://.
                    service.addr.url = service.addr.url.replacen("http://", "https://", 1);
                    service.addr.admin_url =
                        service.addr.admin_url.replacen("http://", "https://", 1);
                }
                let serving =
                    wait_serving(&service.name, &service.addr.url, spec.tls.as_ref()).await;
                urls.push(service.addr.url.clone());
                match r {
                    0 => chain.services.insert(0, service),
                    _ => chain.replicas.push(service),
                }
                if let Err(error) = serving {
                    chain.stop().await;
                    return Err(error);
                }
            }
            downstream = urls.join(",");
        }
        Ok(chain)
    }

    /// The services' addresses.
    pub fn addrs(&self) -> ChainAddrs {
        addrs_of(self.services.iter().map(|s| s.addr.clone()))
    }

    /// The database the chain started for itself, if it did.
    pub fn own_database(&self) -> Option<&OwnDatabase> {
        self.database.as_ref()
    }

    /// The database the chain started for itself, to fault it (restart, freeze, fail
    /// over).
    pub fn own_database_mut(&mut self) -> Option<&mut OwnDatabase> {
        self.database.as_mut()
    }

    /// Keeps the services running: one that exits is started again after a short backoff
    /// (250 ms, doubling to 8 s while it keeps failing; back to 250 ms once it has run for
    /// 30 s), while the others go on serving and the Postgres cluster stays up. Runs until
    /// the caller stops waiting for it.
    pub async fn supervise(&mut self) {
        const FIRST: Duration = Duration::from_millis(250);
        const LONGEST: Duration = Duration::from_secs(8);
        const STEADY: Duration = Duration::from_secs(30);
        let count = self.services.len() + self.replicas.len();
        let mut waits = vec![FIRST; count];
        let mut started = vec![tokio::time::Instant::now(); count];
        loop {
            let (i, status) = self.first_exit().await;
            if started[i].elapsed() >= STEADY {
                waits[i] = FIRST;
            }
            let name = self.nth(i).name.clone();
            announce(
                self.logs,
                "up",
                &format!("{name} exited ({status}); restarting in {:?}", waits[i]),
            );
            tokio::time::sleep(waits[i]).await;
            match self.nth(i).restart().await {
                Ok(()) => announce(self.logs, "up", &format!("{name} restarted")),
                Err(error) => announce(
                    self.logs,
                    "up",
                    &format!("{name} did not restart: {error:#}"),
                ),
            }
            started[i] = tokio::time::Instant::now();
            waits[i] = (waits[i] * 2).min(LONGEST);
        }
    }

    /// Service `i` of the first replicas followed by the other replicas.
    fn nth(&mut self, i: usize) -> &mut ChildService {
        match i.checked_sub(self.services.len()) {
            None => &mut self.services[i],
            Some(extra) => &mut self.replicas[extra],
        }
    }

    /// Completes when any service (any replica) exits: its index, as [`Self::nth`]
    /// counts, and its exit status.
    async fn first_exit(&mut self) -> (usize, String) {
        let waits = self
            .services
            .iter_mut()
            .chain(self.replicas.iter_mut())
            .enumerate()
            .map(|(i, service)| Box::pin(async move { (i, service.exited().await) }));
        futures::future::select_all(waits).await.0
    }

    /// Stops the services top-down, then removes the chain's own database.
    pub async fn stop(mut self) {
        for service in std::mem::take(&mut self.services) {
            service.stop().await;
        }
        for service in std::mem::take(&mut self.replicas) {
            service.stop().await;
        }
        if let Some(database) = self.database.take() {
            let _ = tokio::task::spawn_blocking(move || database.stop()).await;
        }
    }
}

/// The five services of a chain in this runtime, each on listeners of its own, with a
/// database of their own when no database URL is given. Dropping it stops them accepting
/// calls (as [`InProcessService`]'s drop does) and removes the database.
#[derive(Debug)]
pub struct InProcessChain {
    /// The first replica of each service, edge first, ledger last.
    pub services: Vec<InProcessService>,
    /// The other replicas ([`ChainSpec::replicas`]).
    pub replicas: Vec<InProcessService>,
    /// The database, if we started one: held to be removed on drop, after the services
    /// (fields drop in order).
    _database: Option<OwnDatabase>,
}

impl InProcessChain {
    /// Starts Postgres if needed, then the ledger, hop4, hop3, hop2 and the edge from the
    /// same settings a [`LocalChain`] gives its processes (`spec.env`, `logs` and `program`
    /// do not apply). Plaintext only: a chain over TLS is a [`LocalChain`], whose processes
    /// each read their own certificates as a deployment's do.
    pub async fn start(spec: ChainSpec) -> anyhow::Result<Self> {
        anyhow::ensure!(
            spec.tls.is_none(),
            "an in-process chain runs plaintext; start a chain over TLS as a LocalChain"
        );
        let (database, database_url) = database(&spec).await?;
        let (mut services, mut replicas) = (Vec::new(), Vec::new());
        let mut downstream = String::new();
        for i in (0..NAMES.len()).rev() {
            let mut urls = Vec::new();
            for r in 0..spec.replicas_of(i) {
                let command = spec.placed(i, r, &downstream, &database_url);
                let service = InProcessService::start(&replica_name(i, r), command).await?;
                urls.push(service.addr.url.clone());
                match r {
                    0 => services.insert(0, service),
                    _ => replicas.push(service),
                }
            }
            downstream = urls.join(",");
        }
        Ok(Self {
            services,
            replicas,
            _database: database,
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
    fn each_service_is_placed_on_its_port_with_its_name_and_downstream() {
        let mut spec = ChainSpec {
            base_port: 50051,
            ..ChainSpec::default()
        };
        spec.edge().service.max_attempts = 4;
        spec.ledger().db_pool_size = 8;
        let ServiceCommand::Edge(edge) = spec.placed(0, 0, "http://127.0.0.1:50052", "") else {
            panic!("service 0 is the edge")
        };
        assert_eq!(
            edge.service.listen,
            Some("127.0.0.1:50051".parse().unwrap())
        );
        assert_eq!(edge.service.name.as_deref(), Some("edge"));
        assert_eq!(edge.downstream.as_deref(), Some("http://127.0.0.1:50052"));
        assert_eq!(edge.service.max_attempts, 4);
        assert!(edge.service.fault_injection && edge.service.allow_retry_mode_override);
        let ServiceCommand::Relay(hop3) = spec.placed(2, 0, "http://127.0.0.1:50054", "") else {
            panic!("service 2 is a relay")
        };
        assert_eq!(hop3.service.name.as_deref(), Some("hop3"));
        assert_eq!(
            hop3.service.max_attempts, 3,
            "the edge's setting is the edge's"
        );
        let ServiceCommand::Ledger(ledger) = spec.placed(4, 0, "", "postgres://db") else {
            panic!("service 4 is the ledger")
        };
        assert_eq!(ledger.database_url, "postgres://db");
        assert_eq!(ledger.db_pool_size, 8);
        let ServiceCommand::Ledger(any_port) = ChainSpec::default().placed(4, 0, "", "") else {
            panic!("service 4 is the ledger")
        };
        assert_eq!(
            any_port.service.listen,
            Some("127.0.0.1:0".parse().unwrap())
        );
        let ServiceCommand::Relay(hop3_b) = spec.placed(2, 1, "http://a,http://b", "") else {
            panic!("service 2 is a relay")
        };
        assert_eq!(
            hop3_b.service.listen,
            Some("127.0.0.1:50063".parse().unwrap()),
            "replica 2 of hop3: ten ports up"
        );
        assert_eq!(
            hop3_b.service.name.as_deref(),
            Some("hop3"),
            "named after its tier"
        );
        assert_eq!(replica_name(2, 1), "hop3.2");
        assert_eq!(spec.replicas_of(0), 1, "one edge");
    }
}
