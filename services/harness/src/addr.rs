//! Where services answer, and reaching them: addresses, channels, the health check.

use std::time::Duration;

use anyhow::Context;
use retrychain_node::ReadyAddrs;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// The five services of a chain, top to bottom.
pub const NAMES: [&str; 5] = ["edge", "hop2", "hop3", "hop4", "ledger"];

/// Where one service answers: Payments on `url`, Control on `admin_url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAddr {
    /// The public address, `http://host:port`.
    pub url: String,
    /// The admin address, `http://host:port`.
    pub admin_url: String,
}

impl ServiceAddr {
    /// A service someone else started at `url`, with Control at `admin` — by default the
    /// public port + 1000, as `up` and docker-compose publish them.
    pub fn external(url: &str, admin: Option<&str>) -> Self {
        let url = with_scheme(url);
        if let Some(admin) = admin {
            return Self {
                admin_url: with_scheme(admin),
                url,
            };
        }
        let admin_url = match url.rsplit_once(':') {
            Some((host, port)) => match port.trim_end_matches('/').parse::<u16>() {
                Ok(port) => format!("{host}:{}", port.saturating_add(1000)),
                Err(_) => url.clone(),
            },
            None => url.clone(),
        };
        Self { url, admin_url }
    }

    /// `host:port` of the public address (for `--listen`, grpcurl).
    pub fn host_port(&self) -> &str {
        host_port(&self.url)
    }

    /// `host:port` of the admin address.
    pub fn admin_host_port(&self) -> &str {
        host_port(&self.admin_url)
    }
}

impl From<&ReadyAddrs> for ServiceAddr {
    fn from(ready: &ReadyAddrs) -> Self {
        Self {
            url: format!("http://{}", ready.public),
            admin_url: format!("http://{}", ready.admin),
        }
    }
}

fn host_port(url: &str) -> &str {
    url.split_once("://").map_or(url, |(_, rest)| rest)
}

/// A chain's five addresses, by position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainAddrs {
    /// Where clients call.
    pub edge: ServiceAddr,
    /// The first relay.
    pub hop2: ServiceAddr,
    /// The second relay.
    pub hop3: ServiceAddr,
    /// The third relay.
    pub hop4: ServiceAddr,
    /// The bottom: keys, charges, the processor.
    pub ledger: ServiceAddr,
}

impl ChainAddrs {
    /// From five addresses, edge first.
    pub fn from_array([edge, hop2, hop3, hop4, ledger]: [ServiceAddr; 5]) -> Self {
        Self {
            edge,
            hop2,
            hop3,
            hop4,
            ledger,
        }
    }

    /// The five, edge first, in [`NAMES`] order.
    pub fn all(&self) -> [&ServiceAddr; 5] {
        [&self.edge, &self.hop2, &self.hop3, &self.hop4, &self.ledger]
    }
}

/// `url` with `http://` in front unless it names a scheme.
pub(crate) fn with_scheme(url: &str) -> String {
    if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    }
}

/// Connects to a service at `url` (`http://` is assumed when no scheme is given).
pub async fn connect(url: &str) -> anyhow::Result<tonic::transport::Channel> {
    let url = with_scheme(url);
    tonic::transport::Endpoint::from_shared(url.clone())
        .with_context(|| format!("URL {url:?}"))?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connecting to {url}"))
}

/// A channel to `url` — over TLS for an `https://` one, presenting `tls`'s certificate
/// and requiring the server to be the tier of `service` (`hop3.2` is hop3): how a tool
/// (storm, top) reaches a chain that `up --tls` or a deployment runs, as the operator.
pub async fn connect_as(
    url: &str,
    service: &str,
    tls: Option<&retrychain_tls::Tls>,
) -> anyhow::Result<tonic::transport::Channel> {
    let url = with_scheme(url);
    if !url.starts_with("https://") {
        return connect(&url).await;
    }
    let tls = tls.with_context(|| {
        format!("{url} speaks TLS: give the operator's TLS material (--tls-dir)")
    })?;
    let connector =
        retrychain_tls::Connector::new(tls.clone(), retrychain_tls::Identity::of_service(service));
    tonic::transport::Endpoint::from_shared(url.clone())
        .with_context(|| format!("URL {url:?}"))?
        .tcp_nodelay(true)
        .connect_with_connector(connector)
        .await
        .with_context(|| format!("connecting to {url} over TLS"))
}

/// Whether the service at `addr` reports SERVING for the whole server (""), asked with
/// the standard gRPC health check within `timeout`.
pub async fn serving(addr: &str, timeout: Duration) -> anyhow::Result<bool> {
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .with_context(|| format!("address {addr:?}"))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect()
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    serving_on(channel).await
}

/// [`serving`] over TLS: `tls` presented, the server required to be `expected`.
pub async fn serving_tls(
    addr: &str,
    timeout: Duration,
    tls: retrychain_tls::Tls,
    expected: retrychain_tls::Identity,
) -> anyhow::Result<bool> {
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .with_context(|| format!("address {addr:?}"))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_with_connector(retrychain_tls::Connector::new(tls, expected))
        .await
        .with_context(|| format!("connecting to {addr} over TLS"))?;
    serving_on(channel).await
}

/// Whether the server behind `channel` reports SERVING for the whole server ("").
async fn serving_on(channel: tonic::transport::Channel) -> anyhow::Result<bool> {
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .context("health check")?;
    Ok(response.into_inner().status == ServingStatus::Serving as i32)
}

/// Waits until the service at `addr` reports SERVING: up to 120 checks, 250 ms apart.
/// Over TLS (`tls`), as the operator, the server must be `name`'s tier.
pub(crate) async fn wait_serving(
    name: &str,
    addr: &str,
    tls: Option<&crate::ChainTls>,
) -> anyhow::Result<()> {
    for _ in 0..120 {
        let answer = match tls {
            None => serving(addr, Duration::from_millis(500)).await,
            Some(tls) => {
                let check = async { serving_on(tls.connect(addr, name).await?).await };
                tokio::time::timeout(Duration::from_millis(500), check)
                    .await
                    .unwrap_or_else(|_| Ok(false))
            }
        };
        if let Ok(true) = answer {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    anyhow::bail!("{name} did not report SERVING within 30 s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_external_service_has_its_admin_port_1000_up_unless_told() {
        let edge = ServiceAddr::external("localhost:50051", None);
        assert_eq!(edge.url, "http://localhost:50051");
        assert_eq!(edge.admin_url, "http://localhost:51051");
        let told = ServiceAddr::external("http://edge:50051", Some("10.0.0.1:9000"));
        assert_eq!(told.admin_url, "http://10.0.0.1:9000");
        assert_eq!(told.host_port(), "edge:50051");
        assert_eq!(told.admin_host_port(), "10.0.0.1:9000");
    }
}
