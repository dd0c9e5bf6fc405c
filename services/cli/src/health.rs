//! `retrychain health`: the container health check.

use std::time::Duration;

use crate::config::HealthArgs;

/// Whether the service at `args.addr` reports SERVING for the whole server ("").
pub async fn check(args: &HealthArgs) -> anyhow::Result<bool> {
    retrychain_harness::serving(&args.addr, Duration::from_millis(args.timeout_ms)).await
}
