//! What every Payments handler does first and last: count the request, take its deadline
//! and trace context, open the span its log lines belong to, and log one line with the
//! outcome.

use std::{sync::atomic::Ordering, time::Duration};

use resilience::{Deadline, IncomingDeadline};
use tokio::time::Instant;
use tonic::{Request, Response, Status, metadata::MetadataValue};
use tracing::{Instrument, Span, field};

use crate::{
    Node, TraceContext,
    metadata::{TRACE_ID, TRACEPARENT},
    stats::Counters,
};

/// One Payments call in progress at one service.
#[derive(Debug)]
pub struct RpcScope {
    /// When the caller stops waiting.
    pub deadline: Deadline,
    /// The `grpc-timeout` received, or the default applied.
    pub timeout: Duration,
    /// This request's trace.
    pub trace: TraceContext,
    /// The span every log line of this call belongs to; the handler records `key` in it
    /// once it has parsed (or, at the edge, made) the idempotency key.
    pub span: Span,
    /// When the call arrived.
    started: Instant,
}

impl RpcScope {
    /// Starts the scope of a call to `method` on `node`.
    pub fn begin<T>(node: &Node, method: &'static str, request: &Request<T>) -> Self {
        Counters::bump(&node.counters.requests_received);
        let incoming = request
            .extensions()
            .get::<IncomingDeadline>()
            .copied()
            .unwrap_or_else(|| {
                // Only reachable without the server stack (the DeadlineLayer is in it).
                let timeout = node.default_deadline;
                IncomingDeadline {
                    deadline: Deadline::after(timeout),
                    received: None,
                    timeout,
                }
            });
        node.counters
            .last_incoming_timeout_ms
            .store(incoming.timeout.as_millis() as u64, Ordering::Relaxed);
        let metadata = request.metadata();
        let text = |key: &str| metadata.get(key).and_then(|v| v.to_str().ok());
        let trace = TraceContext::continue_or_start(text(TRACEPARENT));
        let attempt = text(resilience::retry::PREVIOUS_ATTEMPTS_HEADER)
            .and_then(|v| v.parse::<u32>().ok())
            .map_or(1, |previous| previous.saturating_add(1));
        let span = tracing::info_span!(
            "rpc",
            service = %node.name,
            method,
            trace_id = %trace.trace_id,
            key = field::Empty,
            attempt,
            deadline_ms = incoming.timeout.as_millis() as u64,
        );
        Self {
            deadline: incoming.deadline,
            timeout: incoming.timeout,
            trace,
            span,
            started: Instant::now(),
        }
    }

    /// Runs the handler body inside this call's span, then logs the outcome and stamps the
    /// trace id on the reply or the failure.
    pub async fn run<T, F>(&self, body: F) -> Result<Response<T>, Status>
    where
        F: Future<Output = Result<Response<T>, Status>>,
    {
        let span = self.span.clone();
        async move {
            let result = body.await;
            let elapsed_ms = self.started.elapsed().as_secs_f64() * 1e3;
            let trace_id = MetadataValue::try_from(self.trace.trace_id.as_str()).ok();
            match result {
                Ok(mut response) => {
                    tracing::info!(code = "OK", elapsed_ms, "rpc done");
                    if let Some(value) = trace_id {
                        response.metadata_mut().insert(TRACE_ID, value);
                    }
                    Ok(response)
                }
                Err(mut status) => {
                    tracing::info!(
                        code = ?status.code(),
                        elapsed_ms,
                        message = status.message(),
                        remaining_ms = self.deadline.remaining().as_millis() as u64,
                        "rpc failed"
                    );
                    if let Some(value) = trace_id {
                        status.metadata_mut().insert(TRACE_ID, value);
                    }
                    Err(status)
                }
            }
        }
        .instrument(span)
        .await
    }
}
