//! The admin port over TLS: each accepted connection's handshake (several at once, each
//! within [`crate::h2::HANDSHAKE_WITHIN`], so a silent client holds up nobody), and the
//! caller's identity handed to tonic's server as the connection's info — every request on it
//! carries it as a [`PeerIdentity`], which Control's guard reads.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use futures::{Stream, StreamExt};
use retrychain_tls::Tls;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::server::Connected;

use crate::authz::PeerIdentity;

/// Handshakes in progress at once on the admin port.
const HANDSHAKES_AT_ONCE: usize = 64;

/// An admin connection over TLS, and who is on the other end.
#[derive(Debug)]
pub struct TlsConnection {
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    peer: PeerIdentity,
}

impl Connected for TlsConnection {
    type ConnectInfo = PeerIdentity;

    fn connect_info(&self) -> PeerIdentity {
        self.peer.clone()
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The connections `listener` accepts, each once its TLS handshake (with the admin
/// configuration: client certificates optional) is done; a failed or slow handshake closes
/// its connection and is logged.
pub fn incoming(
    listener: TcpListener,
    tls: Tls,
) -> impl Stream<Item = io::Result<TlsConnection>> + Send + 'static {
    TcpListenerStream::new(listener)
        .filter_map(|accepted| async move {
            accepted
                .map_err(|error| tracing::debug!(%error, "accepting an admin connection failed"))
                .ok()
        })
        .map(move |tcp| {
            let config = tls.admin_server_config();
            async move {
                let _ = tcp.set_nodelay(true);
                let handshake = retrychain_tls::accept_with(config, tcp);
                match tokio::time::timeout(crate::h2::HANDSHAKE_WITHIN, handshake).await {
                    Ok(Ok((stream, identity))) => Some(TlsConnection {
                        stream,
                        peer: PeerIdentity(identity),
                    }),
                    Ok(Err(error)) => {
                        tracing::info!(%error, "a TLS handshake on the admin port failed");
                        None
                    }
                    Err(_) => {
                        tracing::info!("a TLS handshake on the admin port did not finish in time");
                        None
                    }
                }
            }
        })
        .buffer_unordered(HANDSHAKES_AT_ONCE)
        .filter_map(|connection| async move { connection.map(Ok) })
}
