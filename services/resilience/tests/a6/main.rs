//! gRFC A6 conformance of [`RetryLayer`], on paused time, against tonic servers called in
//! process (the generated `PaymentsServer` is itself a tower service: no sockets, so time
//! can be paused and every wait checked to the millisecond); then the layer's extensions
//! for a service in a chain, and the propagation layers above it.

#![allow(clippy::unwrap_used, missing_docs)] // tests: a panic is the failure report

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Duration,
};

use resilience::{RetryLayer, ServiceConfig};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest,
    payments_client::PaymentsClient,
    payments_server::{Payments, PaymentsServer},
};
use tokio::time::Instant;
use tonic::{Code, Request, Response, Status};

mod chain;
mod hedging;
mod retries;

/// What the server saw of one call.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    previous_attempts: Option<String>,
    timeout: Option<String>,
    key: Option<String>,
}

/// A server that answers from a script (then OK) and remembers every call.
#[derive(Debug, Clone, Default)]
struct Scripted {
    script: Arc<Mutex<VecDeque<Status>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Scripted {
    fn failing(statuses: Vec<Status>) -> Self {
        Self {
            script: Arc::new(Mutex::new(statuses.into())),
            seen: Arc::default(),
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl Payments for Scripted {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let text = |key: &str| {
            request
                .metadata()
                .get(key)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        self.seen.lock().unwrap().push(Seen {
            at: Instant::now(),
            previous_attempts: text("grpc-previous-rpc-attempts"),
            timeout: text("grpc-timeout"),
            key: text("idempotency-key"),
        });
        match self.script.lock().unwrap().pop_front() {
            Some(status) => Err(status),
            None => Ok(Response::new(ChargeReply::default())),
        }
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

fn config(policy: &str, throttling: &str) -> ServiceConfig {
    ServiceConfig::parse(&format!(
        r#"{{"methodConfig": [{{"name": [{{"service": "retrychain.v1.Payments", "method": "Charge"}}],
            "retryPolicy": {policy}}}] {throttling}}}"#
    ))
    .unwrap()
}

/// Retry on UNAVAILABLE and RESOURCE_EXHAUSTED, 100 ms backoff without jitter.
fn policy(max_attempts: u32) -> String {
    format!(
        r#"{{"maxAttempts": {max_attempts}, "initialBackoff": "0.1s", "maxBackoff": "0.1s",
            "backoffMultiplier": 1, "retrychainJitter": "exponential",
            "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]}}"#
    )
}

fn client_of(
    layer: RetryLayer,
    server: &Scripted,
) -> PaymentsClient<resilience::client::RetryService<PaymentsServer<Scripted>>> {
    PaymentsClient::new(tower::Layer::layer(
        &layer,
        PaymentsServer::new(server.clone()),
    ))
}

async fn charge(
    client: &mut PaymentsClient<resilience::client::RetryService<PaymentsServer<Scripted>>>,
) -> Result<Response<ChargeReply>, Status> {
    client
        .charge(ChargeRequest {
            account_id: "a".into(),
            amount_cents: 1,
        })
        .await
}

fn unavailable(n: usize) -> Vec<Status> {
    (0..n).map(|_| Status::unavailable("down")).collect()
}

fn with_pushback(mut status: Status, ms: &str) -> Status {
    status
        .metadata_mut()
        .insert("grpc-retry-pushback-ms", ms.parse().unwrap());
    status
}

/// A server whose calls take a scripted time and answer a scripted outcome, and which
/// notices when a call is cancelled (its handler dropped before it answered).
#[derive(Debug, Clone, Default)]
struct Slow {
    script: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    cancelled: Arc<Mutex<u32>>,
}

/// How long a call takes, and its failure (`None`: OK).
type Step = (Duration, Option<Status>);

/// Counts a cancellation unless disarmed.
struct CancelGuard(Option<Arc<Mutex<u32>>>);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if let Some(cancelled) = self.0.take() {
            *cancelled.lock().unwrap() += 1;
        }
    }
}

#[tonic::async_trait]
impl Payments for Slow {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        self.seen.lock().unwrap().push(Seen {
            at: Instant::now(),
            previous_attempts: request
                .metadata()
                .get("grpc-previous-rpc-attempts")
                .map(|v| v.to_str().unwrap().to_owned()),
            timeout: None,
            key: None,
        });
        let (delay, outcome) = self
            .script
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or((Duration::ZERO, None));
        let mut guard = CancelGuard(Some(Arc::clone(&self.cancelled)));
        tokio::time::sleep(delay).await;
        guard.0 = None;
        match outcome {
            Some(status) => Err(status),
            None => Ok(Response::new(ChargeReply {
                charge_id: format!("after {delay:?}"),
                ..ChargeReply::default()
            })),
        }
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

fn hedging(max_attempts: u32, delay_ms: u64, non_fatal: &str, throttling: &str) -> RetryLayer {
    RetryLayer::new(
        ServiceConfig::parse(&format!(
            r#"{{"methodConfig": [{{"name": [{{"service": "retrychain.v1.Payments"}}],
                "hedgingPolicy": {{"maxAttempts": {max_attempts}, "hedgingDelay": "{}s",
                                   "nonFatalStatusCodes": [{non_fatal}]}}}}] {throttling}}}"#,
            delay_ms as f64 / 1000.0
        ))
        .unwrap(),
    )
}

fn slow(script: Vec<(u64, Option<Status>)>) -> Slow {
    Slow {
        script: Arc::new(Mutex::new(
            script
                .into_iter()
                .map(|(ms, outcome)| (Duration::from_millis(ms), outcome))
                .collect(),
        )),
        ..Slow::default()
    }
}

/// A transport that answers every call the same scripted way, counting calls: for
/// answers a tonic server would never give (headers, then a failure in the trailers) and
/// for calls that reach no server at all.
struct Fake<E> {
    calls: Arc<Mutex<u32>>,
    answer: fn() -> Result<http::Response<tonic::body::Body>, E>,
}

// By hand: the derive would ask `E: Clone`, and io::Error is not.
impl<E> Clone for Fake<E> {
    fn clone(&self) -> Self {
        Self {
            calls: Arc::clone(&self.calls),
            answer: self.answer,
        }
    }
}

impl<E> Fake<E> {
    fn new(answer: fn() -> Result<http::Response<tonic::body::Body>, E>) -> Self {
        Self {
            calls: Arc::default(),
            answer,
        }
    }

    fn calls(&self) -> u32 {
        *self.calls.lock().unwrap()
    }
}

impl<E> tower::Service<http::Request<tonic::body::Body>> for Fake<E> {
    type Response = http::Response<tonic::body::Body>;
    type Error = E;
    type Future = std::future::Ready<Result<Self::Response, E>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), E>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
        *self.calls.lock().unwrap() += 1;
        std::future::ready((self.answer)())
    }
}

/// Response headers (committing the call), and only then a failure, in the trailers.
fn headers_then_unavailable() -> Result<http::Response<tonic::body::Body>, std::convert::Infallible>
{
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", "14".parse().unwrap());
    trailers.insert("grpc-message", "failed%20after%20headers".parse().unwrap());
    let frames: Vec<Result<http_body::Frame<bytes::Bytes>, Status>> =
        vec![Ok(http_body::Frame::trailers(trailers))];
    let body = tonic::body::Body::new(http_body_util::StreamBody::new(futures::stream::iter(
        frames,
    )));
    Ok(http::Response::builder()
        .header("content-type", "application/grpc")
        .body(body)
        .unwrap())
}

/// No server: the connection is reset.
fn connection_reset() -> Result<http::Response<tonic::body::Body>, std::io::Error> {
    Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
}
