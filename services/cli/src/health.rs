//! `retrychain health`: the container health check.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// Flags of `health`.
#[derive(Debug, Clone, Args)]
pub struct HealthArgs {
    /// The service to ask, e.g. http://127.0.0.1:50051.
    #[arg(
        long,
        env = "RETRYCHAIN_HEALTH_ADDR",
        default_value = "http://127.0.0.1:50051"
    )]
    pub addr: String,
    /// Give up after this many ms.
    #[arg(long, default_value_t = 2000, env = "RETRYCHAIN_HEALTH_TIMEOUT_MS")]
    pub timeout_ms: u64,
}

/// Whether the service at `addr` reports SERVING for the whole server ("").
pub async fn check(args: &HealthArgs) -> anyhow::Result<bool> {
    let timeout = Duration::from_millis(args.timeout_ms);
    let channel = tonic::transport::Endpoint::from_shared(args.addr.clone())
        .with_context(|| format!("address {:?}", args.addr))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect()
        .await
        .with_context(|| format!("connecting to {}", args.addr))?;
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .context("health check")?;
    Ok(response.into_inner().status == ServingStatus::Serving as i32)
}
