//! Benchmark helpers.
//!
//! - [`Sink`]: a Payments server that answers every Charge at once, so the cost of a hop in
//!   front of it is the cost being measured.
//! - [`BareForwarder`]: the minimal tonic forwarder — one shared channel, the request
//!   message and its metadata passed on as they came, nothing else: no deadline layer or
//!   arithmetic, no key, mode or trace handling, no retry executor, no counters, no logging.
//!   It is the baseline a retrychain relay is compared to.
//! - [`h2_floor`]: a forwarder on `h2` alone, the floor under every forwarder built on it,
//!   and a refuser on `h2` alone, the floor under every refusal.
//! - [`procs`]: the processes a benchmark starts: killed on drop, on free ports.
//! - [`serve_tls`]: tonic's own server behind a rustls handshake (the chain's material),
//!   so a bare forwarder can be compared with a relay over TLS on both sides too.
//! - [`cpu_seconds`]: a process's user + system CPU time, from `/proc`.
//! - [`storm_args`]: `retrychain storm`'s settings from a command line, for benchmarks that
//!   run storms in process.
//! - [`refusal_buckets`], [`refusal_p99_ms`]: how long the edge took to answer its
//!   refusals, from its `shed_seconds` histogram, over a stretch of a run.

pub mod h2_floor;
pub mod procs;

use std::time::Duration;

use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest,
    payments_client::PaymentsClient,
    payments_server::{Payments, PaymentsServer},
};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status, transport::Channel};

/// Answers every call at once.
#[derive(Debug, Clone, Default)]
pub struct Sink;

#[tonic::async_trait]
impl Payments for Sink {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let message = request.into_inner();
        Ok(Response::new(ChargeReply {
            charge_id: "sink".into(),
            account_id: message.account_id,
            amount_cents: message.amount_cents,
            balance_cents: message.amount_cents,
        }))
    }

    async fn get_account(
        &self,
        request: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Ok(Response::new(Account {
            account_id: request.into_inner().account_id,
            balance_cents: 0,
            charges: 0,
        }))
    }
}

/// Forwards every call downstream and nothing more.
#[derive(Debug, Clone)]
pub struct BareForwarder {
    /// The downstream service.
    downstream: PaymentsClient<Channel>,
}

impl BareForwarder {
    /// A forwarder over `channel`.
    pub fn new(channel: Channel) -> Self {
        Self {
            downstream: PaymentsClient::new(channel),
        }
    }
}

#[tonic::async_trait]
impl Payments for BareForwarder {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let reply = self.downstream.clone().charge(pass_on(request)).await?;
        Ok(Response::new(reply.into_inner()))
    }

    async fn get_account(
        &self,
        request: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        let reply = self
            .downstream
            .clone()
            .get_account(pass_on(request))
            .await?;
        Ok(Response::new(reply.into_inner()))
    }
}

/// The call to make downstream: the message and its metadata as they came (tonic drops
/// the transport's own headers when it sends them), so a key and a deadline reach the
/// ledger of a bare chain unchanged.
fn pass_on<T>(request: Request<T>) -> Request<T> {
    let (metadata, _, message) = request.into_parts();
    Request::from_parts(metadata, tonic::Extensions::default(), message)
}

/// Serves `service` on `listener` until the process ends.
pub async fn serve<P: Payments>(listener: TcpListener, service: P) -> anyhow::Result<()> {
    use futures::StreamExt;
    // Without Nagle's delay, as every retrychain service and the `h2` floors accept.
    let incoming = TcpListenerStream::new(listener).map(|tcp| {
        tcp.inspect(|tcp| {
            let _ = tcp.set_nodelay(true);
        })
    });
    tonic::transport::Server::builder()
        .add_service(PaymentsServer::new(service))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}

/// [`serve`] over TLS with `tls` (its server configuration: TLS 1.3, a client certificate
/// required when `tls` was loaded so): each connection's handshake in a task of its own,
/// then tonic's server on the TLS stream — nothing of retrychain's server in between.
pub async fn serve_tls<P: Payments>(
    listener: TcpListener,
    service: P,
    tls: retrychain_tls::Tls,
) -> anyhow::Result<()> {
    let (handshaken, incoming) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                // Out of descriptors, say: wait rather than spin.
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (tls, handshaken) = (tls.clone(), handshaken.clone());
            tokio::spawn(async move {
                if let Ok((stream, _)) = retrychain_tls::accept(&tls, tcp).await {
                    let _ = handshaken
                        .send(Ok::<_, std::io::Error>(TlsIo(stream)))
                        .await;
                }
            });
        }
    });
    tonic::transport::Server::builder()
        .add_service(PaymentsServer::new(service))
        .serve_with_incoming(tokio_stream::wrappers::ReceiverStream::new(incoming))
        .await?;
    Ok(())
}

/// A server's TLS connection as tonic's server takes it (tonic's own impl for rustls
/// streams is behind its TLS features, which would bring a second TLS set-up).
struct TlsIo(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for TlsIo {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl tokio::io::AsyncRead for TlsIo {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TlsIo {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// User plus system CPU time a process has used, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    // utime and stime are fields 14 and 15 of stat.
    Ok(stat_ticks(pid, &[14, 15])? / clock_ticks_per_second())
}

/// CPU seconds used by `pid` and by the children it has reaped: for a Postgres
/// postmaster, the backends that have exited (a connection's backend exits with it, and
/// its CPU would be missed by reading the live ones alone).
pub fn cpu_seconds_with_reaped(pid: u32) -> anyhow::Result<f64> {
    // utime, stime, cutime and cstime: fields 14 to 17 of stat.
    Ok(stat_ticks(pid, &[14, 15, 16, 17])? / clock_ticks_per_second())
}

/// The sum of `/proc/<pid>/stat`'s `fields` (numbered from 1, as proc(5) does).
fn stat_ticks(pid: u32, fields: &[usize]) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (field 2), which is in parentheses and may contain
    // spaces: field n is the (n - 3)th after it.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow::anyhow!("unexpected /proc/{pid}/stat"))?;
    let values: Vec<&str> = after.split_whitespace().collect();
    fields
        .iter()
        .map(|n| {
            values
                .get(n - 3)
                .and_then(|v| v.parse::<f64>().ok())
                .ok_or_else(|| anyhow::anyhow!("short /proc/{pid}/stat"))
        })
        .sum()
}

/// The machine's CPU seconds so far, summed over its cores: (busy, idle). Busy is user,
/// nice, system, interrupts and steal; idle includes waiting for I/O.
pub fn machine_cpu_seconds() -> anyhow::Result<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .ok_or_else(|| anyhow::anyhow!("no cpu line in /proc/stat"))?;
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    anyhow::ensure!(ticks.len() == 8, "short cpu line in /proc/stat");
    // user nice system idle iowait irq softirq steal
    let idle = ticks[3] + ticks[4];
    let busy = ticks.iter().sum::<f64>() - idle;
    Ok((
        busy / clock_ticks_per_second(),
        idle / clock_ticks_per_second(),
    ))
}

/// The most calls an open-loop point holds in flight at once (storm's `--concurrency`).
pub const OPEN_LOOP_MOST_IN_FLIGHT: usize = 20_000;

/// The edge's streams a connection (`Http2Settings::max_concurrent_streams`).
const STREAMS_PER_CONNECTION: usize = 512;

/// storm's flags for an open loop at `rate` calls a second with 5 s deadlines: at most
/// [`OPEN_LOOP_MOST_IN_FLIGHT`] in flight, over enough connections to carry all of them at
/// the edge (up to what storm opens from one address), so that the calls wait at the
/// edge, which decides on them, and not in storm for a stream, where no chain sees them.
/// One connection per 500 calls a second, as before, carried 3,072 calls at 2× a capacity
/// of 1,500/s: fewer than admission off holds (4,096), and fewer than an edge admitting to
/// half a call's time lets in, whose calls then waited out their deadlines inside storm.
pub fn open_loop_args(rate: f64) -> Vec<String> {
    let in_flight = ((rate * 5.0).ceil() as usize).min(OPEN_LOOP_MOST_IN_FLIGHT);
    let connections = in_flight
        .div_ceil(STREAMS_PER_CONNECTION)
        .clamp(1, retrychain_experiments::storm::MOST_DEFAULT_CONNECTIONS);
    vec![
        "--rate".into(),
        format!("{rate:.0}"),
        "--concurrency".into(),
        OPEN_LOOP_MOST_IN_FLIGHT.to_string(),
        "--connections".into(),
        connections.to_string(),
    ]
}

/// `retrychain storm`'s settings from `args` (its flags, without the program's name), as
/// the command line would parse them: a benchmark that runs storms in process states each
/// one as a user would type it.
pub fn storm_args(
    args: impl IntoIterator<Item = String>,
) -> anyhow::Result<retrychain_experiments::storm::StormArgs> {
    #[derive(clap::Parser)]
    struct Wrapper {
        #[command(flatten)]
        storm: retrychain_experiments::storm::StormArgs,
    }
    let argv = std::iter::once("storm".to_owned()).chain(args);
    Ok(<Wrapper as clap::Parser>::try_parse_from(argv)?.storm)
}

/// Resident set size of a process in KiB, from `/proc/<pid>/status`.
pub fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS for {pid}"))
}

/// Linux's USER_HZ, which is 100 on every architecture Linux runs on today.
fn clock_ticks_per_second() -> f64 {
    100.0
}

/// Sends `requests` Charges to `target`, `concurrency` at a time, each with an idempotency
/// key and a deadline (what a retrychain relay requires), over TLS when `tls` is given
/// (its certificate presented, the server required to be `tls`'s second element). Returns
/// the wall time.
pub async fn load(
    target: &str,
    tls: Option<&(retrychain_tls::Tls, retrychain_tls::Identity)>,
    requests: u64,
    concurrency: usize,
) -> anyhow::Result<Duration> {
    use futures::StreamExt;
    let endpoint = tonic::transport::Endpoint::from_shared(target.to_owned())?.tcp_nodelay(true);
    let channel = match tls {
        Some((tls, server)) => {
            endpoint
                .connect_with_connector(retrychain_tls::Connector::new(tls.clone(), server.clone()))
                .await?
        }
        None => endpoint.connect().await?,
    };
    let client = PaymentsClient::new(channel);
    let start = std::time::Instant::now();
    let failures = futures::stream::iter(0..requests)
        .map(|n| {
            let mut client = client.clone();
            async move { client.charge(charge(n)).await.is_err() }
        })
        .buffer_unordered(concurrency.max(1))
        .filter(|failed| std::future::ready(*failed))
        .count()
        .await;
    anyhow::ensure!(failures == 0, "{failures} of {requests} requests failed");
    Ok(start.elapsed())
}

/// The `n`th Charge of a benchmark's load: a key of its own, one of 100 accounts, a 5 s
/// deadline.
pub fn charge(n: u64) -> Request<ChargeRequest> {
    retrychain_harness::charge_request(
        &format!("bench-{}", n % 100),
        100,
        Some(&format!("bench-{n}")),
        Duration::from_secs(5),
        None,
    )
}

/// The median of `values` (the mean of the middle two of an even count): what a figure of
/// alternating rounds reports, so one disturbed round does not move it.
///
/// # Panics
///
/// When `values` is empty.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let middle = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    } else {
        sorted[middle]
    }
}

/// The edge's refusal-time histogram (`retrychain_shed_seconds`, read from `/metrics` on
/// its admin address): the cumulative count at each bucket's bound, in seconds.
pub async fn refusal_buckets(admin: &str) -> anyhow::Result<Vec<(f64, f64)>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = admin.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = tokio::net::TcpStream::connect(host).await?;
    stream
        .write_all(
            format!("GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    let mut buckets = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("retrychain_shed_seconds_bucket{") else {
            continue;
        };
        let le = rest.split("le=\"").nth(1).and_then(|s| s.split('"').next());
        let count = rest.rsplit(' ').next().and_then(|n| n.parse::<f64>().ok());
        if let (Some(le), Some(count)) = (le, count) {
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse()?
            };
            buckets.push((le, count));
        }
    }
    Ok(buckets)
}

/// Of the refusals the edge answered between two readings of [`refusal_buckets`], the
/// bound (ms) of the bucket that holds the 99th percentile; `None` when there were none.
pub fn refusal_p99_ms(before: &[(f64, f64)], after: &[(f64, f64)]) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| {
            let was = before
                .iter()
                .find(|(b, _)| b == le)
                .map_or(0.0, |(_, n)| *n);
            (*le, n - was)
        })
        .collect();
    let total = delta.iter().map(|(_, n)| *n).fold(0.0, f64::max);
    (total > 0.0).then(|| {
        delta
            .iter()
            .find(|(_, n)| *n >= 0.99 * total)
            .map_or(f64::INFINITY, |(le, _)| *le)
            * 1000.0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connections(rate: f64) -> usize {
        let args = open_loop_args(rate);
        let at = args.iter().position(|a| a == "--connections").unwrap();
        args[at + 1].parse().unwrap()
    }

    /// Enough streams at the edge for every call a 5 s deadline lets be in flight, up to
    /// storm's bound on them, over no more connections than storm opens from one address.
    #[test]
    fn an_open_loop_opens_streams_for_every_call_in_flight() {
        // 3,000/s for 5 s: 15,000 calls, 30 connections of 512 streams.
        assert_eq!(connections(3000.0), 30);
        assert!(connections(3000.0) * STREAMS_PER_CONNECTION >= 15_000);
        // Past storm's 20,000 in flight: 40.
        assert_eq!(connections(15_000.0), 40);
        assert_eq!(connections(0.0), 1);
        let parsed = storm_args(open_loop_args(3000.0)).unwrap();
        assert_eq!(parsed.connections, Some(30));
        assert_eq!(parsed.concurrency, OPEN_LOOP_MOST_IN_FLIGHT);
    }
}
