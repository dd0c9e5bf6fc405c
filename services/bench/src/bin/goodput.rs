//! The goodput curve: open-loop load from half the chain's capacity to ten times it, and
//! what the chain makes of it — goodput (charges answered OK within their deadline, per
//! second), the latency of those successes, the share refused as overloaded and how fast
//! a refusal is answered (by the client's clock, and at the edge by its own histogram),
//! and every service's memory ten seconds after each step.
//!
//! Capacity is measured first, closed loop at concurrency 32 (`retrychain storm`'s way);
//! then each step is `storm --rate <factor × capacity>` with as many calls in flight as it
//! takes (open loop: the rate does not slow down when the chain does).
//!
//! ```text
//! cargo run --release -p retrychain-bench --bin goodput -- \
//!     --edge http://127.0.0.1:50051 --ledger http://127.0.0.1:50055 \
//!     --pids edge=1,hop2=2,hop3=3,hop4=4,ledger=5 --svg bench/results/goodput.svg
//! ```

use std::{path::PathBuf, time::Duration};

use anyhow::Context;
use clap::Parser;
use plotters::prelude::*;
use retrychain_experiments::storm::{self, StormArgs, StormReport};
use serde::Serialize;

#[derive(Debug, Parser)]
struct Cli {
    /// The chain's edge.
    #[arg(long)]
    edge: String,
    /// The chain's ledger (its admin port is this port + 1000 unless --ledger-admin).
    #[arg(long)]
    ledger: String,
    /// The ledger's admin address.
    #[arg(long)]
    ledger_admin: Option<String>,
    /// The edge's admin address (its refusal-time histogram) [default: --edge's port + 1000].
    #[arg(long)]
    edge_admin: Option<String>,
    /// The services' processes, `name=pid,…`, for their memory.
    #[arg(long, default_value = "")]
    pids: String,
    /// Load steps, as multiples of the measured capacity.
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.8,1,2,5,10")]
    steps: Vec<f64>,
    /// How long each step (and the capacity measurement) lasts.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// How long to wait after each step before reading memory.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    settle: Duration,
    /// Draw the curve into this SVG.
    #[arg(long)]
    svg: Option<PathBuf>,
}

/// One step of the curve.
#[derive(Debug, Serialize)]
struct Step {
    /// The load as a multiple of capacity.
    factor: f64,
    /// The rate offered, charges/s.
    offered_rps: f64,
    /// Charges answered OK within the deadline, per second.
    goodput_rps: f64,
    /// Goodput as a share of the best step's.
    goodput_of_peak: f64,
    /// Successes' latency, p50 and p99, ms.
    ok_p50_ms: f64,
    /// …
    ok_p99_ms: f64,
    /// Calls refused as overloaded, as a share of all.
    shed_share: f64,
    /// Refusals' latency by the client's clock, p50 and p99, ms.
    shed_p50_ms: f64,
    /// …
    shed_p99_ms: f64,
    /// Refusals timed at the edge (its `shed_seconds` histogram, this step only): the
    /// bucket bound of the 99th percentile, ms.
    edge_refusal_p99_ms: Option<f64>,
    /// Calls that failed otherwise (not refused as overloaded).
    other_failures: u64,
    /// Each service's RSS after the step and the settling time, KiB.
    rss_after_kib: Vec<(String, u64)>,
}

#[derive(Debug, Serialize)]
struct Report {
    /// Charges/s at concurrency 32, closed loop.
    capacity_rps: f64,
    /// Each service's RSS before the first step, KiB.
    rss_idle_kib: Vec<(String, u64)>,
    steps: Vec<Step>,
}

fn storm_args(cli: &Cli, extra: &[String]) -> anyhow::Result<StormArgs> {
    let mut argv = vec![
        "--edge".to_owned(),
        cli.edge.clone(),
        "--ledger".to_owned(),
        cli.ledger.clone(),
        "--duration".to_owned(),
        format!("{}ms", cli.duration.as_millis()),
    ];
    if let Some(admin) = &cli.ledger_admin {
        argv.extend(["--ledger-admin".to_owned(), admin.clone()]);
    }
    if let Some(admin) = &cli.edge_admin {
        argv.extend(["--edge-admin".to_owned(), admin.clone()]);
    }
    argv.extend(extra.iter().cloned());
    retrychain_bench::storm_args(argv)
}

fn rss(pids: &str) -> Vec<(String, u64)> {
    pids.split(',')
        .filter_map(|pair| pair.split_once('='))
        .map(|(name, pid)| {
            let kib = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|status| {
                    status
                        .lines()
                        .find(|l| l.starts_with("VmRSS:"))
                        .and_then(|l| l.split_whitespace().nth(1))
                        .and_then(|n| n.parse().ok())
                })
                .unwrap_or(0);
            (name.to_owned(), kib)
        })
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let edge_admin = cli
        .edge_admin
        .clone()
        .unwrap_or_else(|| retrychain_harness::ServiceAddr::external(&cli.edge, None).admin_url);
    let rss_idle = rss(&cli.pids);
    let capacity: StormReport =
        storm::run(&storm_args(&cli, &["--concurrency".into(), "32".into()])?).await?;
    let capacity_rps = capacity.goodput_rps;
    eprintln!("capacity: {capacity_rps:.0} charges/s at concurrency 32");
    let mut steps = Vec::new();
    for &factor in &cli.steps {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rate = capacity_rps * factor;
        let before = retrychain_bench::refusal_buckets(&edge_admin)
            .await
            .unwrap_or_default();
        let report = storm::run(&storm_args(&cli, &retrychain_bench::open_loop_args(rate))?)
            .await
            .with_context(|| format!("the step at {factor}x"))?;
        let after = retrychain_bench::refusal_buckets(&edge_admin)
            .await
            .unwrap_or_default();
        tokio::time::sleep(cli.settle).await;
        let step = Step {
            factor,
            offered_rps: rate,
            goodput_rps: report.goodput_rps,
            goodput_of_peak: 0.0,
            ok_p50_ms: report.ok_latency_ms.p50,
            ok_p99_ms: report.ok_latency_ms.p99,
            shed_share: report.shed as f64 / report.requests.max(1) as f64,
            shed_p50_ms: report.shed_latency_ms.p50,
            shed_p99_ms: report.shed_latency_ms.p99,
            edge_refusal_p99_ms: retrychain_bench::refusal_p99_ms(&before, &after),
            other_failures: report.requests - report.ok - report.shed,
            rss_after_kib: rss(&cli.pids),
        };
        eprintln!(
            "{factor:>4}x  offered {rate:>6.0}/s  goodput {:>6.0}/s  ok p50 {:.1} ms p99 {:.1} ms  shed {:.0}% (client p99 {:.1} ms, edge p99 ≤ {:?} ms)  other failures {}",
            step.goodput_rps,
            step.ok_p50_ms,
            step.ok_p99_ms,
            step.shed_share * 100.0,
            step.shed_p99_ms,
            step.edge_refusal_p99_ms,
            step.other_failures
        );
        steps.push(step);
    }
    let peak = steps.iter().map(|s| s.goodput_rps).fold(0.0, f64::max);
    for step in &mut steps {
        step.goodput_of_peak = step.goodput_rps / peak.max(1e-9);
    }
    let report = Report {
        capacity_rps,
        rss_idle_kib: rss_idle,
        steps,
    };
    if let Some(path) = &cli.svg {
        draw(path, &report)?;
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// Goodput and offered load against the load factor, with the successes' p99 on a second
/// axis.
fn draw(path: &std::path::Path, r: &Report) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (900, 440)).into_drawing_area();
    root.fill(&WHITE).context("drawing")?;
    let max_factor = r.steps.iter().map(|s| s.factor).fold(1.0, f64::max);
    let top = r
        .steps
        .iter()
        .map(|s| s.goodput_rps.max(s.offered_rps.min(r.capacity_rps * 1.5)))
        .fold(r.capacity_rps, f64::max)
        * 1.1;
    let top_latency = r.steps.iter().map(|s| s.ok_p99_ms).fold(1.0, f64::max) * 1.2;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "goodput under open-loop load (capacity {:.0} charges/s at concurrency 32)",
                r.capacity_rps
            ),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .right_y_label_area_size(64)
        .build_cartesian_2d((0.4f64..max_factor * 1.1).log_scale(), 0f64..top)
        .context("layout")?
        .set_secondary_coord((0.4f64..max_factor * 1.1).log_scale(), 0f64..top_latency);
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(BLACK.mix(0.15))
        .x_desc("offered load, × capacity (log)")
        .y_desc("charges/s")
        .draw()
        .context("axes")?;
    chart
        .configure_secondary_axes()
        .y_desc("p99 of successes, ms")
        .draw()
        .context("axes")?;
    let goodput: Vec<(f64, f64)> = r.steps.iter().map(|s| (s.factor, s.goodput_rps)).collect();
    chart
        .draw_series(LineSeries::new(
            goodput.clone(),
            RGBColor(30, 120, 40).stroke_width(3),
        ))
        .context("series")?
        .label("goodput (OK within the deadline)")
        .legend(|(x, y)| {
            PathElement::new(
                vec![(x, y), (x + 18, y)],
                RGBColor(30, 120, 40).stroke_width(3),
            )
        });
    chart
        .draw_series(
            goodput
                .iter()
                .map(|&p| Circle::new(p, 4, RGBColor(30, 120, 40).filled())),
        )
        .context("points")?;
    let capped: Vec<(f64, f64)> = r
        .steps
        .iter()
        .map(|s| (s.factor, s.offered_rps.min(top)))
        .collect();
    chart
        .draw_series(LineSeries::new(capped, BLACK.mix(0.4).stroke_width(1)))
        .context("series")?
        .label("offered (clipped)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.mix(0.4)));
    let p99: Vec<(f64, f64)> = r.steps.iter().map(|s| (s.factor, s.ok_p99_ms)).collect();
    chart
        .draw_secondary_series(LineSeries::new(p99, RGBColor(40, 80, 200).stroke_width(2)))
        .context("series")?
        .label("p99 of successes (right axis)")
        .legend(|(x, y)| {
            PathElement::new(
                vec![(x, y), (x + 18, y)],
                RGBColor(40, 80, 200).stroke_width(2),
            )
        });
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .context("legend")?;
    root.present().context("writing the SVG")?;
    Ok(())
}
