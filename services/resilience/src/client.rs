//! The face of the retry engine: [`RetryLayer`], configured by a gRPC service config, and
//! the two services it makes — [`RetryService`] over a tonic client (a `Channel`, any
//! `GrpcService`), and [`RetryCalls`] over an in-process service whose requests can be
//! cloned. Both drive the same loop ([`engine`](crate::engine)) and hedging
//! ([`hedge`](crate::hedge)).
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
//! streaming body, which is not `Clone` (hyperium/tonic#733). What the layer does, exactly
//! as gRFC A6 says:
//!
//! - **Which calls**: those whose method has a `retryPolicy` or `hedgingPolicy` in the
//!   service config (exact method, then the service, then the default). Others pass
//!   through, unbuffered (they may be streaming), unless the layer was told that every
//!   call is unary ([`RetryLayer::unary`]): then they are buffered too, so that a call that
//!   never reached the server can be sent again.
//! - **Committed on headers**: once the server sends response headers, the call is
//!   committed and never retried, whatever its trailers say.
//! - **Which failures**: exactly `retryableStatusCodes`; a failure to reach the server
//!   counts as UNAVAILABLE, and one that provably never reached it is sent again at once,
//!   once, whatever the policy (A6's transparent retry).
//! - **When**: after the backoff (`initialBackoff · backoffMultiplier^n`, capped at
//!   `maxBackoff`, jittered), or exactly the server's pushback; a negative, malformed or
//!   doubled pushback ends the call.
//! - **How many**: `maxAttempts` (at most 5), and, with `retryThrottling`, only while the
//!   channel's throttle has more than half its tokens.
//! - **Marked**: every retry carries its previous attempts.
//! - **Deadline**: the call's [`CallDeadline`](crate::CallDeadline), the timeout its caller wrote on it, or
//!   the method config's `timeout`, whichever ends first, bounds it: each attempt is sent
//!   the time left, no attempt starts and no backoff sleeps past it, and a call still
//!   unanswered then ends DEADLINE_EXCEEDED.
//!
//! Streaming calls (client- or bidirectional-streaming) must not be given a retry policy:
//! their body does not end before the response starts, so the layer would wait for it.

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use rand::{SeedableRng, rngs::SmallRng};
use tokio::time::Instant;
use tonic::{Status, body::Body};
use tower::{Layer, Service, ServiceExt};

use crate::{
    classify::transport_failure_as_unavailable,
    engine::{self, Attempt, Attempts, Call, Settings, Verdict, uncancelled},
    hedge,
    observe::RetryObserver,
    replay::{DEFAULT_PER_CALL_LIMIT, DEFAULT_PER_CHANNEL_LIMIT, Replay, ReplayBudget},
    service_config::{CallPolicy, MethodConfig, RetryPolicyConfig, ServiceConfig},
    throttle::Throttle,
};

/// Retries calls per a service config; see the module docs.
#[derive(Clone)]
pub struct RetryLayer {
    /// What is shared by every service this layer makes.
    shared: Arc<Shared>,
}

/// A layer's configuration and state, shared by its services and their calls.
struct Shared {
    /// Which methods retry, and how.
    config: Arc<ServiceConfig>,
    /// What the loop needs: throttle, jitter, observer, minimum, how failures are told.
    settings: Settings,
    /// Bytes held for replay.
    replay: Arc<ReplayBudget>,
    /// Whether every call is unary (so every call may be buffered).
    unary: bool,
    /// The per-attempt timeout of a call whose method config sets none.
    per_try: Option<Duration>,
}

impl Shared {
    /// The method config for `path` (`/package.Service/Method`).
    fn method(&self, path: &str) -> Option<&MethodConfig> {
        let (service, method) = path.trim_start_matches('/').split_once('/')?;
        self.config.for_method(service, method)
    }

    /// A copy with its own buffer accounting and jitter: what a layer becomes when a
    /// setting changes after it was cloned.
    fn copy(&self) -> Self {
        let s = &self.settings;
        Self {
            config: Arc::clone(&self.config),
            settings: Settings {
                throttle: s.throttle.clone(),
                rng: Mutex::new(rand::make_rng()),
                observer: Arc::clone(&s.observer),
                min_attempt: s.min_attempt,
                refuse_caller_retries: s.refuse_caller_retries,
                label: s.label.clone(),
            },
            replay: Arc::new(ReplayBudget::new(
                self.replay.per_call,
                self.replay.per_channel,
            )),
            unary: self.unary,
            per_try: self.per_try,
        }
    }
}

impl std::fmt::Debug for RetryLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryLayer")
            .field("config", &self.shared.config)
            .field("replay", &self.shared.replay)
            .finish_non_exhaustive()
    }
}

impl RetryLayer {
    /// A layer applying `config` (its `retryThrottling` or `adaptiveThrottling` becomes the
    /// layer's throttle). The
    /// config is shared, not copied: a service parses it once and hands it to every layer.
    pub fn new(config: impl Into<Arc<ServiceConfig>>) -> Self {
        let config = config.into();
        let throttle = config.throttle();
        Self {
            shared: Arc::new(Shared {
                config,
                settings: Settings {
                    throttle,
                    rng: Mutex::new(rand::make_rng()),
                    observer: Arc::new(()),
                    min_attempt: Duration::ZERO,
                    refuse_caller_retries: false,
                    label: None,
                },
                replay: Arc::new(ReplayBudget::new(
                    DEFAULT_PER_CALL_LIMIT,
                    DEFAULT_PER_CHANNEL_LIMIT,
                )),
                unary: false,
                per_try: None,
            }),
        }
    }

    /// Changes a setting. A layer that was cloned (or has made services) is copied first,
    /// so the change never reaches services already made.
    fn edit(mut self, f: impl FnOnce(&mut Shared)) -> Self {
        if Arc::get_mut(&mut self.shared).is_none() {
            self.shared = Arc::new(self.shared.copy());
        }
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            f(shared);
        }
        self
    }

    /// Limits replay buffering: a call's body over `per_call`, or one that would take the
    /// layer's total over `per_channel`, goes through once, unretried.
    pub fn buffer_limits(self, per_call: usize, per_channel: usize) -> Self {
        self.edit(|s| s.replay = Arc::new(ReplayBudget::new(per_call, per_channel)))
    }

    /// Uses `throttle` instead of the config's `retryThrottling` (e.g. a [`RetryBudget`]
    /// shared with other clients).
    ///
    /// [`RetryBudget`]: crate::RetryBudget
    pub fn throttle(self, throttle: Arc<dyn Throttle>) -> Self {
        self.edit(|s| s.settings.throttle = Some(throttle))
    }

    /// No throttle, whatever the config's `retryThrottling` says: retries limited by
    /// `maxAttempts` alone (a chain's every-layer mode, the anti-pattern it shows).
    pub fn no_throttle(self) -> Self {
        self.edit(|s| s.settings.throttle = None)
    }

    /// Seeds the jitter, so tests see the same waits every run.
    pub fn seed(self, seed: u64) -> Self {
        self.edit(|s| s.settings.rng = Mutex::new(SmallRng::seed_from_u64(seed)))
    }

    /// Reports attempts and refusals to `observer`.
    pub fn observer(self, observer: Arc<dyn RetryObserver>) -> Self {
        self.edit(|s| s.settings.observer = observer)
    }

    /// Starts no attempt with less than `min_attempt` of the call's deadline left (after
    /// its backoff): an attempt that cannot finish only adds load.
    pub fn min_attempt(self, min_attempt: Duration) -> Self {
        self.edit(|s| s.settings.min_attempt = min_attempt)
    }

    /// Makes this layer the one retrying layer of the calls it retries: a call that it
    /// retried, or would have retried but the throttle, the deadline or a pushback
    /// refused, fails with a pushback of -1. A service that relays that answer tells its
    /// own caller — a gRFC A6 client — not to retry on top, which would multiply the load
    /// this layer already put on the servers below.
    pub fn refuse_caller_retries(self) -> Self {
        self.edit(|s| s.settings.refuse_caller_retries = true)
    }

    /// Ends the message of a call that failed after retries (or a refused retry) with the
    /// attempts made and why they stopped — `[edge: 3 attempts, stopped by the retry
    /// budget]` for `who = "edge"` — so the caller can tell the layer's verdict from the
    /// server's. Off by default: a gRFC A6 client returns the server's status as it is.
    pub fn annotate_failures(self, who: &str) -> Self {
        let who = who.to_owned();
        self.edit(|s| s.settings.label = Some(who))
    }

    /// Declares every call through this layer unary, so that calls whose method has no
    /// policy are buffered too, and one that never reached the server is sent again.
    pub fn unary(self) -> Self {
        self.edit(|s| s.unary = true)
    }

    /// Cuts each attempt of a call at `per_try` (Envoy's `per_try_timeout`) where that
    /// ends before the call's own time left; a method config's `retrychainPerTryTimeout`
    /// takes its place for its method. The attempt's `grpc-timeout` says so, so the server
    /// gives up with it; a [`Balancer`](crate::Balancer) below keeps the timer, tells its
    /// expiry as UNAVAILABLE (retried at another replica) and takes it as a sample of the
    /// replica's slowness. `None` (the default): an attempt may take the call's whole time.
    pub fn per_try_timeout(self, per_try: Option<Duration>) -> Self {
        self.edit(|s| s.per_try = per_try)
    }

    /// The in-process face: retries calls to `inner` (a service whose requests can be
    /// cloned) as the method config of `path` says (`/package.Service/Method`); `path` also
    /// names the calls to the observer.
    pub fn calls<S>(&self, path: &str, inner: S) -> RetryCalls<S> {
        RetryCalls {
            inner,
            shared: Arc::clone(&self.shared),
            path: Arc::from(path),
        }
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

/// The gRPC service [`RetryLayer`] makes.
#[derive(Clone)]
pub struct RetryService<S> {
    /// Where attempts go.
    inner: S,
    /// Config, settings, buffers.
    shared: Arc<Shared>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for RetryService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// One attempt and no retries: a call whose method has no policy, where the layer still
/// drives it (a unary call, for its transparent resend; an in-process call).
static SINGLE_ATTEMPT: CallPolicy = CallPolicy::Retry(RetryPolicyConfig::SINGLE_ATTEMPT);

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
        Box::pin(async move {
            // A clone of the URI shares its buffers (for an http or https URI): the path
            // without copying it.
            let uri = request.uri().clone();
            let path = uri.path();
            let method = shared.method(path);
            let per_try = method.and_then(|m| m.per_try_timeout).or(shared.per_try);
            let deadline = Replay::<S>::deadline(&request, method.and_then(|m| m.timeout));
            let policy = match method.and_then(|m| m.policy.as_ref()) {
                Some(policy) => policy,
                None if shared.unary => &SINGLE_ATTEMPT,
                None => return pass_through(ready, request).await,
            };
            let replay = match Replay::prepare(ready, &shared.replay, request, per_try).await {
                Ok(replay) => replay,
                Err((mut inner, whole)) => return inner.call(whole).await, // over the limits
            };
            let call = Call {
                settings: &shared.settings,
                path,
                deadline,
            };
            match policy {
                CallPolicy::Retry(policy) => engine::retry(call, policy, replay).await,
                CallPolicy::Hedging(policy) => hedge::hedge(call, policy, replay).await,
            }
        })
    }
}

/// A call the layer does not retry: sent once, its CANCELLED told apart (the caller did
/// not cancel).
async fn pass_through<S, ResBody>(
    mut inner: S,
    request: http::Request<Body>,
) -> Result<http::Response<ResBody>, S::Error>
where
    S: Service<http::Request<Body>, Response = http::Response<ResBody>>,
    S::Error: Into<BoxError>,
    ResBody: Default,
{
    match inner.call(request).await {
        Ok(response) => match crate::wire::failure_in(response.headers()) {
            Some(status) if status.code() == tonic::Code::Cancelled => {
                Ok(uncancelled(status, None).into_http())
            }
            _ => Ok(response),
        },
        Err(error) => {
            let status = transport_failure_as_unavailable(Status::from_error(error.into()));
            Ok(uncancelled(status, None).into_http())
        }
    }
}

/// An in-process call for [`RetryCalls`]: the request, and when the call ends.
#[derive(Debug, Clone)]
pub struct CallRequest<R> {
    /// What each attempt sends (cloned per attempt).
    pub request: R,
    /// When the call ends, if it must.
    pub deadline: Option<Instant>,
}

/// One attempt of an in-process call, as the retried service receives it.
#[derive(Debug, Clone)]
pub struct AttemptRequest<R> {
    /// The call's request.
    pub request: R,
    /// Which attempt this is, and until when.
    pub attempt: Attempt,
}

/// The in-process face of the engine (see [`RetryLayer::calls`]).
#[derive(Clone)]
pub struct RetryCalls<S> {
    /// The retried service.
    inner: S,
    /// Config, settings.
    shared: Arc<Shared>,
    /// Whose method config applies, and the calls' name to the observer.
    path: Arc<str>,
}

impl<S> std::fmt::Debug for RetryCalls<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryCalls")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl<S, R, T> Service<CallRequest<R>> for RetryCalls<S>
where
    S: Service<AttemptRequest<R>, Response = T, Error = Status> + Clone + Send + 'static,
    S::Future: Send,
    R: Clone + Send + 'static,
    T: Send + 'static,
{
    type Response = T;
    type Error = Status;
    type Future = BoxFuture<Result<T, Status>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        // Each attempt waits for readiness of its own clone (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: CallRequest<R>) -> Self::Future {
        let shared = Arc::clone(&self.shared);
        let path = Arc::clone(&self.path);
        let inner = self.inner.clone();
        Box::pin(async move {
            let method = shared.method(&path);
            let configured = method
                .and_then(|m| m.timeout)
                .and_then(|t| Instant::now().checked_add(t));
            let deadline = [call.deadline, configured].into_iter().flatten().min();
            let policy = method
                .and_then(|m| m.policy.as_ref())
                .unwrap_or(&SINGLE_ATTEMPT);
            let attempts = Cloning {
                inner,
                request: call.request,
            };
            let call = Call {
                settings: &shared.settings,
                path: &path,
                deadline,
            };
            match policy {
                CallPolicy::Retry(policy) => engine::retry(call, policy, attempts).await,
                CallPolicy::Hedging(policy) => hedge::hedge(call, policy, attempts).await,
            }
        })
    }
}

/// In-process attempts: the request cloned for each.
struct Cloning<S, R> {
    inner: S,
    request: R,
}

impl<S, R, T> Attempts for Cloning<S, R>
where
    S: Service<AttemptRequest<R>, Response = T, Error = Status> + Clone + Send + 'static,
    S::Future: Send,
    R: Clone + Send + 'static,
    T: Send + 'static,
{
    type Answer = Result<T, Status>;
    type Sent = tower::util::Oneshot<S, AttemptRequest<R>>;

    fn send(&mut self, attempt: &Attempt) -> Self::Sent {
        self.inner.clone().oneshot(AttemptRequest {
            request: self.request.clone(),
            attempt: *attempt,
        })
    }

    fn judge(&self, answer: Self::Answer, deadline: Option<Instant>) -> Verdict<Self::Answer> {
        match answer {
            Ok(value) => Verdict::Committed(Ok(value)),
            Err(status) => {
                let status = uncancelled(transport_failure_as_unavailable(status), deadline);
                Verdict::Failed {
                    answer: Err(status.clone()),
                    status,
                }
            }
        }
    }

    fn failure(&self, status: Status) -> Self::Answer {
        Err(status)
    }

    fn restate(
        &self,
        answer: Self::Answer,
        restate: impl FnOnce(Status) -> Status,
    ) -> Self::Answer {
        answer.map_err(restate)
    }
}
