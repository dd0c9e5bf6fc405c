//! gRFC A6 retries and hedging as a tower layer for any tonic client: wrap a `Channel` (or
//! any `GrpcService`) and every unary call is retried or hedged as its service config says.
//!
//! ```ignore
//! let config = ServiceConfig::parse(&std::fs::read_to_string("service-config.json")?)?;
//! let channel = Endpoint::from_static("http://[::1]:50051").connect_lazy();
//! let stack = tower::ServiceBuilder::new()
//!     .layer(RetryLayer::new(config))
//!     .service(channel);
//! let mut client = PaymentsClient::new(stack);
//! ```
//!
//! Why a layer of its own and not `tower::retry`: a tonic request is an HTTP request with a
//! streaming body, which is not `Clone` (hyperium/tonic#733). This layer buffers a request's
//! body once (up to a per-call limit, default 1 MiB, and a per-channel total, as grpc-java
//! does) and replays it for each attempt. What it does, exactly as gRFC A6 says:
//!
//! - **Which calls**: those whose method has a `retryPolicy` in the service config (exact
//!   method, then the service, then the default). Others pass through untouched. So do calls
//!   whose body is over the limits — they go through once, unretried.
//! - **Committed on headers**: once the server sends response headers, the call is committed
//!   and never retried, whatever its trailers say. Only a Trailers-Only answer (the status in
//!   the headers, which is how servers refuse a call at once) or a failure to get any answer
//!   can be retried.
//! - **Which failures**: exactly `retryableStatusCodes`; a failure to reach the server counts
//!   as UNAVAILABLE.
//! - **When**: after the backoff (`initialBackoff · backoffMultiplier^n`, capped at
//!   `maxBackoff`, jittered), or exactly the server's `grpc-retry-pushback-ms`; a negative
//!   or malformed pushback ends the call.
//! - **How many**: `maxAttempts` (at most 5), and, with `retryThrottling`, only while the
//!   channel's throttle has more than half its tokens. A failure costs a token when its
//!   attempt fails; a success is credited when the call commits (its trailers are the
//!   caller's to read).
//! - **Marked**: every retry carries `grpc-previous-rpc-attempts`.
//! - **Deadline**: the call's `grpc-timeout` (or the method config's `timeout`, or a
//!   [`CallDeadline`] from a layer above, whichever ends first) bounds it: each attempt is
//!   sent the time left, no attempt starts and no backoff sleeps past it, and a call still
//!   unanswered then ends DEADLINE_EXCEEDED (also when the channel's own timer reports it
//!   as CANCELLED). A retry the deadline leaves no room for ends the call
//!   DEADLINE_EXCEEDED too, as it would have ended had the retry been made.
//!
//! A method with a `hedgingPolicy` is hedged instead: the first attempt at once, another
//! every `hedgingDelay` up to `maxAttempts` (at once after a non-fatal failure, or after
//! the server's pushback), each marked with `grpc-previous-rpc-attempts` and counted by the
//! throttle; the first committed answer, or the first fatal failure, wins, and the other
//! attempts are dropped — their streams reset, so their servers see the cancellation.
//!
//! Streaming calls (client- or bidirectional-streaming) must not be given a retry policy:
//! their body does not end before the response starts, so the layer would wait for it.

use std::{
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http_body::Body as _;
use http_body_util::BodyExt;
use rand::{SeedableRng, rngs::SmallRng};
use tonic::{Code, Status, body::Body};
use tower::{Layer, Service, ServiceExt};
use tracing::Instrument;

use crate::{
    backoff::Backoff,
    classify::{PUSHBACK_HEADER, Pushback, parse_pushback},
    classify::{is_local_timeout, never_processed, transport_failure_as_unavailable},
    deadline::{format_grpc_timeout, parse_grpc_timeout},
    observe::{AttemptInfo, Refusal, RetryObserver},
    retry::{PREVIOUS_ATTEMPTS_HEADER, TIMEOUT_HEADER},
    rules::{Next, Retrying, StopReason},
    service_config::{CallPolicy, HedgingPolicy, MethodConfig, RetryPolicyConfig, ServiceConfig},
    throttle::{A6Throttle, Throttle},
};

/// The largest request body buffered for replay, by default (grpc-java's default).
pub const DEFAULT_PER_CALL_LIMIT: usize = 1 << 20;
/// The most request bytes all calls of a channel may hold buffered at once, by default
/// (grpc-java's default).
pub const DEFAULT_PER_CHANNEL_LIMIT: usize = 16 << 20;

/// Retries unary gRPC calls per a service config; see the module docs.
#[derive(Clone)]
pub struct RetryLayer {
    /// What is shared by every service this layer makes.
    shared: Arc<Shared>,
}

struct Shared {
    /// Which methods retry, and how.
    config: ServiceConfig,
    /// The channel's `retryThrottling`, if any.
    throttle: Option<Arc<dyn Throttle>>,
    /// The per-call replay buffer limit.
    per_call_limit: usize,
    /// The per-channel total.
    per_channel_limit: usize,
    /// Bytes buffered now, across calls.
    buffered: AtomicUsize,
    /// Jitter.
    rng: Mutex<SmallRng>,
    /// Who is told.
    observer: Arc<dyn RetryObserver>,
    /// The least time left worth starting a retry with.
    min_attempt: std::time::Duration,
    /// Whether a call this layer retried, or wanted to retry, fails with a negative
    /// pushback.
    refuse_caller_retries: bool,
    /// Who this layer is in annotated failure messages (`"edge"`); `None`: messages are
    /// the server's.
    label: Option<String>,
}

impl std::fmt::Debug for RetryLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryLayer")
            .field("config", &self.shared.config)
            .field("per_call_limit", &self.shared.per_call_limit)
            .finish_non_exhaustive()
    }
}

impl RetryLayer {
    /// A layer applying `config` (its `retryThrottling` becomes the channel's throttle).
    pub fn new(config: ServiceConfig) -> Self {
        let throttle = config
            .retry_throttling
            .map(|t| Arc::new(A6Throttle::new(t.max_tokens, t.token_ratio)) as Arc<dyn Throttle>);
        Self {
            shared: Arc::new(Shared {
                config,
                throttle,
                per_call_limit: DEFAULT_PER_CALL_LIMIT,
                per_channel_limit: DEFAULT_PER_CHANNEL_LIMIT,
                buffered: AtomicUsize::new(0),
                rng: Mutex::new(rand::make_rng()),
                observer: Arc::new(()),
                min_attempt: std::time::Duration::ZERO,
                refuse_caller_retries: false,
                label: None,
            }),
        }
    }

    /// Changes a setting. A layer that was cloned (or has made services) is copied
    /// first, so the change never reaches services already made — the copy is a layer of
    /// its own, with its own buffer accounting and jitter.
    fn edit(mut self, f: impl FnOnce(&mut Shared)) -> Self {
        if Arc::get_mut(&mut self.shared).is_none() {
            let s = &self.shared;
            self.shared = Arc::new(Shared {
                config: s.config.clone(),
                throttle: s.throttle.clone(),
                per_call_limit: s.per_call_limit,
                per_channel_limit: s.per_channel_limit,
                buffered: AtomicUsize::new(0),
                rng: Mutex::new(rand::make_rng()),
                observer: Arc::clone(&s.observer),
                min_attempt: s.min_attempt,
                refuse_caller_retries: s.refuse_caller_retries,
                label: s.label.clone(),
            });
        }
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            f(shared);
        }
        self
    }

    /// Limits replay buffering: a call's body over `per_call`, or one that would take the
    /// channel's total over `per_channel`, goes through once, unretried.
    pub fn buffer_limits(self, per_call: usize, per_channel: usize) -> Self {
        self.edit(|s| {
            s.per_call_limit = per_call;
            s.per_channel_limit = per_channel;
        })
    }

    /// Uses `throttle` instead of the config's `retryThrottling` (e.g. a [`RetryBudget`]
    /// shared with other clients).
    ///
    /// [`RetryBudget`]: crate::RetryBudget
    pub fn throttle(self, throttle: Arc<dyn Throttle>) -> Self {
        self.edit(|s| s.throttle = Some(throttle))
    }

    /// Seeds the jitter, so tests see the same waits every run.
    pub fn seed(self, seed: u64) -> Self {
        self.edit(|s| s.rng = Mutex::new(SmallRng::seed_from_u64(seed)))
    }

    /// Reports attempts and refusals to `observer`.
    pub fn observer(self, observer: Arc<dyn RetryObserver>) -> Self {
        self.edit(|s| s.observer = observer)
    }

    /// Starts no retry with less than `min_attempt` of the call's deadline left after its
    /// backoff: an attempt that cannot finish only adds load.
    pub fn min_attempt(self, min_attempt: std::time::Duration) -> Self {
        self.edit(|s| s.min_attempt = min_attempt)
    }

    /// Makes this layer the one retrying layer of the calls it retries: a call that it
    /// retried, or would have retried but the throttle, the deadline or a pushback
    /// refused, fails with `grpc-retry-pushback-ms: -1`. A service that relays that
    /// answer tells its own caller — a gRFC A6 client — not to retry on top, which would
    /// multiply the load this layer already put on the servers below.
    pub fn refuse_caller_retries(self) -> Self {
        self.edit(|s| s.refuse_caller_retries = true)
    }

    /// Ends the message of a call that failed after retries (or a refused retry) with the
    /// attempts made and why they stopped — `[edge: 3 attempts, stopped by the retry
    /// budget]` for `who = "edge"` — so the caller can tell the layer's verdict from the
    /// server's. Off by default: a gRFC A6 client returns the server's status as it is.
    pub fn annotate_failures(self, who: &str) -> Self {
        let who = who.to_owned();
        self.edit(|s| s.label = Some(who))
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = RetryService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryService {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// The service [`RetryLayer`] makes.
#[derive(Clone)]
pub struct RetryService<S> {
    /// Where attempts go.
    inner: S,
    /// Config, throttle, buffers.
    shared: Arc<Shared>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for RetryService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ResBody> Service<http::Request<Body>> for RetryService<S>
where
    S: Service<http::Request<Body>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError> + Send,
    ResBody: Default + Send + 'static,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // The inner service was made ready for this call; keep that one, use a clone later.
        let ready = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, ready);
        let shared = Arc::clone(&self.shared);
        let method = method_config(&shared.config, request.uri().path());
        let timeout = method.and_then(|m| m.timeout);
        let policy = method.and_then(|m| m.policy.clone());
        match policy {
            // Not the layer's to retry (and maybe streaming: its body is not buffered), but a
            // CANCELLED the caller did not ask for is still told apart (`judge`).
            None => {
                let mut ready = ready;
                let call = ready.call(request);
                Box::pin(async move {
                    match judge(call.await, None) {
                        Verdict::Committed(answer)
                        | Verdict::Failed {
                            answer: Some(answer),
                            ..
                        }
                        | Verdict::Unprocessed {
                            answer: Some(answer),
                            ..
                        } => answer,
                        Verdict::Failed { status, .. } | Verdict::Unprocessed { status, .. } => {
                            Ok(status.into_http())
                        }
                    }
                })
            }
            Some(CallPolicy::Retry(policy)) => {
                Box::pin(retrying(ready, shared, policy, timeout, request))
            }
            Some(CallPolicy::Hedging(policy)) => {
                Box::pin(hedging(ready, shared, policy, timeout, request))
            }
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The method config of the method at `path` (`/package.Service/Method`).
fn method_config<'c>(config: &'c ServiceConfig, path: &str) -> Option<&'c MethodConfig> {
    let (service, method) = path.trim_start_matches('/').split_once('/')?;
    config.for_method(service, method)
}

/// A request's body, read into memory for replay, holding its share of the channel's
/// buffer until dropped.
struct Buffered {
    bytes: Bytes,
    shared: Arc<Shared>,
}

impl Drop for Buffered {
    fn drop(&mut self) {
        self.shared
            .buffered
            .fetch_sub(self.bytes.len(), Ordering::AcqRel);
    }
}

/// Bytes of the channel's buffer held by a call still reading its body: given back on
/// drop, however the read ends (cancellation included).
struct Reservation<'a> {
    shared: &'a Shared,
    bytes: usize,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.shared.buffered.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Reads `body` up to the limits: `Ok` with all of it, or `Err` with a body that replays
/// what was read and then the rest (to send once, unretried).
async fn buffer(shared: &Arc<Shared>, mut body: Body) -> Result<Buffered, Body> {
    let mut bytes = BytesMut::new();
    let mut reservation = Reservation { shared, bytes: 0 };
    loop {
        let frame = match body.frame().await {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(error)) => return Err(futures_error_body(bytes.freeze(), error)),
        };
        let Ok(data) = frame.into_data() else {
            continue; // request trailers: gRPC clients send none
        };
        let size = data.len();
        let total = shared.buffered.fetch_add(size, Ordering::AcqRel) + size;
        reservation.bytes += size;
        bytes.extend_from_slice(&data);
        if bytes.len() > shared.per_call_limit || total > shared.per_channel_limit {
            return Err(chain(bytes.freeze(), body));
        }
        if body.is_end_stream() {
            break;
        }
    }
    // The bytes are now held by the `Buffered`, which gives them back when dropped.
    reservation.bytes = 0;
    Ok(Buffered {
        bytes: bytes.freeze(),
        shared: Arc::clone(shared),
    })
}

/// A call ready to be attempted again and again.
struct Prepared {
    /// `/package.Service/Method`, for the observer.
    path: String,
    /// The request's head, copied into each attempt.
    parts: http::request::Parts,
    /// The request's body, replayed by each attempt.
    body: Buffered,
    /// When the call ends.
    deadline: Option<tokio::time::Instant>,
}

/// Buffers a call for replay. A call over the buffer limits comes back as the request to
/// send once, unretried (already reported to the observer as its only attempt).
async fn prepare(
    shared: &Arc<Shared>,
    request: http::Request<Body>,
    timeout: Option<std::time::Duration>,
) -> Result<Prepared, http::Request<Body>> {
    let path = request.uri().path().to_owned();
    let (parts, body) = request.into_parts();
    let deadline = deadline_of(&parts, timeout);
    match buffer(shared, body).await {
        Ok(body) => Ok(Prepared {
            path,
            parts,
            body,
            deadline,
        }),
        Err(whole) => {
            shared.observer.attempt(
                &path,
                &AttemptInfo {
                    previous: 0,
                    retry_of: None,
                    timeout: None,
                },
            );
            Err(http::Request::from_parts(parts, whole))
        }
    }
}

/// A body of `prefix`, then whatever `rest` still yields.
fn chain(prefix: Bytes, rest: Body) -> Body {
    let first = futures::stream::once(async move { Ok(http_body::Frame::data(prefix)) });
    let rest = http_body_util::BodyStream::new(rest);
    Body::new(http_body_util::StreamBody::new(futures::StreamExt::chain(
        first, rest,
    )))
}

/// A body of `prefix`, then `error`.
fn futures_error_body(prefix: Bytes, error: Status) -> Body {
    let frames: Vec<Result<http_body::Frame<Bytes>, Status>> =
        vec![Ok(http_body::Frame::data(prefix)), Err(error)];
    Body::new(http_body_util::StreamBody::new(futures::stream::iter(
        frames,
    )))
}

/// What an attempt's answer says, before its body is read.
enum Verdict<R> {
    /// Headers without a status (the call is committed), or OK: hand it back.
    Committed(R),
    /// A Trailers-Only failure, or no answer: maybe retry.
    Failed { status: Status, answer: Option<R> },
    /// No answer, and the request provably never reached the server's application (see
    /// [`never_processed`]): sending it again is safe whatever the policy says, once
    /// (gRFC A6's transparent retry). Otherwise it is an UNAVAILABLE failure.
    Unprocessed { status: Status, answer: Option<R> },
}

/// Judges an attempt's answer. CANCELLED means "the caller cancelled", and this layer's
/// caller did not — it is still waiting for the answer — so CANCELLED never passes up:
///
/// - the call's deadline passed (the channel's own timer enforcing the `grpc-timeout` it
///   sent reports CANCELLED): DEADLINE_EXCEEDED;
/// - the request never left, or was refused unprocessed, because its connection was
///   closing (a draining server's GOAWAY): a transparent retry, else UNAVAILABLE;
/// - a server or connection that cancelled the call otherwise: UNAVAILABLE, the code for
///   "try again".
fn judge<B: Default, E: Into<BoxError>>(
    result: Result<http::Response<B>, E>,
    deadline: Option<tokio::time::Instant>,
) -> Verdict<Result<http::Response<B>, E>> {
    let deadline_passed = || deadline.is_some_and(|d| tokio::time::Instant::now() >= d);
    let failed = |status: Status| Verdict::Failed {
        answer: Some(Ok(status.clone().into_http())),
        status,
    };
    match result {
        Ok(response) => match Status::from_header_map(response.headers()) {
            Some(status) if status.code() == Code::Cancelled => {
                if deadline_passed() {
                    failed(Status::deadline_exceeded(status.message().to_owned()))
                } else {
                    failed(Status::with_metadata(
                        Code::Unavailable,
                        format!("the server cancelled the call: {}", status.message()),
                        status.metadata().clone(),
                    ))
                }
            }
            Some(status) if status.code() != Code::Ok => Verdict::Failed {
                status,
                answer: Some(Ok(response)),
            },
            _ => Verdict::Committed(Ok(response)),
        },
        // No answer: the status tonic would have made of the error, answered as a gRPC
        // response, with CANCELLED told apart as above.
        Err(error) => {
            let error: BoxError = error.into();
            if is_local_timeout(&*error) {
                return failed(Status::deadline_exceeded(
                    "the call's deadline passed before an answer",
                ));
            }
            if never_processed(&*error) {
                let status = Status::unavailable(format!(
                    "the call never reached the server (its connection was closing or could not be made): {error}"
                ));
                return Verdict::Unprocessed {
                    answer: Some(Ok(status.clone().into_http())),
                    status,
                };
            }
            let status = transport_failure_as_unavailable(Status::from_error(error));
            match status.code() {
                Code::Cancelled if deadline_passed() => {
                    failed(Status::deadline_exceeded(status.message().to_owned()))
                }
                Code::Cancelled => failed(Status::unavailable(format!(
                    "the connection cancelled the call: {}",
                    status.message()
                ))),
                _ => failed(status),
            }
        }
    }
}

/// The answer when the call's deadline ends it.
fn deadline_exceeded<B: Default>() -> http::Response<B> {
    Status::deadline_exceeded("the call's deadline passed before an answer").into_http()
}

/// The answer of a retried call that failed for good, told the way the layer was set up:
/// its message naming the attempts and why they stopped (`annotate_failures`), and a
/// negative pushback where this layer was the retrying one (`refuse_caller_retries`).
fn failed_answer<B: Default>(
    shared: &Shared,
    response: http::Response<B>,
    stop: StopReason,
    attempts: u32,
    max_attempts: u32,
) -> http::Response<B> {
    if !stop.is_the_loops_verdict(attempts, max_attempts) {
        return response; // nothing was retried or refused: the answer is the server's
    }
    let mut response = match (&shared.label, Status::from_header_map(response.headers())) {
        (Some(who), Some(status)) => {
            let message = stop.annotate(status.message(), who, attempts, max_attempts);
            Status::with_metadata(status.code(), message, status.metadata().clone()).into_http()
        }
        _ => response,
    };
    if shared.refuse_caller_retries && stop.retries_were_spent(attempts, max_attempts) {
        response
            .headers_mut()
            .insert(PUSHBACK_HEADER, http::HeaderValue::from_static("-1"));
    }
    response
}

async fn retrying<S, ResBody>(
    mut inner: S,
    shared: Arc<Shared>,
    policy: RetryPolicyConfig,
    timeout: Option<std::time::Duration>,
    request: http::Request<Body>,
) -> Result<http::Response<ResBody>, S::Error>
where
    S: Service<http::Request<Body>, Response = http::Response<ResBody>> + Clone + Send,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResBody: Default,
{
    let Prepared {
        path,
        parts,
        body,
        deadline,
    } = match prepare(&shared, request, timeout).await {
        Ok(call) => call,
        Err(once) => return inner.call(once).await,
    };
    let backoff = Backoff::new(policy.jitter, policy.initial_backoff, policy.max_backoff)
        .with_multiplier(policy.backoff_multiplier);
    let mut retrying = Retrying::start(
        policy.max_attempts,
        &policy.retryable_status_codes,
        backoff,
        shared.throttle.as_deref(),
    );
    let mut retry_of = None;
    let mut resent_unprocessed = false;
    // Whether an attempt could still start after `wait`.
    let has_room = |wait: Duration| {
        deadline.is_none_or(|deadline| {
            deadline.saturating_duration_since(tokio::time::Instant::now())
                > wait + shared.min_attempt
        })
    };
    // The failed answer to give, and why; a success returns from inside.
    let (answer, stop) = loop {
        let previous = retrying.attempts;
        let attempt = attempt_request(&parts, &body, previous, deadline);
        let left = deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()));
        shared.observer.attempt(
            &path,
            &AttemptInfo {
                previous,
                retry_of,
                timeout: left,
            },
        );
        // The attempt's span: a client span in a trace, the parent of the server's span
        // (layers below this one inject it into the request when exporting).
        let span = tracing::info_span!(
            "attempt",
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            attempt = previous + 1,
            retry_of = retry_of.map(|code: Code| format!("{code:?}")),
            timeout_ms = left.map(|left| left.as_millis() as u64),
            outcome = tracing::field::Empty,
        );
        let call = async {
            match inner.ready().await {
                Ok(ready) => ready.call(attempt).await,
                Err(error) => Err(error),
            }
        }
        .instrument(span.clone());
        retrying.attempts += 1;
        // The deadline is enforced here too: a server that ignores grpc-timeout, or a
        // network gone silent, must not hold the call past it.
        let result = match deadline {
            Some(deadline) => match tokio::time::timeout_at(deadline, call).await {
                Ok(result) => result,
                Err(_) => Ok(deadline_exceeded()),
            },
            None => call.await,
        };
        let (status, answer) = match judge(result, deadline) {
            Verdict::Committed(answer) => {
                span.record("outcome", "OK");
                retrying.succeeded();
                shared
                    .observer
                    .call_finished(&path, retrying.attempts + u32::from(resent_unprocessed));
                return answer;
            }
            // Sent again at once, whatever the policy: it never reached the server. Once
            // only, so a server that keeps refusing is not hammered; and not one of
            // `maxAttempts` (gRFC A6), so it neither spends nor marks an attempt.
            Verdict::Unprocessed { status, .. }
                if !resent_unprocessed && has_room(Duration::ZERO) =>
            {
                span.record("outcome", "never processed");
                resent_unprocessed = true;
                retrying.attempts -= 1;
                retry_of = Some(status.code());
                continue;
            }
            Verdict::Failed { status, answer } | Verdict::Unprocessed { status, answer } => {
                (status, answer)
            }
        };
        span.record("outcome", format!("{:?}", status.code()));
        span.record("otel.status_code", "ERROR");
        let answer =
            answer.unwrap_or_else(|| unreachable!("a failed attempt always has its answer"));
        let pushback = answer
            .as_ref()
            .map(|response| pushback_of(response.headers()))
            .unwrap_or(Pushback::Absent);
        match retrying.after_failure(status.code(), pushback, has_room, &shared.rng) {
            Next::RetryAfter(wait) => {
                retry_of = Some(status.code());
                tokio::time::sleep(wait).await;
            }
            Next::NoRoom { wait } => {
                shared.observer.refused(&path, Refusal::Deadline);
                // The call fails DEADLINE_EXCEEDED, as it would have had the retry been
                // made (grpc-go's answer), keeping the last failure in its message and
                // metadata.
                let status = Status::with_metadata(
                    Code::DeadlineExceeded,
                    format!(
                        "last failure {:?}: {}; a retry after {wait:?} would not fit before the deadline",
                        status.code(),
                        status.message(),
                    ),
                    status.metadata().clone(),
                );
                break (Ok(status.into_http()), StopReason::NoRoom);
            }
            Next::Stop(reason) => {
                if let Some(refusal) = reason.refusal() {
                    shared.observer.refused(&path, refusal);
                }
                break (answer, reason);
            }
        }
    };
    shared
        .observer
        .call_finished(&path, retrying.attempts + u32::from(resent_unprocessed));
    let max_attempts = policy.max_attempts;
    answer.map(|response| failed_answer(&shared, response, stop, retrying.attempts, max_attempts))
}

/// Attempt number `previous + 1` of a buffered call: the same request, marked with
/// `grpc-previous-rpc-attempts` after the first, its `grpc-timeout` the time left.
fn attempt_request(
    parts: &http::request::Parts,
    body: &Buffered,
    previous: u32,
    deadline: Option<tokio::time::Instant>,
) -> http::Request<Body> {
    let mut attempt = http::Request::from_parts(
        parts.clone(),
        Body::new(http_body_util::Full::new(body.bytes.clone())),
    );
    if previous > 0 {
        attempt
            .headers_mut()
            .insert(PREVIOUS_ATTEMPTS_HEADER, http::HeaderValue::from(previous));
    }
    if let Some(deadline) = deadline {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if let Ok(value) = http::HeaderValue::from_str(&format_grpc_timeout(left)) {
            attempt.headers_mut().insert(TIMEOUT_HEADER, value);
        }
    }
    attempt
}

/// An absolute deadline for a call, put in its request's extensions by a layer above
/// ([`PropagateDeadlineLayer`](crate::PropagateDeadlineLayer)). The relative `grpc-timeout`
/// alone would start counting again after any wait between the two layers (a busy channel,
/// say); the layer uses whichever ends first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallDeadline(pub tokio::time::Instant);

/// The call's deadline: its [`CallDeadline`], its `grpc-timeout`, or the method config's
/// `timeout`, whichever ends first.
fn deadline_of(
    parts: &http::request::Parts,
    configured: Option<std::time::Duration>,
) -> Option<tokio::time::Instant> {
    let now = tokio::time::Instant::now();
    let sent = parts
        .headers
        .get(TIMEOUT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_grpc_timeout(v).ok());
    [
        parts.extensions.get::<CallDeadline>().map(|d| d.0),
        sent.and_then(|timeout| now.checked_add(timeout)),
        configured.and_then(|timeout| now.checked_add(timeout)),
    ]
    .into_iter()
    .flatten()
    .min()
}

/// gRFC A6 hedging ([`hedge_attempts`]), then the call's failure told as the layer was set
/// up: after more than one attempt, the layer was the one sending copies, so its caller is
/// told not to retry on top (`refuse_caller_retries`) and the message says so
/// (`annotate_failures`).
async fn hedging<S, ResBody>(
    inner: S,
    shared: Arc<Shared>,
    policy: HedgingPolicy,
    timeout: Option<std::time::Duration>,
    request: http::Request<Body>,
) -> Result<http::Response<ResBody>, S::Error>
where
    S: Service<http::Request<Body>, Response = http::Response<ResBody>> + Clone + Send,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResBody: Default,
{
    let path = request.uri().path().to_owned();
    let max_attempts = policy.max_attempts;
    let mut sent = 0;
    let mut resent_unprocessed = false;
    let answer = hedge_attempts(
        inner,
        Arc::clone(&shared),
        policy,
        timeout,
        request,
        &mut sent,
        &mut resent_unprocessed,
    )
    .await;
    shared
        .observer
        .call_finished(&path, sent + u32::from(resent_unprocessed));
    answer.map(
        |response| match Status::from_header_map(response.headers()) {
            Some(status) if status.code() != Code::Ok => {
                let stop = if sent > 1 {
                    StopReason::MaxAttempts
                } else {
                    StopReason::NotRetryable
                };
                failed_answer(&shared, response, stop, sent, max_attempts)
            }
            _ => response,
        },
    )
}

/// gRFC A6 hedging: the first attempt now, another every `hedgingDelay` (at once after a
/// non-fatal failure) up to `maxAttempts`, while the throttle allows; the first committed
/// answer or fatal failure wins and the other attempts are dropped — cancelled, as the
/// server sees it. `sent` counts the attempts made.
async fn hedge_attempts<S, ResBody>(
    inner: S,
    shared: Arc<Shared>,
    policy: HedgingPolicy,
    timeout: Option<std::time::Duration>,
    request: http::Request<Body>,
    sent: &mut u32,
    resent_unprocessed: &mut bool,
) -> Result<http::Response<ResBody>, S::Error>
where
    S: Service<http::Request<Body>, Response = http::Response<ResBody>> + Clone + Send,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResBody: Default,
{
    use futures::{StreamExt, stream::FuturesUnordered};

    let Prepared {
        path,
        parts,
        body,
        deadline,
    } = match prepare(&shared, request, timeout).await {
        Ok(call) => call,
        Err(once) => {
            let mut inner = inner;
            return inner.call(once).await;
        }
    };
    if let Some(throttle) = &shared.throttle {
        throttle.first_attempt();
    }
    // Every attempt goes through a fresh clone (`oneshot`); the instance made ready for
    // this call would otherwise keep a slot of the channel's buffer for the whole call.
    let inner = {
        let fresh = inner.clone();
        drop(inner);
        fresh
    };
    // An attempt on its way, yielding its `grpc-previous-rpc-attempts` with its answer.
    let send = move |previous: u32, attempt| {
        let inner = inner.clone();
        async move { (previous, inner.oneshot(attempt).await) }
    };
    let mut running = FuturesUnordered::new();
    let mut last_failure = None;
    let mut last_failure_code = None;
    let mut next_hedge = Some(tokio::time::Instant::now());
    loop {
        // Send the hedge that is due, without waiting on a timer for one due now (the
        // first attempt, or the one after a non-fatal failure).
        if next_hedge.is_some_and(|at| at <= tokio::time::Instant::now()) {
            next_hedge = None;
            // The first attempt always goes; hedges only while the deadline has room.
            let past_deadline =
                *sent > 0 && deadline.is_some_and(|d| tokio::time::Instant::now() >= d);
            let throttled = *sent > 0 && shared.throttle.as_ref().is_some_and(|t| !t.try_retry());
            if past_deadline || throttled {
                shared.observer.refused(
                    &path,
                    if throttled {
                        Refusal::Throttle
                    } else {
                        Refusal::Deadline
                    },
                );
                if running.is_empty()
                    && let Some(failure) = last_failure
                {
                    return failure;
                }
            } else {
                let attempt = attempt_request(&parts, &body, *sent, deadline);
                shared.observer.attempt(
                    &path,
                    &AttemptInfo {
                        previous: *sent,
                        retry_of: last_failure_code,
                        timeout: deadline
                            .map(|d| d.saturating_duration_since(tokio::time::Instant::now())),
                    },
                );
                *sent += 1;
                running.push(send(*sent - 1, attempt));
                if *sent < policy.max_attempts {
                    next_hedge = Some(tokio::time::Instant::now() + policy.hedging_delay);
                }
            }
        }
        let hedge_due = async {
            match next_hedge {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let deadline_passes = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            Some((previous, result)) = running.next(), if !running.is_empty() => {
                match judge(result, deadline) {
                    // Never reached the server: sent again at once, once, not counted.
                    Verdict::Unprocessed { .. }
                        if !*resent_unprocessed
                            && deadline.is_none_or(|d| tokio::time::Instant::now() < d) =>
                    {
                        *resent_unprocessed = true;
                        shared.observer.attempt(
                            &path,
                            &AttemptInfo {
                                previous,
                                retry_of: Some(Code::Unavailable),
                                timeout: deadline
                                    .map(|d| d.saturating_duration_since(tokio::time::Instant::now())),
                            },
                        );
                        running.push(send(previous, attempt_request(&parts, &body, previous, deadline)));
                    }
                    Verdict::Committed(answer) => {
                        if let Some(throttle) = &shared.throttle {
                            throttle.attempt_succeeded();
                        }
                        return answer; // the others are dropped: cancelled
                    }
                    Verdict::Failed { status, answer } | Verdict::Unprocessed { status, answer } => {
                        let non_fatal = policy.non_fatal_status_codes.contains(&status.code());
                        if !non_fatal {
                            return answer.unwrap_or_else(|| unreachable!("failed with an answer"));
                        }
                        if let Some(throttle) = &shared.throttle {
                            throttle.attempt_failed();
                        }
                        let pushback = answer
                            .as_ref()
                            .and_then(|a| a.as_ref().ok())
                            .map(|response| pushback_of(response.headers()))
                            .unwrap_or(Pushback::Absent);
                        last_failure = answer;
                        last_failure_code = Some(status.code());
                        if *sent < policy.max_attempts {
                            next_hedge = match pushback {
                                // A6: a non-fatal failure sends the next hedge at once…
                                Pushback::Absent => Some(tokio::time::Instant::now()),
                                // …or after the server's pushback, or never.
                                Pushback::RetryAfter(wait) => Some(tokio::time::Instant::now() + wait),
                                Pushback::DoNotRetry => {
                                    shared.observer.refused(&path, Refusal::Pushback);
                                    None
                                }
                            };
                        }
                        if running.is_empty() && next_hedge.is_none() {
                            return last_failure.unwrap_or_else(|| unreachable!("a failure was kept"));
                        }
                    }
                }
            }
            () = hedge_due => {}
            () = deadline_passes => return Ok(deadline_exceeded()),
        }
    }
}

fn pushback_of(headers: &http::HeaderMap) -> Pushback {
    parse_pushback(
        headers
            .get(PUSHBACK_HEADER)
            .map(|value| value.to_str().unwrap_or("malformed")),
    )
}
