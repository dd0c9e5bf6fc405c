//! OpenTelemetry traces over OTLP: a real five-service chain exports to a collector that
//! runs in this test (a tonic `TraceService` server from the OpenTelemetry proto crate),
//! and one request must come out as one trace — five server spans linked parent to child
//! through each hop's attempt spans, and the amplification visible as spans: 243
//! processor calls in one trace in every-layer mode, 3 in edge-only.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::support::*;
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::any_value::Value,
    trace::v1::span::SpanKind,
};
use tonic::{Request, Response, Status};

/// One span as the collector received it.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    kind: SpanKind,
}

/// Keeps every span exported to it.
#[derive(Debug, Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Got>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    Value::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(Got {
                        service: service.clone(),
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent: hex(&span.parent_span_id),
                        kind: SpanKind::try_from(span.kind).unwrap_or(SpanKind::Unspecified),
                        name: span.name,
                    });
                }
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Collector {
    /// Starts the collector on a free port; its OTLP endpoint.
    async fn start() -> (Collector, String) {
        let collector = Collector::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = TraceServiceServer::new(collector.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(server)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (collector, format!("http://{addr}"))
    }

    /// The spans of `trace_id`, once `enough` says they have all arrived (batches come
    /// every 50 ms; give up after 20 s).
    async fn trace(&self, trace_id: &str, enough: impl Fn(&[Got]) -> bool) -> Vec<Got> {
        let start = Instant::now();
        let of_the_trace = || -> Vec<Got> {
            let spans = self.spans.lock().unwrap();
            spans
                .iter()
                .filter(|s| s.trace_id == trace_id)
                .cloned()
                .collect()
        };
        loop {
            let spans = of_the_trace();
            if enough(&spans) {
                // Whatever else was in flight lands in the next batch.
                tokio::time::sleep(Duration::from_millis(300)).await;
                return of_the_trace();
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "trace {trace_id} incomplete: {} spans: {spans:#?}",
                spans.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A chain exporting to `endpoint` every 50 ms.
async fn traced_chain(endpoint: &str) -> Chain {
    exporting_chain(endpoint, "50", &[]).await
}

/// A chain exporting to `endpoint` every `schedule_delay_ms`, with `more` variables.
async fn exporting_chain(endpoint: &str, schedule_delay_ms: &str, more: &[(&str, &str)]) -> Chain {
    let mut options = Options::processes();
    options.spec.env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_BSP_SCHEDULE_DELAY", schedule_delay_ms),
    ]
    .iter()
    .chain(more)
    .map(|&(name, value)| (name.into(), value.into()))
    .collect();
    Chain::spawn(options).await
}

fn count(spans: &[Got], service: &str, name: &str) -> usize {
    spans
        .iter()
        .filter(|s| s.service == service && s.name == name)
        .count()
}

#[tokio::test]
async fn one_request_is_one_trace_of_five_linked_server_spans() {
    let (collector, endpoint) = Collector::start().await;
    let chain = traced_chain(&endpoint).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{client_span}-01");
    let reply = chain
        .charge(
            &new_account(),
            500,
            Some(&new_key()),
            Duration::from_secs(5),
            &[(TRACEPARENT, traceparent.as_str())],
        )
        .await
        .unwrap();
    assert_eq!(header(&reply, TRACE_ID).as_deref(), Some(trace_id));

    let spans = collector
        .trace(trace_id, |spans| {
            spans.iter().filter(|s| s.kind == SpanKind::Server).count() >= 5
                && spans.iter().any(|s| s.name == "record_charge")
        })
        .await;
    let by_id: HashMap<&str, &Got> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let server = |service: &str| -> &Got {
        let found: Vec<&Got> = spans
            .iter()
            .filter(|s| s.service == service && s.kind == SpanKind::Server)
            .collect();
        assert_eq!(found.len(), 1, "{service}: {spans:#?}");
        found[0]
    };
    assert_eq!(
        server("edge").parent,
        client_span,
        "the client's span is the root's parent"
    );
    assert_eq!(server("edge").name, "edge Charge");
    for pair in NAMES.windows(2) {
        let (upstream, downstream) = (server(pair[0]), server(pair[1]));
        let attempt = by_id
            .get(downstream.parent.as_str())
            .unwrap_or_else(|| panic!("{}'s parent is not in the trace", pair[1]));
        assert_eq!(attempt.kind, SpanKind::Client, "{attempt:?}");
        assert_eq!(attempt.service, pair[0]);
        assert_eq!(attempt.name, "attempt");
        assert_eq!(
            attempt.parent, upstream.span_id,
            "{} attempt under its server span",
            pair[0]
        );
    }
    // Attempt spans are the Stats counts, service by service.
    let stats = chain.all_stats().await;
    for (i, name) in NAMES.iter().enumerate() {
        assert_eq!(
            count(&spans, name, "attempt") as u64,
            stats[i].downstream_attempts,
            "{name}"
        );
    }
    // The ledger's own steps hang under its server span.
    let ledger = server("ledger");
    // Phase 1 (the claim) and phase 2 (the charge recorded), each a statement of its own.
    for step in ["claim_key", "record_charge"] {
        let span = spans
            .iter()
            .find(|s| s.name == step)
            .unwrap_or_else(|| panic!("no {step} span"));
        let mut parent = by_id.get(span.parent.as_str()).copied();
        while let Some(p) = parent {
            if p.span_id == ledger.span_id {
                break;
            }
            parent = by_id.get(p.parent.as_str()).copied();
        }
        assert!(parent.is_some(), "{step} is under the ledger's server span");
    }
}

#[tokio::test]
async fn amplification_shows_as_processor_spans_243_against_3() {
    let (collector, endpoint) = Collector::start().await;
    let chain = traced_chain(&endpoint).await;
    chain.fail_processor().await;
    for (mode, trace_id, expected) in [
        ("every-layer", "11111111111111111111111111111111", 243),
        ("edge-only", "22222222222222222222222222222222", 3),
    ] {
        let traceparent = format!("00-{trace_id}-00f067aa0ba902b7-01");
        chain
            .charge_new(
                Duration::from_secs(30),
                &[(TRACEPARENT, traceparent.as_str()), (RETRY_MODE, mode)],
            )
            .await
            .expect_err("the processor fails");
        let spans = collector
            .trace(trace_id, |spans| {
                count(spans, "ledger", "attempt") >= expected
            })
            .await;
        assert_eq!(count(&spans, "ledger", "attempt"), expected, "{mode}");
        println!(
            "{mode}: {} spans in one trace, {expected} processor calls",
            spans.len()
        );
    }
}

/// Sampling is decided once per request and agreed by every hop: at a trace-id ratio of
/// 0.5, with the edge starting each trace (no `traceparent` sent), every trace is either
/// exported whole — five linked server spans, under the trace id the client was told — or
/// not at all, and about half are exported.
#[tokio::test]
async fn a_sampled_trace_is_exported_whole_under_the_id_the_logs_show() {
    let (collector, endpoint) = Collector::start().await;
    let chain = exporting_chain(
        &endpoint,
        "50",
        &[
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.5"),
        ],
    )
    .await;
    let mut trace_ids = Vec::new();
    for _ in 0..40 {
        let reply = chain
            .charge_new(Duration::from_secs(10), &[])
            .await
            .unwrap();
        trace_ids.push(header(&reply, TRACE_ID).unwrap());
    }
    // Every batch lands within a second (50 ms schedule).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spans = collector.spans.lock().unwrap().clone();
    let mut exported = 0;
    for trace_id in &trace_ids {
        let of_trace: Vec<&Got> = spans.iter().filter(|s| &s.trace_id == trace_id).collect();
        let servers = of_trace
            .iter()
            .filter(|s| s.kind == SpanKind::Server)
            .count();
        if of_trace.is_empty() {
            continue;
        }
        exported += 1;
        assert_eq!(servers, 5, "trace {trace_id}: {of_trace:#?}");
        for service in ["edge", "hop2", "hop3", "hop4", "ledger"] {
            assert!(
                of_trace.iter().any(|s| s.service == service),
                "{service} in {trace_id}"
            );
        }
    }
    let foreign = spans
        .iter()
        .filter(|s| !trace_ids.contains(&s.trace_id))
        .count();
    println!("{exported} of 40 traces exported whole; {foreign} spans under other trace ids");
    assert_eq!(
        foreign, 0,
        "every exported span is under a trace id a client was told"
    );
    assert!(
        (8..=32).contains(&exported),
        "{exported} of 40 at a ratio of 0.5"
    );
}

/// A service that stops (SIGTERM) sends the spans it has not exported yet: with batches
/// due only every ten minutes, one charge's trace still reaches the collector whole once
/// the five services have stopped. Each runs on one thread by default, where the exporter's
/// last batch needs the runtime the shutdown is made from: flushed on that thread, it waited
/// for itself until the SDK gave up, and the spans were lost.
#[tokio::test]
async fn a_stopped_service_exports_the_spans_it_still_held() {
    let (collector, endpoint) = Collector::start().await;
    let mut chain = exporting_chain(&endpoint, "600000", &[]).await;
    let reply = chain
        .charge_new(Duration::from_secs(10), &[])
        .await
        .unwrap();
    let trace_id = header(&reply, TRACE_ID).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let early = collector
        .spans
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.trace_id == trace_id)
        .count();
    assert_eq!(
        early, 0,
        "nothing of the trace exported before the services stop"
    );
    for service in &mut chain.services {
        let grace = retrychain_node::DRAIN_GRACE + Duration::from_secs(5);
        let status = service.terminate(grace).await.expect("exits on SIGTERM");
        assert!(status.success(), "{} exited with {status}", service.name);
    }
    let spans = collector.spans.lock().unwrap().clone();
    let servers: Vec<&Got> = spans
        .iter()
        .filter(|s| s.trace_id == trace_id && s.kind == SpanKind::Server)
        .collect();
    for service in ["edge", "hop2", "hop3", "hop4", "ledger"] {
        assert_eq!(
            servers.iter().filter(|s| s.service == service).count(),
            1,
            "{service}'s server span of {trace_id}, exported when it stopped: {servers:#?}"
        );
    }
}
