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
//!
//! **Sampling is decided once per request, before its first span** ([`Sampler`], the
//! standard samplers of `OTEL_TRACES_SAMPLER`, with the SDK's own trace-id-ratio
//! arithmetic so that every hop of a trace agrees). The OpenTelemetry layer's filter
//! admits a request's spans and events only when it was sampled, so an unsampled request
//! builds no OpenTelemetry data at all — at 1% sampling, 99% of requests cost what they
//! cost without export. A sampled request's spans carry the trace id its logs show, also
//! at the edge where the trace starts ([`ChainIds`]).

use std::{
    cell::Cell,
    io::IsTerminal,
    sync::{
        OnceLock,
        atomic::{AtomicBool, Ordering},
    },
};

use opentelemetry::{
    propagation::{Injector, TextMapPropagator},
    trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TracerProvider as _},
};
use opentelemetry_sdk::{
    propagation::TraceContextPropagator,
    trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider},
};
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

/// Which requests are traced: `OTEL_TRACES_SAMPLER` (and `_ARG`), read once by [`init`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    /// `parentbased_*`: a request whose caller sent a `traceparent` follows its sampled
    /// flag; only a new trace is decided by `root`.
    parent_based: bool,
    /// How a trace is decided when nobody decided before.
    root: Root,
}

/// The decision for a trace nobody decided yet.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Root {
    On,
    Off,
    /// Sampled when the trace id's low 64 bits, shifted right by one, fall below
    /// `ratio × 2^63` (the OpenTelemetry SDK's arithmetic, so every hop agrees).
    Ratio(f64),
}

/// The sampler in force (set by [`init`] when exporting).
static SAMPLER: OnceLock<Sampler> = OnceLock::new();

impl Sampler {
    /// The sampler `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` name, as the
    /// specification reads them: unset means `parentbased_always_on`; an unknown name is
    /// reported and read as unset; a missing or malformed ratio is 1.
    pub fn from_env() -> Self {
        let name = std::env::var("OTEL_TRACES_SAMPLER").unwrap_or_default();
        let arg = std::env::var("OTEL_TRACES_SAMPLER_ARG").ok();
        Self::parse(name.trim(), arg.as_deref())
    }

    fn parse(name: &str, arg: Option<&str>) -> Self {
        let ratio = || {
            let ratio = arg
                .and_then(|a| a.trim().parse::<f64>().ok())
                .filter(|r| (0.0..=1.0).contains(r))
                .unwrap_or(1.0);
            Root::Ratio(ratio)
        };
        let (parent_based, root) = match name {
            "always_on" => (false, Root::On),
            "always_off" => (false, Root::Off),
            "traceidratio" => (false, ratio()),
            "" | "parentbased_always_on" => (true, Root::On),
            "parentbased_always_off" => (true, Root::Off),
            "parentbased_traceidratio" => (true, ratio()),
            other => {
                eprintln!(
                    "OTEL_TRACES_SAMPLER={other} is not supported here; using parentbased_always_on"
                );
                (true, Root::On)
            }
        };
        Self { parent_based, root }
    }

    /// Whether the trace `trace_id` (32 hex digits) is sampled, given the caller's
    /// sampled flag if a `traceparent` came.
    pub fn decide(&self, trace_id: &str, caller_sampled: Option<bool>) -> bool {
        if self.parent_based
            && let Some(sampled) = caller_sampled
        {
            return sampled;
        }
        match self.root {
            Root::On => true,
            Root::Off => false,
            Root::Ratio(ratio) if ratio >= 1.0 => true,
            Root::Ratio(ratio) => {
                let low = u128::from_str_radix(trace_id, 16).unwrap_or(0) as u64;
                (low >> 1) < (ratio.max(0.0) * (1u64 << 63) as f64) as u64
            }
        }
    }
}

/// Whether the request whose trace context is `trace` has its spans exported: exporting,
/// and sampled by [`Sampler`]. `caller_sampled`: the caller's flag, if it sent one.
pub fn sampled(trace_id: &str, caller_sampled: Option<bool>) -> bool {
    exporting()
        && SAMPLER
            .get()
            .is_some_and(|sampler| sampler.decide(trace_id, caller_sampled))
}

thread_local! {
    /// Set while a sampled request's `rpc` span is created: the OpenTelemetry layer's
    /// filter admits it (and so everything inside it) only then.
    static SAMPLING_RPC: Cell<bool> = const { Cell::new(false) };
    /// The trace id a new root span must take ([`ChainIds`]), while it starts.
    static ROOT_TRACE_ID: Cell<Option<TraceId>> = const { Cell::new(None) };
}

/// Creates a request's `rpc` span with `make`, admitted by the OpenTelemetry layer only
/// when `sampled`.
pub fn rpc_span(sampled: bool, make: impl FnOnce() -> Span) -> Span {
    SAMPLING_RPC.with(|flag| flag.set(sampled));
    let span = make();
    SAMPLING_RPC.with(|flag| flag.set(false));
    span
}

/// Trace and span ids for the SDK: random, except that a span starting a trace takes
/// the trace id the request already has (generated before sampling could be decided,
/// and already in its logs), so logs and traces agree at the edge too.
#[derive(Debug, Default)]
struct ChainIds(RandomIdGenerator);

impl IdGenerator for ChainIds {
    fn new_trace_id(&self) -> TraceId {
        ROOT_TRACE_ID
            .with(|id| id.take())
            .unwrap_or_else(|| self.0.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        self.0.new_span_id()
    }
}

/// Flushes and stops the trace exporter when a service stops ([`Telemetry::shutdown`], or
/// when dropped), so the spans of the last requests are not lost.
#[derive(Debug)]
#[must_use = "dropping the guard stops the trace exporter"]
pub struct Telemetry {
    /// The exporter's provider, when exporting.
    provider: Option<SdkTracerProvider>,
    /// The log writer's thread: dropped last, it writes out the lines still pending.
    _logs: Option<crate::log_writer::Flusher>,
}

impl Telemetry {
    /// Flushes and stops the trace exporter from a blocking thread, while this task's
    /// runtime goes on: the exporter's last batch is sent by its own thread over a tonic
    /// channel whose connection is a task of this runtime, and on a runtime of one thread
    /// (a service's default) a flush made on that thread would wait for itself until the
    /// SDK gave up (5 s) and the batch was lost.
    pub async fn shutdown(mut self) {
        if let Some(provider) = self.provider.take() {
            match tokio::task::spawn_blocking(move || provider.shutdown()).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => eprintln!("flushing traces: {error}"),
                Err(error) => eprintln!("flushing traces: {error}"),
            }
        }
    }
}

/// Without [`Telemetry::shutdown`] (an error on the way out): the flush on this thread.
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
    // Lines go to stdout in batches from a thread of their own (see [`crate::log_writer`]):
    // a request's task formats its line and appends it to a buffer, never waiting for a
    // write(2) to a pipe nor waking a thread per line. Lines are dropped (and counted)
    // only past a 4 MiB backlog, when stdout is not being read. The guard in [`Telemetry`]
    // writes out the last lines at exit.
    let (writer, guard) = crate::log_writer::BatchedStdout::stdout();
    let fmt = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_timer(Rfc3339Micros)
        .with_writer(writer);
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
        // A sampled request's `rpc` span, and what happens inside one: nothing else.
        let sampled_requests = tracing_subscriber::filter::DynFilterFn::new(|metadata, context| {
            if *metadata.level() > tracing::Level::INFO {
                false
            } else if metadata.is_span() && metadata.name() == "rpc" {
                SAMPLING_RPC.with(Cell::get)
            } else {
                context.lookup_current().is_some()
            }
        })
        .with_max_level_hint(tracing_subscriber::filter::LevelFilter::INFO);
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("retrychain"))
            .with_filter(sampled_requests)
    });
    let logged = log_filter(std::env::var(EnvFilter::DEFAULT_ENV).ok().as_deref());
    // Without export, no OpenTelemetry layer at all, not an absent one: an absent layer
    // (`None`) counts as one that wants every span, so the spans for traces only would be
    // made, entered, left and closed on every call for nothing to see.
    let installed = match otel {
        Some(otel) => tracing_subscriber::registry()
            .with(fmt.with_filter(logged))
            .with(otel)
            .try_init(),
        None => tracing_subscriber::registry()
            .with(fmt.with_filter(logged))
            .try_init(),
    }
    .is_ok();
    if installed && provider.is_some() {
        let _ = SAMPLER.set(Sampler::from_env());
        EXPORTING.store(true, Ordering::Relaxed);
    }
    Telemetry {
        provider: if installed { provider } else { None },
        _logs: installed.then_some(guard),
    }
}

/// What the log layer lets through: `RUST_LOG`'s directives (`info` when unset, empty or
/// not understood), and never the spans that exist for traces only
/// ([`resilience::TRACE_ONLY`]: without export nothing asks for them, and they are not
/// created at all).
///
/// Directives that only name targets and levels ([`by_target`]) make a
/// [`Targets`](tracing_subscriber::filter::Targets) filter; any other (on spans or
/// fields: `[rpc]=debug`, `[{key}]=debug`) needs an [`EnvFilter`]. The difference is paid on
/// every request: an `EnvFilter` takes a lock to look up the request's span each time its
/// future is polled, entered and left, and when the span is created and closed, to see
/// whether a directive applies inside it.
fn log_filter(
    directives: Option<&str>,
) -> Box<dyn tracing_subscriber::layer::Filter<tracing_subscriber::Registry> + Send + Sync> {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    let only_logged =
        |targets: Targets| targets.with_target(resilience::TRACE_ONLY, LevelFilter::OFF);
    let directives = directives.map(str::trim).filter(|d| !d.is_empty());
    match directives.map(|d| (d, by_target(d))) {
        None => Box::new(only_logged(Targets::new().with_default(LevelFilter::INFO))),
        Some((_, Some(targets))) => Box::new(only_logged(targets)),
        Some((directives, None)) => {
            let filter = EnvFilter::try_new(directives).unwrap_or_else(|_| EnvFilter::new("info"));
            // A directive, so that the filter's answers stay cached per callsite (a filter
            // function would make every disabled `trace!` of h2 and hyper ask again).
            Box::new(match format!("{}=off", resilience::TRACE_ONLY).parse() {
                Ok(directive) => filter.add_directive(directive),
                Err(_) => filter,
            })
        }
    }
}

/// `directives` as a [`Targets`](tracing_subscriber::filter::Targets) filter when each one
/// is a level (`info`), a target (`h2`) or both (`retrychain_ledger=debug`), as an
/// [`EnvFilter`] reads them; `None` for anything else, which an `EnvFilter` must read
/// (`Targets`' own parser would take `[rpc]=debug` for a target of that name, and an empty
/// directive for `error`).
fn by_target(directives: &str) -> Option<tracing_subscriber::filter::Targets> {
    use tracing_subscriber::filter::LevelFilter;
    let named = |target: &str| {
        !target.is_empty()
            && target
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | ':' | '-'))
    };
    let plain = |directive: &str| match directive.split_once('=') {
        Some((target, level)) => {
            named(target) && !level.is_empty() && level.parse::<LevelFilter>().is_ok()
        }
        None => named(directive),
    };
    // An `EnvFilter` skips empty directives (`info,`).
    let directives: Vec<&str> = directives
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    if directives.is_empty() || !directives.iter().all(|d| plain(d)) {
        return None;
    }
    directives.join(",").parse().ok()
}

/// Every line's time: RFC 3339 in UTC to the microsecond (`2026-12-05T14:03:07.123456Z`),
/// what tracing-subscriber's `SystemTime` writes, formatted by humantime in one piece:
/// tracing-subscriber's takes a `write!` per part, a sixtieth of a relay's instructions
/// per request. A clock set before 1970 is left to tracing-subscriber.
#[derive(Debug, Clone, Copy)]
struct Rfc3339Micros;

impl tracing_subscriber::fmt::time::FormatTime for Rfc3339Micros {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        let now = std::time::SystemTime::now();
        if now < std::time::UNIX_EPOCH {
            return tracing_subscriber::fmt::time::SystemTime.format_time(w);
        }
        write!(w, "{}", humantime::format_rfc3339_micros(now))
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
        Rfc3339Micros.format_time(&mut tracing_subscriber::fmt::format::Writer::new(
            &mut timestamp,
        ))?;
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
        mut writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        // A span's fields go into a String the subscriber keeps with the span: formatted
        // in one piece elsewhere first, it is allocated once rather than grown field by field.
        let formatted = with_scratch(|scratch| {
            write_fields(scratch, &fields)?;
            writer.write_str(scratch)
        });
        formatted.unwrap_or_else(|| write_fields(&mut writer, &fields))
    }

    fn add_fields(
        &self,
        current: &'w mut tracing_subscriber::fmt::FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> std::fmt::Result {
        let mut append = |added: &str| {
            if added.is_empty() {
                return;
            }
            let current = &mut current.fields;
            current.reserve(added.len() + 1);
            if !current.is_empty() {
                current.push(' ');
            }
            current.push_str(added);
        };
        let added = with_scratch(|scratch| {
            write_fields(scratch, fields)?;
            append(scratch);
            Ok(())
        });
        added.unwrap_or_else(|| {
            let mut added = String::new();
            write_fields(&mut added, fields)?;
            append(&added);
            Ok(())
        })
    }
}

/// Runs `f` with this thread's scratch String, emptied; `None` when it is taken (a
/// field's `Debug` that logs). The per-request log line's fields are formatted there, so
/// what a span keeps is allocated once, at its full length, not grown field by field.
fn with_scratch<R>(f: impl FnOnce(&mut String) -> R) -> Option<R> {
    thread_local! {
        static SCRATCH: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
    }
    /// A field list longer than this is rare; the scratch is let go after one.
    const KEEP: usize = 4096;
    // `try_with`: a thread whose locals are being torn down formats without it.
    SCRATCH
        .try_with(|scratch| {
            let mut scratch = scratch.try_borrow_mut().ok()?;
            scratch.clear();
            let result = f(&mut scratch);
            if scratch.capacity() > KEEP {
                *scratch = String::new();
            }
            Some(result)
        })
        .ok()
        .flatten()
}

/// Writes `fields` as `name=value` pairs (the message bare), leaving out `otel.*`.
fn write_fields(
    out: &mut dyn std::fmt::Write,
    fields: impl tracing_subscriber::field::RecordFields,
) -> std::fmt::Result {
    let mut visitor = FieldWriter {
        writer: out,
        first: true,
        result: Ok(()),
    };
    fields.record(&mut visitor);
    visitor.result
}

struct FieldWriter<'w> {
    writer: &'w mut dyn std::fmt::Write,
    first: bool,
    result: std::fmt::Result,
}

impl FieldWriter<'_> {
    /// Writes one field: `name=value`, or the message bare. In pieces rather than through
    /// one `write!` with three arguments: every request formats a dozen fields.
    fn field(
        &mut self,
        field: &tracing::field::Field,
        value: impl FnOnce(&mut dyn std::fmt::Write) -> std::fmt::Result,
    ) {
        if self.result.is_err() || field.name().starts_with("otel.") {
            return;
        }
        let separator = if self.first { "" } else { " " };
        self.first = false;
        let writer = &mut *self.writer;
        self.result = (|| {
            writer.write_str(separator)?;
            if field.name() != "message" {
                writer.write_str(field.name())?;
                writer.write_char('=')?;
            }
            value(writer)
        })();
    }
}

impl tracing::field::Visit for FieldWriter<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.field(field, |w| w.write_str(value));
        } else {
            // Quoted and escaped: a value a client chose cannot forge a field or a line.
            // Printable ASCII other than `"` and `\` is what `Debug` leaves as it is (ids,
            // keys, names): written as it is, without `Debug`'s look at every character.
            let plain = value
                .bytes()
                .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\');
            if plain {
                self.field(field, |w| {
                    w.write_char('"')?;
                    w.write_str(value)?;
                    w.write_char('"')
                });
            } else {
                self.field(field, |w| write!(w, "{value:?}"));
            }
        }
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.field(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.field(field, |w| w.write_str(itoa::Buffer::new().format(value)));
    }

    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.field(field, |w| w.write_str(if value { "true" } else { "false" }));
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.field(field, |w| write!(w, "{value:?}"));
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
            // Sampling was decided before the span existed ([`Sampler`]): whatever
            // reaches the SDK is to be recorded.
            .with_sampler(opentelemetry_sdk::trace::Sampler::AlwaysOn)
            .with_id_generator(ChainIds::default())
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name(name)
                    .build(),
            )
            .build(),
    )
}

/// Starts a sampled request's `span` (a server span) in its trace: the child of the
/// caller's span when a `traceparent` came (`trace.parent_id`), else the root of the trace
/// `trace.trace_id`. `tracestate`, if the caller sent one, is kept.
pub fn continue_trace(
    span: &Span,
    trace: &retrychain_domain::metadata::TraceContext,
    metadata: &MetadataMap,
) {
    let Ok(trace_id) = TraceId::from_hex(trace.trace_id.as_str()) else {
        return;
    };
    if let Some(parent) = trace
        .parent_id
        .and_then(|p| SpanId::from_hex(p.as_str()).ok())
    {
        let state = metadata
            .get("tracestate")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or_default();
        let caller = SpanContext::new(trace_id, parent, TraceFlags::SAMPLED, true, state);
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(caller));
    }
    // Starting the span here, on this thread, lets a root take the request's trace id.
    ROOT_TRACE_ID.with(|id| id.set(Some(trace_id)));
    let _ = span.context();
    ROOT_TRACE_ID.with(|id| id.set(None));
}

/// The client layer that writes each outgoing call's trace context — the one place it
/// reaches the wire. Exporting, it is the current span's (placed below a retry layer, each
/// attempt's span is the parent of the server's); otherwise the [`TraceContext`] the
/// handler put in the call's extensions (this hop as the next one's parent), as a
/// [`TraceParent`](retrychain_domain::metadata::TraceParent).
///
/// [`TraceContext`]: retrychain_domain::TraceContext
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
        let ours = request
            .extensions()
            .get::<retrychain_domain::metadata::TraceParent>()
            .cloned();
        // The attempt span's own context only for a request whose spans are exported
        // (and calls made outside a request, when exporting); otherwise this hop's.
        let context = match &ours {
            Some(ours) => ours.exported.then(|| Span::current().context()),
            None => exporting().then(|| Span::current().context()),
        };
        match context {
            Some(context) if context.span().span_context().is_valid() => {
                TraceContextPropagator::new()
                    .inject_context(&context, &mut HeaderInjector(request.headers_mut()));
            }
            _ => {
                if let Some(ours) = ours {
                    request.headers_mut().insert(
                        http::HeaderName::from_static(resilience::wire::TRACEPARENT),
                        ours.value,
                    );
                }
            }
        }
        self.inner.call(request)
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

#[cfg(test)]
mod tests;
