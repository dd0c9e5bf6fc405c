//! The server stack every node runs: Payments and Control on one port, with health and
//! reflection, behind the deadline layer.

use std::{sync::Arc, time::Duration};

use resilience::DeadlineLayer;
use retrychain_proto::{
    FILE_DESCRIPTOR_SET,
    v1::{
        control_server::ControlServer,
        payments_server::{Payments, PaymentsServer},
    },
};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Server;
use tonic_health::ServingStatus;

use crate::{Node, control::ControlService};

/// What a service prints on stderr, followed by its address, once it accepts calls.
pub const READY_PREFIX: &str = "retrychain ready: listening on ";

/// How long a stopping service waits for open connections to close.
pub const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// Why a node stopped serving with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The reflection service could not load our descriptor set.
    #[error("building the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The transport failed.
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves `payments` and the node's Control service on `listener` until `shutdown`
/// completes, then drains in-flight calls.
///
/// The stack, outermost first:
/// 1. `DeadlineLayer`: every request gets its deadline (or `node.default_deadline`); a
///    malformed `grpc-timeout` is INVALID_ARGUMENT; a spent one is DEADLINE_EXCEEDED,
///    answered `reserve` before tonic itself would answer CANCELLED.
/// 2. The services: health (for `retrychain health` and container checks), reflection v1
///    and v1alpha (grpcurl 1.8.6 speaks only v1alpha), Payments, Control.
pub async fn serve<P, F>(
    listener: TcpListener,
    node: Arc<Node>,
    payments: P,
    reserve: Duration,
    shutdown: F,
) -> Result<(), ServeError>
where
    P: Payments,
    F: Future<Output = ()> + Send,
{
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<PaymentsServer<P>>().await;
    health.set_serving::<ControlServer<ControlService>>().await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let address = listener
        .local_addr()
        .map_or_else(|_| "unknown".to_owned(), |a| a.to_string());
    tracing::info!(service = %node.name, addr = %address, "listening");
    // One plain line on stderr whatever the log format and level: `retrychain up`, the demo
    // and the tests read it to learn the address of a service started on port 0.
    eprintln!("{READY_PREFIX}{address}");
    let stopping = Arc::new(tokio::sync::Notify::new());
    let draining = {
        let health = health.clone();
        let stopping = Arc::clone(&stopping);
        async move {
            shutdown.await;
            tracing::info!("shutting down: draining in-flight calls");
            health
                .set_service_status("", ServingStatus::NotServing)
                .await;
            stopping.notify_one();
        }
    };
    // Draining waits for clients to close their connections; a client that never does must
    // not keep the process alive past the grace period.
    let grace = async {
        stopping.notified().await;
        tokio::time::sleep(DRAIN_GRACE).await;
    };
    let server = Server::builder()
        .layer(DeadlineLayer::new(node.default_deadline, reserve))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(PaymentsServer::new(payments))
        .add_service(ControlServer::new(ControlService::new(Arc::clone(&node))))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), draining);
    tokio::select! {
        served = server => served?,
        _ = grace => tracing::warn!(?DRAIN_GRACE, "connections still open after the grace period; stopping anyway"),
    }
    tracing::info!(service = %node.name, "stopped");
    Ok(())
}
