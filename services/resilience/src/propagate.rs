//! Deadline and header propagation as client layers: a service's downstream calls inherit
//! the deadline and chosen headers of the request it is serving, without its handler
//! passing them along (tonic has neither, hyperium/tonic#2316).
//!
//! Both work through the task that serves the request. On the server, [`DeadlineLayer`]
//! and [`CarryHeadersLayer`] put the request's deadline and headers in the handler's task;
//! on the client, [`PropagateDeadlineLayer`] and [`ForwardHeadersLayer`] read them when a
//! call is made from that task. A call made from a spawned task, or outside any request,
//! goes out as it is.
//!
//! ```ignore
//! // server: the incoming deadline and idempotency-key are kept for the handler's task
//! Server::builder()
//!     .layer(DeadlineLayer::new(default, reserve))
//!     .layer(CarryHeadersLayer::new(["idempotency-key"]))
//! // client: every downstream call gets them, its deadline 20 ms shorter
//! ServiceBuilder::new()
//!     .layer(ForwardHeadersLayer)
//!     .layer(PropagateDeadlineLayer::new(Duration::from_millis(20), Duration::from_millis(20)))
//!     .layer(RetryLayer::new(config))
//!     .service(channel)
//! ```
//!
//! [`DeadlineLayer`]: crate::DeadlineLayer

use std::{
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use futures::future::Either;
use http::{HeaderMap, HeaderName};
use tokio::task::futures::TaskLocalFuture;
use tonic::Status;
use tower::{Layer, Service};

use crate::{
    client::CallDeadline,
    deadline::{format_grpc_timeout, parse_grpc_timeout},
    layer::IncomingDeadline,
    observe::{Refusal, RetryObserver},
    retry::TIMEOUT_HEADER,
};

/// Gives every outgoing call the time left on the request being served, less a margin:
/// strictly shorter than what this service has, so the call below fails first and this
/// service can still answer. A call with less than `min_attempt` left is not sent; it
/// fails DEADLINE_EXCEEDED at once and the observer hears [`Refusal::Deadline`].
///
/// A request that already carries a shorter `grpc-timeout` keeps it.
#[derive(Clone)]
pub struct PropagateDeadlineLayer {
    /// Taken off the time left.
    margin: Duration,
    /// The shortest call worth sending.
    min_attempt: Duration,
    /// Told of calls refused for lack of time.
    observer: Arc<dyn RetryObserver>,
}

impl std::fmt::Debug for PropagateDeadlineLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PropagateDeadlineLayer")
            .field("margin", &self.margin)
            .field("min_attempt", &self.min_attempt)
            .finish_non_exhaustive()
    }
}

impl PropagateDeadlineLayer {
    /// Calls get the time left less `margin`, and none is sent with less than
    /// `min_attempt`.
    pub fn new(margin: Duration, min_attempt: Duration) -> Self {
        Self {
            margin,
            min_attempt,
            observer: Arc::new(()),
        }
    }

    /// Reports calls refused for lack of time to `observer`.
    pub fn observer(mut self, observer: Arc<dyn RetryObserver>) -> Self {
        self.observer = observer;
        self
    }
}

impl<S> Layer<S> for PropagateDeadlineLayer {
    type Service = PropagateDeadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PropagateDeadline {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`PropagateDeadlineLayer`] makes.
#[derive(Debug, Clone)]
pub struct PropagateDeadline<S> {
    /// Where calls go.
    inner: S,
    /// Margin, minimum, observer.
    layer: PropagateDeadlineLayer,
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for PropagateDeadline<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    ResBody: Default,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = Either<std::future::Ready<Result<Self::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let Some(incoming) = IncomingDeadline::current() else {
            return Either::Right(self.inner.call(request));
        };
        let timeout = match incoming
            .deadline
            .downstream_timeout(self.layer.margin, self.layer.min_attempt)
        {
            Ok(timeout) => timeout,
            Err(no_room) => {
                self.layer
                    .observer
                    .refused(request.uri().path(), Refusal::Deadline);
                let status = Status::deadline_exceeded(format!(
                    "no call sent: {:?} left of the deadline, a call needs more than {:?}",
                    no_room.remaining, no_room.needed
                ));
                return Either::Left(std::future::ready(Ok(status.into_http())));
            }
        };
        let own = request
            .headers()
            .get(TIMEOUT_HEADER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| parse_grpc_timeout(value).ok());
        if own.is_none_or(|own| own > timeout)
            && let Ok(value) = http::HeaderValue::from_str(&format_grpc_timeout(timeout))
        {
            request.headers_mut().insert(TIMEOUT_HEADER, value);
        }
        // The same deadline as an instant, for a retry layer below: time spent waiting for
        // the channel between here and there still counts.
        request.extensions_mut().insert(CallDeadline(
            incoming.deadline.earlier_by(self.layer.margin).instant(),
        ));
        Either::Right(self.inner.call(request))
    }
}

tokio::task_local! {
    /// The carried headers of the request whose handler runs on this task.
    static CARRIED: Arc<HeaderMap>;
}

/// The server half of header propagation: keeps the named headers of each request in its
/// handler's task, for [`ForwardHeadersLayer`] to add to the calls the handler makes.
#[derive(Debug, Clone)]
pub struct CarryHeadersLayer {
    /// Which headers.
    names: Arc<[HeaderName]>,
}

impl CarryHeadersLayer {
    /// Carries the headers called `names`.
    pub fn new(names: impl IntoIterator<Item = HeaderName>) -> Self {
        Self {
            names: names.into_iter().collect(),
        }
    }
}

impl<S> Layer<S> for CarryHeadersLayer {
    type Service = CarryHeaders<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CarryHeaders {
            inner,
            names: Arc::clone(&self.names),
        }
    }
}

/// The service [`CarryHeadersLayer`] makes.
#[derive(Debug, Clone)]
pub struct CarryHeaders<S> {
    /// The server's services.
    inner: S,
    /// Which headers.
    names: Arc<[HeaderName]>,
}

impl<S, ReqBody> Service<http::Request<ReqBody>> for CarryHeaders<S>
where
    S: Service<http::Request<ReqBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = TaskLocalFuture<Arc<HeaderMap>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let mut carried = HeaderMap::new();
        for name in self.names.iter() {
            for value in request.headers().get_all(name) {
                carried.append(name.clone(), value.clone());
            }
        }
        // Shared, not copied, between the call and its future: one map per request.
        let carried = Arc::new(carried);
        let future = CARRIED.sync_scope(Arc::clone(&carried), || self.inner.call(request));
        CARRIED.scope(carried, future)
    }
}

/// The client half of header propagation: adds the headers [`CarryHeadersLayer`] kept for
/// the request being served to each outgoing call that does not set them itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct ForwardHeadersLayer;

impl<S> Layer<S> for ForwardHeadersLayer {
    type Service = ForwardHeaders<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ForwardHeaders { inner }
    }
}

/// The service [`ForwardHeadersLayer`] makes.
#[derive(Debug, Clone)]
pub struct ForwardHeaders<S> {
    /// Where calls go.
    inner: S,
}

impl<S, ReqBody> Service<http::Request<ReqBody>> for ForwardHeaders<S>
where
    S: Service<http::Request<ReqBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let _ = CARRIED.try_with(|carried| {
            for name in carried.keys() {
                if !request.headers().contains_key(name) {
                    for value in carried.get_all(name) {
                        request.headers_mut().append(name.clone(), value.clone());
                    }
                }
            }
        });
        self.inner.call(request)
    }
}
