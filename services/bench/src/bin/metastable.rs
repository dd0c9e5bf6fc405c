//! The metastability scenario (`retrychain demo`'s g) against a running chain, with the
//! trigger chosen: load at 0.8× the measured capacity, then the processor slowed or
//! failing for a moment, per retry mode; the two goodput timelines as JSON and a picture.
//!
//! ```text
//! cargo run --release -p retrychain-bench --bin metastable -- \
//!     --edge http://127.0.0.1:50051 --ledger-admin http://127.0.0.1:51055 \
//!     --trigger fail --svg bench/results/metastability.svg
//! ```

use std::time::Duration;

use clap::Parser;
use retrychain_experiments::metastable::{self, Shape, Trigger};
use retrychain_proto::v1::control_client::ControlClient;

#[derive(Debug, Parser)]
struct Cli {
    /// The chain's edge.
    #[arg(long)]
    edge: String,
    /// The ledger's admin address (its faults are the trigger).
    #[arg(long)]
    ledger_admin: String,
    /// `slow:<ms>` (every processor call takes that long) or `fail` (every call fails).
    #[arg(long, default_value = "fail")]
    trigger: String,
    /// How long the trigger lasts, in seconds.
    #[arg(long, default_value_t = 2.0)]
    trigger_s: f64,
    /// Write the two timelines as an SVG here.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let trigger_kind = match cli.trigger.as_str() {
        "fail" => Trigger::FailingProcessor,
        other => {
            let ms: u64 = other
                .strip_prefix("slow:")
                .and_then(|ms| ms.parse().ok())
                .ok_or_else(|| anyhow::anyhow!("--trigger slow:<ms> or fail, not {other}"))?;
            Trigger::SlowProcessor(Duration::from_millis(ms))
        }
    };
    let mut edge = Vec::new();
    for _ in 0..4 {
        edge.push(retrychain_harness::connect(&cli.edge).await?);
    }
    let ledger = ControlClient::new(retrychain_harness::connect(&cli.ledger_admin).await?);
    let shape = Shape {
        trigger_kind,
        trigger: Duration::from_secs_f64(cli.trigger_s),
        ..Shape::default()
    };
    let tag = format!("{:08x}", rand::random::<u32>());
    let m = metastable::run(&ledger, &edge, shape, &tag).await?;
    if let Some(path) = &cli.svg {
        metastable::draw(path, &m)?;
    }
    println!("{}", serde_json::to_string_pretty(&m)?);
    Ok(())
}
