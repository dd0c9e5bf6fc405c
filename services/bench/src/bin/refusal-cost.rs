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
//! All three serve on one thread (tokio's current-thread scheduler), as a retrychain
//! service does by default; the edge's process also has its log writer's thread, idle here
//! (a refusal logs no line). Each round sends `--requests` calls to each, `--concurrency`
//! in flight on one HTTP/2 connection, as fast as the answers come back; the server's CPU
//! (user + system, from /proc) until all but the round's last two answers, divided by the
//! calls answered by then, is its figure (the last two are where the edge's held calls
//! end, 5 s on). The load generator shares the machine's two cores and is measured too.
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
    procs::{Proc, RetrychainBinary, free_ports, spawn_quiet, wait_listening},
    serve,
};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest, payments_client::PaymentsClient,
    payments_server::Payments,
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
    #[command(flatten)]
    retrychain: RetrychainBinary,
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
        Some(Role::Refuse { listen }) => serve(TcpListener::bind(listen).await?, Refuser).await,
        Some(Role::Hold { listen }) => serve(TcpListener::bind(listen).await?, Holder).await,
        None => compare(&cli).await,
    }
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
    /// Over `h2`'s, each round's, and their median: `None` for a round too short for
    /// `h2`'s CPU to have moved a clock tick (10 ms; `bench/run --quick`), and for the
    /// median when every round was.
    over_h2_rounds: Vec<Option<f64>>,
    over_h2_median: Option<f64>,
    /// Calls answered a second, over all rounds (up to the answer before each round's
    /// last two: see `refused_load`).
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
    let retrychain = cli.retrychain.path()?;
    let [h2_port, tonic_port, hold_port, edge_port, edge_admin] = free_ports()?;
    let listen = |port: u16| format!("127.0.0.1:{port}");
    // This binary in one of its roles, serving on `port`.
    let role = |role: &str, port: u16| {
        spawn_quiet(Command::new(&me).args([role, "--listen", &listen(port)]))
    };
    let h2 = role("h2-refuse", h2_port)?;
    let tonic = role("refuse", tonic_port)?;
    let hold = role("hold", hold_port)?;
    wait_listening(hold_port).await?;
    let edge = spawn_quiet(
        Command::new(&retrychain)
            .args(["edge", "--listen", &listen(edge_port)])
            .args(["--admin-listen", &listen(edge_admin)])
            .args(["--downstream", &format!("http://{}", listen(hold_port))])
            .args(["--max-in-flight", "1", "--min-concurrency", "1"])
            .env("RUST_LOG", &cli.edge_log)
            .env("RETRYCHAIN_LOG_FORMAT", "text"),
    )?;
    let (h2_pid, tonic_pid, edge_pid) = (h2.0.id(), tonic.0.id(), edge.0.id());
    let processes: [Proc; 4] = [h2, tonic, hold, edge];
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
        refused_load(
            &target.url,
            [target.pid, me_pid],
            cli.requests / 10 + 100,
            cli.concurrency,
        )
        .await?;
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
            let outcome = refused_load(
                &target.url,
                [target.pid, me_pid],
                cli.requests,
                cli.concurrency,
            )
            .await?;
            cpu[i].push(outcome.cpu[0]);
            load_cpu[i] += outcome.cpu[1];
            answered[i].push(outcome.answered as f64);
            refused[i] += outcome.refused;
            wall[i] += outcome.took.as_secs_f64();
            eprintln!(
                "round {}: {:>5} {:.2} µs a call ({} of {} refused)",
                round + 1,
                target.name,
                outcome.cpu[0] / outcome.answered.max(1) as f64 * 1e6,
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
            let over_h2: Vec<Option<f64>> = rounds
                .iter()
                .zip(&h2)
                .map(|(c, f)| (*f > 0.0).then(|| c / f))
                .collect();
            let measured: Vec<f64> = over_h2.iter().flatten().copied().collect();
            let calls: f64 = answered[i].iter().sum();
            Figures {
                name: targets[i].name,
                cpu_us_per_call_median: median(&rounds),
                cpu_us_per_call_rounds: rounds,
                over_h2_median: (!measured.is_empty()).then(|| median(&measured)),
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

/// What one round of calls came back with, up to the answer before its last two (see
/// [`refused_load`]).
struct Outcome {
    /// Calls answered by then.
    answered: u64,
    /// Of those, refused as overloaded (UNAVAILABLE with `retrychain-overloaded`).
    refused: u64,
    /// The CPU seconds each of the processes measured used by then.
    cpu: [f64; 2],
    /// The time until then.
    took: Duration,
}

/// `requests` Charges to `target`, `concurrency` at once on one connection, each sent as
/// the last answer comes back; the CPU of `pids` (the server's, the load's) measured
/// over the answers but the last two. Those are where the edge's held calls end (one, or
/// two in a round past 5 s), after its 5 s deadline: counted, the edge's idle seconds
/// waiting for them would be counted as the refusals' time. At least 99% of the answers
/// counted must be refusals, or the round did not measure refusing; any other answer
/// than a refusal or a deadline ending is an error.
async fn refused_load(
    target: &str,
    pids: [u32; 2],
    requests: u64,
    concurrency: usize,
) -> anyhow::Result<Outcome> {
    let channel = tonic::transport::Endpoint::from_shared(target.to_owned())?
        .tcp_nodelay(true)
        .connect()
        .await?;
    let client = PaymentsClient::new(channel);
    let cpu = || -> anyhow::Result<[f64; 2]> { Ok([cpu_seconds(pids[0])?, cpu_seconds(pids[1])?]) };
    let before = cpu()?;
    let start = std::time::Instant::now();
    let mut answers = futures::stream::iter(0..requests)
        .map(|n| {
            let mut client = client.clone();
            async move {
                match client.charge(retrychain_bench::charge(n)).await {
                    Ok(_) => Err(Status::internal("a call was served: nothing here serves")),
                    Err(status) if status.code() == Code::Unavailable => {
                        Ok(resilience::wire::is_overloaded(status.metadata().as_ref()))
                    }
                    Err(status) if status.code() == Code::DeadlineExceeded => Ok(false),
                    Err(status) => Err(status),
                }
            }
        })
        .buffer_unordered(concurrency.max(1));
    let counted = requests.saturating_sub(2).max(1);
    let (mut answered, mut refused) = (0, 0);
    let mut outcome = None;
    while let Some(answer) = answers.next().await {
        match answer {
            Ok(true) => refused += 1,
            Ok(false) => {}
            Err(status) => anyhow::bail!("{target}: {status:?}"),
        }
        answered += 1;
        if answered == counted {
            let after = cpu()?;
            outcome = Some(Outcome {
                answered,
                refused,
                cpu: [after[0] - before[0], after[1] - before[1]],
                took: start.elapsed(),
            });
        }
    }
    let outcome = outcome.ok_or_else(|| anyhow::anyhow!("{target}: no answers"))?;
    anyhow::ensure!(
        outcome.refused * 100 >= outcome.answered * 99,
        "{target}: only {} of {} answers were refusals",
        outcome.refused,
        outcome.answered
    );
    Ok(outcome)
}
