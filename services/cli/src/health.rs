//! `retrychain health`: the container health check.

use std::time::Duration;

use anyhow::Context;

use crate::config::HealthArgs;

/// Whether the service at `args.addr` reports SERVING for the whole server (""). With
/// `--tls-dir` (in a container, the service's own `RETRYCHAIN_TLS_DIR`), the check is made
/// over TLS as the service itself, to itself: its certificate presented, the server
/// required to have the identity that certificate names.
pub async fn check(args: &HealthArgs) -> anyhow::Result<bool> {
    let timeout = Duration::from_millis(args.timeout_ms);
    match &args.tls_dir {
        None => retrychain_harness::serving(&args.addr, timeout).await,
        Some(dir) => {
            let files = retrychain_tls::TlsFiles::in_dir(dir);
            let tls = retrychain_tls::Tls::load(files, retrychain_tls::ClientAuth::Optional)
                .context("--tls-dir")?;
            let itself = tls.identity();
            retrychain_harness::serving_tls(&args.addr, timeout, tls, itself).await
        }
    }
}
