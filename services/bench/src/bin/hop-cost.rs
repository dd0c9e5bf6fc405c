//! The CPU cost of one retrychain relay hop against a bare tonic forwarder, measured in the
//! same run: each forwards the same number of Charges to the same sink, and the CPU time
//! each process used (from /proc) is divided by the requests.
//!
//! ```text
//! cargo run --release -p retrychain-bench --bin hop-cost -- --requests 100000
//! ```
//!
//! The same binary also runs the pieces: `hop-cost sink --listen ADDR`,
//! `hop-cost forward --listen ADDR --downstream URL`, and `hop-cost otlp-sink --listen ADDR`
//! (an OTLP trace collector that drops what it gets), for `--otlp-sample`: the relay then
//! exports its spans, sampled at that ratio.

use std::{
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::Context;
use clap::{Parser, Subcommand};
use retrychain_bench::{BareForwarder, Sink, cpu_seconds, load, rss_kib, serve};
use retrychain_harness::{ChildService, Launch, Logs};
use serde::Serialize;
use tokio::net::TcpListener;

#[derive(Debug, Parser)]
struct Cli {
    #[command(subcommand)]
    command: Option<Role>,
    /// Charges sent through each forwarder per round.
    #[arg(long, default_value_t = 50_000)]
    requests: u64,
    /// Requests in flight.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Rounds, alternating the two forwarders; figures are summed over rounds.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// The retrychain binary (default: next to this one).
    #[arg(long)]
    retrychain: Option<std::path::PathBuf>,
    /// RUST_LOG for the relay: `info` logs one line per call, as deployed.
    #[arg(long, default_value = "info")]
    relay_log: String,
    /// Export the relay's traces over OTLP (to a collector this tool runs), sampling this
    /// ratio of requests (1 = all). Unset: no export, as by default.
    #[arg(long)]
    otlp_sample: Option<f64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Answer every Charge at once.
    Sink {
        #[arg(long)]
        listen: String,
    },
    /// Forward every call, with nothing else.
    Forward {
        #[arg(long)]
        listen: String,
        #[arg(long)]
        downstream: String,
    },
    /// Accept OTLP trace exports and drop them.
    OtlpSink {
        #[arg(long)]
        listen: String,
    },
}

/// An OTLP trace collector that drops every span: the exporting side's cost, measured
/// without a real collector's.
#[derive(Debug, Clone, Copy)]
struct DropSpans;

#[tonic::async_trait]
impl opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceService
    for DropSpans
{
    async fn export(
        &self,
        _: tonic::Request<
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest,
        >,
    ) -> Result<
        tonic::Response<
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse,
        >,
        tonic::Status,
    > {
        Ok(tonic::Response::new(Default::default()))
    }
}

#[derive(Debug, Serialize)]
struct Report {
    requests: u64,
    concurrency: usize,
    relay_cpu_us_per_request: f64,
    bare_cpu_us_per_request: f64,
    ratio: f64,
    relay_rss_kib: u64,
    bare_rss_kib: u64,
    relay_rps: f64,
    bare_rps: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match &cli.command {
        Some(Role::Sink { listen }) => serve(TcpListener::bind(listen).await?, Sink).await,
        Some(Role::Forward { listen, downstream }) => {
            let channel = tonic::transport::Endpoint::from_shared(downstream.clone())?
                .tcp_nodelay(true)
                .connect_lazy();
            serve(
                TcpListener::bind(listen).await?,
                BareForwarder::new(channel),
            )
            .await
        }
        Some(Role::OtlpSink { listen }) => {
            use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer;
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(DropSpans))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(
                    TcpListener::bind(listen).await?,
                ))
                .await?;
            Ok(())
        }
        None => compare(&cli).await,
    }
}

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `N` distinct free ports: bound all at once (so no two are the same, as ports bound and
/// released one after the other can be), then released for the processes to take.
fn free_ports<const N: usize>() -> anyhow::Result<[u16; N]> {
    let listeners = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ports = [0; N];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener.local_addr()?.port();
    }
    Ok(ports)
}

async fn wait_listening(port: u16) -> anyhow::Result<()> {
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("nothing listens on {port}")
}

async fn compare(cli: &Cli) -> anyhow::Result<()> {
    let me = std::env::current_exe()?;
    let retrychain = match &cli.retrychain {
        Some(path) => path.clone(),
        None => me.with_file_name("retrychain"),
    };
    // The relay takes a port of its own choosing and says which (a port picked here and
    // released could be taken in between); the tool's own processes get distinct ones.
    let [sink_port, bare_port, collector_port] = free_ports()?;
    let sink_url = format!("http://127.0.0.1:{sink_port}");
    let _sink =
        spawn(Command::new(&me).args(["sink", "--listen", &format!("127.0.0.1:{sink_port}")]))?;
    // The relay is a retrychain service, started as `up` starts one; the sink, the bare
    // forwarder and the collector are this binary's own.
    let mut relay_env = vec![("RUST_LOG".to_owned(), cli.relay_log.clone())];
    let _collector = match cli.otlp_sample {
        Some(ratio) => Some(otlp_collector(&me, ratio, collector_port, &mut relay_env).await?),
        None => None,
    };
    let relay = ChildService::start(
        "relay",
        Launch {
            program: Some(retrychain.clone()),
            args: [
                "relay",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--downstream",
                &sink_url,
            ]
            .map(String::from)
            .into(),
            env: relay_env,
            logs: Logs::Discard,
        },
    )
    .await
    .with_context(|| format!("starting {}", retrychain.display()))?;
    let relay_pid = relay.pid().context("the relay runs")?;
    let bare = spawn(Command::new(&me).args([
        "forward",
        "--listen",
        &format!("127.0.0.1:{bare_port}"),
        "--downstream",
        &sink_url,
    ]))?;
    for port in [sink_port, bare_port] {
        wait_listening(port).await?;
    }
    let targets = [
        (relay.url().to_owned(), relay_pid),
        (format!("http://127.0.0.1:{bare_port}"), bare.0.id()),
    ];
    let report = measure(cli, &targets).await?;
    if cli.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "relay: {:.1} µs CPU per request ({:.0} req/s, RSS {} KiB)\nbare:  {:.1} µs CPU per request ({:.0} req/s, RSS {} KiB)\nratio relay/bare: {:.2}",
            report.relay_cpu_us_per_request,
            report.relay_rps,
            report.relay_rss_kib,
            report.bare_cpu_us_per_request,
            report.bare_rps,
            report.bare_rss_kib,
            report.ratio
        );
    }
    Ok(())
}

/// A child process, its output discarded.
fn spawn(command: &mut Command) -> anyhow::Result<Proc> {
    Ok(Proc(
        command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    ))
}

/// Starts this binary's OTLP collector on `port` and points the relay's environment at
/// it, sampling `ratio` of traces.
async fn otlp_collector(
    me: &std::path::Path,
    ratio: f64,
    port: u16,
    relay_env: &mut Vec<(String, String)>,
) -> anyhow::Result<Proc> {
    let collector =
        spawn(Command::new(me).args(["otlp-sink", "--listen", &format!("127.0.0.1:{port}")]))?;
    wait_listening(port).await?;
    relay_env.extend([
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
            format!("http://127.0.0.1:{port}"),
        ),
        ("OTEL_TRACES_SAMPLER".to_owned(), "traceidratio".to_owned()),
        ("OTEL_TRACES_SAMPLER_ARG".to_owned(), ratio.to_string()),
    ]);
    Ok(collector)
}

/// Loads the relay and the bare forwarder (`targets`: URL and pid) in alternating rounds
/// and reports their CPU per request.
async fn measure(cli: &Cli, targets: &[(String, u32); 2]) -> anyhow::Result<Report> {
    // Warm both up, then alternate rounds so drift on a shared machine hits both alike.
    for (url, _) in targets {
        load(url, cli.requests / 10 + 100, cli.concurrency).await?;
    }
    let mut cpu = [0.0f64; 2];
    let mut wall = [0.0f64; 2];
    for _ in 0..cli.rounds {
        for (i, (url, pid)) in targets.iter().enumerate() {
            let before = cpu_seconds(*pid)?;
            wall[i] += load(url, cli.requests, cli.concurrency)
                .await?
                .as_secs_f64();
            cpu[i] += cpu_seconds(*pid)? - before;
        }
    }
    let total = (cli.requests * u64::from(cli.rounds)) as f64;
    Ok(Report {
        requests: cli.requests * u64::from(cli.rounds),
        concurrency: cli.concurrency,
        relay_cpu_us_per_request: cpu[0] / total * 1e6,
        bare_cpu_us_per_request: cpu[1] / total * 1e6,
        ratio: cpu[0] / cpu[1].max(f64::EPSILON),
        relay_rss_kib: rss_kib(targets[0].1)?,
        bare_rss_kib: rss_kib(targets[1].1)?,
        relay_rps: total / wall[0],
        bare_rps: total / wall[1],
    })
}
