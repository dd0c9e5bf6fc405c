//! Prometheus metrics on the admin port: `curl http://127.0.0.1:51051/metrics`.
//!
//! The admin listener speaks HTTP/1.1 as well as gRPC; [`MetricsLayer`] answers
//! `GET /metrics` in front of the gRPC services with the Prometheus text format (0.0.4).
//! Every metric is prefixed `retrychain_` and carries the service's name as the `service`
//! label, so one query covers five scrape targets:
//!
//! | metric | type | from |
//! |---|---|---|
//! | `requests_received_total` | counter | Stats `requests_received` |
//! | `requests_total{method,code}` | counter | each finished Payments call |
//! | `request_duration_seconds{method}` | histogram | each finished Payments call |
//! | `downstream_attempts_total` | counter | Stats `downstream_attempts` (ledger: processor calls) |
//! | `retries_total{reason}` | counter | Stats `retries`, by the code that caused each |
//! | `retries_refused_total{by="budget"\|"deadline"}` | counter | Stats `budget_denied`, `deadline_denied` |
//! | `attempts_per_call` | histogram, buckets 1–5 | each downstream call (as gRFC A96) |
//! | `budget_tokens` | gauge | the retry budget or throttle (edge): tokens, or for adaptive throttling the requests left before it rejects |
//! | `throttle_reject_probability` | gauge | adaptive throttling's local rejection probability now (edge) |
//! | `endpoint_calls_total{endpoint}`, `endpoint_failures_total{endpoint}`, `endpoint_ejections_total{endpoint}` | counter | a hop's balancer, per replica below: attempts, failures of its own, ejections |
//! | `endpoint_ejected{endpoint}`, `endpoint_in_flight{endpoint}`, `endpoint_rtt_seconds{endpoint}` | gauge | per replica below: out of rotation (0/1), attempts in flight, load estimate |
//! | `ledger_executions_total`, `ledger_replays_total` | counter | Stats `executions`, `replays` |
//! | `ledger_in_flight_waits_total` | counter | duplicates that waited for their key |
//! | `ledger_db_connections{state="in_use"\|"idle"}`, `ledger_db_acquires_waiting` | gauge | the ledger's pool |
//! | `ledger_db_round_trip_seconds` | histogram | each database round trip of a request |
//! | `concurrency_limit`, `in_flight` | gauge | how many calls at once fit the last call's budget now (admission's concurrency), and the Payments calls being served |
//! | `door_waiting`, `door_line_share` | gauge | the edge's line at the door (`--door-wait-share`): calls waiting in it now, and the share of the places given while calls waited that went to them (the rest to callers under their fair share and retries, past the line) |
//! | `shed_total{attempt="first"\|"retry"}` | counter | calls refused as overloaded (Stats `shed`, `shed_retries`) |
//! | `shed_seconds` | histogram | how long each refusal took to answer |
//! | `ledger_processor_conflicts_total` | counter | Stats `processor_conflicts` |
//! | `log_lines_dropped_total` | counter | log lines the process dropped because stdout was not taking them ([`crate::log_writer`]; the process's, not a Stats counter: `ResetStats` leaves it) |
//!
//! The counters are the Stats counters' totals since the process started (see
//! [`crate::stats`]), so the two always agree up to the last `ResetStats`.

use std::{
    fmt::Write as _,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};
use tower::{Layer, Service};

pub use crate::stats::{DatabaseGauges, round_trip_buckets};
use crate::{Node, stats::Count};

/// The registry a node's `/metrics` renders.
pub fn registry(node: &Arc<Node>) -> Registry {
    let mut registry = Registry::with_prefix_and_labels(
        "retrychain",
        [("service".into(), node.name.clone().into())].into_iter(),
    );
    let counters = &node.counters;
    registry.register(
        "requests",
        "Payments calls finished, by method and gRPC code",
        counters.calls.clone(),
    );
    registry.register(
        "request_duration_seconds",
        "Payments call latency at this service",
        counters.latency.clone(),
    );
    registry.register(
        "retries",
        "Downstream attempts that were retries, by the code of the failure that caused them",
        counters.retry_reasons.clone(),
    );
    registry.register(
        "attempts_per_call",
        "Attempts made per downstream call (1 = no retry)",
        counters.attempts_per_call.clone(),
    );
    registry.register(
        "shed_seconds",
        "How long each Payments call refused as overloaded took to answer, from its arrival",
        counters.shed_seconds.clone(),
    );
    if let Some(db) = &node.database {
        registry.register(
            "ledger_db_round_trip_seconds",
            "Time of each database round trip of a request (a statement, BEGIN, COMMIT), by the ledger's clock",
            db.round_trip_seconds(),
        );
    }
    registry.register_collector(Box::new(NodeCollector(Arc::clone(node))));
    registry
}

/// Renders `registry` in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut text = String::new();
    if prometheus_client::encoding::prometheus_text::encode(&mut text, registry).is_err() {
        let _ = writeln!(text, "# encoding failed");
    }
    text
}

/// The Stats counters and the gauges, read at scrape time.
#[derive(Debug)]
struct NodeCollector(Arc<Node>);

impl NodeCollector {
    fn counter(
        encoder: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        value: u64,
    ) -> Result<(), std::fmt::Error> {
        let counter = ConstCounter::new(value);
        let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
        counter.encode(metric)
    }

    fn gauge<T: prometheus_client::encoding::EncodeGaugeValue>(
        encoder: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        value: T,
    ) -> Result<(), std::fmt::Error> {
        let gauge = ConstGauge::new(value);
        let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
        gauge.encode(metric)
    }
}

impl NodeCollector {
    /// One family per figure, one series per replica below (`endpoint` = its URL).
    fn endpoints(
        encoder: &mut DescriptorEncoder,
        endpoints: &[resilience::balance::EndpointStats],
    ) -> Result<(), std::fmt::Error> {
        type Read = fn(&resilience::balance::EndpointStats) -> f64;
        let counters: [(&str, &str, Read); 3] = [
            (
                "endpoint_calls",
                "Attempts sent to each replica below",
                |e| e.calls as f64,
            ),
            (
                "endpoint_failures",
                "Failures of each replica below's own (not relayed from further down)",
                |e| e.failures as f64,
            ),
            (
                "endpoint_ejections",
                "Times each replica below was ejected (gRFC A50)",
                |e| e.ejections as f64,
            ),
        ];
        for (name, help, read) in counters {
            let mut metric = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for endpoint in endpoints {
                ConstCounter::new(read(endpoint) as u64)
                    .encode(metric.encode_family(&vec![("endpoint", endpoint.url.as_str())])?)?;
            }
        }
        let gauges: [(&str, &str, Read); 3] = [
            (
                "endpoint_ejected",
                "1 while a replica below is out of rotation",
                |e| f64::from(u8::from(e.ejected)),
            ),
            (
                "endpoint_in_flight",
                "Attempts in flight to each replica below",
                |e| f64::from(e.in_flight),
            ),
            (
                "endpoint_rtt_seconds",
                "Each replica below's load estimate (peak-EWMA response time)",
                |e| e.rtt_seconds,
            ),
        ];
        for (name, help, read) in gauges {
            let mut metric = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            for endpoint in endpoints {
                ConstGauge::new(read(endpoint))
                    .encode(metric.encode_family(&vec![("endpoint", endpoint.url.as_str())])?)?;
            }
        }
        Ok(())
    }
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let node = &self.0;
        let c = &node.counters;
        let simple: [(&str, &str, &Count); 2] = [
            (
                "requests_received",
                "Payments calls that reached this service (Stats requests_received)",
                &c.requests_received,
            ),
            (
                "downstream_attempts",
                "Calls made downstream; at the ledger, processor calls (Stats downstream_attempts)",
                &c.downstream_attempts,
            ),
        ];
        for (name, help, count) in simple {
            Self::counter(&mut encoder, name, help, count.total())?;
        }
        Self::counter(
            &mut encoder,
            "log_lines_dropped",
            "Log lines dropped because stdout was not taking them (past a 4 MiB backlog)",
            crate::log_writer::dropped_lines(),
        )?;
        {
            let counter = ConstCounter::new(c.budget_denied.total());
            let mut metric = encoder.encode_descriptor(
                "retries_refused",
                "Retries not made: refused by the retry budget, or no room left in the deadline",
                None,
                counter.metric_type(),
            )?;
            counter.encode(metric.encode_family(&vec![("by", "budget")])?)?;
            ConstCounter::new(c.deadline_denied.total())
                .encode(metric.encode_family(&vec![("by", "deadline")])?)?;
        }
        Self::gauge(
            &mut encoder,
            "concurrency_limit",
            "The adaptive concurrency limit on Payments calls now",
            node.admission.limit() as i64,
        )?;
        Self::gauge(
            &mut encoder,
            "in_flight",
            "Payments calls being served now",
            node.admission.in_flight() as i64,
        )?;
        Self::gauge(
            &mut encoder,
            "door_waiting",
            "Payments calls waiting at the door for a place now (the edge, with --door-wait-share)",
            node.admission.waiting() as i64,
        )?;
        Self::gauge(
            &mut encoder,
            "door_line_share",
            "Of the places given while calls waited at the door, the share that went to them (1 before any line)",
            node.admission.line_share(),
        )?;
        {
            let (first, retries) = node.admission.shed();
            let counter = ConstCounter::new(first);
            let mut metric = encoder.encode_descriptor(
                "shed",
                "Payments calls refused as overloaded, first attempts and retries (retries are refused first)",
                None,
                counter.metric_type(),
            )?;
            counter.encode(metric.encode_family(&vec![("attempt", "first")])?)?;
            ConstCounter::new(retries)
                .encode(metric.encode_family(&vec![("attempt", "retry")])?)?;
        }
        if let Some(budget) = &node.budget {
            Self::gauge(
                &mut encoder,
                "budget_tokens",
                "Tokens in this service's retry budget now",
                budget.tokens(),
            )?;
            Self::gauge(
                &mut encoder,
                "throttle_reject_probability",
                "Probability that adaptive throttling rejects an attempt locally now (0 for a budget)",
                budget.reject_probability(),
            )?;
        }
        if let Some(balancer) = &node.downstream {
            Self::endpoints(&mut encoder, &balancer.endpoints())?;
        }
        if let Some(db) = &node.database {
            Self::counter(
                &mut encoder,
                "ledger_executions",
                "Charges committed (Stats executions)",
                c.executions.total(),
            )?;
            Self::counter(
                &mut encoder,
                "ledger_replays",
                "Saved replies returned for a repeated key (Stats replays)",
                c.replays.total(),
            )?;
            Self::counter(
                &mut encoder,
                "ledger_processor_conflicts",
                "Processor calls refused because their key came with other parameters (Stats processor_conflicts)",
                c.processor_conflicts.total(),
            )?;
            Self::counter(
                &mut encoder,
                "ledger_in_flight_waits",
                "Charges that waited for another request with their key",
                db.key_waits_total(),
            )?;
            let in_use = ConstGauge::new(db.connections_in_use() as i64);
            let mut metric = encoder.encode_descriptor(
                "ledger_db_connections",
                "The ledger's pooled Postgres connections",
                None,
                in_use.metric_type(),
            )?;
            in_use.encode(metric.encode_family(&vec![("state", "in_use")])?)?;
            ConstGauge::new(db.connections_idle() as i64)
                .encode(metric.encode_family(&vec![("state", "idle")])?)?;
            Self::gauge(
                &mut encoder,
                "ledger_db_acquires_waiting",
                "Requests waiting for a database connection now",
                db.acquires_waiting() as i64,
            )?;
        }
        Ok(())
    }
}

/// Answers `GET /metrics` in front of a tonic server; everything else goes through.
#[derive(Debug, Clone)]
pub struct MetricsLayer {
    /// What to render.
    registry: Arc<Registry>,
}

impl MetricsLayer {
    /// A layer serving `registry`.
    pub fn new(registry: Registry) -> Self {
        Self {
            registry: Arc::new(registry),
        }
    }
}

impl<S> Layer<S> for MetricsLayer {
    type Service = MetricsEndpoint<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MetricsEndpoint {
            inner,
            registry: Arc::clone(&self.registry),
        }
    }
}

/// The service [`MetricsLayer`] produces.
#[derive(Debug, Clone)]
pub struct MetricsEndpoint<S> {
    /// The gRPC services.
    inner: S,
    /// What `/metrics` renders.
    registry: Arc<Registry>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, ReqBody> Service<http::Request<ReqBody>> for MetricsEndpoint<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        if request.uri().path() != "/metrics" {
            return Box::pin(self.inner.call(request));
        }
        let response = if request.method() == http::Method::GET {
            http::Response::builder()
                .header(
                    http::header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )
                .body(tonic::body::Body::new(render(&self.registry)))
        } else {
            http::Response::builder()
                .status(http::StatusCode::METHOD_NOT_ALLOWED)
                .header(http::header::ALLOW, "GET")
                .body(tonic::body::Body::empty())
        };
        let response = response.unwrap_or_else(|_| http::Response::new(tonic::body::Body::empty()));
        Box::pin(async move { Ok(response) })
    }
}
