//! What TLS costs a connection: handshakes per second, and the latency of a first call on
//! a new connection against a call on an open one — over TLS 1.3 with mutual
//! authentication (the chain's own material, as between two tiers) and over plaintext, in
//! the same run, against the same server: the node's public HTTP/2 server
//! (`retrychain_node::h2`) answering every Charge at once.
//!
//! ```text
//! cargo run --release -p retrychain-bench --bin tls-cost -- --connections 2000
//! ```

use std::{
    future::pending,
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Parser;
use hdrhistogram::Histogram;
use retrychain_bench::Sink;
use retrychain_harness::{ChainTls, charge_request};
use retrychain_node::{h2::Http2Settings, limits};
use retrychain_proto::v1::payments_client::PaymentsClient;
use retrychain_proto::v1::payments_server::PaymentsServer;
use retrychain_tls::{ClientAuth, Connector, Identity, Tls};
use serde::Serialize;
use tokio::net::TcpListener;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, Parser)]
struct Cli {
    /// New connections opened, each with one call, per transport (sequentially).
    #[arg(long, default_value_t = 2000)]
    connections: u32,
    /// Connections opened at once for the handshakes-per-second figure.
    #[arg(long, default_value_t = 16)]
    concurrency: u32,
    /// Calls on one open connection, per transport.
    #[arg(long, default_value_t = 5000)]
    calls: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// One transport's figures.
#[derive(Debug, Serialize)]
struct Figures {
    transport: &'static str,
    /// New connection and its first call, one after another: p50 / p99 in µs.
    first_call_p50_us: u64,
    first_call_p99_us: u64,
    /// A call on an open connection: p50 / p99 in µs.
    open_call_p50_us: u64,
    open_call_p99_us: u64,
    /// Connections (each with its first call) per second, one at a time.
    connections_per_s_serial: f64,
    /// Connections (each with its first call) per second, `concurrency` at a time.
    connections_per_s_concurrent: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    connections: u32,
    concurrency: u32,
    calls: u32,
    tls: Figures,
    plaintext: Figures,
    /// TLS against plaintext: first call p50, and connections per second (concurrent).
    first_call_ratio: f64,
    connections_per_s_ratio: f64,
}

/// How a client reaches the server.
#[derive(Clone)]
enum Transport {
    Plain,
    Tls(Tls),
}

impl Transport {
    async fn connect(&self, port: u16) -> anyhow::Result<Channel> {
        Ok(match self {
            Transport::Plain => {
                Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
                    .connect()
                    .await?
            }
            Transport::Tls(tls) => {
                Endpoint::from_shared(format!("https://127.0.0.1:{port}"))?
                    .connect_with_connector(Connector::new(tls.clone(), Identity::named("edge")))
                    .await?
            }
        })
    }
}

async fn one_call(channel: Channel) -> anyhow::Result<()> {
    PaymentsClient::new(channel)
        .charge(charge_request(
            "bench",
            1,
            Some("k"),
            Duration::from_secs(5),
            None,
        ))
        .await
        .context("a call")?;
    Ok(())
}

/// Serves the sink on a port of its own, over `tls` when given.
async fn server(tls: Option<Tls>) -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let settings = Http2Settings {
        max_concurrent_streams: 1024,
        max_header_list_size: 16 * 1024,
        stream_window: 1 << 20,
        connection_window: 1 << 22,
        max_local_error_reset_streams: 1024,
        keepalive_interval: Duration::from_secs(30),
        keepalive_timeout: Duration::from_secs(10),
    };
    let incoming = limits::incoming(
        listener,
        limits::ConnectionLimits {
            max_connections: 100_000,
            max_per_peer: 100_000,
            ..Default::default()
        },
        limits::Refusal::of_port(tls.is_some()),
    );
    tokio::spawn(retrychain_node::h2::serve_h2(
        incoming,
        PaymentsServer::new(Sink),
        settings,
        tls,
        pending::<()>(),
    ));
    Ok(port)
}

fn micros(h: &Histogram<u64>, q: f64) -> u64 {
    h.value_at_quantile(q)
}

async fn measure(
    name: &'static str,
    transport: Transport,
    port: u16,
    cli: &Cli,
) -> anyhow::Result<Figures> {
    // Warm up both paths.
    for _ in 0..50 {
        one_call(transport.connect(port).await?).await?;
    }
    let mut first = Histogram::<u64>::new(3)?;
    let started = Instant::now();
    for _ in 0..cli.connections {
        let at = Instant::now();
        one_call(transport.connect(port).await?).await?;
        first.record(at.elapsed().as_micros() as u64)?;
    }
    let serial = f64::from(cli.connections) / started.elapsed().as_secs_f64();

    let started = Instant::now();
    let per_task = cli.connections / cli.concurrency;
    let tasks: Vec<_> = (0..cli.concurrency)
        .map(|_| {
            let transport = transport.clone();
            tokio::spawn(async move {
                for _ in 0..per_task {
                    one_call(transport.connect(port).await?).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let concurrent = f64::from(per_task * cli.concurrency) / started.elapsed().as_secs_f64();

    let open = transport.connect(port).await?;
    let mut calls = Histogram::<u64>::new(3)?;
    for _ in 0..cli.calls {
        let at = Instant::now();
        one_call(open.clone()).await?;
        calls.record(at.elapsed().as_micros() as u64)?;
    }
    Ok(Figures {
        transport: name,
        first_call_p50_us: micros(&first, 0.5),
        first_call_p99_us: micros(&first, 0.99),
        open_call_p50_us: micros(&calls, 0.5),
        open_call_p99_us: micros(&calls, 0.99),
        connections_per_s_serial: serial,
        connections_per_s_concurrent: concurrent,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let dir = tempfile::tempdir()?;
    let chain = ChainTls::create(dir.path())?;
    // The server is the edge (its certificate), the client the operator: mutual TLS 1.3,
    // P-256 keys, as between two tiers.
    let server_tls = Tls::load(chain.files_of("edge"), ClientAuth::Optional)?;
    let client_tls = Tls::load(chain.files_of("operator"), ClientAuth::Optional)?;
    let tls_port = server(Some(server_tls)).await?;
    let plain_port = server(None).await?;
    let tls = measure("tls", Transport::Tls(client_tls), tls_port, &cli).await?;
    let plaintext = measure("plaintext", Transport::Plain, plain_port, &cli).await?;
    let report = Report {
        connections: cli.connections,
        concurrency: cli.concurrency,
        calls: cli.calls,
        first_call_ratio: tls.first_call_p50_us as f64 / plaintext.first_call_p50_us.max(1) as f64,
        connections_per_s_ratio: tls.connections_per_s_concurrent
            / plaintext.connections_per_s_concurrent,
        tls,
        plaintext,
    };
    if cli.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{:<10} {:>16} {:>16} {:>14} {:>14} {:>12} {:>12}",
            "transport",
            "first call p50",
            "first call p99",
            "open call p50",
            "open call p99",
            "conn/s (1)",
            "conn/s (n)"
        );
        for f in [&report.tls, &report.plaintext] {
            println!(
                "{:<10} {:>13} µs {:>13} µs {:>11} µs {:>11} µs {:>12.0} {:>12.0}",
                f.transport,
                f.first_call_p50_us,
                f.first_call_p99_us,
                f.open_call_p50_us,
                f.open_call_p99_us,
                f.connections_per_s_serial,
                f.connections_per_s_concurrent
            );
        }
        println!(
            "TLS / plaintext: first call p50 ×{:.2}, connections per second ×{:.2}",
            report.first_call_ratio, report.connections_per_s_ratio
        );
    }
    Ok(())
}
