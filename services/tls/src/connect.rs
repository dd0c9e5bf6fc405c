//! The two ends of a TLS connection as the chain makes them: [`Connector`], the tower
//! service a tonic channel opens its connections with, and [`accept`], a server's
//! handshake on an accepted connection, which also says who the caller is.

use std::{
    future::Future,
    io,
    pin::Pin,
    task::{Context, Poll},
};

use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};

use crate::{Identity, Tls};

/// Opens TLS connections to a server that must be `expected` (a tonic channel's
/// connector: `Endpoint::connect_with_connector_lazy`). Each connection takes the
/// service's current material, so a rotated certificate is used from the next connection
/// on.
#[derive(Debug, Clone)]
pub struct Connector {
    tls: Tls,
    expected: Identity,
    present: bool,
}

impl Connector {
    /// Connections that present this service's certificate and accept only `expected`.
    pub fn new(tls: Tls, expected: Identity) -> Self {
        Self {
            tls,
            expected,
            present: true,
        }
    }

    /// Connections that present no certificate (a caller with only the CA, and perhaps a
    /// bearer token), still accepting only `expected`.
    pub fn without_certificate(mut self) -> Self {
        self.present = false;
        self
    }
}

impl tower::Service<http::Uri> for Connector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connector = self.clone();
        Box::pin(async move {
            let host = host_of(&uri)?;
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            Ok(TokioIo::new(connector.handshake(&uri, tcp).await?))
        })
    }
}

impl Connector {
    /// The TLS handshake on `tcp`, a connection already open to `uri`'s host: what a call
    /// of this service does once it has dialled, for a caller that dials with settings of
    /// its own (the balancer's connections to replicas).
    pub fn handshake(
        &self,
        uri: &http::Uri,
        tcp: TcpStream,
    ) -> impl Future<Output = io::Result<tokio_rustls::client::TlsStream<TcpStream>>> + Send + use<>
    {
        let config = self
            .tls
            .client_config_presenting(&self.expected, self.present);
        let name = host_of(uri).and_then(|host| {
            // The name is sent as SNI when it is one; the check is of the identity.
            ServerName::try_from(host)
                .map_err(|error| io::Error::new(io::ErrorKind::InvalidInput, error))
        });
        async move {
            tokio_rustls::TlsConnector::from(config)
                .connect(name?, tcp)
                .await
        }
    }
}

/// The host `uri` names, without an IPv6 address's brackets.
fn host_of(uri: &http::Uri) -> io::Result<String> {
    let host = uri.host().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{uri} names no host and port"),
        )
    })?;
    Ok(host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned())
}

/// The server's side of a handshake on `io`: the TLS stream, and the caller's identity
/// when it presented a certificate (the server's configuration has already checked its
/// chain, and requires one below the edge).
pub async fn accept<IO>(
    tls: &Tls,
    io: IO,
) -> io::Result<(tokio_rustls::server::TlsStream<IO>, Option<Identity>)>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    accept_with(tls.server_config(), io).await
}

/// [`accept`] with a configuration of the caller's (the admin port's,
/// [`Tls::admin_server_config`]).
pub async fn accept_with<IO>(
    config: std::sync::Arc<rustls::ServerConfig>,
    io: IO,
) -> io::Result<(tokio_rustls::server::TlsStream<IO>, Option<Identity>)>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let stream = tokio_rustls::TlsAcceptor::from(config).accept(io).await?;
    let identity = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .and_then(Identity::of_certificate);
    Ok((stream, identity))
}
