//! `retrychain`: parse the command line and run it; everything else is library code.

use std::process::ExitCode;

use clap::Parser;

/// jemalloc, not glibc's malloc: after an overload every service's memory goes back to
/// near its idle figure within seconds — its background thread purges pages unused for a
/// second (`.cargo/config.toml` sets the decay) — where glibc kept the edge at twice its
/// idle size for good (docs/benchmarks.md, memory after overload).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = retrychain::config::Cli::parse();
    match retrychain::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
