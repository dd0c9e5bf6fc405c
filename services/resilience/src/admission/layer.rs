//! The tower layer in front of a server's services: each call asks the limit, and a
//! refusal is answered at once, its body drained apart.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tokio::time::Instant;
use tonic::{Code, Status};

use super::{
    fairness::{CallerKey, Priority},
    limit::{Admitted, Ask, ConcurrencyLimit, Entry},
};
use crate::{server_deadline::IncomingDeadline, wire};

/// The longest a refused request's body is waited for (see the module docs); a client
/// that has not sent it by then has its stream reset.
pub const DRAIN_WITHIN: Duration = Duration::from_millis(250);

/// The most request body a refusal reads (and drops) before answering anyway.
const DRAIN_AT_MOST: usize = 1024 * 1024;

/// How a caller is told apart from the request's headers and extensions (the connection's
/// peer, its credentials); `None`: not at all.
pub type KeyOf =
    Arc<dyn Fn(&http::HeaderMap, &http::Extensions) -> Option<CallerKey> + Send + Sync>;

/// The tower layer: every request through [`ConcurrencyLimit::enter`] (and, told to wait,
/// [`ConcurrencyLimit::wait_for_place`]); a refusal is the layer's error (a `Status`, for
/// tonic's `RecoverErrorLayer` to answer).
#[derive(Clone)]
pub struct AdmissionLayer {
    /// The limit, shared with whoever reports it.
    limit: Arc<ConcurrencyLimit>,
    /// Only this gRPC service's calls are limited (health checks and reflection must
    /// answer under overload: a probe that fails then restarts a busy service).
    only: Option<&'static str>,
    /// Who the caller is, where callers are told apart.
    key_of: Option<KeyOf>,
}

impl std::fmt::Debug for AdmissionLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionLayer")
            .field("limit", &self.limit)
            .field("only", &self.only)
            .field("keyed", &self.key_of.is_some())
            .finish()
    }
}

impl AdmissionLayer {
    /// Admission under `limit`, for every call. A call's time is what the server's
    /// [`DeadlineLayer`](crate::DeadlineLayer), which must sit in front of this layer, read
    /// from it ([`IncomingDeadline`], in the request's extensions) up to the point its
    /// handler must answer; a call without one is asked for with no time known.
    pub fn new(limit: Arc<ConcurrencyLimit>) -> Self {
        Self {
            limit,
            only: None,
            key_of: None,
        }
    }

    /// Limits only the calls of the gRPC service named `service` (`package.Service`).
    pub fn only_service(mut self, service: &'static str) -> Self {
        self.only = Some(service);
        self
    }

    /// Tells callers apart by `key_of`, for fair shares (the edge: see the module docs).
    pub fn keyed_by(mut self, key_of: KeyOf) -> Self {
        self.key_of = Some(key_of);
        self
    }
}

/// Whether `path` is `/<service>/<method>`.
fn is_method_of(path: &str, service: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|rest| rest.strip_prefix(service))
        .is_some_and(|rest| rest.starts_with('/'))
}

impl<S> tower::Layer<S> for AdmissionLayer {
    type Service = Admission<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Admission {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`AdmissionLayer`] makes.
#[derive(Clone, Debug)]
pub struct Admission<S> {
    /// The server's services.
    inner: S,
    /// The limit and how calls are read.
    layer: AdmissionLayer,
}

impl<S, B, RB> tower::Service<http::Request<B>> for Admission<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>> + Clone,
    S::Error: Into<tower::BoxError>,
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: Send,
{
    type Response = S::Response;
    type Error = tower::BoxError;
    type Future = AdmissionFuture<S::Future, S, http::Request<B>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let layer = &self.layer;
        if let Some(service) = layer.only
            && !is_method_of(request.uri().path(), service)
        {
            return AdmissionFuture::Admitted {
                future: self.inner.call(request),
                admitted: None,
            };
        }
        let arrived = Instant::now();
        let time = request
            .extensions()
            .get::<IncomingDeadline>()
            .map(|incoming| incoming.answer_by.remaining());
        let ask = Ask {
            priority: Priority::of(request.headers()),
            time,
            caller: layer
                .key_of
                .as_ref()
                .and_then(|key_of| key_of(request.headers(), request.extensions())),
        };
        match layer.limit.enter(ask) {
            Entry::Admitted(admitted) => AdmissionFuture::Admitted {
                future: self.inner.call(request),
                admitted: Some(admitted),
            },
            Entry::Refused(status) => {
                refused(&layer.limit, request, arrived);
                AdmissionFuture::Refused {
                    status: Some(status),
                }
            }
            Entry::Wait => {
                // The service this call will be made on once admitted: the one that was
                // polled ready; a clone of it stays for the next request.
                let ready = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, ready);
                AdmissionFuture::Waiting {
                    wait: Box::pin(Arc::clone(&layer.limit).wait_for_place(ask)),
                    call: Some(Held {
                        inner,
                        request,
                        arrived,
                        limit: Arc::clone(&layer.limit),
                    }),
                }
            }
        }
    }
}

/// A refused request: its body drained apart, the refusal's time observed.
fn refused<B>(limit: &ConcurrencyLimit, request: http::Request<B>, arrived: Instant)
where
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: Send,
{
    drain_soon(request.into_body());
    if let Some(observe) = &limit.on_refusal {
        (observe.0)(arrived.elapsed());
    }
}

/// A call waiting at the door for its place.
type Wait = Pin<Box<dyn Future<Output = Result<Admitted, Box<Status>>> + Send>>;

/// What a call waiting at the door keeps until it has its place or its refusal.
#[derive(Debug)]
pub struct Held<S, R> {
    /// The service to make it on.
    inner: S,
    /// The request, its body unread.
    request: R,
    /// When it arrived.
    arrived: Instant,
    /// Whose door.
    limit: Arc<ConcurrencyLimit>,
}

pin_project_lite::pin_project! {
    /// The future of [`Admission`]: the call served under its place, waiting at the door
    /// for one (the service `S` to make request `R` on kept until then), or its refusal.
    #[project = AdmissionProj]
    #[allow(missing_docs)] // described above; the macro takes no field docs
    pub enum AdmissionFuture<F, S, R> {
        Admitted { #[pin] future: F, admitted: Option<Admitted> },
        Waiting { wait: Wait, call: Option<Held<S, R>> },
        Refused { status: Option<Box<Status>> },
    }
}

impl<F, S, B, RB, E> Future for AdmissionFuture<F, S, http::Request<B>>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
    S: tower::Service<http::Request<B>, Future = F>,
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: Send,
    E: Into<tower::BoxError>,
{
    type Output = Result<http::Response<RB>, tower::BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let AdmissionProj::Waiting { wait, call } = self.as_mut().project() {
            let place = std::task::ready!(wait.as_mut().poll(cx));
            let Some(Held {
                mut inner,
                request,
                arrived,
                limit,
            }) = call.take()
            else {
                return Poll::Pending;
            };
            match place {
                Ok(admitted) => {
                    let future = inner.call(request);
                    self.set(AdmissionFuture::Admitted {
                        future,
                        admitted: Some(admitted),
                    });
                }
                Err(status) => {
                    refused(&limit, request, arrived);
                    self.set(AdmissionFuture::Refused { status: None });
                    return Poll::Ready(Err(status));
                }
            }
        }
        match self.project() {
            AdmissionProj::Admitted { future, admitted } => {
                let answer = std::task::ready!(future.poll(cx));
                if let (Ok(response), Some(admitted)) = (&answer, admitted.take()) {
                    let headers = response.headers();
                    match wire::status_code(headers) {
                        // A caller that left, or a call refused before any work (its
                        // credentials, its deadline header, its method), says nothing
                        // about how fast this server drains its calls.
                        Some(
                            Code::Cancelled
                            | Code::InvalidArgument
                            | Code::Unimplemented
                            | Code::Unauthenticated
                            | Code::PermissionDenied
                            | Code::ResourceExhausted,
                        ) => {}
                        Some(_) if wire::is_overloaded(headers) => admitted.dropped(),
                        // The chain below failed it: a sample, not a call served.
                        Some(code)
                            if crate::classify::is_retryable(code)
                                || matches!(code, Code::Internal | Code::Unknown) =>
                        {
                            admitted.failed()
                        }
                        _ => admitted.answered(),
                    }
                }
                Poll::Ready(answer.map_err(Into::into))
            }
            AdmissionProj::Refused { status } => match status.take() {
                Some(status) => Poll::Ready(Err(status)),
                None => Poll::Pending,
            },
            AdmissionProj::Waiting { .. } => Poll::Pending,
        }
    }
}

/// Reads a refused request's body to its end, dropping it, in a task of its own (see the
/// module docs). Not inline: reading a stream's data takes its HTTP/2 connection's lock,
/// which the connection's own task holds while it reads frames, and a refusal waiting for
/// it behind a busy connection on a busy core took milliseconds (p99 5 ms at 1,500 calls
/// in flight, against 0.1 ms with the read in a task).
fn drain_soon<B>(body: B)
where
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: Send,
{
    if !body.is_end_stream() {
        tokio::spawn(drain(body, 0));
    }
}

/// Reads a refused request's body to its end, dropping it, for at most [`DRAIN_WITHIN`]
/// and [`DRAIN_AT_MOST`] bytes; see the module docs.
async fn drain<B>(mut body: B, mut read: usize)
where
    B: http_body::Body + Unpin,
{
    use http_body_util::BodyExt;
    let _ = tokio::time::timeout(DRAIN_WITHIN, async {
        while read <= DRAIN_AT_MOST {
            match body.frame().await {
                Some(Ok(frame)) => read += frame.data_ref().map_or(0, bytes::Buf::remaining),
                _ => break,
            }
        }
    })
    .await;
}
