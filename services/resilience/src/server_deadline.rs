//! The server side of deadline propagation, as a tower layer.
//!
//! [`DeadlineLayer`] reads the incoming request's timeout once, as it arrives (or applies
//! the default: the method config's `timeout`, else the layer's), refuses a malformed one
//! with INVALID_ARGUMENT before any handler runs, and hands the handler an
//! [`IncomingDeadline`] through its task ([`IncomingDeadline::guard`]): when the caller stops waiting, and
//! `answer_by`, a little earlier, when the handler must answer DEADLINE_EXCEEDED itself.
//! That matters because tonic enforces an incoming timeout by dropping the handler and answering
//! CANCELLED, which a caller must not retry and cannot tell from a user's cancel; a handler
//! that answers first keeps the status honest and can put its own metadata (trace id, the
//! key the edge made) on the answer.
//!
//! The layer also enforces the deadline itself, from the moment the request's headers
//! arrived: tonic calls a unary handler only once the whole request body has arrived, so a
//! client that never finishes its body (or sends it slowly) would otherwise hold a stream
//! open past its deadline (under tonic's own server, until its timer answered CANCELLED;
//! served on hyper directly, for as long as the client likes). It fires
//! half a reserve after `answer_by` (still before the caller's deadline), so a running
//! handler, whose guard (`RpcScope::run` in retrychain-node) fires at `answer_by`, answers
//! first, with its own metadata. A handler that has a guard says so
//! ([`IncomingDeadline::guard`]), and the layer then arms no timer of its own: a request
//! costs one timer, and only one whose body is late costs two. (Under tonic's own server,
//! its timeout layer parses the header and arms a timer too; retrychain's services are
//! served on hyper directly, `retrychain_node::h2`, so this layer is the only one.)
//!
//! The header is read here and nowhere else in a server: the layer is the first a request
//! meets, and what it read travels as one typed value, [`IncomingDeadline`]. The layers
//! below it find it in the request's extensions (admission sizes a call's time from it,
//! [`crate::admission`]); the handler's task carries it too ([`IncomingDeadline::current`]),
//! so that a client layer below the handler ([`PropagateDeadlineLayer`]) hands every
//! downstream call a shorter one without the handler passing it along.
//!
//! [`PropagateDeadlineLayer`]: crate::propagate::PropagateDeadlineLayer

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::task::futures::TaskLocalFuture;
use tonic::Status;
use tower::{Layer, Service};

use crate::{deadline::Deadline, service_config::ServiceConfig, wire};

/// The deadline a request arrived with: read from its `grpc-timeout` once, by
/// [`DeadlineLayer`], and kept in the request's extensions and with its handler's task.
#[derive(Debug, Clone, Copy)]
pub struct IncomingDeadline {
    /// When the caller stops waiting.
    pub deadline: Deadline,
    /// The timeout the caller sent; `None` when the default was applied.
    pub received: Option<Duration>,
    /// The timeout in force: `received`, or the default, capped at the layer's maximum.
    pub timeout: Duration,
    /// When the handler must have its answer ready: the deadline less the layer's reserve.
    /// A handler that answers DEADLINE_EXCEEDED itself at this point can still stamp its own
    /// metadata (trace id, the key the edge made) on the answer.
    pub answer_by: Deadline,
}

/// What the handler's task knows of the request it serves: its deadline, and a flag the
/// handler raises when it takes over answering at `answer_by` (see [`IncomingDeadline::guard`]).
#[derive(Debug, Clone)]
struct Served {
    /// The request's deadline.
    incoming: IncomingDeadline,
    /// Raised by the handler's guard.
    guarded: Arc<AtomicBool>,
}

tokio::task_local! {
    /// The request whose handler runs on this task.
    static CURRENT: Served;
}

impl IncomingDeadline {
    /// The deadline of the request being served on this task, if a [`DeadlineLayer`] is
    /// above it: what a client layer reads to propagate it.
    pub fn current() -> Option<IncomingDeadline> {
        CURRENT.try_with(|served| served.incoming).ok()
    }

    /// The deadline of the request being served on this task, telling the layer that its
    /// handler answers DEADLINE_EXCEEDED itself at `answer_by` (with its own metadata), so
    /// that the layer need not keep a timer of its own: one timer per request, not two, on
    /// the path every request takes. The layer's timer is then armed only for a request
    /// whose handler has not started — a body that has not arrived. `None` outside a
    /// [`DeadlineLayer`].
    pub fn guard() -> Option<IncomingDeadline> {
        CURRENT
            .try_with(|served| {
                served.guarded.store(true, Ordering::Relaxed);
                served.incoming
            })
            .ok()
    }
}

/// Applies deadlines to every request of a server; see the module docs.
#[derive(Debug, Clone)]
pub struct DeadlineLayer {
    /// Applied when a request carries no timeout (and its method config has none).
    default_timeout: Duration,
    /// How long before the deadline the handler must answer.
    reserve: Duration,
    /// The longest deadline honoured; a longer timeout is cut to this. A server that
    /// promises something for "as long as a request may run" (the ledger keeps keys longer
    /// than that) needs the bound to be its own, not the caller's.
    max_timeout: Option<Duration>,
    /// Method configs whose `timeout` is the default for their method.
    methods: Option<std::sync::Arc<ServiceConfig>>,
}

impl DeadlineLayer {
    /// A layer that applies `default_timeout` to requests without a deadline and asks
    /// handlers to answer `reserve` before each deadline.
    pub fn new(default_timeout: Duration, reserve: Duration) -> Self {
        Self {
            default_timeout,
            reserve,
            max_timeout: None,
            methods: None,
        }
    }

    /// Uses each method's `timeout` in `config`, where it has one, as the default for
    /// requests of that method (as a gRPC client applies it to its calls).
    pub fn with_method_timeouts(mut self, config: std::sync::Arc<ServiceConfig>) -> Self {
        self.methods = Some(config);
        self
    }

    /// The default timeout of a request to `path`.
    fn default_for(&self, path: &str) -> Duration {
        self.methods
            .as_ref()
            .and_then(|config| {
                let (service, method) = path.trim_start_matches('/').split_once('/')?;
                config.for_method(service, method)?.timeout
            })
            .unwrap_or(self.default_timeout)
    }

    /// Caps every incoming deadline at `max` (as Envoy's `max_grpc_timeout` does): the
    /// request runs as if the caller had sent `max`.
    pub fn with_max(mut self, max: Duration) -> Self {
        self.max_timeout = Some(max);
        self
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = EnforceDeadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        EnforceDeadline {
            inner,
            config: self.clone(),
        }
    }
}

/// The service [`DeadlineLayer`] produces.
#[derive(Debug, Clone)]
pub struct EnforceDeadline<S> {
    /// The wrapped service.
    inner: S,
    /// Default and reserve.
    config: DeadlineLayer,
}

pin_project_lite::pin_project! {
    /// The future of [`EnforceDeadline`]: the inner service's, run with the request's
    /// deadline in the task (`Inner`), or an immediate refusal of a malformed
    /// timeout (`Refused`, taken when polled).
    #[project = ResponseProj]
    #[allow(missing_docs)] // the variants' fields are described above; the macro takes no field docs
    pub enum ResponseFuture<F, B> {
        Inner {
            #[pin] future: TaskLocalFuture<Served, F>,
            #[pin] answer_by: tokio::time::Sleep,
            timeout: Duration,
            guarded: Arc<AtomicBool>,
            armed: bool,
        },
        Refused { response: Option<http::Response<B>> },
    }
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<http::Response<B>, E>>,
    B: Default,
{
    type Output = Result<http::Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            ResponseProj::Inner {
                future,
                answer_by,
                timeout,
                guarded,
                armed,
            } => {
                if let Poll::Ready(answer) = future.poll(cx) {
                    return Poll::Ready(answer);
                }
                // The handler's guard answers at `answer_by`: no second timer.
                if !*armed && guarded.load(Ordering::Relaxed) {
                    return Poll::Pending;
                }
                *armed = true;
                // Dropping the inner future (done by whoever drops this one) stops reading
                // the request's body.
                // (A layer below that took the call, admission, sees it dropped: no sample of
                // how fast the server serves, which a body that never came says nothing of.)
                answer_by.poll(cx).map(|()| {
                    Ok(Status::deadline_exceeded(format!(
                        "the deadline of {timeout:?} passed before the request was answered (or before its body had arrived)"
                    ))
                    .into_http())
                })
            }
            ResponseProj::Refused { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => Poll::Pending,
            },
        }
    }
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for EnforceDeadline<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    ResBody: Default,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let received = match wire::timeout_of(request.headers()) {
            Ok(received) => received,
            Err(error) => {
                return ResponseFuture::Refused {
                    response: Some(Status::invalid_argument(error.to_string()).into_http()),
                };
            }
        };
        let mut timeout = received.unwrap_or_else(|| self.config.default_for(request.uri().path()));
        if let Some(max) = self.config.max_timeout {
            timeout = timeout.min(max);
        }
        let deadline = Deadline::after(timeout);
        let incoming = IncomingDeadline {
            deadline,
            received,
            timeout,
            answer_by: deadline.earlier_by(self.config.reserve),
        };
        request.extensions_mut().insert(incoming);
        let guarded = Arc::new(AtomicBool::new(false));
        let served = Served {
            incoming,
            guarded: Arc::clone(&guarded),
        };
        let future = CURRENT.sync_scope(served.clone(), || self.inner.call(request));
        ResponseFuture::Inner {
            future: CURRENT.scope(served, future),
            guarded,
            armed: false,
            answer_by: tokio::time::sleep_until(
                deadline.earlier_by(self.config.reserve / 2).instant(),
            ),
            timeout,
        }
    }
}
