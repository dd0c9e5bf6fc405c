//! The server side of deadline propagation, as a tower layer.
//!
//! [`DeadlineLayer`] reads the incoming `grpc-timeout` (or applies a default), refuses a
//! malformed one with INVALID_ARGUMENT before the handler runs, hands the handler its
//! [`IncomingDeadline`] through the request extensions, and answers DEADLINE_EXCEEDED itself
//! shortly before the deadline if the handler has not (handlers are asked to answer a little
//! earlier still, at `answer_by`, so that their own answer carries their metadata). The last part matters: tonic enforces `grpc-timeout` by
//! dropping the handler and answering CANCELLED, which a caller must not retry and cannot
//! tell from a user's cancel; answering first keeps the status honest.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use tonic::Status;
use tower::{Layer, Service};

use crate::{
    deadline::{Deadline, parse_grpc_timeout},
    retry::TIMEOUT_HEADER,
};

/// The deadline a request arrived with, put in its extensions by [`DeadlineLayer`].
#[derive(Debug, Clone, Copy)]
pub struct IncomingDeadline {
    /// When the caller stops waiting.
    pub deadline: Deadline,
    /// The `grpc-timeout` the caller sent; `None` when the default was applied.
    pub received: Option<Duration>,
    /// The timeout in force: `received`, or the default.
    pub timeout: Duration,
    /// When the handler must have its answer ready: the deadline less the layer's reserve.
    /// A handler that answers DEADLINE_EXCEEDED itself at this point can still stamp its own
    /// metadata (trace id, the key the edge made) on the answer.
    pub answer_by: Deadline,
}

/// Applies deadlines to every request of a server; see the module docs.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineLayer {
    /// Applied when a request carries no `grpc-timeout`.
    default_timeout: Duration,
    /// How long before the deadline the handler must answer; the layer itself answers
    /// DEADLINE_EXCEEDED at half of this, should the handler not have.
    reserve: Duration,
}

impl DeadlineLayer {
    /// A layer that applies `default_timeout` to requests without a deadline, asks handlers
    /// to answer `reserve` before each deadline, and answers for them at `reserve / 2`.
    pub fn new(default_timeout: Duration, reserve: Duration) -> Self {
        Self {
            default_timeout,
            reserve,
        }
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = EnforceDeadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        EnforceDeadline {
            inner,
            config: *self,
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

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for EnforceDeadline<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let received = match request.headers().get(TIMEOUT_HEADER).map(|value| {
            value
                .to_str()
                .map_err(|_| "grpc-timeout is not ASCII".to_owned())
                .and_then(|text| parse_grpc_timeout(text).map_err(|e| e.to_string()))
        }) {
            None => None,
            Some(Ok(timeout)) => Some(timeout),
            Some(Err(message)) => {
                let response = Status::invalid_argument(message).into_http();
                return Box::pin(async move { Ok(response) });
            }
        };
        let timeout = received.unwrap_or(self.config.default_timeout);
        let deadline = Deadline::after(timeout);
        request.extensions_mut().insert(IncomingDeadline {
            deadline,
            received,
            timeout,
            answer_by: deadline.earlier_by(self.config.reserve),
        });
        let backstop = deadline.earlier_by(self.config.reserve / 2);
        let response = self.inner.call(request);
        Box::pin(async move {
            match tokio::time::timeout_at(backstop.instant(), response).await {
                Ok(result) => result,
                Err(_) => Ok(Status::deadline_exceeded(format!(
                    "the deadline of {timeout:?} ran out before an answer"
                ))
                .into_http()),
            }
        })
    }
}
