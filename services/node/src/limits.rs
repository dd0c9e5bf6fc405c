//! What a service facing untrusted clients bounds, below gRPC: how many connections it
//! holds (in all and per peer), how long a connection may take to say it speaks HTTP/2,
//! how many requests it serves at once, how large a request's metadata may be. Deadlines (how long a request may take to arrive and be
//! answered) are `resilience::DeadlineLayer`'s; the HTTP/2 settings are in
//! [`crate::server`].
//!
//! hyper and tonic bound none of the first two: HTTP/2's handshake waits for the client's
//! preface forever, and there is no connection limit, so a client can hold any number of
//! idle sockets (and their buffers) for free. hyper's HTTP/2 header limit answers a bare
//! HTTP 431 that gRPC clients report as UNKNOWN; [`MetadataLimit`] answers the
//! gRPC status instead, below the transport's own (larger) limit.

use std::{
    io,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use futures::Stream;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Sleep,
};
use tonic::Status;

/// Limits on the connections of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections held at once; past it, new ones wait in the kernel's accept queue until
    /// one closes.
    pub max_connections: usize,
    /// Connections held at once from one IP address; past it, a new one from that address
    /// is closed at once. Without it, one client could take every slot of
    /// `max_connections` and lock everybody else out.
    pub max_per_peer: usize,
    /// How long a new connection may take to send the HTTP/2 preface and its first SETTINGS
    /// frame before it is closed: a real client sends them at once.
    pub preface_within: Duration,
    /// Requests being served at once, over all connections; past it, a new request is
    /// answered RESOURCE_EXHAUSTED at once. It bounds the memory that unfinished requests
    /// can hold (each up to the message limit), whatever the number of connections.
    pub max_in_flight: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_per_peer: 256,
            preface_within: Duration::from_secs(10),
            max_in_flight: 4096,
        }
    }
}

/// The HTTP/2 client preface (24 bytes) and the frame header of the SETTINGS frame that
/// must follow it (9 bytes): what a connection must have sent before its silence timer
/// stops. One byte is not enough to hold a slot.
const PREFACE_BYTES: usize = 24 + 9;

/// Connections per peer address, shared by a listener's accepted connections.
#[derive(Debug, Default)]
struct PeerCounts(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

impl PeerCounts {
    /// One more connection from `peer`, unless it already holds `max`.
    fn admit(self: &Arc<Self>, peer: std::net::IpAddr, max: usize) -> Option<PeerSlot> {
        let mut counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(peer).or_default();
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            counts: Arc::clone(self),
            peer,
        })
    }
}

/// A connection's place among its peer's, given back when the connection is dropped.
#[derive(Debug)]
struct PeerSlot {
    counts: Arc<PeerCounts>,
    peer: std::net::IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = counts.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

/// The connections `listener` accepts: at most `limits.max_connections` open at once and
/// `limits.max_per_peer` from one address (more are closed as they come), each closed if
/// it has not sent the HTTP/2 preface within `limits.preface_within`. Accept errors (out
/// of file descriptors, say) are yielded after a short pause, so that a persistent one
/// does not spin the accept loop.
pub fn incoming(
    listener: TcpListener,
    limits: ConnectionLimits,
) -> impl Stream<Item = io::Result<GuardedStream>> + Send + 'static {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let peers = Arc::new(PeerCounts::default());
    futures::stream::unfold(
        (listener, slots, peers),
        move |(listener, slots, peers)| async move {
            let accepted = loop {
                let slot = Arc::clone(&slots).acquire_owned().await.ok()?;
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        let Some(peer_slot) = peers.admit(peer.ip(), limits.max_per_peer) else {
                            tracing::debug!(%peer, "refused a connection: its address holds too many");
                            continue; // dropped: closed
                        };
                        let _ = stream.set_nodelay(true);
                        break Ok(GuardedStream {
                            stream,
                            _slot: slot,
                            _peer_slot: peer_slot,
                            received: 0,
                            silence: Some(Box::pin(tokio::time::sleep(limits.preface_within))),
                        });
                    }
                    Err(error) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        break Err(error);
                    }
                }
            };
            Some((accepted, (listener, slots, peers)))
        },
    )
}

/// An accepted connection holding its slots (of the listener's limit and of its peer's)
/// until it is dropped, and closed (a read error) if its preface does not come in time.
#[derive(Debug)]
pub struct GuardedStream {
    /// The socket.
    stream: TcpStream,
    /// The connection's place under the listener's limit.
    _slot: OwnedSemaphorePermit,
    /// The connection's place under its peer's limit.
    _peer_slot: PeerSlot,
    /// Bytes read so far, until the preface is in.
    received: usize,
    /// Until the preface is in: when the connection is given up.
    silence: Option<Pin<Box<Sleep>>>,
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        let Some(silence) = self.silence.as_mut() else {
            return read;
        };
        match read {
            Poll::Ready(Ok(())) => {
                self.received += buf.filled().len() - before;
                if self.received >= PREFACE_BYTES {
                    self.silence = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match silence.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client did not send the HTTP/2 preface in time",
                ))),
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The largest request metadata accepted, counted as HTTP/2 counts a header list (each
/// entry's name and value plus 32 bytes): gRPC core's hard limit. A Charge needs a few
/// hundred bytes; 1,000 small headers are about 40 KiB.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;

/// The transport's own limit (`SETTINGS_MAX_HEADER_LIST_SIZE`), above
/// [`MAX_METADATA_BYTES`] so that a list between the two gets a gRPC status from
/// [`MetadataLimit`]. Past it, hyper answers HTTP 431 before any gRPC code runs (clients
/// that honour the setting, as grpc-go does, refuse to send such a list in the first place),
/// and past four times it the connection is closed.
pub const MAX_HEADER_LIST_BYTES: u32 = 64 * 1024;

/// Refuses a request whose metadata is over [`MAX_METADATA_BYTES`] with RESOURCE_EXHAUSTED,
/// before it is read further: a gRPC answer (trailers-only), where the transport would give
/// a bare HTTP error.
#[derive(Debug, Clone, Copy, Default)]
pub struct MetadataLimit;

impl MetadataLimit {
    /// The check, for `tower::filter::FilterLayer`: the request, or the status refusing it.
    pub fn check<B>(request: http::Request<B>) -> Result<http::Request<B>, Status> {
        let size: usize = request
            .headers()
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 32)
            .sum();
        if size > MAX_METADATA_BYTES {
            return Err(Status::resource_exhausted(format!(
                "request metadata of {size} bytes (name + value + 32 per entry, {} entries) is over the limit of {MAX_METADATA_BYTES}",
                request.headers().len()
            )));
        }
        Ok(request)
    }
}

/// Answers RESOURCE_EXHAUSTED at once when `max` requests are already being served (over
/// all connections), instead of queueing: the caller's retry policy, with its backoff,
/// decides what to do, and the memory unfinished requests can hold stays bounded. A count
/// in an atomic: every request passes here, and a semaphore's release takes a lock.
#[derive(Debug, Clone)]
pub struct InFlightLimitLayer {
    /// Requests being served now.
    serving: Arc<AtomicUsize>,
    /// The limit.
    max: usize,
}

impl InFlightLimitLayer {
    /// At most `max` requests at once.
    pub fn new(max: usize) -> Self {
        Self {
            serving: Arc::new(AtomicUsize::new(0)),
            max,
        }
    }
}

impl<S> tower::Layer<S> for InFlightLimitLayer {
    type Service = InFlightLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        InFlightLimit {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`InFlightLimitLayer`] makes.
#[derive(Debug, Clone)]
pub struct InFlightLimit<S> {
    /// The server's services.
    inner: S,
    /// Count and limit.
    layer: InFlightLimitLayer,
}

/// One request's place under the limit, given back when its answer is done (or dropped).
#[derive(Debug)]
pub struct Serving(Arc<AtomicUsize>);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

pin_project_lite::pin_project! {
    /// The future of [`InFlightLimit`]: the request served while holding its place, or
    /// its refusal.
    #[project = InFlightProj]
    #[allow(missing_docs)] // described above; the macro takes no field docs
    pub enum InFlightFuture<F> {
        Serving { #[pin] future: F, serving: Serving },
        Refused { status: Option<Status> },
    }
}

impl<F, T, E> Future for InFlightFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<tower::BoxError>,
{
    type Output = Result<T, tower::BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            InFlightProj::Serving { future, .. } => future.poll(cx).map_err(Into::into),
            InFlightProj::Refused { status } => match status.take() {
                Some(status) => Poll::Ready(Err(status.into())),
                None => Poll::Pending,
            },
        }
    }
}

impl<S, B> tower::Service<http::Request<B>> for InFlightLimit<S>
where
    S: tower::Service<http::Request<B>>,
    S::Error: Into<tower::BoxError>,
{
    type Response = S::Response;
    type Error = tower::BoxError;
    type Future = InFlightFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let serving = Serving(Arc::clone(&self.layer.serving));
        if serving.0.fetch_add(1, Ordering::AcqRel) >= self.layer.max {
            drop(serving);
            return InFlightFuture::Refused {
                status: Some(Status::resource_exhausted(format!(
                    "this service is serving {} requests, its limit; retry after a backoff",
                    self.layer.max
                ))),
            };
        }
        InFlightFuture::Serving {
            future: self.inner.call(request),
            serving,
        }
    }
}
