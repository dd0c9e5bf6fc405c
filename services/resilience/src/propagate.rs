//! Deadline propagation as a client layer: a service's downstream calls inherit the
//! deadline of the request it is serving, without its handler passing it along (tonic has
//! none, hyperium/tonic#2316).
//!
//! It works through the task that serves the request. On the server,
//! [`DeadlineLayer`](crate::DeadlineLayer) keeps the request's deadline in the handler's
//! task; on the client, [`PropagateDeadlineLayer`] reads it when a call is made from that
//! task and hands the call a [`CallDeadline`] — an instant, never text — which the retry
//! engine below writes on each attempt as the time left. A call made from a spawned task,
//! or outside any request, goes out as it is.
//!
//! ```ignore
//! // server: the incoming deadline is kept for the handler's task
//! Server::builder().layer(DeadlineLayer::new(default, reserve))
//! // client: every downstream call gets it, 20 ms shorter
//! ServiceBuilder::new()
//!     .layer(PropagateDeadlineLayer::new(Duration::from_millis(20), Duration::from_millis(20)))
//!     .layer(RetryLayer::new(config))
//!     .service(channel)
//! ```

use std::{
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use futures::future::Either;
use tonic::Status;
use tower::{Layer, Service};

use crate::{
    deadline::CallDeadline,
    observe::{Refusal, RetryObserver},
    server_deadline::IncomingDeadline,
};

/// Gives every outgoing call the time left on the request being served, less a margin:
/// strictly shorter than what this service has, so the call below fails first and this
/// service can still answer. A call with less than `min_attempt` left is not sent; it
/// fails DEADLINE_EXCEEDED at once and the observer hears [`Refusal::Deadline`].
///
/// A call that already carries an earlier [`CallDeadline`] keeps it. Put a
/// [`RetryLayer`](crate::RetryLayer) below it: the engine is what writes the deadline on
/// the wire.
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
        if let Err(no_room) = incoming
            .deadline
            .downstream_timeout(self.layer.margin, self.layer.min_attempt)
        {
            self.layer
                .observer
                .refused(request.uri().path(), Refusal::Deadline);
            let status = Status::deadline_exceeded(format!(
                "no call sent: {:?} left of the deadline, a call needs more than {:?}",
                no_room.remaining, no_room.needed
            ));
            return Either::Left(std::future::ready(Ok(status.into_http())));
        }
        let ours = incoming.deadline.earlier_by(self.layer.margin).instant();
        let deadline = match request.extensions().get::<CallDeadline>() {
            Some(CallDeadline(own)) => ours.min(*own),
            None => ours,
        };
        request.extensions_mut().insert(CallDeadline(deadline));
        Either::Right(self.inner.call(request))
    }
}
