//! The `retrychain` command: one binary, a subcommand per job, each a page over the crates
//! under `services/`.
//!
//! # Layout
//!
//! - [`config`]: the command line (clap, every flag also an environment variable); a leaf
//!   module. `edge`, `relay` and `ledger` are `retrychain-serve`'s: one way to start a
//!   service, here or in a test's runtime.
//! - [`up`]: the whole chain on this machine (`retrychain-harness` starts and supervises it).
//! - [`health`]: the container health check; `certs`: a deployment's certificates
//!   (`retrychain-harness`'s `ChainTls::renew`).
//!
//! `demo`, `storm` and `sim` run the experiments of `retrychain-experiments`, which return
//! typed reports; this crate prints them, or their JSON. `top`, the live view of a chain's
//! admin ports, is `retrychain-top`'s; `chaos`, faults under load and the checker, is
//! `retrychain-chaos`'s.

use std::process::ExitCode;

pub mod config;
pub mod health;
pub mod up;

use clap::Parser;
use config::{Cli, Command};
use retrychain_experiments::{demo, sim, storm};

/// The whole program: the command line parsed, then run on a tokio runtime — a service's
/// as its `--worker-threads` says (`retrychain_serve::runtime`), every other command's
/// multi-threaded.
///
/// The runtime is started here rather than by `#[tokio::main]` in the binary: release
/// builds do not share generic instantiations between crates, so a binary that polls this
/// crate's futures compiles every state machine of the program a second time (45 s of a
/// clean release build, against 1 s now).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match &cli.command {
        Command::Serve(service) => retrychain_serve::runtime(service),
        _ => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve(service) => retrychain_serve::run(service).await?,
        Command::Up(args) => up::run(args).await?,
        Command::Demo(args) => {
            let report = demo::run(&args).await?;
            if args.json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                demo::print_report(&report);
            }
        }
        Command::Storm(args) => {
            let report = storm::run(&args).await?;
            if args.json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                storm::print_report(&report);
            }
        }
        Command::Sim(args) => {
            let seeds = args.seeds;
            let report = tokio::task::spawn_blocking(move || sim::run(seeds)).await??;
            if args.json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                sim::print_tables(&report, seeds);
            }
        }
        Command::Top(args) => retrychain_top::run(&args).await?,
        Command::Certs(args) => {
            let chain = retrychain_harness::ChainTls::renew(&args.dir)?;
            println!(
                "certificates for {} and postgres in {} (authority kept in ca/, tokens in callers/)",
                retrychain_tls::CHAIN
                    .iter()
                    .chain([&retrychain_tls::OPERATOR])
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", "),
                chain.dir.display()
            );
        }
        Command::Chaos(args) => {
            if let Some(report) = retrychain_chaos::run(&args).await? {
                retrychain_chaos::print_report(&report);
                if !report.verdict.valid {
                    return Ok(ExitCode::FAILURE);
                }
            }
        }
        Command::Health(args) => {
            return Ok(match health::check(&args).await {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => {
                    eprintln!("{} is not SERVING", args.addr);
                    ExitCode::FAILURE
                }
                Err(error) => {
                    eprintln!("{error:#}");
                    ExitCode::FAILURE
                }
            });
        }
    }
    Ok(ExitCode::SUCCESS)
}
