//! Logging, and traces for Jaeger or any OpenTelemetry collector.
//!
//! Every Payments log line sits inside the `rpc` span, whose fields carry the service, the
//! trace id and the idempotency key; both log formats print them on each line, so
//! `grep <trace-id>` over five services' logs shows a request's whole path.
//!
//! With `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, the same
//! spans also go to that collector over OTLP/gRPC: each service's `rpc` span is a server
//! span whose parent is the caller's `traceparent`, each downstream attempt a client span
//! (attempt number, why it was retried, the backoff waited, the budget's tokens, the
//! deadline sent, the outcome), and the ledger adds the key claim and the commit. The
//! standard variables apply: `OTEL_SERVICE_NAME` (default: the service's `--name`),
//! `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`, `OTEL_BSP_SCHEDULE_DELAY`. Unset, no
//! exporter and no OpenTelemetry layer exist: tracing costs what it did before.

use std::{
    io::IsTerminal,
    sync::atomic::{AtomicBool, Ordering},
};

use opentelemetry::{
    propagation::{Extractor, Injector, TextMapPropagator},
    trace::{TraceContextExt, TracerProvider as _},
};
use opentelemetry_sdk::{propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tonic::metadata::MetadataMap;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{EnvFilter, Layer, layer::SubscriberExt, util::SubscriberInitExt};

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines with span fields.
    Text,
    /// One JSON object per line, flat: the service, the level, the message, the event's
    /// fields and those of the spans it is in (a request's trace id and key among them),
    /// as top-level keys, for `jq`.
    Json,
}

/// Whether spans go to an OpenTelemetry collector (set once, by [`init`]).
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether this process exports traces over OTLP.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Flushes and stops the trace exporter when dropped (at the end of `main`), so the
/// spans of the last requests are not lost.
#[derive(Debug)]
#[must_use = "dropping the guard stops the trace exporter"]
pub struct Telemetry {
    /// The exporter's provider, when exporting.
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("flushing traces: {error}");
        }
    }
}

/// Installs the global subscriber: logs in `format` (`RUST_LOG` overrides the default level,
/// `info`) and, when the OTLP variables say so, trace export as `service` (unless
/// `OTEL_SERVICE_NAME` names it). Must run inside the Tokio runtime. Safe to call more than
/// once: later calls change nothing.
pub fn init(format: LogFormat, service: &str) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_writer(std::io::stdout);
    let fmt = match format {
        LogFormat::Text => fmt
            .with_ansi(std::io::stdout().is_terminal())
            .fmt_fields(WithoutOtelFields)
            .boxed(),
        LogFormat::Json => fmt
            .event_format(JsonLines {
                service: service.to_owned(),
            })
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .boxed(),
    };
    let provider = otlp_requested().then(|| tracer_provider(service)).flatten();
    let otel = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("retrychain"))
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
    });
    let installed = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel)
        .try_init()
        .is_ok();
    if installed && provider.is_some() {
        EXPORTING.store(true, Ordering::Relaxed);
    }
    Telemetry {
        provider: if installed { provider } else { None },
    }
}

/// The JSON log line: one flat object per event — `timestamp`, `level`, `service`,
/// `message`, then the fields of the spans the event is in (outermost first, an inner
/// span's field replacing an outer one's) and the event's own. Numbers stay numbers (a
/// duration in ms rounded to the microsecond), and the `otel.*` fields, which only steer
/// the OpenTelemetry layer, are left out. tracing-subscriber's own JSON nests span fields
/// under `span`, where `jq .trace_id` does not find them.
#[derive(Debug, Clone)]
struct JsonLines {
    /// Whose log this is, on every line (a request's span names it too).
    service: String,
}

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for JsonLines
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        use serde_json::Value;
        use tracing_subscriber::fmt::time::FormatTime;
        let mut line = serde_json::Map::new();
        let mut timestamp = String::new();
        tracing_subscriber::fmt::time::SystemTime.format_time(
            &mut tracing_subscriber::fmt::format::Writer::new(&mut timestamp),
        )?;
        line.insert("timestamp".into(), Value::String(timestamp));
        line.insert(
            "level".into(),
            Value::String(event.metadata().level().as_str().to_owned()),
        );
        line.insert("service".into(), Value::String(self.service.clone()));
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let extensions = span.extensions();
                let Some(fields) = extensions.get::<tracing_subscriber::fmt::FormattedFields<N>>()
                else {
                    continue;
                };
                if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(fields) {
                    for (name, value) in fields {
                        if !name.starts_with("otel.") {
                            line.insert(name, value);
                        }
                    }
                }
            }
        }
        event.record(&mut JsonFieldsOf(&mut line));
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// Records an event's fields into a JSON object, as JSON numbers, booleans and strings.
struct JsonFieldsOf<'a>(&'a mut serde_json::Map<String, serde_json::Value>);

impl tracing::field::Visit for JsonFieldsOf<'_> {
    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        // Milliseconds to the microsecond: the rest is noise, and long in every line.
        let value = if field.name().ends_with("_ms") {
            (value * 1e3).round() / 1e3
        } else {
            value
        };
        self.0
            .insert(field.name().to_owned(), serde_json::json!(value));
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.0.insert(field.name().to_owned(), value.into());
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.into());
    }

    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.0.insert(field.name().to_owned(), value.into());
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.into());
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if !field.name().starts_with("otel.") {
            self.0
                .insert(field.name().to_owned(), format!("{value:?}").into());
        }
    }
}

/// Span and event fields as `name=value`, as tracing-subscriber writes them, leaving out
/// the `otel.*` fields that only instruct the OpenTelemetry layer (span kind, name, status).
#[derive(Debug, Clone, Copy)]
struct WithoutOtelFields;

impl<'w> tracing_subscriber::fmt::FormatFields<'w> for WithoutOtelFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = FieldWriter {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }

    fn add_fields(
        &self,
        current: &'w mut tracing_subscriber::fmt::FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> std::fmt::Result {
        let mut added = String::new();
        self.format_fields(
            tracing_subscriber::fmt::format::Writer::new(&mut added),
            fields,
        )?;
        if added.is_empty() {
            return Ok(());
        }
        if !current.fields.is_empty() {
            current.fields.push(' ');
        }
        current.fields.push_str(&added);
        Ok(())
    }
}

struct FieldWriter<'w> {
    writer: tracing_subscriber::fmt::format::Writer<'w>,
    first: bool,
    result: std::fmt::Result,
}

impl tracing::field::Visit for FieldWriter<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"));
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if self.result.is_err() || field.name().starts_with("otel.") {
            return;
        }
        let separator = if self.first { "" } else { " " };
        self.first = false;
        self.result = if field.name() == "message" {
            write!(self.writer, "{separator}{value:?}")
        } else {
            write!(self.writer, "{separator}{field}={value:?}")
        };
    }
}

fn otlp_requested() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|var| std::env::var(var).is_ok_and(|v| !v.trim().is_empty()))
}

fn tracer_provider(service: &str) -> Option<SdkTracerProvider> {
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
    {
        Ok(exporter) => exporter,
        Err(error) => {
            eprintln!("OTLP trace export is off: {error}");
            return None;
        }
    };
    let name = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| service.to_owned());
    Some(
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name(name)
                    .build(),
            )
            .build(),
    )
}

/// Makes `span` (a server span) the child of the trace context in `metadata`'s
/// `traceparent`, and returns the trace id it belongs to — `None` when not exporting, or
/// when the span has no valid context.
pub fn continue_trace(span: &Span, metadata: &MetadataMap) -> Option<String> {
    if !exporting() {
        return None;
    }
    let parent = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
    let _ = span.set_parent(parent);
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context
        .is_valid()
        .then(|| span_context.trace_id().to_string())
}

/// The client layer that writes each outgoing call's trace context — the one place it
/// reaches the wire. Exporting, it is the current span's (placed below a retry layer, each
/// attempt's span is the parent of the server's); otherwise the [`TraceContext`] the
/// handler put in the call's extensions (this hop as the next one's parent), as a
/// [`TraceParent`](crate::metadata::TraceParent).
///
/// [`TraceContext`]: crate::TraceContext
#[derive(Debug, Clone, Copy, Default)]
pub struct InjectTraceLayer;

impl<S> tower::Layer<S> for InjectTraceLayer {
    type Service = InjectTrace<S>;

    fn layer(&self, inner: S) -> Self::Service {
        InjectTrace { inner }
    }
}

/// The service [`InjectTraceLayer`] makes.
#[derive(Debug, Clone)]
pub struct InjectTrace<S> {
    /// Where calls go.
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for InjectTrace<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let context = exporting().then(|| Span::current().context());
        match context {
            Some(context) if context.span().span_context().is_valid() => {
                TraceContextPropagator::new()
                    .inject_context(&context, &mut HeaderInjector(request.headers_mut()));
            }
            _ => {
                let traceparent = request
                    .extensions()
                    .get::<crate::metadata::TraceParent>()
                    .map(|value| value.0.clone());
                if let Some(traceparent) = traceparent {
                    request
                        .headers_mut()
                        .insert(resilience::wire::TRACEPARENT, traceparent);
                }
            }
        }
        self.inner.call(request)
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                tonic::metadata::KeyRef::Ascii(key) => Some(key.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::try_from(value),
        ) {
            self.0.insert(key, value);
        }
    }
}
