//! Starting one service from its flags: bind, build the node and its Payments service,
//! serve until told to stop. The binary's `edge`, `relay` and `ledger` and the harness's
//! in-process chains both come through [`start`].

use std::{net::SocketAddr, pin::Pin, sync::Arc, time::Duration};

use anyhow::Context;
use resilience::{AdaptiveThrottle, Balancer, Downstream, RetryBudget, ServiceConfig, Throttle};
use retrychain_hop::{Forwarding, Hop, HopSettings, Role};
use retrychain_ledger::{
    InFlight, KeyStore, Ledger, StoreOptions,
    processor::{ProcessorRecord, RecordOptions},
    run_completer, run_retention,
};
use retrychain_node::{
    Listeners, Node, NodeConfig, ReadyAddrs, ServeError, Statements, authz::ServerTls, decoding,
    default_admin_addr, serve, telemetry,
};
use retrychain_tls::{ClientAuth, Tls};

use crate::args::{HopArgs, InFlightArg, LedgerArgs, ServiceArgs, ServiceCommand, StandbyCopyArg};

/// A future this crate has already compiled: see [`start`]. Not `Send`: starting a ledger
/// holds sqlx's connection futures, whose `Send` the compiler cannot prove through a
/// trait object; nobody spawns a start (a runtime's `block_on` or an `.await` runs it).
pub type Serving<T> = Pin<Box<dyn Future<Output = anyhow::Result<T>>>>;

/// The runtime a service process runs on, as `--worker-threads` says: one thread on
/// tokio's current-thread scheduler, or the multi-thread scheduler with that many workers
/// (0: one per core).
///
/// One thread is the default because a forwarding service's CPU goes to handing work
/// between threads otherwise. On the multi-thread scheduler every call wakes tasks that
/// the other worker may steal, and each wake-up across threads is a futex and a context
/// switch. Measured on this machine (two cores shared by five services, Postgres and the
/// load), one relay forwarding at 32 in flight: about 49 µs of CPU a request with a worker
/// per core, 30–33 µs on one thread; the whole chain at 32 in flight, 561–671 µs of the
/// five services' CPU a charge against 382–524, and 8–16% more charges a second. An
/// `h2` forwarder with nothing on top, the floor under both, cost 30.2 µs and 18.2 µs
/// (docs/benchmarks.md, section 2). linkerd2-proxy makes the same choice when it is
/// given one core.
pub fn runtime(command: &ServiceCommand) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = match command.service().worker_threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        0 => tokio::runtime::Builder::new_multi_thread(),
        workers => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(workers);
            builder
        }
    };
    builder.enable_all().build()
}

/// Runs the service `command` describes as this process's only service: logging set up
/// from its flags, serving until Ctrl-C or SIGTERM. (Boxed here, as [`start`] is.)
pub fn run(command: ServiceCommand) -> Serving<()> {
    Box::pin(run_service(command))
}

async fn run_service(command: ServiceCommand) -> anyhow::Result<()> {
    let telemetry = telemetry::init(command.service().log_format.into(), &command.name());
    let served = async {
        let started = start(command, retrychain_node::shutdown_signal()).await?;
        // One plain line on stderr whatever the log format and level: `retrychain up`, the
        // experiments and the tests read it to learn the addresses of a process started
        // on port 0. Calls made from now on queue on the bound sockets until served.
        eprintln!("{}", started.addrs);
        started.serve().await
    }
    .await;
    // The last spans out while the runtime still runs (see `Telemetry::shutdown`).
    telemetry.shutdown().await;
    served
}

/// A service bound to its ports, its node built, ready to serve.
pub struct Started {
    /// Where it listens.
    pub addrs: ReadyAddrs,
    /// Serving until the shutdown future given to [`start`] completes.
    serving: Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>,
}

impl std::fmt::Debug for Started {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Started")
            .field("addrs", &self.addrs)
            .finish_non_exhaustive()
    }
}

impl Started {
    /// Serves until the shutdown future completes, then drains in-flight calls; the
    /// ledger's key purge runs alongside. Calls that arrive before this is polled wait in
    /// the sockets' queues.
    pub async fn serve(self) -> anyhow::Result<()> {
        self.serving.await
    }
}

/// Binds the service `command` describes and builds it (the ledger connects to Postgres and
/// migrates first); [`Started::serve`] then serves it until `shutdown` completes. Logging
/// is the caller's: [`run`] sets it up for a process.
///
/// The future comes boxed, built by a function that is not generic: the whole service —
/// its server stack's state machines — is then compiled once, in this crate. Returned
/// unboxed, it would be compiled again in every crate that starts a service (the binary,
/// the harness, the tests), since release builds share no generic code between crates.
pub fn start(
    command: ServiceCommand,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Serving<Started> {
    start_boxed(command, Box::pin(shutdown))
}

fn start_boxed(
    command: ServiceCommand,
    shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
) -> Serving<Started> {
    Box::pin(start_service(command, shutdown))
}

async fn start_service(
    command: ServiceCommand,
    shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
) -> anyhow::Result<Started> {
    let name = command.name();
    match command {
        ServiceCommand::Edge(args) => hop(args, Role::Edge, name, shutdown).await,
        ServiceCommand::Relay(args) => hop(args, Role::Relay, name, shutdown).await,
        ServiceCommand::Ledger(args) => ledger(args, name, shutdown).await,
    }
}

async fn hop(
    args: HopArgs,
    role: Role,
    name: String,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Started> {
    let service = &args.service;
    let edge = role == Role::Edge;
    let default_listen = if edge {
        "0.0.0.0:50051"
    } else {
        "0.0.0.0:50052"
    };
    let tls = server_tls(service, &name, edge)?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let downstream = match (&args.downstream, edge) {
        (Some(url), _) => url.clone(),
        (None, true) => format!("{scheme}://127.0.0.1:50052"),
        (None, false) => anyhow::bail!("a relay needs --downstream (or RETRYCHAIN_DOWNSTREAM)"),
    };
    let policies = Policies::from_args(service)?;
    let listeners = bind(service, default_listen).await?;
    // Only the edge retries under a throttle; elsewhere Stats reports 0 tokens.
    let budget = if edge {
        policies.throttle.clone()
    } else {
        None
    };
    // Replicas connect lazily: services may start in any order, and a downstream that is
    // not up yet is an UNAVAILABLE attempt like any other.
    let downstream = Downstream::parse(&downstream)?;
    let replicas = match &tls {
        Some(server) => {
            if let Downstream::Urls(urls) = &downstream {
                let plain = urls.iter().find(|url| !url.starts_with("https://"));
                anyhow::ensure!(
                    plain.is_none(),
                    "--downstream {}: with TLS every downstream URL is https://",
                    plain.map(String::as_str).unwrap_or_default()
                );
            }
            let expected = args.tls_downstream_identity(&name)?;
            let connector = retrychain_tls::Connector::new(server.tls.clone(), expected);
            Balancer::start_with_connector(
                downstream.clone(),
                args.balance(),
                resilience::balance::Connector::over_tcp(move |uri, tcp| {
                    connector.handshake(&uri, tcp)
                }),
            )
            .await
        }
        None => {
            if let Downstream::Urls(urls) = &downstream
                && let Some(secure) = urls.iter().find(|url| url.starts_with("https://"))
            {
                anyhow::bail!(
                    "--downstream {secure}: an https:// downstream needs this service's TLS material (--tls-dir, or --tls-cert, --tls-key and --tls-ca)"
                );
            }
            Balancer::start(downstream.clone(), args.balance()).await
        }
    };
    let callers = args.callers(edge, tls.is_some())?;
    if let Some(callers) = &callers {
        if let Some(tokens) = &callers.tokens {
            tokens.watch(TLS_WATCH_EVERY);
        }
        tracing::info!(
            require = callers.require,
            tokens = callers.tokens.is_some(),
            max_in_flight = callers.max_in_flight,
            "callers"
        );
    }
    // The edge states each call's caller, signed, for the ledger to check; a relay passes
    // the statement on.
    let statements = if edge && tls.is_some() {
        Statements::Sign
    } else {
        Statements::Off
    };
    let admission = service
        .admission(edge.then_some(args.door_wait_share))
        .map_err(admission_flags)?;
    let node = node(
        service,
        name,
        budget,
        admission,
        policies.config,
        tls,
        callers,
        statements,
        Served::Hop(replicas.clone()),
    )?;
    let hop = Hop::new(
        Arc::clone(&node),
        role,
        HopSettings {
            mode: service.retry_mode,
            margin: service.margin(),
            min_attempt: service.min_attempt(),
            per_try: args.per_try(),
            every_layer_per_try: args.every_layer_per_try(),
        },
        replicas.clone(),
    );
    tracing::info!(
        %downstream,
        replicas = ?replicas.replicas(),
        mode = %service.retry_mode.as_str(),
        "forwarding"
    );
    let addrs = listeners.addrs();
    let reserve = service.reserve();
    // The edge decodes each message (it validates and states it); a relay forwards it unread.
    let serving: Pin<Box<dyn Future<Output = Result<(), ServeError>> + Send>> = match role {
        Role::Edge => Box::pin(serve(listeners, node, decoding(hop), reserve, shutdown)),
        Role::Relay => Box::pin(serve(
            listeners,
            node,
            Forwarding::new(hop),
            reserve,
            shutdown,
        )),
    };
    Ok(Started {
        addrs,
        serving: Box::pin(async move { Ok(serving.await?) }),
    })
}

async fn ledger(
    args: LedgerArgs,
    name: String,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Started> {
    let service = &args.service;
    let policies = Policies::from_args(service)?;
    // A key must outlive every retry of its request: the retries of one request all happen
    // within its deadline, and no deadline is honoured past --max-deadline-ms.
    let max_deadline = Duration::from_millis(service.max_deadline_ms);
    anyhow::ensure!(
        args.key_retention >= max_deadline,
        "--key-retention {} is shorter than --max-deadline-ms {} ms: a retry that arrived \
         after its key was purged would charge again; keep keys at least as long as the \
         longest deadline (or lower --max-deadline-ms)",
        humantime::format_duration(args.key_retention),
        service.max_deadline_ms,
    );
    // Connect (and migrate) before listening: while the database is not there yet, callers
    // get a fast refusal instead of a connection that answers nothing.
    let store = KeyStore::connect(
        &args.database_url,
        StoreOptions {
            pool_size: args.db_pool_size,
            acquire_timeout: Duration::from_millis(args.db_acquire_timeout_ms),
            connect_timeout: Duration::from_millis(args.db_connect_timeout_ms),
            round_trip_timeout: Duration::from_millis(args.db_round_trip_timeout_ms),
            skip_key_claim: args.test_skip_key_claim,
            standby_copy: match args.standby_copy {
                StandbyCopyArg::Required => true,
                StandbyCopyArg::Off => false,
                StandbyCopyArg::Auto => {
                    retrychain_ledger::primary::Hosts::parse(&args.database_url)?.len() > 1
                }
            },
        },
    )
    .await?;
    // The simulated processor's own connections: a provider's database, not the key
    // store's; a quarter of the store's, as it sends one statement per call to the store's
    // three.
    let processor_record = ProcessorRecord::open(
        &args.database_url,
        RecordOptions {
            pool_size: (args.db_pool_size as usize / 4).max(2),
            acquire_timeout: Duration::from_millis(args.db_acquire_timeout_ms),
            connect_timeout: Duration::from_millis(args.db_connect_timeout_ms),
            round_trip_timeout: Duration::from_millis(args.db_round_trip_timeout_ms),
        },
    )
    .await?;
    let tls = server_tls(service, &name, false)?;
    let listeners = bind(service, "0.0.0.0:50055").await?;
    let statements = args.statements(tls.is_some())?;
    tracing::info!(?statements, "callers below the edge");
    let admission = service.admission(None).map_err(admission_flags)?;
    let node = node(
        service,
        name,
        None,
        admission,
        policies.config,
        tls,
        None,
        statements,
        Served::Ledger(Arc::new(store.clone())),
    )?;
    let in_flight = match args.in_flight {
        InFlightArg::Wait => InFlight::Wait,
        InFlightArg::Reject => InFlight::Reject,
    };
    let ledger = Ledger::new(
        Arc::clone(&node),
        store.clone(),
        processor_record.clone(),
        service.retry_mode,
        service.margin(),
        service.min_attempt(),
        in_flight,
    );
    // Purge a few times per retention window, at most once a minute.
    let every = (args.key_retention / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
    let retention = args.key_retention;
    tracing::info!(?retention, in_flight = ?args.in_flight, "ledger ready");
    let addrs = listeners.addrs();
    let completing = ledger.clone();
    let serving = serve(
        listeners,
        node,
        decoding(ledger),
        service.reserve(),
        shutdown,
    );
    Ok(Started {
        addrs,
        serving: Box::pin(async move {
            let purging = tokio::spawn(run_retention(store, processor_record, retention, every));
            let completer = tokio::spawn(run_completer(completing));
            let served = serving.await;
            purging.abort();
            completer.abort();
            Ok(served?)
        }),
    })
}

/// How a service retries, from its flags or, with `--service-config`, from that document:
/// parsed and validated once, here, and handed down as it is.
struct Policies {
    /// Per method: retry or hedging policy, and timeout. Every retrying layer of the
    /// service (a hop's plans, the ledger's processor) applies this one value.
    config: Arc<ServiceConfig>,
    /// The throttle of the edge's edge-only retries: the config's `retryThrottling` or
    /// `adaptiveThrottling`, else `--adaptive-throttling`, else the budget flags; `None`
    /// with `--no-budget` and none of those.
    throttle: Option<Arc<dyn Throttle>>,
}

impl Policies {
    fn from_args(service: &ServiceArgs) -> anyhow::Result<Self> {
        let config = match &service.service_config {
            None => service.retry_policy(),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading --service-config {}", path.display()))?;
                ServiceConfig::parse(&text)
                    .with_context(|| format!("--service-config {}", path.display()))?
            }
        };
        let max_deadline = Duration::from_millis(service.max_deadline_ms);
        for (i, method) in config.method_configs.iter().enumerate() {
            if let Some(timeout) = method.timeout {
                anyhow::ensure!(
                    timeout <= max_deadline,
                    "--service-config: methodConfig[{i}].timeout {timeout:?} is longer than --max-deadline-ms {}",
                    service.max_deadline_ms
                );
            }
        }
        anyhow::ensure!(
            service.adaptive_throttling_k.is_finite() && service.adaptive_throttling_k >= 1.0,
            "--adaptive-throttling-k must be at least 1 (below 1 it rejects a healthy service's calls), got {}",
            service.adaptive_throttling_k
        );
        // The document's throttle, else the flags': adaptive throttling, the budget, none.
        let throttle = config.throttle().or_else(|| {
            if service.adaptive_throttling {
                Some(Arc::new(AdaptiveThrottle::new(
                    service.adaptive_throttling_k,
                    Duration::from_millis(service.adaptive_throttling_window_ms),
                )) as Arc<dyn Throttle>)
            } else {
                (!service.no_budget).then(|| {
                    Arc::new(RetryBudget::new(
                        service.budget_tokens,
                        service.budget_refund,
                    )) as Arc<dyn Throttle>
                })
            }
        });
        Ok(Policies {
            config: Arc::new(config),
            throttle,
        })
    }
}

/// The service's TLS, from its flags: the material read (and watched for changes from now
/// on) and who may call. The edge asks callers for a certificate but does not require
/// one; every tier below requires one from the authorities it trusts.
fn server_tls(service: &ServiceArgs, name: &str, edge: bool) -> anyhow::Result<Option<ServerTls>> {
    let Some(files) = service.tls_files()? else {
        return Ok(None);
    };
    let client_auth = if edge {
        ClientAuth::Optional
    } else {
        ClientAuth::Required
    };
    let tls = Tls::load(files, client_auth).context("TLS")?;
    let accept = service.tls_accept(name, edge)?;
    tracing::info!(identity = %tls.identity(), ?accept, "TLS 1.3 on the public port and every downstream call");
    tls.watch(TLS_WATCH_EVERY);
    Ok(Some(ServerTls { tls, accept }))
}

/// How often a service looks for new TLS material.
const TLS_WATCH_EVERY: Duration = Duration::from_secs(1);

/// What a node serves from, made before it: a hop's replicas below, or the ledger's
/// store.
enum Served {
    /// A hop's balancer.
    Hop(Balancer),
    /// The ledger's store, as its database gauges.
    Ledger(Arc<dyn retrychain_node::metrics::DatabaseGauges>),
}

/// The admission flags' refusal, naming them.
fn admission_flags(error: resilience::admission::InvalidAdmission) -> anyhow::Error {
    anyhow::anyhow!("--min-concurrency / --initial-concurrency / --max-in-flight: {error}")
}

#[allow(clippy::too_many_arguments)] // one per part of a node, each made by its caller
fn node(
    service: &ServiceArgs,
    name: String,
    budget: Option<Arc<dyn Throttle>>,
    admission: resilience::AdmissionSettings,
    policy: Arc<ServiceConfig>,
    tls: Option<ServerTls>,
    callers: Option<retrychain_node::callers::CallersSettings>,
    statements: Statements,
    served: Served,
) -> anyhow::Result<Arc<Node>> {
    let (database, downstream) = match served {
        Served::Hop(balancer) => (None, Some(balancer)),
        Served::Ledger(database) => (Some(database), None),
    };
    Ok(Arc::new(Node::new(NodeConfig {
        name,
        fault_injection: service.fault_injection,
        default_deadline: Duration::from_millis(service.default_deadline_ms),
        policy,
        max_deadline: Duration::from_millis(service.max_deadline_ms),
        allow_retry_mode_override: service.allow_retry_mode_override,
        budget,
        connection_limits: retrychain_node::limits::ConnectionLimits {
            max_connections: service.max_connections as usize,
            max_per_peer: service.max_connections_per_peer as usize,
            ..Default::default()
        },
        admission,
        tls,
        callers,
        statements,
        database,
        downstream,
    })))
}

/// Binds the public address (`--listen`, else `default`) and the admin address
/// (`--admin-listen`, else the public port + 1000 on 127.0.0.1).
async fn bind(service: &ServiceArgs, default: &str) -> anyhow::Result<Listeners> {
    anyhow::ensure!(
        service.default_deadline_ms <= service.max_deadline_ms,
        "--default-deadline-ms {} is longer than --max-deadline-ms {}",
        service.default_deadline_ms,
        service.max_deadline_ms
    );
    let public: SocketAddr = match service.listen {
        Some(address) => address,
        None => default.parse().context("default listen address")?,
    };
    let admin = service
        .admin_listen
        .unwrap_or_else(|| default_admin_addr(public));
    Ok(Listeners::bind(public, admin).await?)
}
