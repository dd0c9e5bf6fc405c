//! The server stack every node runs: Payments on the public port, Control on the admin
//! port, both with health and reflection.
//!
//! Two listeners because Control steers the service (faults, counters) and must not be
//! reachable by whoever can reach Payments: the admin port binds to 127.0.0.1 by default,
//! and Control called on the public port is UNIMPLEMENTED like any unknown service.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use resilience::{AdmissionLayer, DeadlineLayer};
use retrychain_proto::{
    FILE_DESCRIPTOR_SET,
    v1::{
        control_server::ControlServer,
        payments_server::{Payments, PaymentsServer},
    },
};
use tokio::{net::TcpListener, sync::watch};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{
    service::{RecoverErrorLayer, Routes},
    transport::Server,
};
use tonic_health::{
    ServingStatus,
    pb::health_server::{Health, HealthServer},
};
use tower::ServiceBuilder;

use crate::{
    Node,
    authz::{Accept, AuthorizeLayer, PeerIdentity},
    callers::CallersLayer,
    control::ControlService,
    h2::{Dispatch, Http2Settings},
    limits,
};

const PAYMENTS: &str = <PaymentsServer<()> as tonic::server::NamedService>::NAME;
const CONTROL: &str = <ControlServer<ControlService> as tonic::server::NamedService>::NAME;

/// What a service process prints on stderr once its ports are bound (calls made from then
/// on are served), followed by [`ReadyAddrs`]'s `Display` form: `retrychain ready:
/// listening on 127.0.0.1:50051 admin 127.0.0.1:51051`. `retrychain-serve` prints it;
/// `retrychain-harness` reads it to find a process started on port 0.
pub const READY_PREFIX: &str = "retrychain ready: listening on ";

/// The largest Payments request accepted, encoded: a Charge is well under 1 KiB, so a
/// megabyte-sized one is an attack or a bug, refused (RESOURCE_EXHAUSTED, as gRPC's own
/// servers answer; see `limits::RequestDecodeFailures`) before it is decoded.
/// tonic's default would be 4 MiB.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// Concurrent streams (calls) per HTTP/2 connection; a client with more queues them. The
/// hops' own clients multiplex every call over one connection, so it is well above the
/// concurrency any test or benchmark here uses; an internet-facing edge lowers it.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 512;

/// HTTP/2 flow-control window per stream: room for the largest request
/// ([`MAX_REQUEST_BYTES`]) and its framing, not hyper's 1 MiB, so a stream that never
/// finishes its body holds little.
pub const STREAM_WINDOW: u32 = 128 * 1024;

/// HTTP/2 flow-control window per connection: what one connection's unread request bodies
/// may hold in all.
pub const CONNECTION_WINDOW: u32 = 1024 * 1024;

/// How often an HTTP/2 connection is pinged, so a peer that vanished (no FIN, no RST) is
/// noticed and its streams and buffers freed.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);

/// How long a ping may go unanswered before the connection is closed.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a stopping service waits for open connections to close.
pub const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// The two addresses a running service listens on, as its ready line names them; a service
/// started on port 0 is found this way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyAddrs {
    /// Payments, health and reflection.
    pub public: String,
    /// Control, health and reflection.
    pub admin: String,
}

impl ReadyAddrs {
    /// The addresses named by a ready line, or `None` if `line` is not one.
    pub fn parse(line: &str) -> Option<Self> {
        let rest = line.trim().strip_prefix(READY_PREFIX)?;
        let (public, admin) = rest.split_once(" admin ")?;
        Some(Self {
            public: public.trim().to_owned(),
            admin: admin.trim().to_owned(),
        })
    }
}

impl std::fmt::Display for ReadyAddrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{READY_PREFIX}{} admin {}", self.public, self.admin)
    }
}

/// The admin address used when `--admin-listen` is not given: the public address's host on
/// the loopback interface, port + 1000 (edge 50051 → 51051), or port 0 (any free port) when
/// the public port is 0 or too high to shift.
pub fn default_admin_addr(public: SocketAddr) -> SocketAddr {
    let port = match public.port() {
        0 => 0,
        port => port.checked_add(1000).unwrap_or(0),
    };
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// The two sockets a node serves on.
#[derive(Debug)]
pub struct Listeners {
    /// Payments, health, reflection.
    pub public: TcpListener,
    /// Control, health, reflection.
    pub admin: TcpListener,
}

impl Listeners {
    /// Binds both addresses; the error names the one that failed.
    pub async fn bind(public: SocketAddr, admin: SocketAddr) -> std::io::Result<Self> {
        let bind = |address: SocketAddr, what: &'static str| async move {
            TcpListener::bind(address).await.map_err(|error| {
                std::io::Error::new(error.kind(), format!("binding {what} {address}: {error}"))
            })
        };
        Ok(Self {
            public: bind(public, "the public address").await?,
            admin: bind(admin, "the admin address").await?,
        })
    }

    /// The bound addresses, as the ready line prints them.
    pub fn addrs(&self) -> ReadyAddrs {
        let show = |l: &TcpListener| {
            l.local_addr()
                .map_or_else(|_| "unknown".to_owned(), |a| a.to_string())
        };
        ReadyAddrs {
            public: show(&self.public),
            admin: show(&self.admin),
        }
    }
}

/// Why a node stopped serving with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The reflection service could not load our descriptor set.
    #[error("building the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The admin port's transport (tonic's server) failed.
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// A served `Payments`: tonic's generated server ([`decoding`] its messages), or a relay's
/// own forwarding them unread (`retrychain_hop::Forwarding`).
pub trait PaymentsService:
    tower::Service<
        http::Request<tonic::body::Body>,
        Response = http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + tonic::server::NamedService
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> PaymentsService for S where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// `payments` served with its messages decoded (the edge, the ledger), none over
/// [`MAX_REQUEST_BYTES`].
pub fn decoding<P: Payments>(payments: P) -> PaymentsServer<P> {
    PaymentsServer::new(payments).max_decoding_message_size(MAX_REQUEST_BYTES)
}

/// Serves `payments` on the public listener and the node's Control service on the admin
/// listener until `shutdown` completes, then drains in-flight calls on both.
///
/// The public stack (served on hyper directly, [`crate::h2`]), outermost first:
/// 1. tonic's `RecoverError`: a layer's refusal (a `Status` as its error) becomes the
///    gRPC answer.
/// 2. `DeadlineLayer`: every request gets its deadline (or `node.default_deadline`, or
///    its method's `timeout`), capped at `node.max_deadline`, read from its `grpc-timeout`
///    here once (`resilience::IncomingDeadline`, in its extensions for the layers below
///    and in the handler's task for the client layers of its downstream calls,
///    `resilience::propagate`); a malformed timeout is INVALID_ARGUMENT; the handler
///    answers DEADLINE_EXCEEDED `reserve` before the deadline, and a request whose body
///    never arrives is answered so by the layer.
/// 3. `Admission` (`resilience::admission`), before any other work: a Payments call that
///    could not be answered within its deadline (or `--latency-objective-ms`) at the
///    rate this service drains its calls now is answered UNAVAILABLE (overloaded, with a
///    pushback) at once — retries and hedges before first attempts, and at the edge
///    callers over their fair share ([`crate::callers::fair_key`]) before those under
///    it; health and reflection are not limited.
///    `Authorize` ([`crate::authz`]): over TLS, a Payments call from a caller the
///    service does not accept is UNAUTHENTICATED or PERMISSION_DENIED before any work.
///    `Identify` ([`crate::callers`], the edge only): the caller, from its bearer token or
///    certificate, written into `x-caller` for the chain; bad or missing credentials
///    UNAUTHENTICATED, a caller over its own limit RESOURCE_EXHAUSTED.
///    `MetadataLimit` ([`limits`]): RESOURCE_EXHAUSTED at once for too much metadata.
/// 4. [`Dispatch`]: Payments straight to its generated server; health (for `retrychain
///    health` and container checks), reflection v1 and v1alpha (grpcurl 1.8.6 speaks only
///    v1alpha) and UNIMPLEMENTED for anything else through tonic's router.
///
/// The admin stack: `GET /metrics` (Prometheus, HTTP/1.1), health, reflection, Control;
/// over TLS when the service has it, Control answering only the operator's identity
/// (PERMISSION_DENIED, or UNAUTHENTICATED without a certificate).
pub async fn serve<P, F>(
    listeners: Listeners,
    node: Arc<Node>,
    payments: P,
    reserve: Duration,
    shutdown: F,
) -> Result<(), ServeError>
where
    P: PaymentsService,
    F: Future<Output = ()> + Send,
{
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<P>().await;
    health.set_serving::<ControlServer<ControlService>>().await;

    let addrs = listeners.addrs();
    tracing::info!(service = %node.name, addr = %addrs.public, admin = %addrs.admin, "listening");

    // One shutdown signal, two servers: each waits on its own receiver.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let draining = {
        let health = health.clone();
        async move {
            shutdown.await;
            tracing::info!("shutting down: draining in-flight calls");
            health
                .set_service_status("", ServingStatus::NotServing)
                .await;
            let _ = stop_tx.send(true);
        }
    };
    // Draining waits for clients to close their connections; a client that never does must
    // not keep the process alive past the grace period.
    let grace = {
        let rx = stop_rx.clone();
        async move {
            stopped(rx).await;
            tokio::time::sleep(DRAIN_GRACE).await;
        }
    };

    let public = public_server(
        listeners.public,
        &node,
        health_service.clone(),
        payments,
        reserve,
        stopped(stop_rx.clone()),
    )?;
    let admin = admin_server(
        listeners.admin,
        Arc::clone(&node),
        health_service,
        stopped(stop_rx),
    )?;
    let both = async {
        let ((), admin, ()) = tokio::join!(public, admin, draining);
        admin
    };
    tokio::select! {
        served = both => served?,
        _ = grace => tracing::warn!(?DRAIN_GRACE, "connections still open after the grace period; stopping anyway"),
    }
    tracing::info!(service = %node.name, "stopped");
    Ok(())
}

/// The public server: Payments beside health and reflection, under the limits of a port
/// that faces untrusted clients and the deadline layer (see [`serve`]), served on hyper
/// directly ([`crate::h2`]).
fn public_server<P, H, F>(
    listener: TcpListener,
    node: &Arc<Node>,
    health: HealthServer<H>,
    payments: P,
    reserve: Duration,
    shutdown: F,
) -> Result<impl Future<Output = ()>, ServeError>
where
    P: PaymentsService,
    H: Health,
    F: Future<Output = ()> + Send,
{
    let others = Routes::new(health)
        .add_service(reflection_v1(&[PAYMENTS])?)
        .add_service(reflection_v1alpha(&[PAYMENTS])?)
        .prepare();
    let accept = Arc::new(
        node.tls
            .as_ref()
            .map_or(Accept::Anyone, |tls| tls.accept.clone()),
    );
    let deadlines = DeadlineLayer::new(node.default_deadline, reserve)
        .with_max(node.max_deadline)
        .with_method_timeouts(Arc::clone(&node.policy));
    let mut admission = AdmissionLayer::new(Arc::clone(&node.admission)).only_service(PAYMENTS);
    if node.callers.is_some() {
        // At the edge, callers' fair shares (credentials, else the connection).
        admission = admission.keyed_by(Arc::new(crate::callers::fair_key));
    }
    let service = ServiceBuilder::new()
        // A layer's refusal (a tonic Status as its error) becomes the gRPC answer.
        .layer(RecoverErrorLayer::new())
        // Every request's deadline, read once, from its arrival: what every layer below
        // and the handler know of it.
        .layer(deadlines)
        // Then, and cheaply: a call that could not be answered within its deadline is
        // refused at once, before its caller is authorised or its token verified (retries
        // first; at the edge, callers over their fair share first).
        .layer(admission)
        // Over TLS, a caller this service does not accept is refused before any work.
        .layer(AuthorizeLayer::new(accept, PAYMENTS))
        // At the edge: who the caller is (credentials refused here), and its own limit.
        .layer(CallersLayer::new(node.callers.clone(), PAYMENTS))
        // Too much metadata is refused too.
        .layer(tower::filter::FilterLayer::new(
            limits::MetadataLimit::check,
        ))
        // A message tonic could not read: over the size limit RESOURCE_EXHAUSTED, as
        // gRPC's own servers say; not the method's protobuf INVALID_ARGUMENT.
        .layer(tower::layer::layer_fn(limits::RequestDecodeFailures::new))
        .service(Dispatch::new(payments, others));
    Ok(crate::h2::serve_h2(
        limits::incoming(
            listener,
            node.connection_limits,
            limits::Refusal::of_port(node.tls.is_some()),
        ),
        service,
        Http2Settings {
            // HTTP/2 limits for a port that faces untrusted clients (docs/contract.md's table).
            max_concurrent_streams: MAX_STREAMS_PER_CONNECTION,
            max_header_list_size: limits::MAX_HEADER_LIST_BYTES,
            stream_window: STREAM_WINDOW,
            connection_window: CONNECTION_WINDOW,
            max_local_error_reset_streams: 1024,
            keepalive_interval: KEEPALIVE_INTERVAL,
            keepalive_timeout: KEEPALIVE_TIMEOUT,
        },
        node.tls.as_ref().map(|tls| tls.tls.clone()),
        shutdown,
    ))
}

/// The admin server: Control beside the same health service and reflection.
fn admin_server<H, F>(
    listener: TcpListener,
    node: Arc<Node>,
    health: HealthServer<H>,
    shutdown: F,
) -> Result<impl Future<Output = Result<(), tonic::transport::Error>>, ServeError>
where
    H: Health,
    F: Future<Output = ()> + Send,
{
    let tls = node.tls.as_ref().map(|tls| tls.tls.clone());
    // Over TLS, Control — which steers the service — answers the operator alone; /metrics,
    // health and reflection answer anyone who completes the handshake (a client
    // certificate is asked for there, not required).
    let accept = match tls {
        Some(_) => Accept::Only(vec![retrychain_tls::Identity::named(
            retrychain_tls::OPERATOR,
        )]),
        None => Accept::Anyone,
    };
    let control = ControlServer::with_interceptor(
        ControlService::new(Arc::clone(&node)),
        move |request: tonic::Request<()>| {
            accept.check(request.extensions().get::<PeerIdentity>())?;
            Ok(request)
        },
    );
    let router = Server::builder()
        // Prometheus scrapes over HTTP/1.1 on the same port: `GET /metrics`.
        .accept_http1(true)
        .layer(crate::metrics::MetricsLayer::new(crate::metrics::registry(
            &node,
        )))
        .add_service(health)
        .add_service(reflection_v1(&[CONTROL])?)
        .add_service(reflection_v1alpha(&[CONTROL])?)
        .add_service(control);
    Ok(async move {
        match tls {
            None => {
                router
                    .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
                    .await
            }
            Some(tls) => {
                router
                    .serve_with_incoming_shutdown(
                        crate::admin_tls::incoming(listener, tls),
                        shutdown,
                    )
                    .await
            }
        }
    })
}

/// Reflection that lists `services` (and health) only: one descriptor set holds both
/// Payments and Control, and each listener must advertise just what it serves.
fn reflection(services: &[&str]) -> tonic_reflection::server::Builder<'static> {
    let mut builder = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name(HEALTH);
    for service in services {
        builder = builder.with_service_name(*service);
    }
    builder
}

fn reflection_v1(
    services: &[&str],
) -> Result<
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    ServeError,
> {
    Ok(reflection(services).build_v1()?)
}

fn reflection_v1alpha(
    services: &[&str],
) -> Result<
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
    ServeError,
> {
    Ok(reflection(services).build_v1alpha()?)
}

const HEALTH: &str = "grpc.health.v1.Health";

/// Completes on Ctrl-C or SIGTERM (what `docker stop` and `retrychain up` send).
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_lines_round_trip() {
        let addrs = ReadyAddrs {
            public: "127.0.0.1:50051".into(),
            admin: "127.0.0.1:51051".into(),
        };
        assert_eq!(ReadyAddrs::parse(&addrs.to_string()), Some(addrs));
        assert_eq!(ReadyAddrs::parse("INFO listening"), None);
    }

    #[test]
    fn the_admin_port_is_the_public_port_plus_1000_on_loopback() {
        let admin = default_admin_addr("0.0.0.0:50051".parse().expect("addr"));
        assert_eq!(admin, "127.0.0.1:51051".parse().expect("addr"));
        let any = default_admin_addr("127.0.0.1:0".parse().expect("addr"));
        assert_eq!(any.port(), 0);
        let high = default_admin_addr("127.0.0.1:65000".parse().expect("addr"));
        assert_eq!(high.port(), 0);
    }
}
