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
//!
//! `--haproxy PATH`: HAProxy, started from `PATH` with a configuration written here, is
//! measured in the same alternating rounds as a third forwarder: HTTP/2 on both sides, a
//! log line per request (to its stdout, discarded as the relay's logs are), as many
//! threads as the machine has cores. Plaintext only.
//!
//! `--callgrind VALGRIND`: instead of CPU time, the user-space instructions the relay and the
//! bare forwarder each execute per request, counted by valgrind's callgrind over
//! `--requests` after the warm-up (instrumentation switched on with `callgrind_control` for
//! the measured requests only). A count moves by a tenth of a percent from run to run where
//! CPU time on a shared machine moves by five, so a change to a relay's own work shows; what
//! it cannot see is the kernel's part (a third of a relay's CPU). Plaintext only.
//!
//! `--tls`: every connection — load to forwarder, forwarder to sink — is mutual TLS 1.3
//! with the chain's own material, as between tiers: the load presents hop2's certificate,
//! both forwarders hop3's, the sink hop4's. The bare forwarder is then tonic's server and
//! channel behind the same rustls handshake, and the relay runs with `--tls-dir`.

use std::{
    os::unix::process::ExitStatusExt,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::Context;
use clap::{Parser, Subcommand};
use retrychain_bench::{
    BareForwarder, Sink, cpu_seconds, load, median,
    procs::{Proc, RetrychainBinary, free_ports, spawn_quiet as spawn, wait_listening},
    rss_kib, serve, serve_tls,
};
use retrychain_harness::{ChainTls, ChildService, Launch, Logs};
use retrychain_tls::{ClientAuth, Connector, Identity, Tls, TlsFiles};
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
    #[command(flatten)]
    retrychain: RetrychainBinary,
    /// RUST_LOG for the relay: `info` logs one line per call, as deployed.
    #[arg(long, default_value = "info")]
    relay_log: String,
    /// Export the relay's traces over OTLP (to a collector this tool runs), sampling this
    /// ratio of requests (1 = all). Unset: no export, as by default.
    #[arg(long)]
    otlp_sample: Option<f64>,
    /// Mutual TLS on every connection (see the module's documentation).
    #[arg(long)]
    tls: bool,
    /// Also measure HAProxy, this binary (see the module's documentation).
    #[arg(long, conflicts_with = "tls")]
    haproxy: Option<std::path::PathBuf>,
    /// Also measure the floor of a forwarder on `h2`: `hop-cost h2-forward` (see
    /// `retrychain_bench::h2_floor`), in the same alternating rounds.
    #[arg(long, conflicts_with = "tls")]
    h2_floor: bool,
    /// The bare forwarder on one thread (`forward --current-thread`), as the relay runs by
    /// default; unset, on a worker per core, as `#[tokio::main]` starts one.
    #[arg(long)]
    bare_current_thread: bool,
    /// The `h2` floor on one thread (`h2-forward --current-thread`).
    #[arg(long, requires = "h2_floor")]
    h2_floor_current_thread: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Count instructions under this valgrind instead of measuring CPU time (see the
    /// module's documentation).
    #[arg(long, conflicts_with_all = ["tls", "haproxy", "h2_floor", "perf", "otlp_sample"])]
    callgrind: Option<std::path::PathBuf>,
    /// With --callgrind: keep the two profiles in this directory (`relay.out.1`,
    /// `bare.out.1`) for `callgrind_annotate`, instead of a temporary one.
    #[arg(long, requires = "callgrind")]
    callgrind_profiles: Option<std::path::PathBuf>,
    /// After the measured rounds, one more round with each forwarder profiled by `perf
    /// record` (DWARF call graphs), written to this directory as `relay.perf.data`,
    /// `bare.perf.data`, `haproxy.perf.data` and `h2-floor.perf.data` (`bench/flamegraphs`
    /// draws them). The
    /// profiled round is not counted: sampling costs the profiled process CPU.
    #[arg(long)]
    perf: Option<std::path::PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Answer every Charge at once.
    Sink {
        #[arg(long)]
        listen: String,
        /// Serve TLS with the material here (tls.crt, tls.key, ca.crt).
        #[arg(long)]
        tls_dir: Option<std::path::PathBuf>,
    },
    /// Forward every call, with nothing else.
    Forward {
        #[arg(long)]
        listen: String,
        #[arg(long)]
        downstream: String,
        /// Serve and call over TLS with the material here; the downstream must be hop4.
        #[arg(long)]
        tls_dir: Option<std::path::PathBuf>,
        /// On a runtime of one thread (tokio's current-thread scheduler), as a retrychain
        /// service runs by default, rather than a worker per core (`#[tokio::main]`'s).
        #[arg(long)]
        current_thread: bool,
    },
    /// Forward every stream on `h2` alone, nothing else (`retrychain_bench::h2_floor`).
    H2Forward {
        #[arg(long)]
        listen: String,
        /// The sink's address (host:port), plaintext.
        #[arg(long)]
        downstream: std::net::SocketAddr,
        /// On a runtime of one thread (tokio's current-thread scheduler), as HAProxy
        /// runs an event loop a thread, rather than a worker per core.
        #[arg(long)]
        current_thread: bool,
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
    tls: bool,
    requests: u64,
    concurrency: usize,
    relay_cpu_us_per_request: f64,
    bare_cpu_us_per_request: f64,
    /// relay / bare, over all rounds.
    ratio: f64,
    /// relay / bare: each round's, their median.
    ratio_rounds: Vec<f64>,
    ratio_median: f64,
    relay_rss_kib: u64,
    bare_rss_kib: u64,
    relay_rps: f64,
    bare_rps: f64,
    /// With `--haproxy`.
    haproxy: Option<BaselineReport>,
    /// With `--h2-floor`.
    h2_floor: Option<FloorReport>,
}

/// The `h2` floor's figures, the relay's and the bare forwarder's against them, and the
/// floor's against HAProxy's.
#[derive(Debug, Serialize)]
struct FloorReport {
    #[serde(flatten)]
    baseline: BaselineReport,
    /// floor / HAProxy, with `--haproxy`: each round's, their median.
    haproxy_ratio_rounds: Option<Vec<f64>>,
    haproxy_ratio_median: Option<f64>,
}

/// A forwarder measured: its name (the relay's and the bare forwarder's come first, in that
/// order), where the load goes, and the process whose CPU is counted.
#[derive(Debug)]
struct Target {
    name: &'static str,
    url: String,
    pid: u32,
}

const RELAY: &str = "relay";
const BARE: &str = "bare";
const HAPROXY: &str = "haproxy";
const H2_FLOOR: &str = "h2-floor";

/// A baseline's figures (HAProxy's, the `h2` floor's), and the relay's and the bare
/// forwarder's against them.
#[derive(Debug, Serialize)]
struct BaselineReport {
    cpu_us_per_request: f64,
    rps: f64,
    rss_kib: u64,
    /// relay / the baseline: each round's, their median.
    relay_ratio_rounds: Vec<f64>,
    relay_ratio_median: f64,
    /// bare / the baseline: each round's, their median.
    bare_ratio_rounds: Vec<f64>,
    bare_ratio_median: f64,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // A forwarder asked to run on one thread gets tokio's current-thread scheduler, as a
    // retrychain service does by default; everything else a worker per core.
    let one_thread = matches!(
        cli.command,
        Some(
            Role::Forward {
                current_thread: true,
                ..
            } | Role::H2Forward {
                current_thread: true,
                ..
            }
        )
    );
    let runtime = match one_thread {
        true => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        false => tokio::runtime::Runtime::new()?,
    };
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match &cli.command {
        Some(Role::Sink { listen, tls_dir }) => {
            let listener = TcpListener::bind(listen).await?;
            match tls_dir {
                Some(dir) => serve_tls(listener, Sink, material(dir)?).await,
                None => serve(listener, Sink).await,
            }
        }
        Some(Role::Forward {
            listen,
            downstream,
            tls_dir,
            ..
        }) => {
            let endpoint =
                tonic::transport::Endpoint::from_shared(downstream.clone())?.tcp_nodelay(true);
            let listener = TcpListener::bind(listen).await?;
            match tls_dir {
                Some(dir) => {
                    let tls = material(dir)?;
                    let channel = endpoint.connect_with_connector_lazy(Connector::new(
                        tls.clone(),
                        Identity::named("hop4"),
                    ));
                    serve_tls(listener, BareForwarder::new(channel), tls).await
                }
                None => serve(listener, BareForwarder::new(endpoint.connect_lazy())).await,
            }
        }
        Some(Role::H2Forward {
            listen, downstream, ..
        }) => {
            let listener = TcpListener::bind(listen).await?;
            retrychain_bench::h2_floor::forward(listener, *downstream).await
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

/// A tier's material from `dir`, a client certificate required of its callers.
fn material(dir: &std::path::Path) -> anyhow::Result<Tls> {
    Tls::load(TlsFiles::in_dir(dir), ClientAuth::Required)
        .with_context(|| format!("TLS material in {}", dir.display()))
}

async fn compare(cli: &Cli) -> anyhow::Result<()> {
    let me = std::env::current_exe()?;
    let retrychain = cli.retrychain.path()?;
    // The relay takes a port of its own choosing and says which (a port picked here and
    // released could be taken in between); the tool's own processes get distinct ones.
    let [
        sink_port,
        bare_port,
        collector_port,
        haproxy_port,
        floor_port,
    ] = free_ports()?;
    // With --tls: a throwaway authority and the tiers' material; each process is told its
    // own directory (`--tls-dir`), as a deployment mounts one.
    let material_dir = tempfile::tempdir()?;
    let chain = match cli.tls {
        true => Some(ChainTls::create(material_dir.path())?),
        false => None,
    };
    let tls_dir = |tier: &str| -> Vec<String> {
        chain
            .iter()
            .flat_map(|chain| {
                [
                    "--tls-dir".to_owned(),
                    chain.dir.join(tier).display().to_string(),
                ]
            })
            .collect()
    };
    let scheme = if cli.tls { "https" } else { "http" };
    let sink_url = format!("{scheme}://127.0.0.1:{sink_port}");
    let _sink = spawn(
        Command::new(&me)
            .args(["sink", "--listen", &format!("127.0.0.1:{sink_port}")])
            .args(tls_dir("hop4")),
    )?;
    // The relay is a retrychain service, started as `up` starts one; the sink, the bare
    // forwarder and the collector are this binary's own.
    let mut relay_env = vec![("RUST_LOG".to_owned(), cli.relay_log.clone())];
    let _collector = match cli.otlp_sample {
        Some(ratio) => Some(otlp_collector(&me, ratio, collector_port, &mut relay_env).await?),
        None => None,
    };
    // Under callgrind, each forwarder starts with its instrumentation off (as fast as valgrind
    // runs anything) and writes its counts to `profiles` when asked.
    let temporary = tempfile::tempdir()?;
    let profiles = match &cli.callgrind_profiles {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            dir.clone()
        }
        None => temporary.path().to_owned(),
    };
    let under_callgrind = |name: &str, program: &std::path::Path| -> Vec<String> {
        match &cli.callgrind {
            Some(_) => vec![
                "--tool=callgrind".to_owned(),
                "--instr-atstart=no".to_owned(),
                format!(
                    "--callgrind-out-file={}",
                    profiles.join(format!("{name}.out")).display()
                ),
                program.display().to_string(),
            ],
            None => Vec::new(),
        }
    };
    let relay = ChildService::start(
        "relay",
        Launch {
            program: Some(cli.callgrind.clone().unwrap_or_else(|| retrychain.clone())),
            args: under_callgrind("relay", &retrychain)
                .into_iter()
                .chain(
                    [
                        "relay",
                        "--name",
                        "hop3",
                        "--listen",
                        "127.0.0.1:0",
                        "--admin-listen",
                        "127.0.0.1:0",
                        "--downstream",
                        &sink_url,
                    ]
                    .map(String::from),
                )
                .chain(tls_dir("hop3"))
                .collect(),
            env: relay_env,
            logs: Logs::Discard,
        },
    )
    .await
    .with_context(|| format!("starting {}", retrychain.display()))?;
    let relay_pid = relay.pid().context("the relay runs")?;
    let bare = spawn(
        Command::new(cli.callgrind.as_deref().unwrap_or(&me))
            .args(under_callgrind("bare", &me))
            .args([
                "forward",
                "--listen",
                &format!("127.0.0.1:{bare_port}"),
                "--downstream",
                &sink_url,
            ])
            .args(tls_dir("hop3"))
            .args(cli.bare_current_thread.then_some("--current-thread")),
    )?;
    let config_dir = tempfile::tempdir()?;
    let haproxy = match &cli.haproxy {
        Some(path) => Some(haproxy(path, config_dir.path(), haproxy_port, sink_port)?),
        None => None,
    };
    // The floor opens its one connection to the sink as it starts.
    if cli.h2_floor {
        wait_listening(sink_port).await?;
    }
    let floor = match cli.h2_floor {
        true => Some(spawn(
            Command::new(&me)
                .args([
                    "h2-forward",
                    "--listen",
                    &format!("127.0.0.1:{floor_port}"),
                    "--downstream",
                    &format!("127.0.0.1:{sink_port}"),
                ])
                .args(cli.h2_floor_current_thread.then_some("--current-thread")),
        )?),
        false => None,
    };
    for port in [sink_port, bare_port]
        .into_iter()
        .chain(haproxy.as_ref().map(|_| haproxy_port))
        .chain(floor.as_ref().map(|_| floor_port))
    {
        wait_listening(port).await?;
    }
    let mut targets = vec![
        Target {
            name: RELAY,
            url: relay.url().replacen("http://", &format!("{scheme}://"), 1),
            pid: relay_pid,
        },
        Target {
            name: BARE,
            url: format!("{scheme}://127.0.0.1:{bare_port}"),
            pid: bare.0.id(),
        },
    ];
    if let Some(haproxy) = &haproxy {
        targets.push(Target {
            name: HAPROXY,
            url: format!("http://127.0.0.1:{haproxy_port}"),
            pid: haproxy.0.id(),
        });
    }
    if let Some(floor) = &floor {
        targets.push(Target {
            name: H2_FLOOR,
            url: format!("http://127.0.0.1:{floor_port}"),
            pid: floor.0.id(),
        });
    }
    // The load is hop2 calling hop3.
    let client = match &chain {
        Some(chain) => Some((
            Tls::load(chain.files_of("hop2"), ClientAuth::Optional)?,
            Identity::named("hop3"),
        )),
        None => None,
    };
    if cli.callgrind.is_some() {
        let report = count_instructions(cli, &targets, &profiles).await?;
        if cli.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!(
                "relay: {:.0} instructions per request\nbare:  {:.0} instructions per request\nratio relay/bare: {:.3}",
                report.relay_instructions_per_request,
                report.bare_instructions_per_request,
                report.ratio
            );
        }
        return Ok(());
    }
    let report = measure(cli, &targets, client.as_ref()).await?;
    if cli.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{}relay: {:.1} µs CPU per request ({:.0} req/s, RSS {} KiB)\nbare:  {:.1} µs CPU per request ({:.0} req/s, RSS {} KiB)\nratio relay/bare: {:.2}",
            if report.tls {
                "mutual TLS on every connection\n"
            } else {
                ""
            },
            report.relay_cpu_us_per_request,
            report.relay_rps,
            report.relay_rss_kib,
            report.bare_cpu_us_per_request,
            report.bare_rps,
            report.bare_rss_kib,
            report.ratio
        );
        if let Some(haproxy) = &report.haproxy {
            println!(
                "haproxy: {:.1} µs CPU per request ({:.0} req/s, RSS {} KiB)\nratio relay/haproxy: {:.2}, bare/haproxy: {:.2} (medians of rounds)",
                haproxy.cpu_us_per_request,
                haproxy.rps,
                haproxy.rss_kib,
                haproxy.relay_ratio_median,
                haproxy.bare_ratio_median
            );
        }
        if let Some(floor) = &report.h2_floor {
            println!(
                "h2 floor: {:.1} µs CPU per request ({:.0} req/s, RSS {} KiB)\nratio relay/floor: {:.2}, bare/floor: {:.2}{} (medians of rounds)",
                floor.baseline.cpu_us_per_request,
                floor.baseline.rps,
                floor.baseline.rss_kib,
                floor.baseline.relay_ratio_median,
                floor.baseline.bare_ratio_median,
                match floor.haproxy_ratio_median {
                    Some(ratio) => format!(", floor/haproxy: {ratio:.2}"),
                    None => String::new(),
                }
            );
        }
    }
    Ok(())
}

/// HAProxy forwarding HTTP/2 from `port` to the sink's HTTP/2 on `sink_port`, as a
/// production proxy between two gRPC services would be set up: one log line per request.
fn haproxy(
    program: &std::path::Path,
    dir: &std::path::Path,
    port: u16,
    sink_port: u16,
) -> anyhow::Result<Proc> {
    let config = dir.join("haproxy.cfg");
    std::fs::write(
        &config,
        format!(
            "global
    log stdout format raw local0 info
defaults
    mode http
    log global
    option httplog
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend relay
    bind 127.0.0.1:{port} proto h2
    default_backend sink
backend sink
    server sink 127.0.0.1:{sink_port} proto h2
"
        ),
    )?;
    // Checked first: a configuration it refuses would otherwise show as nothing listening.
    let check = Command::new(program)
        .args(["-c", "-q", "-f"])
        .arg(&config)
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    anyhow::ensure!(
        check.status.success(),
        "haproxy refuses its configuration: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    // In the foreground (`-db`): the process measured is the one that forwards.
    spawn(Command::new(program).args(["-db", "-f"]).arg(&config))
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

/// What `--callgrind` reports.
#[derive(Debug, Serialize)]
struct InstructionReport {
    requests: u64,
    concurrency: usize,
    /// User-space instructions the relay executed per request.
    relay_instructions_per_request: f64,
    /// The same for the bare forwarder.
    bare_instructions_per_request: f64,
    /// relay / bare.
    ratio: f64,
}

/// Warms the relay and the bare forwarder (`targets`, both under callgrind, in that order)
/// up, then counts each one's instructions over `--requests`: instrumentation on, the load,
/// a dump of the counts, instrumentation off again.
async fn count_instructions(
    cli: &Cli,
    targets: &[Target],
    profiles: &std::path::Path,
) -> anyhow::Result<InstructionReport> {
    for target in targets {
        load(&target.url, None, cli.requests / 10 + 100, cli.concurrency).await?;
    }
    let valgrind = cli
        .callgrind
        .as_deref()
        .context("--callgrind names valgrind")?;
    let mut per_request = Vec::new();
    for Target { name, url, pid } in targets {
        callgrind_control(valgrind, *pid, &["--instr=on"]).await?;
        load(url, None, cli.requests, cli.concurrency).await?;
        callgrind_control(valgrind, *pid, &["--dump"]).await?;
        callgrind_control(valgrind, *pid, &["--instr=off"]).await?;
        let instructions = dumped_instructions(profiles, name)?;
        per_request.push(instructions as f64 / cli.requests as f64);
    }
    Ok(InstructionReport {
        requests: cli.requests,
        concurrency: cli.concurrency,
        relay_instructions_per_request: per_request[0],
        bare_instructions_per_request: per_request[1],
        ratio: per_request[0] / per_request[1].max(f64::EPSILON),
    })
}

/// Runs valgrind's `callgrind_control` (beside `valgrind`, else on the PATH) on `pid`,
/// which does what it is asked before it answers. It exits 0 even when it found no such
/// run, so its words are read too; and it waits for as long as it takes to reach the
/// process (through ptrace), so it is given a minute.
async fn callgrind_control(
    valgrind: &std::path::Path,
    pid: u32,
    args: &[&str],
) -> anyhow::Result<()> {
    let beside = valgrind.with_file_name("callgrind_control");
    let program = if beside.is_file() {
        beside
    } else {
        "callgrind_control".into()
    };
    let run = tokio::process::Command::new(&program)
        .args(args)
        .arg(pid.to_string())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .with_context(|| {
            format!(
                "{} {args:?} {pid} did not answer within a minute",
                program.display()
            )
        })?
        .with_context(|| format!("running {} (valgrind)", program.display()))?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    anyhow::ensure!(
        output.status.success() && !said.contains("Error") && !said.contains("No active"),
        "{} {args:?} {pid}: {}: {said}",
        program.display(),
        output.status
    );
    Ok(())
}

/// The instructions in `name`'s first dump in `profiles` (its `totals:` or `summary:`
/// line): callgrind numbers the dumps it is asked for from 1.
fn dumped_instructions(profiles: &std::path::Path, name: &str) -> anyhow::Result<u64> {
    let dump = profiles.join(format!("{name}.out.1"));
    std::fs::read_to_string(&dump)
        .with_context(|| format!("reading {}", dump.display()))?
        .lines()
        .find_map(|line| {
            line.strip_prefix("totals:")
                .or_else(|| line.strip_prefix("summary:"))
        })
        .and_then(|count| count.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no instruction count in {}", dump.display()))
}

/// Loads the relay, the bare forwarder, and HAProxy and the `h2` floor when asked
/// (`targets`) in alternating rounds, over `tls` when given, and reports their CPU per
/// request.
async fn measure(
    cli: &Cli,
    targets: &[Target],
    tls: Option<&(Tls, Identity)>,
) -> anyhow::Result<Report> {
    // Warm each up, then alternate rounds so drift on a shared machine hits all alike.
    for target in targets {
        load(&target.url, tls, cli.requests / 10 + 100, cli.concurrency).await?;
    }
    // Per target: each round's CPU seconds, and the wall time in all.
    let mut cpu = vec![Vec::new(); targets.len()];
    let mut wall = vec![0.0f64; targets.len()];
    for _ in 0..cli.rounds {
        for (i, Target { url, pid, .. }) in targets.iter().enumerate() {
            let before = cpu_seconds(*pid)?;
            wall[i] += load(url, tls, cli.requests, cli.concurrency)
                .await?
                .as_secs_f64();
            cpu[i].push(cpu_seconds(*pid)? - before);
        }
    }
    if let Some(dir) = &cli.perf {
        for Target { name, url, pid } in targets {
            let data = dir.join(format!("{name}.perf.data"));
            let mut perf = Command::new("perf")
                .args([
                    "record",
                    "--quiet",
                    "-F",
                    "249",
                    "--call-graph",
                    "dwarf,16384",
                ])
                .args(["-p", &pid.to_string(), "-o"])
                .arg(&data)
                .stdout(Stdio::null())
                .spawn()
                .context("running perf (linux-perf)")?;
            // perf attaches within a moment; calls before that are not sampled.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let sent = load(url, tls, cli.requests, cli.concurrency).await;
            // SIGINT: perf writes its file and exits. Should the signal not go out, perf is
            // killed outright rather than left sampling (and waited for) for ever.
            let interrupted = Command::new("kill")
                .args(["-INT", &perf.id().to_string()])
                .status();
            if !interrupted.as_ref().is_ok_and(|s| s.success()) {
                let _ = perf.kill();
                let _ = perf.wait();
                anyhow::bail!("could not stop perf record for the {name}: {interrupted:?}");
            }
            let status = perf.wait()?;
            sent?;
            // perf writes its file on SIGINT, then ends by that signal.
            anyhow::ensure!(
                status.success() || status.signal() == Some(2),
                "perf record for the {name}: {status}"
            );
        }
    }
    let total = (cli.requests * u64::from(cli.rounds)) as f64;
    let sum = |i: usize| cpu[i].iter().sum::<f64>();
    let rounds = |over: usize, under: usize| -> Vec<f64> {
        cpu[over]
            .iter()
            .zip(&cpu[under])
            .map(|(over, under)| over / under.max(f64::EPSILON))
            .collect()
    };
    let ratio_rounds = rounds(0, 1);
    let at = |name: &str| targets.iter().position(|target| target.name == name);
    let baseline = |b: usize| -> anyhow::Result<BaselineReport> {
        let relay_ratio_rounds = rounds(0, b);
        let bare_ratio_rounds = rounds(1, b);
        Ok(BaselineReport {
            cpu_us_per_request: sum(b) / total * 1e6,
            rps: total / wall[b],
            rss_kib: rss_kib(targets[b].pid)?,
            relay_ratio_median: median(&relay_ratio_rounds),
            relay_ratio_rounds,
            bare_ratio_median: median(&bare_ratio_rounds),
            bare_ratio_rounds,
        })
    };
    let haproxy = at(HAPROXY).map(baseline).transpose()?;
    let h2_floor = match at(H2_FLOOR) {
        Some(f) => {
            let haproxy_ratio_rounds = at(HAPROXY).map(|h| rounds(f, h));
            Some(FloorReport {
                baseline: baseline(f)?,
                haproxy_ratio_median: haproxy_ratio_rounds.as_deref().map(median),
                haproxy_ratio_rounds,
            })
        }
        None => None,
    };
    Ok(Report {
        tls: cli.tls,
        requests: cli.requests * u64::from(cli.rounds),
        concurrency: cli.concurrency,
        relay_cpu_us_per_request: sum(0) / total * 1e6,
        bare_cpu_us_per_request: sum(1) / total * 1e6,
        ratio: sum(0) / sum(1).max(f64::EPSILON),
        ratio_median: median(&ratio_rounds),
        ratio_rounds,
        relay_rss_kib: rss_kib(targets[0].pid)?,
        bare_rss_kib: rss_kib(targets[1].pid)?,
        relay_rps: total / wall[0],
        bare_rps: total / wall[1],
        haproxy,
        h2_floor,
    })
}
