//! What a service facing untrusted clients bounds, below gRPC: how many connections it
//! holds, how long a connection may stay silent before its first bytes, how large a
//! request's metadata may be. Deadlines (how long a request may take to arrive and be
//! answered) are `resilience::DeadlineLayer`'s; the HTTP/2 settings are in
//! [`crate::server`].
//!
//! hyper and tonic bound none of the first two: HTTP/2's handshake waits for the client's
//! preface forever, and there is no connection limit, so a client can hold any number of
//! idle sockets (and their buffers) for free. tonic's HTTP/2 header limit answers a bare
//! HTTP 431 that gRPC clients report as UNKNOWN; [`MetadataLimit`] answers the
//! gRPC status instead, below the transport's own (larger) limit.

use std::{
    io,
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
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
use tonic::{
    Status,
    transport::server::{Connected, TcpConnectInfo},
};

/// Limits on the connections of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections held at once; past it, new ones wait in the kernel's accept queue until
    /// one closes.
    pub max_connections: usize,
    /// How long a new connection may stay silent before it is closed: a real client sends
    /// the HTTP/2 preface at once.
    pub first_bytes_within: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            first_bytes_within: Duration::from_secs(10),
        }
    }
}

/// The connections `listener` accepts, at most `limits.max_connections` open at once, each
/// closed if it sends nothing within `limits.first_bytes_within`. Accept errors (out of file
/// descriptors, say) are yielded after a short pause, so that a persistent one does not
/// spin the accept loop.
pub fn incoming(
    listener: TcpListener,
    limits: ConnectionLimits,
) -> impl Stream<Item = io::Result<GuardedStream>> + Send + 'static {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    futures::stream::unfold((listener, slots), move |(listener, slots)| async move {
        let slot = Arc::clone(&slots).acquire_owned().await.ok()?;
        let accepted = match listener.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                Ok(GuardedStream {
                    stream,
                    peer,
                    _slot: slot,
                    silence: Some(Box::pin(tokio::time::sleep(limits.first_bytes_within))),
                })
            }
            Err(error) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Err(error)
            }
        };
        Some((accepted, (listener, slots)))
    })
}

/// An accepted connection holding its slot of the connection limit until it is dropped,
/// and closed (a read error) if its first bytes do not come in time.
#[derive(Debug)]
pub struct GuardedStream {
    /// The socket.
    stream: TcpStream,
    /// The peer, for tonic's connect info.
    peer: SocketAddr,
    /// The connection's place under the limit.
    _slot: OwnedSemaphorePermit,
    /// Until the first bytes arrive: when the connection is given up.
    silence: Option<Pin<Box<Sleep>>>,
}

impl Connected for GuardedStream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        let mut info = self.stream.connect_info();
        info.remote_addr = info.remote_addr.or(Some(self.peer));
        info
    }
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
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                self.silence = None;
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match silence.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client sent nothing after connecting",
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
