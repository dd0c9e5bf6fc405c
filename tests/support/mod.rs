//! The end-to-end harness: real `retrychain` processes on 127.0.0.1 port 0, real Postgres,
//! tonic clients. Each test gets its own chain and its own database.
//!
//! Postgres: `DATABASE_URL` if set (each test creates its own database there), else one
//! throwaway cluster per test binary (tempgres), started on first use.
//!
//! External chains: with `RETRYCHAIN_EDGE`, `RETRYCHAIN_HOP2`, `RETRYCHAIN_HOP3`,
//! `RETRYCHAIN_HOP4` and `RETRYCHAIN_LEDGER` set (e.g. to a `docker compose up` deployment),
//! [`Chain::deployment`] uses those services instead of spawning, one test at a time. Their
//! admin ports are `RETRYCHAIN_EDGE_ADMIN` … `RETRYCHAIN_LEDGER_ADMIN` when set, else each
//! public port + 1000 (the default).

#![allow(dead_code, missing_docs, clippy::unwrap_used)]

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, OnceLock, mpsc},
    time::Duration,
};

use retrychain_proto::v1::{
    ChargeReply, ChargeRequest, Faults, GetAccountRequest, GetStatsRequest, ResetStatsRequest,
    Stats, control_client::ControlClient, payments_client::PaymentsClient,
};
use tonic::{Request, Response, Status, metadata::MetadataValue, transport::Channel};

pub const NAMES: [&str; 5] = ["edge", "hop2", "hop3", "hop4", "ledger"];
pub const EDGE: usize = 0;
pub const LEDGER: usize = 4;

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

/// How to start a chain.
#[derive(Debug, Clone)]
pub struct Options {
    /// Flags for all five services.
    pub all: Vec<String>,
    /// Flags for the edge only.
    pub edge: Vec<String>,
    /// Flags for the ledger only.
    pub ledger: Vec<String>,
    /// Environment for all five (e.g. OTEL_* variables).
    pub env: Vec<(String, String)>,
}

impl Default for Options {
    /// The test deployment: edge-only, override allowed, faults allowed, quick backoff.
    fn default() -> Self {
        Self {
            all: args(&[
                "--fault-injection",
                "--allow-retry-mode-override",
                "--backoff-base-ms",
                "2",
                "--backoff-cap-ms",
                "20",
            ]),
            edge: Vec::new(),
            ledger: args(&["--db-pool-size", "8"]),
            env: Vec::new(),
        }
    }
}

pub fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// One running service process.
pub struct Service {
    pub name: String,
    /// Payments: `http://host:port`.
    pub addr: String,
    /// Control: `http://host:port`.
    pub admin: String,
    child: Option<Child>,
    log: Arc<Mutex<String>>,
    args: Vec<String>,
}

impl Service {
    /// Starts `retrychain <args>` and waits for its ready line (on stderr, in any log format).
    pub fn start(name: &str, args: Vec<String>, env: &[(&str, &str)]) -> Service {
        let mut command = Command::new(env!("CARGO_BIN_EXE_retrychain"));
        command
            .args(&args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env_remove("DATABASE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("spawning retrychain");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel::<retrychain_node::ReadyAddrs>();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let log = Arc::clone(&log);
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if let Some(ready) = retrychain_node::ReadyAddrs::parse(&line) {
                        let _ = tx.send(ready);
                    }
                    let mut log = log.lock().unwrap();
                    log.push_str(&line);
                    log.push('\n');
                }
            });
        }
        let ready = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(ready) => ready,
            Err(_) => {
                let _ = child.kill();
                panic!("{name} did not start; its output:\n{}", log.lock().unwrap());
            }
        };
        Service {
            name: name.to_owned(),
            addr: format!("http://{}", ready.public),
            admin: format!("http://{}", ready.admin),
            child: Some(child),
            log,
            args,
        }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGKILL: no shutdown, no clean-up — a crash.
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then wait for the process to exit; returns its exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        for _ in 0..100 {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        child.wait().ok()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.crash();
        if std::thread::panicking() || std::env::var_os("TEST_LOG").is_some() {
            eprintln!("----- {} log -----\n{}", self.name, self.log());
        }
    }
}

/// Five services, edge first, or an external deployment.
pub struct Chain {
    /// Their Payments addresses, edge first.
    pub addrs: Vec<String>,
    /// Their Control (admin) addresses, edge first.
    pub admins: Vec<String>,
    /// The processes, when spawned here (edge first).
    pub services: Vec<Service>,
    /// The ledger's database, when spawned here.
    pub database_url: Option<String>,
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
    /// A chain with `options`, spawned here, bottom-up, on a fresh database.
    pub async fn spawn(options: Options) -> Chain {
        Chain::spawn_on(options, database().await)
    }

    /// A chain with `options` whose ledger uses the database at `database_url`.
    pub fn spawn_on(options: Options, database_url: String) -> Chain {
        let mut services: Vec<Service> = Vec::new();
        let mut downstream = String::new();
        for (i, name) in NAMES.iter().enumerate().rev() {
            let mut args = match i {
                LEDGER => args(&["ledger"]),
                EDGE => args(&["edge"]),
                _ => args(&["relay"]),
            };
            args.extend([
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--name".into(),
                name.to_string(),
            ]);
            if i != LEDGER {
                args.extend(["--downstream".into(), downstream.clone()]);
            }
            args.extend(options.all.iter().cloned());
            match i {
                EDGE => args.extend(options.edge.iter().cloned()),
                LEDGER => args.extend(options.ledger.iter().cloned()),
                _ => {}
            }
            let mut env: Vec<(&str, &str)> = options
                .env
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            if i == LEDGER {
                env.push(("DATABASE_URL", database_url.as_str()));
            }
            let service = Service::start(name, args, &env);
            downstream = service.addr.clone();
            services.insert(0, service);
        }
        Chain {
            addrs: services.iter().map(|s| s.addr.clone()).collect(),
            admins: services.iter().map(|s| s.admin.clone()).collect(),
            services,
            database_url: Some(database_url),
            _external: None,
        }
    }

    /// The deployment under test: the external one named by RETRYCHAIN_EDGE … _LEDGER when
    /// set (faults cleared and counters zeroed first, one test at a time), else a chain
    /// spawned here with the default options. Such a deployment must allow fault injection
    /// and the retry-mode override, as `docker compose` and `retrychain up` do.
    pub async fn deployment() -> Chain {
        static LOCK: OnceLock<Arc<tokio::sync::Mutex<()>>> = OnceLock::new();
        let external: Option<Vec<String>> = EXTERNAL_VARS
            .iter()
            .map(|v| std::env::var(v).ok())
            .collect();
        let Some(addrs) = external else {
            return Chain::spawn(Options::default()).await;
        };
        let guard = Arc::clone(LOCK.get_or_init(Default::default))
            .lock_owned()
            .await;
        let admins = EXTERNAL_VARS
            .iter()
            .zip(&addrs)
            .map(|(var, addr)| {
                std::env::var(format!("{var}_ADMIN")).unwrap_or_else(|_| admin_of(addr))
            })
            .collect();
        let chain = Chain {
            addrs,
            admins,
            services: Vec::new(),
            database_url: None,
            _external: Some(guard),
        };
        for i in 0..5 {
            chain.set_faults(i, Faults::default()).await;
        }
        chain.reset_stats().await;
        chain
    }

    /// Whether this chain's processes are ours (false for an external deployment).
    pub fn is_local(&self) -> bool {
        !self.services.is_empty()
    }

    pub async fn channel(&self, i: usize) -> Channel {
        connect(&self.addrs[i]).await
    }

    pub async fn admin_channel(&self, i: usize) -> Channel {
        connect(&self.admins[i]).await
    }

    pub async fn payments(&self, i: usize) -> PaymentsClient<Channel> {
        PaymentsClient::new(self.channel(i).await)
    }

    pub async fn edge(&self) -> PaymentsClient<Channel> {
        self.payments(EDGE).await
    }

    /// Control on service `i`'s admin port.
    pub async fn control(&self, i: usize) -> ControlClient<Channel> {
        ControlClient::new(self.admin_channel(i).await)
    }

    pub async fn stats(&self, i: usize) -> Stats {
        self.control(i)
            .await
            .get_stats(GetStatsRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn all_stats(&self) -> Vec<Stats> {
        let mut all = Vec::new();
        for i in 0..5 {
            all.push(self.stats(i).await);
        }
        all
    }

    pub async fn reset_stats(&self) {
        for i in 0..5 {
            self.control(i)
                .await
                .reset_stats(ResetStatsRequest {})
                .await
                .unwrap();
        }
    }

    pub async fn set_faults(&self, i: usize, faults: Faults) -> Faults {
        self.control(i)
            .await
            .set_faults(faults)
            .await
            .unwrap()
            .into_inner()
    }

    pub fn log(&self, i: usize) -> String {
        self.services[i].log()
    }

    /// One Charge of 500 cents for a fresh account through the edge, with no key (the edge
    /// makes one), a 10 s deadline and `metadata`.
    pub async fn charge_new_account(
        &self,
        metadata: &[(&'static str, &str)],
    ) -> Result<Response<ChargeReply>, Status> {
        self.edge()
            .await
            .charge(charge(
                &new_account(),
                500,
                None,
                Duration::from_secs(10),
                metadata,
            ))
            .await
    }

    /// Makes the ledger's processor fail every call, UNAVAILABLE: the outage that retries
    /// multiply.
    pub async fn fail_processor(&self) {
        self.set_faults(
            LEDGER,
            Faults {
                fail_rate: 1.0,
                ..faults()
            },
        )
        .await;
    }

    /// The ledger's balance and charge count for `account`, read through the edge.
    pub async fn account(&self, account: &str) -> Option<(i64, i64)> {
        match self
            .edge()
            .await
            .get_account(GetAccountRequest {
                account_id: account.into(),
            })
            .await
        {
            Ok(r) => Some((r.get_ref().balance_cents, r.get_ref().charges)),
            Err(s) if s.code() == tonic::Code::NotFound => None,
            Err(s) => panic!("GetAccount: {s:?}"),
        }
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

/// A ledger alone, on its own database, with fault injection on.
pub async fn spawn_ledger(extra: &[&str]) -> (Service, String) {
    let url = database().await;
    (spawn_ledger_on(&url, extra), url)
}

/// A ledger alone on the database at `url`, with fault injection on.
pub fn spawn_ledger_on(url: &str, extra: &[&str]) -> Service {
    let mut list = args(&[
        "ledger",
        "--listen",
        "127.0.0.1:0",
        "--fault-injection",
        "--allow-retry-mode-override",
    ]);
    if !extra.contains(&"--db-pool-size") {
        list.extend(args(&["--db-pool-size", "60"]));
    }
    list.extend(args(extra));
    Service::start("ledger", list, &[("DATABASE_URL", url)])
}

/// Row counts of the ledger's three tables: (accounts, charges, keys).
pub async fn row_counts(database_url: &str) -> (i64, i64, i64) {
    let pool = sqlx::PgPool::connect(database_url).await.unwrap();
    let mut counts = Vec::new();
    for table in ["accounts", "charges", "idempotency_keys"] {
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

pub async fn connect(addr: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(addr.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"))
}

impl Service {
    /// Starts this service again with the same flags on the same ports (after a crash).
    pub fn restart(&mut self, env: &[(&str, &str)]) {
        let mut args = self.args.clone();
        for (flag, addr) in [("--listen", &self.addr), ("--admin-listen", &self.admin)] {
            let host_port = host_port(addr);
            match args.iter().position(|a| a == flag) {
                Some(i) => args[i + 1] = host_port,
                None => args.extend([flag.to_owned(), host_port]),
            }
        }
        self.crash();
        let fresh = Service::start(&self.name, args, env);
        self.child = fresh_child(fresh, &mut self.log);
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` (e.g. "STOP", "CONT", "KILL") to the process.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the service runs");
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{signal} {pid}");
    }
}

/// The default admin address of a service at `addr`: its port + 1000.
pub fn admin_of(addr: &str) -> String {
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    let port: u16 = port.trim_end_matches('/').parse().expect("port");
    format!("{host}:{}", port + 1000)
}

fn fresh_child(mut fresh: Service, log: &mut Arc<Mutex<String>>) -> Option<Child> {
    *log = Arc::clone(&fresh.log);
    fresh.child.take()
}

/// `GET /metrics` on an admin address (`http://host:port`), over plain HTTP/1.1: the
/// Prometheus text.
pub fn scrape_metrics(admin: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(host_port(admin)).unwrap();
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        host_port(admin)
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
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

/// `host:port` of an `http://host:port` address.
pub fn host_port(addr: &str) -> String {
    addr.trim_start_matches("http://").to_owned()
}

/// Runs `retrychain <args>` (a subcommand with `--json`) off the runtime's thread, asserts
/// it succeeded, and returns the JSON object it printed.
pub async fn retrychain_json(args: Vec<String>) -> serde_json::Value {
    let output = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_retrychain"))
            .args(&args)
            .output()
    })
    .await
    .unwrap()
    .expect("run retrychain");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("one JSON object on stdout")
}
