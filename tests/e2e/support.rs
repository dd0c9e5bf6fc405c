//! What the end-to-end tests share: a database per test, and `retrychain-harness`'s chains
//! with the tests' defaults — in this runtime, or as `retrychain` processes where a crash,
//! a signal, a log or the environment is the point — on 127.0.0.1 port 0, called through
//! tonic clients.
//!
//! Tools: a test whose check needs a tool this machine lacks (iptables and root, promtool)
//! skips that check, and fails instead under `RETRYCHAIN_REQUIRE_TOOLS` ([`missing_tool`]),
//! which `.ci/run` sets.
//!
//! Postgres: `DATABASE_URL` if set (each test creates its own database there), else one
//! throwaway cluster per test binary (tempgres), started on first use.
//!
//! External chains: with `RETRYCHAIN_EDGE`, `RETRYCHAIN_HOP2`, `RETRYCHAIN_HOP3`,
//! `RETRYCHAIN_HOP4` and `RETRYCHAIN_LEDGER` set (e.g. to a `docker compose up` deployment),
//! [`Chain::deployment`] uses those services instead of spawning, one test at a time. Their
//! admin ports are `RETRYCHAIN_EDGE_ADMIN` … `RETRYCHAIN_LEDGER_ADMIN` when set, else each
//! public port + 1000 (the default). A deployment over TLS (docker-compose's default) is
//! reached with `https://` addresses as the operator: `RETRYCHAIN_DEPLOYMENT_TLS` names a
//! directory holding `operator/{tls.crt,tls.key,ca.crt}` (what `scripts/compose-credentials`
//! copies out). Not `RETRYCHAIN_TLS_DIR`: the services these tests start would read that.

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

pub use resilience::wire::{
    PREVIOUS_ATTEMPTS as PREVIOUS_ATTEMPTS_HEADER, PUSHBACK as PUSHBACK_HEADER,
    TIMEOUT as TIMEOUT_HEADER,
};
pub use retrychain_domain::metadata::{
    IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, RETRY_MODE, TRACE_ID, TRACEPARENT,
};
pub use retrychain_harness::faults::{delayed, failing, failing_with, losing_replies};
pub use retrychain_harness::{
    ChainAddrs, ChainClient, ChainSpec, ChainTls, ChildService, InProcessChain, InProcessService,
    Launch, LocalChain, Logs, NAMES, ServiceAddr, client::LEDGER,
};
use retrychain_proto::v1::{
    ChargeReply, ChargeRequest, Faults, Stats, control_client::ControlClient,
    payments_client::PaymentsClient,
};
pub use retrychain_serve::{
    ServiceCommand,
    args::{InFlightArg, LedgerArgs, ServiceArgs},
};
use tonic::{Request, Response, Status, metadata::MetadataValue, transport::Channel};

/// The edge's position in a chain (the ledger's is [`LEDGER`]).
pub const EDGE: usize = 0;

/// A database for one test: a fresh database on the shared server.
pub async fn database() -> String {
    static CLUSTER: OnceLock<Result<ClusterOrUrl, String>> = OnceLock::new();
    let server = CLUSTER
        .get_or_init(|| match std::env::var("DATABASE_URL") {
            Ok(url) => Ok(ClusterOrUrl::Url(url)),
            Err(_) => tempgres::TempCluster::start()
                .map(ClusterOrUrl::Cluster)
                .map_err(|e| e.to_string()),
        })
        .as_ref()
        .unwrap_or_else(|e| {
            panic!("end-to-end tests need Postgres: set DATABASE_URL or put initdb/postgres on PATH: {e}")
        });
    let admin = server.url("postgres");
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&admin)
        .await
        .unwrap_or_else(|e| panic!("connecting to {admin}: {e}"));
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await
        .expect("CREATE DATABASE");
    server.url(&name)
}

enum ClusterOrUrl {
    Cluster(tempgres::TempCluster),
    Url(String),
}

impl ClusterOrUrl {
    fn url(&self, database: &str) -> String {
        match self {
            ClusterOrUrl::Cluster(c) => c.url(database),
            ClusterOrUrl::Url(url) => {
                // Replace the path of the given URL with `database`.
                let (base, query) = url
                    .split_once('?')
                    .map_or((url.as_str(), None), |(b, q)| (b, Some(q)));
                let base = base.rsplit_once('/').map_or(base, |(b, _)| b);
                match query {
                    Some(q) => format!("{base}/{database}?{q}"),
                    None => format!("{base}/{database}"),
                }
            }
        }
    }
}

/// How to start a chain: the typed settings of [`ChainSpec`] with the tests' defaults, and
/// whether as processes (where a crash, a signal, a log or the environment is the point)
/// or in this test's runtime (everything else: faster, and nothing to kill).
#[derive(Debug, Clone)]
pub struct Options {
    /// The chain's settings: change them through [`ChainSpec::edge`],
    /// [`ChainSpec::ledger`] and [`Options::each`].
    pub spec: ChainSpec,
    /// Child processes of the `retrychain` binary, their logs captured.
    pub processes: bool,
}

impl Default for Options {
    /// The test deployment, in process: a playground (faults, the retry-mode override),
    /// edge-only, quick backoff (2 to 20 ms), an 8-connection pool.
    fn default() -> Self {
        let mut spec = ChainSpec {
            logs: Logs::Capture,
            program: Some(BIN.into()),
            ..ChainSpec::default()
        }
        .each(|service| {
            service.backoff_base_ms = 2;
            service.backoff_cap_ms = 20;
        });
        spec.ledger().db_pool_size = 8;
        Self {
            spec,
            processes: false,
        }
    }
}

impl Options {
    /// These options with `change` made to every service's common flags.
    pub fn each(mut self, change: impl Fn(&mut ServiceArgs)) -> Self {
        self.spec = self.spec.each(change);
        self
    }

    /// The test deployment as five processes.
    /// Their ports are below the kernel's range for outgoing connections: a restarted
    /// service binds its ports again, and a port the kernel once handed out for port 0 may
    /// by then be an outgoing connection's (measured: `faults::a_draining_ledger…` failed
    /// with "binding the admin address 127.0.0.1:37343: Address already in use").
    pub fn processes() -> Self {
        let mut options = Self {
            processes: true,
            ..Self::default()
        };
        options.spec.base_port = free_base_port();
        options
    }
}

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_retrychain");

/// A tool a test needs is missing here (`what` says which and what goes unchecked). Where
/// the check is meant to run — CI, which sets `RETRYCHAIN_REQUIRE_TOOLS` — that is a
/// failure, so a check cannot quietly stop running; elsewhere the test says it skipped.
pub fn missing_tool(what: &str) {
    if std::env::var_os("RETRYCHAIN_REQUIRE_TOOLS").is_some() {
        panic!("{what}, and RETRYCHAIN_REQUIRE_TOOLS says this check must run here");
    }
    eprintln!("skipped: {what}");
}

/// A command line of `list`, for the experiments' flags and the binary's own.
pub fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Five services, edge first: processes, in this runtime, or an external deployment.
pub struct Chain {
    /// Their Payments addresses, edge first.
    pub addrs: Vec<String>,
    /// Their Control (admin) addresses, edge first.
    pub admins: Vec<String>,
    /// The processes, when spawned as such (edge first).
    pub services: Vec<ChildService>,
    /// The services, when spawned in this runtime.
    in_process: Option<InProcessChain>,
    /// The ledger's database, when spawned here.
    pub database_url: Option<String>,
    /// The chain's caller.
    pub client: ChainClient,
    /// Serialises tests on an external deployment.
    _external: Option<tokio::sync::OwnedMutexGuard<()>>,
}

const EXTERNAL_VARS: [&str; 5] = [
    "RETRYCHAIN_EDGE",
    "RETRYCHAIN_HOP2",
    "RETRYCHAIN_HOP3",
    "RETRYCHAIN_HOP4",
    "RETRYCHAIN_LEDGER",
];

impl Chain {
    /// A chain with `options` on a fresh database.
    pub async fn spawn(options: Options) -> Chain {
        Chain::spawn_on(options, database().await).await
    }

    /// A chain with `options` whose ledger uses the database at `database_url`.
    pub async fn spawn_on(options: Options, database_url: String) -> Chain {
        let processes = options.processes;
        let spec = ChainSpec {
            database_url: Some(database_url.clone()),
            ..options.spec
        };
        let (addrs, services, in_process) = if processes {
            let chain = LocalChain::start(spec).await.unwrap();
            (chain.addrs(), chain.services, None)
        } else {
            let chain = InProcessChain::start(spec).await.unwrap();
            (chain.addrs(), Vec::new(), Some(chain))
        };
        let mut chain = Chain::over(addrs, None).await;
        chain.services = services;
        chain.in_process = in_process;
        chain.database_url = Some(database_url);
        chain
    }

    async fn over(addrs: ChainAddrs, external: Option<tokio::sync::OwnedMutexGuard<()>>) -> Chain {
        let client = match deployment_tls().filter(|_| external.is_some()) {
            Some(tls) => ChainClient::connect_tls(&addrs, &tls).await.unwrap(),
            None => ChainClient::connect(&addrs).await.unwrap(),
        };
        Chain {
            addrs: addrs.all().map(|a| a.url.clone()).into(),
            admins: addrs.all().map(|a| a.admin_url.clone()).into(),
            client,
            services: Vec::new(),
            in_process: None,
            database_url: None,
            _external: external,
        }
    }

    /// The deployment under test: the external one named by RETRYCHAIN_EDGE … _LEDGER when
    /// set (faults cleared and counters zeroed first, one test at a time), else a chain
    /// started here with the default options. Such a deployment must allow fault injection
    /// and the retry-mode override, as `docker compose` and `retrychain up` do.
    pub async fn deployment() -> Chain {
        Chain::deployment_or(Options::default()).await
    }

    /// [`Chain::deployment`], with a local chain started with `options` when there is no
    /// external one.
    pub async fn deployment_or(options: Options) -> Chain {
        static LOCK: OnceLock<Arc<tokio::sync::Mutex<()>>> = OnceLock::new();
        let external: Option<Vec<String>> = EXTERNAL_VARS
            .iter()
            .map(|v| std::env::var(v).ok())
            .collect();
        let Some(urls) = external else {
            return Chain::spawn(options).await;
        };
        let guard = Arc::clone(LOCK.get_or_init(Default::default))
            .lock_owned()
            .await;
        let addrs: Vec<ServiceAddr> = EXTERNAL_VARS
            .iter()
            .zip(&urls)
            .map(|(var, url)| {
                let admin = std::env::var(format!("{var}_ADMIN")).ok();
                ServiceAddr::external(url, admin.as_deref())
            })
            .collect();
        let addrs = ChainAddrs::from_array(addrs.try_into().unwrap());
        let chain = Chain::over(addrs, Some(guard)).await;
        for i in 0..5 {
            chain.client.clear_faults(i).await.unwrap();
        }
        chain.reset_stats().await;
        chain
    }

    pub async fn channel(&self, i: usize) -> Channel {
        connect(&self.addrs[i]).await
    }

    pub async fn edge(&self) -> PaymentsClient<Channel> {
        self.client.edge()
    }

    /// Control on service `i`'s admin port.
    pub async fn control(&self, i: usize) -> ControlClient<Channel> {
        self.client.control(i)
    }

    pub async fn stats(&self, i: usize) -> Stats {
        self.client.stats(i).await.unwrap()
    }

    pub async fn all_stats(&self) -> Vec<Stats> {
        self.client.all_stats().await.unwrap()
    }

    pub async fn reset_stats(&self) {
        self.client.reset_stats().await.unwrap()
    }

    pub async fn set_faults(&self, i: usize, faults: Faults) -> Faults {
        self.client.set_faults(i, faults).await.unwrap()
    }

    /// What service `i` logged (a chain spawned as processes).
    pub fn log(&self, i: usize) -> String {
        self.services[i].log()
    }

    /// A Charge through the edge: `amount` to `account`, under `key` if given (else the
    /// edge makes one), within `deadline`, with extra `metadata`.
    pub async fn charge(
        &self,
        account: &str,
        amount: i64,
        key: Option<&str>,
        deadline: Duration,
        metadata: &[(&'static str, &str)],
    ) -> Result<Response<ChargeReply>, Status> {
        let request = charge(account, amount, key, deadline, metadata);
        self.client.charge(request).await
    }

    /// A Charge of 500 cents for a fresh account through the edge, with no key (the edge
    /// makes one), within `deadline`, with extra `metadata`.
    pub async fn charge_new(
        &self,
        deadline: Duration,
        metadata: &[(&'static str, &str)],
    ) -> Result<Response<ChargeReply>, Status> {
        self.charge(&new_account(), 500, None, deadline, metadata)
            .await
    }

    /// Makes the ledger's processor fail every call, UNAVAILABLE: the outage that retries
    /// multiply.
    pub async fn fail_processor(&self) {
        self.client.fail_processor().await.unwrap();
    }

    /// The ledger's balance and charge count for `account`, read through the edge.
    pub async fn account(&self, account: &str) -> Option<(i64, i64)> {
        self.client.account(account).await.unwrap()
    }
}

/// A Charge request with an optional key, deadline and extra metadata (sent as given:
/// malformed values included, for the tests of how services refuse them).
pub fn charge(
    account: &str,
    amount: i64,
    key: Option<&str>,
    timeout: Duration,
    metadata: &[(&'static str, &str)],
) -> Request<ChargeRequest> {
    let mut request = retrychain_harness::charge_request(account, amount, key, timeout, None);
    for (k, v) in metadata {
        request
            .metadata_mut()
            .insert(*k, MetadataValue::try_from(*v).unwrap());
    }
    request
}

/// A Charge on `client` (a lone ledger's, a hop's) with no extra metadata.
pub async fn charge_on(
    client: &PaymentsClient<Channel>,
    account: &str,
    amount: i64,
    key: Option<&str>,
    deadline: Duration,
) -> Result<Response<ChargeReply>, Status> {
    let request = charge(account, amount, key, deadline, &[]);
    client.clone().charge(request).await
}

/// Processor calls the ledger behind `control` has made.
pub async fn bottom_calls(control: &ControlClient<Channel>) -> u64 {
    control
        .clone()
        .get_stats(retrychain_proto::v1::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .downstream_attempts
}

/// Runs blocking `work` (pg_ctl, a process) off the runtime, whose services must go on.
pub async fn off_runtime<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(work).await.unwrap()
}

/// A throwaway Postgres cluster of this test's own: the faults apply to the whole server.
pub async fn own_cluster() -> tempgres::TempCluster {
    off_runtime(tempgres::TempCluster::start)
        .await
        .expect("a throwaway Postgres")
}

/// `pg_ctl restart -m fast`: every connection to the server is broken.
pub async fn restart_postgres(cluster: tempgres::TempCluster) -> tempgres::TempCluster {
    off_runtime(move || {
        cluster.restart_server().expect("pg_ctl restart -m fast");
        cluster
    })
    .await
}

pub fn header(response: &Response<ChargeReply>, key: &str) -> Option<String> {
    response
        .metadata()
        .get(key)
        .map(|v| v.to_str().unwrap().to_owned())
}

pub fn status_header(status: &Status, key: &str) -> Option<String> {
    status
        .metadata()
        .get(key)
        .map(|v| v.to_str().unwrap().to_owned())
}

/// A fresh key for a test's logical operation.
pub fn new_key() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A fresh account, so tests against a shared deployment do not see each other's charges.
pub fn new_account() -> String {
    format!("acct-{}", uuid::Uuid::new_v4().simple())
}

pub fn faults() -> Faults {
    Faults::default()
}

/// The tests' lone ledger on the database at `url`: listening on 127.0.0.1 port 0, with
/// fault injection, the retry-mode override and a 60-connection pool, then `configure`d.
fn lone_ledger(url: &str, configure: impl FnOnce(&mut LedgerArgs)) -> ServiceCommand {
    let mut command = ServiceCommand::defaults("ledger", url).unwrap();
    let ServiceCommand::Ledger(ledger) = &mut command else {
        unreachable!("the defaults of a ledger are a ledger's")
    };
    ledger.service.listen = Some("127.0.0.1:0".parse().unwrap());
    ledger.service.fault_injection = true;
    ledger.service.allow_retry_mode_override = true;
    ledger.db_pool_size = 60;
    configure(ledger);
    command
}

/// The tests' lone ledger in this runtime, on a database of its own (its URL returned).
pub async fn start_ledger(configure: impl FnOnce(&mut LedgerArgs)) -> (InProcessService, String) {
    let url = database().await;
    let command = lone_ledger(&url, configure);
    (
        InProcessService::start("ledger", command).await.unwrap(),
        url,
    )
}

/// The tests' lone ledger in this runtime, on the database at `url`.
pub async fn start_ledger_on(
    url: &str,
    configure: impl FnOnce(&mut LedgerArgs),
) -> (InProcessService, String) {
    let command = lone_ledger(url, configure);
    (
        InProcessService::start("ledger", command).await.unwrap(),
        url.to_owned(),
    )
}

/// The tests' lone ledger as a process on the database at `url` (to be signalled).
pub async fn spawn_ledger_on(url: &str) -> ChildService {
    let launch = Launch {
        program: Some(BIN.into()),
        args: lone_ledger(url, |_| {}).to_args(),
        env: vec![("DATABASE_URL".to_owned(), url.to_owned())],
        logs: Logs::Capture,
    };
    ChildService::start("ledger", launch).await.unwrap()
}

/// Row counts of the ledger's three tables: (accounts charged, charges, keys).
pub async fn row_counts(database_url: &str) -> (i64, i64, i64) {
    let pool = sqlx::PgPool::connect(database_url).await.unwrap();
    let mut counts = Vec::new();
    // An account is made by its first claim (for its caller), so one with no charge yet
    // may exist: counted are the accounts charged.
    for table in ["accounts WHERE charges > 0", "charges", "idempotency_keys"] {
        let n: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
                .fetch_one(&pool)
                .await
                .unwrap();
        counts.push(n);
    }
    pool.close().await;
    (counts[0], counts[1], counts[2])
}

/// A chain over TLS, as processes, on its own database, the certificates in `dir`, its
/// settings changed by `change`.
pub async fn tls_chain(
    dir: &std::path::Path,
    change: impl FnOnce(&mut ChainSpec),
) -> (LocalChain, ChainTls) {
    let tls = ChainTls::create(dir).unwrap();
    let mut spec = ChainSpec {
        database_url: Some(database().await),
        tls: Some(tls.clone()),
        ..Options::processes().spec
    };
    change(&mut spec);
    (LocalChain::start(spec).await.unwrap(), tls)
}

pub async fn connect(addr: &str) -> Channel {
    retrychain_harness::connect(addr).await.unwrap()
}

/// `GET /metrics` on an admin address (`http://host:port`), over plain HTTP/1.1: the
/// Prometheus text. Asynchronous, so an in-process service can answer it.
pub async fn scrape_metrics(admin: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(host_port(admin))
        .await
        .unwrap();
    let request = format!(
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        host_port(admin)
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    if head.to_lowercase().contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_owned()
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
    out
}

/// The grpcurl binary: $GRPCURL, else `grpcurl` on PATH.
pub fn grpcurl() -> String {
    std::env::var("GRPCURL").unwrap_or_else(|_| "grpcurl".into())
}

/// The operator's TLS material for an external deployment over TLS
/// (`RETRYCHAIN_DEPLOYMENT_TLS`), if one is named.
pub fn deployment_tls() -> Option<retrychain_harness::ChainTls> {
    let dir = std::env::var_os("RETRYCHAIN_DEPLOYMENT_TLS")?;
    Some(retrychain_harness::ChainTls { dir: dir.into() })
}

/// grpcurl's transport flags for `chain`: `-plaintext`, or for an external deployment over
/// TLS the operator's CA, certificate and key.
pub fn grpcurl_transport(chain: &Chain) -> Vec<String> {
    match deployment_tls().filter(|_| chain.addrs[EDGE].starts_with("https://")) {
        Some(tls) => {
            let files = tls.files_of("operator");
            [
                ("-cacert", files.ca),
                ("-cert", files.cert),
                ("-key", files.key),
            ]
            .into_iter()
            .flat_map(|(flag, path)| [flag.to_owned(), path.display().to_string()])
            .collect()
        }
        None => vec!["-plaintext".to_owned()],
    }
}

/// `host:port` of an `http://host:port` or `https://host:port` address.
pub fn host_port(addr: &str) -> String {
    addr.trim_start_matches("http://")
        .trim_start_matches("https://")
        .to_owned()
}

/// An experiment's flags (`DemoArgs`, `StormArgs`, …) parsed from `argv` as the binary
/// parses them.
pub fn parse_flags<A: clap::Args>(argv: &[String]) -> A {
    #[derive(clap::Parser)]
    struct Flags<A: clap::Args> {
        #[command(flatten)]
        args: A,
    }
    let argv = std::iter::once("retrychain".to_owned()).chain(argv.iter().cloned());
    <Flags<A> as clap::Parser>::try_parse_from(argv)
        .unwrap_or_else(|e| panic!("{e}"))
        .args
}

/// A child process that does not outlive a failed test.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &self.0.id().to_string()])
                .status();
            let _ = self.0.wait();
        }
    }
}

/// `retrychain up` with `args`, once `configure` has set its environment: stdin closed,
/// stderr inherited, and every line of its stdout echoed (`up: …`) and handed over on the
/// returned channel. Its stdout is read to the end whether or not anyone still listens, so
/// `up` never meets a closed pipe. Stopped when the guard is dropped.
/// The TCP listeners of process `root` and its descendants that listen beyond the loopback,
/// as `ss -ltnpH` shows them.
pub fn listeners_beyond_loopback(root: u32) -> Vec<String> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| {
            let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut family = vec![root];
    loop {
        let more: Vec<u32> = parents
            .iter()
            .filter(|(pid, ppid)| family.contains(ppid) && !family.contains(pid))
            .map(|(pid, _)| *pid)
            .collect();
        if more.is_empty() {
            break;
        }
        family.extend(more);
    }
    let ss = std::process::Command::new("ss")
        .args(["-ltnpH"])
        .output()
        .expect("ss (iproute2)");
    String::from_utf8_lossy(&ss.stdout)
        .lines()
        .filter(|line| {
            let local = line.split_whitespace().nth(3).unwrap_or_default();
            let loopback = local.starts_with("127.") || local.starts_with("[::1]");
            let ours = family
                .iter()
                .any(|pid| line.contains(&format!("pid={pid},")));
            ours && !loopback
        })
        .map(str::to_owned)
        .collect()
}

pub fn start_up(
    args: &[&str],
    configure: impl FnOnce(&mut std::process::Command),
) -> (KillOnDrop, std::sync::mpsc::Receiver<String>) {
    use std::io::{BufRead, BufReader};
    let mut command = std::process::Command::new(BIN);
    command
        .arg("up")
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    configure(&mut command);
    let mut up = KillOnDrop(command.spawn().unwrap());
    let stdout = up.0.stdout.take().unwrap();
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            println!("up: {line}");
            let _ = lines_tx.send(line);
        }
    });
    (up, lines)
}

/// Five consecutive free ports whose admin ports (+1000) are free too, all below the
/// kernel's range for outgoing connections (32768–60999), where any connection could take
/// one between this check and the chain's bind.
/// Calls in one test process start their search at different bases, so that two tests
/// asking at once (each lets its ports go before its chain binds them) are not given the
/// same.
pub fn free_base_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let start = NEXT.fetch_add(10, std::sync::atomic::Ordering::Relaxed) % 1100;
    let bases = (20000..31000u16).step_by(10);
    let bases = bases.clone().skip(start as usize / 10).chain(bases);
    'next: for base in bases {
        let mut held = Vec::new();
        for port in (base..base + 5).chain(base + 1000..base + 1005) {
            match std::net::TcpListener::bind(("127.0.0.1", port)) {
                Ok(listener) => held.push(listener),
                Err(_) => continue 'next,
            }
        }
        return base;
    }
    panic!("no free ports")
}
