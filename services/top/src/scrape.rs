//! Reading one service's `/metrics`: a plain HTTP/1.1 GET on the admin port, parsed into
//! a [`Snapshot`] of the totals `top` shows.
//!
//! The admin listener answers HTTP/1.1 beside gRPC (`retrychain-node`'s `MetricsLayer`), so
//! a dozen lines of tokio do: one request with `Connection: close`, read to the end, the body
//! de-chunked if need be. No HTTP client crate is pulled in for that.

use std::{collections::BTreeMap, time::Duration};

use anyhow::Context as _;
use prometheus_parse::{HistogramCount, Scrape, Value};
use retrychain_tls::{Identity, Tls};
use rustls_pki_types::ServerName;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

/// A cumulative Prometheus histogram: bucket upper bounds with their counts, the sum and
/// the count, so that two of them subtract into what happened in between.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// `(le, cumulative count)`, ascending by `le`, the last one `+Inf`.
    pub buckets: Vec<(f64, f64)>,
    /// The sum of the observations.
    pub sum: f64,
    /// How many observations.
    pub count: f64,
}

impl Histogram {
    /// Adds a parsed series' buckets (one per label set, e.g. per method) into this one, so
    /// a service's methods show as one latency.
    fn add(&mut self, buckets: &[HistogramCount]) {
        for bucket in buckets {
            match self
                .buckets
                .iter_mut()
                .find(|(le, _)| *le == bucket.less_than)
            {
                Some((_, count)) => *count += bucket.count,
                None => self.buckets.push((bucket.less_than, bucket.count)),
            }
        }
        self.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
}

/// What `top` reads from one service's `/metrics`: totals since the process started, which
/// only a restart takes back (the view then counts from zero).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// The `service` label, when any sample carried one.
    pub service: Option<String>,
    /// `retrychain_requests_received_total`: Payments calls that reached the service.
    pub received: f64,
    /// `retrychain_requests_total` by `code`, summed over methods: finished calls.
    pub requests_by_code: BTreeMap<String, f64>,
    /// `retrychain_downstream_attempts_total` (the ledger: processor calls).
    pub downstream_attempts: f64,
    /// `retrychain_retries_total` by `reason`.
    pub retries_by_reason: BTreeMap<String, f64>,
    /// `retrychain_retries_refused_total` by `by` (`budget`, `deadline`).
    pub refused_by: BTreeMap<String, f64>,
    /// `retrychain_request_duration_seconds`, summed over methods.
    pub latency: Histogram,
    /// `retrychain_attempts_per_call`.
    pub attempts_per_call: Histogram,
    /// `retrychain_budget_tokens`, for a service with a retry budget.
    pub budget_tokens: Option<f64>,
}

/// Parses the Prometheus text format into a [`Snapshot`]; metrics `top` does not show are
/// skipped, so a service may add metrics without breaking it.
pub fn parse(text: &str) -> anyhow::Result<Snapshot> {
    let scrape = Scrape::parse(text.lines().map(|line| Ok(line.to_owned())))
        .context("parsing the Prometheus text")?;
    let mut snapshot = Snapshot::default();
    for sample in &scrape.samples {
        if snapshot.service.is_none() {
            snapshot.service = sample.labels.get("service").map(str::to_owned);
        }
        let label = |name: &str| sample.labels.get(name).unwrap_or_default().to_owned();
        let metric = sample.metric.as_str();
        let value = match &sample.value {
            Value::Histogram(buckets) => {
                match metric {
                    "retrychain_request_duration_seconds" => snapshot.latency.add(buckets),
                    "retrychain_attempts_per_call" => snapshot.attempts_per_call.add(buckets),
                    _ => {}
                }
                continue;
            }
            Value::Summary(_) => continue,
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
        };
        match metric {
            "retrychain_requests_received_total" => snapshot.received += value,
            "retrychain_requests_total" => {
                *snapshot.requests_by_code.entry(label("code")).or_default() += value;
            }
            "retrychain_downstream_attempts_total" => snapshot.downstream_attempts += value,
            "retrychain_retries_total" => {
                *snapshot
                    .retries_by_reason
                    .entry(label("reason"))
                    .or_default() += value;
            }
            "retrychain_retries_refused_total" => {
                *snapshot.refused_by.entry(label("by")).or_default() += value;
            }
            "retrychain_budget_tokens" => snapshot.budget_tokens = Some(value),
            "retrychain_request_duration_seconds_sum" => snapshot.latency.sum += value,
            "retrychain_request_duration_seconds_count" => snapshot.latency.count += value,
            "retrychain_attempts_per_call_sum" => snapshot.attempts_per_call.sum += value,
            "retrychain_attempts_per_call_count" => snapshot.attempts_per_call.count += value,
            _ => {}
        }
    }
    Ok(snapshot)
}

/// The services' admin addresses and, for `https://` ones, how to check them: the CA of
/// the operator's TLS material, and each service's identity by its place in the chain.
#[derive(Debug, Clone)]
pub struct Scraper {
    admins: Vec<String>,
    /// The material and the identity each position must present.
    tls: Option<(Tls, Vec<Identity>)>,
}

impl Scraper {
    /// Scrapes `admins`; `tls` (the operator's material) for `https://` ones, which must
    /// then be the chain's five services in order, so each is checked as its tier.
    pub fn new(admins: Vec<String>, tls: Option<Tls>) -> anyhow::Result<Self> {
        let secure = admins.iter().any(|a| a.starts_with("https://"));
        let tls = match (tls, secure) {
            (Some(tls), true) => {
                anyhow::ensure!(
                    admins.len() == retrychain_harness::NAMES.len(),
                    "over TLS, --admin names the five services in chain order (each is checked as its tier)"
                );
                let identities = retrychain_harness::NAMES
                    .iter()
                    .map(|name| Identity::named(name))
                    .collect();
                Some((tls, identities))
            }
            (None, true) => anyhow::bail!(
                "an https:// admin address needs the operator's TLS material (--tls-dir)"
            ),
            (_, false) => None,
        };
        Ok(Self { admins, tls })
    }

    /// The addresses, in order.
    pub fn admins(&self) -> &[String] {
        &self.admins
    }

    /// Scrapes every admin address at once; a service that does not answer is `None`
    /// (down).
    pub async fn scrape_all(&self, timeout: Duration) -> Vec<Option<Snapshot>> {
        futures::future::join_all(self.admins.iter().enumerate().map(|(i, admin)| {
            let tls = self
                .tls
                .as_ref()
                .filter(|_| admin.starts_with("https://"))
                .map(|(tls, identities)| (tls, &identities[i]));
            async move { scrape(admin, timeout, tls).await.ok() }
        }))
        .await
    }
}

/// Scrapes the service whose admin address is `admin` (`http://host:port`, or
/// `https://host:port` with the material to check it by), giving up after `timeout` so
/// that one hung service cannot stall the screen.
pub async fn scrape(
    admin: &str,
    timeout: Duration,
    tls: Option<(&Tls, &Identity)>,
) -> anyhow::Result<Snapshot> {
    let text = tokio::time::timeout(timeout, get_metrics(admin, tls))
        .await
        .with_context(|| format!("{admin}: no answer within {timeout:?}"))??;
    parse(&text).with_context(|| format!("{admin}/metrics"))
}

/// `host:port` of an admin address, with or without `http://` and a trailing `/`.
pub fn authority(admin: &str) -> &str {
    let rest = admin.split_once("://").map_or(admin, |(_, rest)| rest);
    rest.split('/').next().unwrap_or(rest)
}

/// `GET /metrics` on `admin` (over TLS as Prometheus reads it — the server checked, no
/// client certificate — when `tls` is given), the body as text.
async fn get_metrics(admin: &str, tls: Option<(&Tls, &Identity)>) -> anyhow::Result<String> {
    let authority = authority(admin);
    let tcp = TcpStream::connect(authority)
        .await
        .with_context(|| format!("connecting to {authority}"))?;
    let request = format!(
        "GET /metrics HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
    );
    let response = match tls {
        None => exchange(tcp, &request).await?,
        Some((tls, identity)) => {
            let host = authority
                .rsplit_once(':')
                .map_or(authority, |(host, _)| host)
                .trim_start_matches('[')
                .trim_end_matches(']');
            let name = ServerName::try_from(host.to_owned())
                .with_context(|| format!("{host} is not a server name"))?;
            let stream = tokio_rustls::TlsConnector::from(tls.metrics_client_config(identity))
                .connect(name, tcp)
                .await
                .with_context(|| format!("TLS with {authority}"))?;
            exchange(stream, &request).await?
        }
    };
    body_of(&response)
}

/// Writes `request` and reads the answer to its end (a server that closes without TLS's
/// close_notify has still said everything: `Connection: close`).
async fn exchange<S>(mut stream: S, request: &str) -> anyhow::Result<Vec<u8>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    match stream.read_to_end(&mut response).await {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof && !response.is_empty() => {
        }
        Err(error) => return Err(error.into()),
    }
    Ok(response)
}

/// The body of a whole HTTP/1.1 response, which must be a 200; chunked bodies de-chunked.
fn body_of(response: &[u8]) -> anyhow::Result<String> {
    let end = find(response, b"\r\n\r\n").context("the answer has no end of headers")?;
    let (head, rest) = response.split_at(end);
    let body = rest.get(4..).unwrap_or_default();
    let head = std::str::from_utf8(head).context("the headers are not UTF-8")?;
    let mut lines = head.lines();
    let status = lines.next().unwrap_or_default();
    anyhow::ensure!(
        status.split_whitespace().nth(1) == Some("200"),
        "/metrics answered {status:?}"
    );
    let chunked = lines.any(|line| {
        line.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("transfer-encoding")
                && value.to_ascii_lowercase().contains("chunked")
        })
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    String::from_utf8(body).context("the metrics are not UTF-8")
}

/// A chunked body's data, up to the last (empty) chunk.
fn dechunk(mut body: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = find(body, b"\r\n").context("a chunk size line is cut short")?;
        let (line, rest) = body.split_at(line_end);
        let line = std::str::from_utf8(line).context("a chunk size is not text")?;
        let hex = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(hex, 16).with_context(|| format!("chunk size {hex:?}"))?;
        if size == 0 {
            return Ok(out);
        }
        let rest = rest.get(2..).unwrap_or_default();
        out.extend_from_slice(rest.get(..size).context("a chunk is cut short")?);
        body = rest
            .get(size..)
            .and_then(|rest| rest.strip_prefix(b"\r\n"))
            .context("a chunk does not end with CRLF")?;
    }
}

/// Where `needle` first starts in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `retrychain-node` renders, cut down (prometheus-client's text format).
    const TEXT: &str = r#"# HELP retrychain_requests Payments calls finished, by method and gRPC code.
# TYPE retrychain_requests counter
retrychain_requests_total{service="edge",method="Charge",code="OK"} 7
retrychain_requests_total{service="edge",method="Charge",code="UNAVAILABLE"} 2
retrychain_requests_total{service="edge",method="GetAccount",code="OK"} 1
# TYPE retrychain_request_duration_seconds histogram
retrychain_request_duration_seconds_bucket{service="edge",method="Charge",le="0.001"} 1
retrychain_request_duration_seconds_bucket{service="edge",method="Charge",le="0.01"} 8
retrychain_request_duration_seconds_bucket{service="edge",method="Charge",le="+Inf"} 9
retrychain_request_duration_seconds_sum{service="edge",method="Charge"} 0.05
retrychain_request_duration_seconds_count{service="edge",method="Charge"} 9
retrychain_request_duration_seconds_bucket{service="edge",method="GetAccount",le="0.001"} 1
retrychain_request_duration_seconds_bucket{service="edge",method="GetAccount",le="0.01"} 1
retrychain_request_duration_seconds_bucket{service="edge",method="GetAccount",le="+Inf"} 1
retrychain_request_duration_seconds_sum{service="edge",method="GetAccount"} 0.0005
retrychain_request_duration_seconds_count{service="edge",method="GetAccount"} 1
# TYPE retrychain_retries counter
retrychain_retries_total{service="edge",reason="UNAVAILABLE"} 4
# TYPE retrychain_attempts_per_call histogram
retrychain_attempts_per_call_bucket{service="edge",le="1.0"} 8
retrychain_attempts_per_call_bucket{service="edge",le="3.0"} 10
retrychain_attempts_per_call_bucket{service="edge",le="+Inf"} 10
retrychain_attempts_per_call_sum{service="edge"} 14.0
retrychain_attempts_per_call_count{service="edge"} 10
# TYPE retrychain_requests_received counter
retrychain_requests_received_total{service="edge"} 10
# TYPE retrychain_downstream_attempts counter
retrychain_downstream_attempts_total{service="edge"} 14
# TYPE retrychain_retries_refused counter
retrychain_retries_refused_total{service="edge",by="budget"} 1
retrychain_retries_refused_total{service="edge",by="deadline"} 0
# TYPE retrychain_budget_tokens gauge
retrychain_budget_tokens{service="edge"} 9.5
# EOF
"#;

    #[test]
    fn the_node_text_format_parses_into_a_snapshot() {
        let s = parse(TEXT).unwrap();
        assert_eq!(s.service.as_deref(), Some("edge"));
        assert_eq!(s.received, 10.0);
        assert_eq!(s.requests_by_code["OK"], 8.0);
        assert_eq!(s.requests_by_code["UNAVAILABLE"], 2.0);
        assert_eq!(s.downstream_attempts, 14.0);
        assert_eq!(s.retries_by_reason["UNAVAILABLE"], 4.0);
        assert_eq!(s.refused_by["budget"], 1.0);
        assert_eq!(s.refused_by["deadline"], 0.0);
        assert_eq!(s.budget_tokens, Some(9.5));
        assert_eq!(
            s.latency.buckets,
            vec![(0.001, 2.0), (0.01, 9.0), (f64::INFINITY, 10.0)]
        );
        assert_eq!(s.latency.count, 10.0);
        assert_eq!(
            s.attempts_per_call,
            Histogram {
                buckets: vec![(1.0, 8.0), (3.0, 10.0), (f64::INFINITY, 10.0)],
                sum: 14.0,
                count: 10.0,
            }
        );
    }

    #[test]
    fn plain_and_chunked_bodies_are_read_and_errors_are_refused() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nx 1\n\n";
        assert_eq!(body_of(plain).unwrap(), "x 1\n\n");
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nx 1\n\r\n3;ext=1\r\ny 2\r\n0\r\n\r\n";
        assert_eq!(body_of(chunked).unwrap(), "x 1\ny 2");
        assert!(body_of(b"HTTP/1.1 404 Not Found\r\n\r\n").is_err());
        assert!(body_of(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nff\r\nab").is_err());
        assert_eq!(authority("http://127.0.0.1:51051/"), "127.0.0.1:51051");
        assert_eq!(authority("localhost:51055"), "localhost:51055");
    }
}
