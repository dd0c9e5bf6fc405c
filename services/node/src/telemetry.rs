//! Logging: one subscriber per process, text for people or JSON for machines.
//!
//! Every Payments log line sits inside the `rpc` span, whose fields carry the service, the
//! trace id and the idempotency key; both formats print them on each line, so
//! `grep <trace-id>` over five services' logs shows a request's whole path.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines with span fields.
    Text,
    /// One JSON object per line, with the current span's fields.
    Json,
}

/// Installs the global subscriber. `RUST_LOG` overrides the default level (`info`).
/// Safe to call more than once: later calls change nothing.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stdout);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stdout().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
}
