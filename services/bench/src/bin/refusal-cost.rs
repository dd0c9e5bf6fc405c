//! What refusing a call costs the server that refuses it: CPU per refused Charge, for
//! three servers under the same closed-loop load, in the same alternating rounds.
//!
//! - `h2`: `h2` alone answering every stream with a refusal (`retrychain_bench::h2_floor::
//!   refuse`): the HTTP/2 framing, HPACK and stream state of a call and its trailers-only
//!   answer, tokio and the kernel, and nothing else. No server on `h2` refuses for less.
//! - `tonic`: tonic's server whose handler returns the refusal — hyper's stream task and
//!   request, tonic's routing and the status written as headers, no layers.
//! - `edge`: a retrychain edge at its ceiling, refusing by admission control as under
//!   overload. `--max-in-flight 1 --min-concurrency 1` (a fixed limit of one call), and the
//!   one call it admits is held by a downstream that never answers, so every other call is
//!   refused: its deadline read, the admission's decision, the pushback, the refusal-time
//!   histogram, the request's body drained apart. Once the held call's 5 s deadline ends
//!   the next is admitted and held, so a round admits one call every 5 s.
//!
//! All three run on one thread (tokio's current-thread scheduler), as a retrychain service
//! does by default. Each round sends `--requests` calls to each, `--concurrency` in flight
//! on one HTTP/2 connection, as fast as the answers come back; the server's CPU over the
//! round (user + system, from /proc) divided by the calls it answered is its figure.
//! The load generator shares the machine's two cores and is measured too.
//!
//! ```text
//! cargo run --release -p retrychain-bench --bin refusal-cost -- --requests 50000
//! ```
//!
//! The report (JSON on stdout) gives each server's CPU per refusal, each round's and their
//! median, and the edge's and tonic's over `h2`'s: how much of a refusal is HTTP/2's own.

use std::{process::Command, time::Duration};

use clap::{Parser, Subcommand};
use futures::StreamExt;
use retrychain_bench::{
    cpu_seconds, median,
    procs::{Proc, free_ports, spawn_quiet, wait_listening},
};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest,
    payments_client::PaymentsClient,
    payments_server::{Payments, PaymentsServer},
};
use serde::Serialize;
use tokio::net::TcpListener;
use tonic::{Code, Request, Response, Status};

#[derive(Debug, Parser)]
struct Cli {
    #[command(subcommand)]
    command: Option<Role>,
    /// Calls sent to each server per round.
    #[arg(long, default_value_t = 50_000)]
    requests: u64,
    /// Calls in flight.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Rounds, alternating the servers.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// The retrychain binary (default: next to this one).
    #[arg(long)]
    retrychain: Option<std::path::PathBuf>,
    /// RUST_LOG for the edge: `info`, as deployed.
    #[arg(long, default_value = "info")]
    edge_log: String,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Answer every stream with a refusal, on `h2` alone.
    H2Refuse {
        #[arg(long)]
        listen: String,
    },
    /// Answer every Charge with a refusal from tonic's handler.
    Refuse {
        #[arg(long)]
        listen: String,
    },
    /// Never answer a Charge (the call the edge admits is held here).
    Hold {
        #[arg(long)]
        listen: String,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The servers on one thread, as a retrychain service runs; the load on a worker per
    // core, so it is not what limits the rate.
    let runtime = match cli.command {
        Some(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        None => tokio::runtime::Runtime::new()?,
    };
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match &cli.command {
        Some(Role::H2Refuse { listen }) => {
            retrychain_bench::h2_floor::refuse(TcpListener::bind(listen).await?).await
        }
        Some(Role::Refuse { listen }) => serve(listen, Refuser).await,
        Some(Role::Hold { listen }) => serve(listen, Holder).await,
        None => compare(&cli).await,
    }
}

async fn serve<P: Payments>(listen: &str, service: P) -> anyhow::Result<()> {
    tonic::transport::Server::builder()
        .add_service(PaymentsServer::new(service))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(
            TcpListener::bind(listen).await?,
        ))
        .await?;
    Ok(())
}

/// Refuses every call as an overloaded service does: UNAVAILABLE, a pushback, the mark.
#[derive(Debug, Clone, Copy)]
struct Refuser;

impl Refuser {
    fn refusal() -> Status {
        let mut status = Status::unavailable(retrychain_bench::h2_floor::REFUSAL_MESSAGE);
        resilience::wire::set_pushback(&mut status, 100);
        resilience::wire::mark_overloaded(status.metadata_mut());
        status
    }
}

#[tonic::async_trait]
impl Payments for Refuser {
    async fn charge(&self, _: Request<ChargeRequest>) -> Result<Response<ChargeReply>, Status> {
        Err(Self::refusal())
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Self::refusal())
    }
}

/// Answers no Charge: each waits until its caller gives up.
#[derive(Debug, Clone, Copy)]
struct Holder;

#[tonic::async_trait]
impl Payments for Holder {
    async fn charge(&self, _: Request<ChargeRequest>) -> Result<Response<ChargeReply>, Status> {
        std::future::pending().await
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        std::future::pending().await
    }
}

/// A server measured: its name, where the load goes, the process whose CPU is counted.
struct Target {
    name: &'static str,
    url: String,
    pid: u32,
}

/// One server's figures over the rounds.
#[derive(Debug, Serialize)]
struct Figures {
    name: &'static str,
    /// CPU µs per call answered: each round's, and their median.
    cpu_us_per_call_rounds: Vec<f64>,
    cpu_us_per_call_median: f64,
    /// Over `h2`'s, each round's, and their median.
    over_h2_rounds: Vec<f64>,
    over_h2_median: f64,
    /// Calls answered a second, over all rounds. Not the edge's rate: its rounds last until
    /// the call it holds reaches its 5 s deadline.
    calls_per_second: f64,
    /// Of the calls answered, those refused as overloaded (the rest: the edge's held
    /// calls, which end in DEADLINE_EXCEEDED).
    refused_share: f64,
    /// The load generator's CPU µs per call against this server.
    load_cpu_us_per_call: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    requests_per_round: u64,
    rounds: u32,
    concurrency: usize,
    servers: Vec<Figures>,
}

async fn compare(cli: &Cli) -> anyhow::Result<()> {
    let me = std::env::current_exe()?;
    let retrychain = match &cli.retrychain {
        Some(path) => path.clone(),
        None => me.with_file_name("retrychain"),
    };
    let [h2_port, tonic_port, hold_port, edge_port, edge_admin] = free_ports()?;
    let listen = |port: u16| format!("127.0.0.1:{port}");
    let mut processes: Vec<Proc> = Vec::new();
    processes.push(spawn_quiet(Command::new(&me).args([
        "h2-refuse",
        "--listen",
        &listen(h2_port),
    ]))?);
    let h2_pid = processes[0].0.id();
    processes.push(spawn_quiet(Command::new(&me).args([
        "refuse",
        "--listen",
        &listen(tonic_port),
    ]))?);
    let tonic_pid = processes[1].0.id();
    processes.push(spawn_quiet(Command::new(&me).args([
        "hold",
        "--listen",
        &listen(hold_port),
    ]))?);
    wait_listening(hold_port).await?;
    processes.push(spawn_quiet(
        Command::new(&retrychain)
            .args(["edge", "--listen", &listen(edge_port)])
            .args(["--admin-listen", &listen(edge_admin)])
            .args(["--downstream", &format!("http://{}", listen(hold_port))])
            .args(["--max-in-flight", "1", "--min-concurrency", "1"])
            .env("RUST_LOG", &cli.edge_log)
            .env("RETRYCHAIN_LOG_FORMAT", "text"),
    )?);
    let edge_pid = processes[3].0.id();
    for port in [h2_port, tonic_port, edge_port] {
        wait_listening(port).await?;
    }
    let url = |port: u16| format!("http://{}", listen(port));
    let targets = [
        Target {
            name: "h2",
            url: url(h2_port),
            pid: h2_pid,
        },
        Target {
            name: "tonic",
            url: url(tonic_port),
            pid: tonic_pid,
        },
        Target {
            name: "edge",
            url: url(edge_port),
            pid: edge_pid,
        },
    ];
    let me_pid = std::process::id();
    // Warm each up (the edge's first call is admitted and held from here on).
    for target in &targets {
        refused_load(&target.url, cli.requests / 10 + 100, cli.concurrency).await?;
    }
    let n = targets.len();
    let mut cpu = vec![Vec::new(); n];
    let mut load_cpu = vec![0.0; n];
    let mut answered = vec![Vec::new(); n];
    let mut refused = vec![0u64; n];
    let mut wall = vec![0.0; n];
    for round in 0..cli.rounds as usize {
        // Each round in another order, so no server always follows the same one.
        for i in (0..n).map(|i| (i + round) % n) {
            let target = &targets[i];
            let (before, load_before) = (cpu_seconds(target.pid)?, cpu_seconds(me_pid)?);
            let outcome = refused_load(&target.url, cli.requests, cli.concurrency).await?;
            cpu[i].push(cpu_seconds(target.pid)? - before);
            load_cpu[i] += cpu_seconds(me_pid)? - load_before;
            answered[i].push(outcome.answered as f64);
            refused[i] += outcome.refused;
            wall[i] += outcome.took.as_secs_f64();
            eprintln!(
                "round {}: {:>5} {:.2} µs a call ({} of {} refused)",
                round + 1,
                target.name,
                cpu[i].last().unwrap_or(&0.0) / outcome.answered.max(1) as f64 * 1e6,
                outcome.refused,
                outcome.answered,
            );
        }
    }
    let per_call = |i: usize| -> Vec<f64> {
        cpu[i]
            .iter()
            .zip(&answered[i])
            .map(|(cpu, calls)| cpu / calls.max(1.0) * 1e6)
            .collect()
    };
    let h2 = per_call(0);
    let servers = (0..n)
        .map(|i| {
            let rounds = per_call(i);
            let over_h2: Vec<f64> = rounds.iter().zip(&h2).map(|(c, f)| c / f).collect();
            let calls: f64 = answered[i].iter().sum();
            Figures {
                name: targets[i].name,
                cpu_us_per_call_median: median(&rounds),
                cpu_us_per_call_rounds: rounds,
                over_h2_median: median(&over_h2),
                over_h2_rounds: over_h2,
                calls_per_second: calls / wall[i],
                refused_share: refused[i] as f64 / calls.max(1.0),
                load_cpu_us_per_call: load_cpu[i] / calls.max(1.0) * 1e6,
            }
        })
        .collect();
    let report = Report {
        requests_per_round: cli.requests,
        rounds: cli.rounds,
        concurrency: cli.concurrency,
        servers,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    drop(processes);
    Ok(())
}

/// What one round of calls came back with.
struct Outcome {
    /// Calls answered (every call sent: each ends, refused or after its deadline).
    answered: u64,
    /// Of those, refused as overloaded (UNAVAILABLE with `retrychain-overloaded`).
    refused: u64,
    took: Duration,
}

/// `requests` Charges to `target`, `concurrency` at once on one connection, each sent as
/// the last answer comes back. Every answer must be a refusal, or (the edge's held call)
/// the end of a 5 s deadline.
async fn refused_load(target: &str, requests: u64, concurrency: usize) -> anyhow::Result<Outcome> {
    let channel = tonic::transport::Endpoint::from_shared(target.to_owned())?
        .tcp_nodelay(true)
        .connect()
        .await?;
    let client = PaymentsClient::new(channel);
    let start = std::time::Instant::now();
    let answers: Vec<Result<bool, Status>> = futures::stream::iter(0..requests)
        .map(|n| {
            let mut client = client.clone();
            async move {
                match client.charge(retrychain_bench::charge(n)).await {
                    Ok(_) => Err(Status::internal("a call was served: nothing here serves")),
                    Err(status) if status.code() == Code::Unavailable => {
                        let marked = resilience::wire::is_overloaded(status.metadata().as_ref());
                        Ok(marked)
                    }
                    Err(status) if status.code() == Code::DeadlineExceeded => Ok(false),
                    Err(status) => Err(status),
                }
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let took = start.elapsed();
    let mut refused = 0;
    for answer in &answers {
        match answer {
            Ok(true) => refused += 1,
            Ok(false) => {}
            Err(status) => anyhow::bail!("{target}: {status:?}"),
        }
    }
    Ok(Outcome {
        answered: answers.len() as u64,
        refused,
        took,
    })
}
