//! What every Payments handler does first and last: count the request, take its deadline
//! and trace context, open the span its log lines belong to, answer DEADLINE_EXCEEDED itself
//! when the deadline is about to pass, stamp the trace id (and, at the edge, the key) on
//! whatever it answers, and log one line with the outcome.

use std::{
    sync::{OnceLock, atomic::Ordering},
    time::Duration,
};

use resilience::{Deadline, IncomingDeadline, wire};
use tokio::time::Instant;
use tonic::{
    Request, Response, Status,
    metadata::{Ascii, MetadataKey, MetadataMap, MetadataValue},
};
use tracing::{Instrument, Span, field};

use retrychain_domain::{
    IdempotencyKey, TraceContext,
    metadata::{IDEMPOTENCY_KEY, TRACE_ID},
};

use crate::{Node, stats::Counters};

/// Writes a call's final line if its handler is dropped before it answered.
struct Unfinished<'a>(Option<&'a RpcScope>);

impl Unfinished<'_> {
    /// The call is answering: its line is the caller's to write.
    fn answered(&mut self) {
        self.0 = None;
    }
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let Some(scope) = self.0 {
            scope.log_cancelled();
        }
    }
}

/// One Payments call in progress at one service.
#[derive(Debug)]
pub struct RpcScope {
    /// When the caller stops waiting.
    pub deadline: Deadline,
    /// When this service must have answered: a little before `deadline`, so that its own
    /// DEADLINE_EXCEEDED reaches the caller before the caller's clock runs out.
    pub answer_by: Deadline,
    /// The timeout received, or the default applied.
    pub timeout: Duration,
    /// This request's trace.
    pub trace: TraceContext,
    /// Whether this request's spans go to the collector (exporting, and sampled).
    exported: bool,
    /// The attempts the caller says came before this one: above 0 when it is retrying.
    pub caller_previous_attempts: u32,
    /// The span every log line of this call belongs to; the handler records `key` in it
    /// once it has parsed (or, at the edge, made) the idempotency key.
    pub span: Span,
    /// The key to return in the `idempotency-key` response header, if the handler set one.
    echo_key: OnceLock<MetadataValue<Ascii>>,
    /// When the call arrived.
    started: Instant,
    /// The service's counters, for the call's outcome and latency.
    node: std::sync::Arc<Node>,
    /// `Charge` or `GetAccount`.
    method: &'static str,
}

impl RpcScope {
    /// Starts the scope of a call to `method` on `node`.
    pub fn begin<T>(
        node: &std::sync::Arc<Node>,
        method: &'static str,
        request: &Request<T>,
    ) -> Self {
        Counters::bump(&node.counters.requests_received);
        // This scope answers at `answer_by` itself (`run`): the server's deadline layer
        // need not keep a timer of its own for this request.
        let incoming = IncomingDeadline::guard().unwrap_or_else(|| {
            // Only reachable without the server stack (the DeadlineLayer is in it).
            let timeout = node.default_deadline;
            let deadline = Deadline::after(timeout);
            IncomingDeadline {
                deadline,
                received: None,
                timeout,
                answer_by: deadline,
            }
        });
        node.counters
            .last_incoming_timeout_ms
            .store(incoming.timeout.as_millis() as u64, Ordering::Relaxed);
        let metadata = request.metadata();
        let headers = metadata.as_ref();
        let traceparent = headers.get(&wire::names::TRACEPARENT);
        let mut trace = TraceContext::continue_or_start(traceparent.and_then(|v| v.to_str().ok()));
        let caller_previous_attempts = wire::previous_attempts(headers);
        let attempt = caller_previous_attempts.saturating_add(1);
        // Decided once, here: an unsampled request builds no OpenTelemetry data.
        let exported = crate::telemetry::sampled(
            trace.trace_id.as_str(),
            trace.parent_id.as_ref().map(|_| trace.sampled),
        );
        if crate::telemetry::exporting() {
            trace.sampled = exported;
        }
        let span = crate::telemetry::rpc_span(exported, || {
            tracing::info_span!(
                "rpc",
                otel.kind = "server",
                otel.name = %format_args!("{} {method}", node.name),
                otel.status_code = field::Empty,
                service = %node.name,
                method,
                trace_id = trace.trace_id.as_str(),
                key = field::Empty,
                attempt,
                deadline_ms = incoming.timeout.as_millis() as u64,
                code = field::Empty,
                replayed = field::Empty,
                charge_id = field::Empty,
                balance_cents = field::Empty,
            )
        });
        // Exported, the span continues the caller's trace (or starts it, with this id).
        if exported {
            crate::telemetry::continue_trace(&span, &trace, metadata);
        }
        Self {
            deadline: incoming.deadline,
            answer_by: incoming.answer_by,
            timeout: incoming.timeout,
            trace,
            exported,
            caller_previous_attempts,
            span,
            echo_key: OnceLock::new(),
            started: Instant::now(),
            node: std::sync::Arc::clone(node),
            method,
        }
    }

    /// Whether this request's spans go to the collector (exporting, and sampled).
    pub fn exported(&self) -> bool {
        self.exported
    }

    /// Records the request's key in the span.
    pub fn record_key(&self, key: &IdempotencyKey) {
        self.span.record("key", key.as_str());
    }

    /// Returns `key` to the caller in the `idempotency-key` header of the answer, success or
    /// failure — including a DEADLINE_EXCEEDED this scope answers after the body was cut
    /// short. The edge uses it: a client that sent no key learns the one its charge ran under.
    pub fn echo_key(&self, key: &IdempotencyKey) {
        if let Ok(value) = MetadataValue::try_from(key.as_str()) {
            let _ = self.echo_key.set(value);
        }
    }

    /// Runs the handler body inside this call's span until `answer_by` (then answers
    /// DEADLINE_EXCEEDED), logs the outcome, and stamps trace id and key on the answer.
    pub async fn run<T, F>(&self, body: F) -> Result<Response<T>, Status>
    where
        F: Future<Output = Result<Response<T>, Status>>,
    {
        let span = self.span.clone();
        async move {
            // The caller may go away (cancel, or its connection closes): this future is
            // then dropped mid-await, and the guard writes the call's one final line.
            let mut unfinished = Unfinished(Some(self));
            let result = match tokio::time::timeout_at(self.answer_by.instant(), body).await {
                Ok(result) => result,
                Err(_) => Err(Status::deadline_exceeded(format!(
                    "the deadline of {:?} ran out before an answer",
                    self.timeout
                ))),
            };
            unfinished.answered();
            let elapsed = self.started.elapsed().as_secs_f64();
            let elapsed_ms = elapsed * 1e3;
            let code = result
                .as_ref()
                .map_or_else(|s| s.code(), |_| tonic::Code::Ok);
            self.node.counters.call_finished(self.method, code, elapsed);
            let answer = match result {
                Ok(mut response) => {
                    tracing::info!(code = "OK", elapsed_ms, "rpc done");
                    self.stamp(response.metadata_mut());
                    Ok(response)
                }
                Err(mut status) => {
                    tracing::info!(
                        code = ?status.code(),
                        elapsed_ms,
                        error = status.message(),
                        remaining_ms = self.deadline.remaining().as_millis() as u64,
                        "rpc failed"
                    );
                    self.stamp(status.metadata_mut());
                    Err(status)
                }
            };
            self.record_outcome(code);
            answer
        }
        .instrument(span)
        .await
    }

    /// The outcome on the span, for the exported trace only, and after the line: the line
    /// has it as its own field, and a sampled request's line then reads as any other's.
    fn record_outcome(&self, code: tonic::Code) {
        if self.exported {
            self.span.record("code", wire::code_name(code));
            if code != tonic::Code::Ok {
                self.span.record("otel.status_code", "ERROR");
            }
        }
    }

    /// The call's one final line when the caller went away before an answer.
    fn log_cancelled(&self) {
        let elapsed = self.started.elapsed().as_secs_f64();
        self.node
            .counters
            .call_finished(self.method, tonic::Code::Cancelled, elapsed);
        self.span.in_scope(|| {
            tracing::info!(
                code = "CANCELLED",
                elapsed_ms = elapsed * 1e3,
                "rpc cancelled: the caller went away before an answer"
            );
        });
        self.record_outcome(tonic::Code::Cancelled);
    }

    fn stamp(&self, metadata: &mut MetadataMap) {
        // Both are new on every call: sent as literals, kept out of the HPACK table. The
        // names are static (a `&str` name is copied for every new entry).
        if let Ok(mut value) = MetadataValue::try_from(self.trace.trace_id.as_str()) {
            value.set_sensitive(true);
            metadata.insert(MetadataKey::from_static(TRACE_ID), value);
        }
        if let Some(key) = self.echo_key.get() {
            let mut key = key.clone();
            key.set_sensitive(true);
            metadata.insert(MetadataKey::from_static(IDEMPOTENCY_KEY), key);
        }
    }
}
