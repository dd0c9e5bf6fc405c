//! Where a hop's calls go: `--downstream` read (one URL, several, or a `dns:///` name),
//! the name resolved again every [`RESOLVE_EVERY`], and how each replica's connection is
//! opened.

use std::time::Duration;

use tower::{BoxError, ServiceExt};

use super::connection::{self, Connection, Dial, Io};

/// How often a DNS name is resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(5);

/// Where a hop's calls go: its `--downstream`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Downstream {
    /// One URL or several, each a replica.
    Urls(Vec<String>),
    /// Every address `host` resolves to, on `port`, resolved again every
    /// [`RESOLVE_EVERY`].
    Dns {
        /// The name.
        host: String,
        /// The port of every replica.
        port: u16,
    },
}

/// Why a `--downstream` value was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DownstreamError {
    /// Nothing was given.
    #[error("--downstream is empty")]
    Empty,
    /// A URL was not `http://host:port` (or https).
    #[error("--downstream {0:?} is not a URL such as http://hop3:50053")]
    BadUrl(String),
    /// A `dns:` target without a port, or with a bad one.
    #[error("--downstream {0:?}: a DNS target is dns:///host:port, e.g. dns:///hop3:50053")]
    BadDns(String),
}

impl Downstream {
    /// Reads `--downstream`: `dns:///host:port` (gRPC's name syntax; `dns:host:port` too),
    /// or one or more comma-separated `http(s)://host:port` URLs.
    pub fn parse(spec: &str) -> Result<Self, DownstreamError> {
        let spec = spec.trim();
        if spec.is_empty() {
            return Err(DownstreamError::Empty);
        }
        if let Some(target) = spec.strip_prefix("dns:") {
            // dns:///host:port (empty authority) or dns:host:port; an authority (a DNS
            // server of its own choosing, dns://8.8.8.8/host:port) is not supported.
            let target = target.strip_prefix("///").unwrap_or(target);
            let bad = || DownstreamError::BadDns(spec.to_owned());
            let (host, port) = target.rsplit_once(':').ok_or_else(bad)?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if host.is_empty() || host.contains('/') {
                return Err(bad());
            }
            let port = port
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(bad)?;
            return Ok(Self::Dns {
                host: host.to_owned(),
                port,
            });
        }
        let urls = spec
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(|url| {
                let uri: http::Uri = url
                    .parse()
                    .map_err(|_| DownstreamError::BadUrl(url.to_owned()))?;
                let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
                if !scheme_ok || uri.host().is_none() {
                    return Err(DownstreamError::BadUrl(url.to_owned()));
                }
                Ok(url.trim_end_matches('/').to_owned())
            })
            .collect::<Result<Vec<_>, _>>()?;
        if urls.is_empty() {
            return Err(DownstreamError::Empty);
        }
        Ok(Self::Urls(urls))
    }
}

impl std::fmt::Display for Downstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Urls(urls) => f.write_str(&urls.join(",")),
            Self::Dns { host, port } => write!(f, "dns:///{host}:{port}"),
        }
    }
}

/// How a replica's connections are opened when not over plain TCP: a connector the
/// caller supplies (TLS, with the identities it presents and expects). The balancer knows
/// nothing of what the connector does, so that this library depends on no TLS stack of
/// its own.
#[derive(Clone)]
pub struct Connector(Dial);

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Connector")
    }
}

impl Connector {
    /// Connections opened by `connector`: a tower service from a URI to an I/O stream (the
    /// shape of tonic's `Endpoint::connect_with_connector`, so one connector serves both).
    /// Its time counts in the connect timeout, a TLS handshake included.
    pub fn new<C>(connector: C) -> Self
    where
        C: tower::Service<http::Uri> + Clone + Send + Sync + 'static,
        C::Response: hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static,
        C::Future: Send,
        BoxError: From<C::Error> + Send,
    {
        Self(std::sync::Arc::new(move |uri: http::Uri| {
            let connector = connector.clone();
            Box::pin(async move {
                let io = connector.oneshot(uri).await?;
                Ok(Box::new(hyper_util::rt::TokioIo::new(io)) as Box<dyn Io>)
            })
        }))
    }
}

impl Connector {
    /// Connections whose TCP is dialled as plain ones are ([`connection::dial`]: its
    /// timeouts and keepalive), then handed to `handshake` (TLS's) for the stream the calls
    /// go over. Its time counts in the connect timeout.
    pub fn over_tcp<H, F, IO, E>(handshake: H) -> Self
    where
        H: Fn(http::Uri, tokio::net::TcpStream) -> F + Send + Sync + 'static,
        F: std::future::Future<Output = Result<IO, E>> + Send + 'static,
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
        BoxError: From<E>,
    {
        let handshake = std::sync::Arc::new(handshake);
        Self(std::sync::Arc::new(move |uri: http::Uri| {
            let handshake = handshake.clone();
            Box::pin(async move {
                let tcp = connection::dial(&uri).await?;
                let io = handshake(uri, tcp).await?;
                Ok(Box::new(io) as Box<dyn Io>)
            })
        }))
    }
}

/// The connection to `url`, opened on first use: by `connector` when there is one, else
/// over plain TCP.
pub(super) fn connection(
    url: &str,
    connector: Option<&Connector>,
) -> Result<Connection, connection::BadUrl> {
    let dial = match connector {
        Some(connector) => connector.0.clone(),
        None => connection::tcp(),
    };
    Connection::new(url, dial)
}

/// The replicas' URLs for `host:port` (`scheme://address`), or `None` when the name does
/// not resolve now.
pub(super) async fn resolve(host: &str, port: u16, scheme: &str) -> Option<Vec<String>> {
    match tokio::net::lookup_host((host, port)).await {
        Ok(addrs) => {
            let mut urls: Vec<String> = addrs.map(|addr| format!("{scheme}://{addr}")).collect();
            urls.sort();
            urls.dedup();
            Some(urls)
        }
        Err(error) => {
            tracing::warn!(%host, port, %error, "could not resolve the downstream's name; keeping its replicas as they were");
            None
        }
    }
}
