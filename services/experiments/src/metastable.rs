//! Metastability on the running chain: load at about 0.8× what the chain can do, a trigger
//! that takes its capacity away for a moment, and what happens once the trigger is gone.
//!
//! A metastable failure (Bronson et al., HotOS 2021; Huang et al., OSDI 2022) is one that
//! outlives its trigger: the trigger pushes the system into a bad state, and something the
//! bad state causes — here, retries of the calls that failed — keeps it there. The design
//! notes predict that retries at every layer (3 per layer, five layers) are such a
//! sustaining effect, and that retries at the edge under a budget are not.
//!
//! The run, once per retry mode, on the same chain and with the same settings (no knob is
//! turned for either):
//!
//! ```text
//! capacity  closed loop at concurrency 32 for a few seconds: charges/s the chain can do
//! load      open loop at 0.8 × capacity, fresh keys, `x-retry-mode` naming the mode
//! trigger   after `before`, for `trigger`: the processor slowed (every call takes
//!           `trigger_delay`), or failing every call; then its faults are cleared
//! measure   goodput (answered OK within the deadline, per completion time) in bins
//! recovery  from the trigger's end, the time until a 1 s rolling goodput is back to
//!           95% of its level before the trigger — or to the lowest 1 s rolling goodput
//!           of the healthy seconds before it, when that is lower: on a loaded machine a
//!           healthy second varies by more than 5%, and "back" means as good as the
//!           healthy chain was, not better than its own worst second (but never less
//!           than 80% of the healthy mean)
//! ```

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context;
use futures::future::join_all;
use retrychain_domain::RetryMode;
use retrychain_harness::charge_request;
use retrychain_proto::v1::{
    Faults, GetStatsRequest, control_client::ControlClient, payments_client::PaymentsClient,
};
use serde::Serialize;
use tokio::time::Instant;
use tonic::transport::Channel;

/// How one run is shaped.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// How long the capacity is measured.
    pub capacity_for: Duration,
    /// The load, as a share of the measured capacity.
    pub load: f64,
    /// Load before the trigger.
    pub before: Duration,
    /// How long the trigger lasts.
    pub trigger: Duration,
    /// What the trigger does.
    pub trigger_kind: Trigger,
    /// Load after the trigger.
    pub after: Duration,
    /// Each request's deadline.
    pub deadline: Duration,
    /// The width of a goodput bin.
    pub bin: Duration,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            capacity_for: Duration::from_secs(3),
            load: 0.8,
            before: Duration::from_secs(4),
            trigger: Duration::from_secs(2),
            trigger_kind: Trigger::FailingProcessor,
            after: Duration::from_secs(8),
            deadline: Duration::from_secs(5),
            bin: Duration::from_millis(250),
        }
    }
}

/// What takes the chain's capacity away for a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Every processor call takes this long.
    SlowProcessor(Duration),
    /// Every processor call fails, UNAVAILABLE (what every layer retries).
    FailingProcessor,
}

impl Trigger {
    /// The ledger's faults while it lasts.
    fn faults(self) -> Faults {
        match self {
            Trigger::SlowProcessor(delay) => Faults {
                delay_ms: delay.as_millis() as u32,
                ..Faults::default()
            },
            Trigger::FailingProcessor => Faults {
                fail_rate: 1.0,
                ..Faults::default()
            },
        }
    }

    /// In words, for reports and pictures.
    pub fn describe(self) -> String {
        match self {
            Trigger::SlowProcessor(delay) => {
                format!("processor slowed to {} ms", delay.as_millis())
            }
            Trigger::FailingProcessor => "processor failing every call".to_owned(),
        }
    }
}

/// What the experiment measured.
#[derive(Debug, Clone, Serialize)]
pub struct Metastability {
    /// Charges/s the chain did at concurrency 32.
    pub capacity_rps: f64,
    /// The open-loop rate offered, charges/s.
    pub offered_rps: f64,
    /// When the trigger began and ended, seconds from the start of each run.
    pub trigger_s: (f64, f64),
    /// What the trigger did.
    pub trigger: String,
    /// Edge-only retries under the budget.
    pub edge_only: Timeline,
    /// Retries at every layer.
    pub every_layer: Timeline,
}

/// One mode's run.
#[derive(Debug, Clone, Serialize)]
pub struct Timeline {
    /// The mode.
    pub mode: String,
    /// Goodput before the trigger, charges/s.
    pub goodput_before_rps: f64,
    /// Goodput in the last two seconds of the run, charges/s.
    pub goodput_end_rps: f64,
    /// Seconds from the trigger's end until goodput was back to 95% of its level before;
    /// `None`: not within the run.
    pub recovered_after_s: Option<f64>,
    /// Requests sent, answered OK, failed.
    pub sent: u64,
    /// …
    pub ok: u64,
    /// …
    pub failed: u64,
    /// Bottom calls (processor calls) during the run.
    pub bottom_calls: u64,
    /// Goodput per bin: (bin end, seconds from the start; charges/s).
    pub goodput: Vec<(f64, f64)>,
    /// The keys of the charges answered OK (for a check of the database after the run).
    #[serde(skip)]
    pub acknowledged: Vec<String>,
}

/// Runs the experiment through `edge` (channels to the chain's edge), the trigger set on
/// the ledger that `ledger` controls (it must allow fault injection).
pub async fn run(
    ledger: &ControlClient<Channel>,
    edge: &[Channel],
    shape: Shape,
    run_tag: &str,
) -> anyhow::Result<Metastability> {
    let mut ledger = ledger.clone();
    ledger
        .set_faults(Faults::default())
        .await
        .context("the ledger must allow fault injection (--fault-injection)")?;
    let capacity = capacity(edge, shape.capacity_for, run_tag).await?;
    let offered = (capacity * shape.load).max(1.0);
    let mut timelines = Vec::new();
    for mode in [RetryMode::EdgeOnly, RetryMode::EveryLayer] {
        // A calm second between the runs: nothing of one is in the other.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let timeline = one_mode(&mut ledger, edge, shape, offered, mode, run_tag).await;
        let _ = ledger.set_faults(Faults::default()).await;
        timelines.push(timeline?);
    }
    let every_layer = timelines.pop().context("two runs")?;
    let edge_only = timelines.pop().context("two runs")?;
    let start = shape.before.as_secs_f64();
    Ok(Metastability {
        capacity_rps: capacity,
        offered_rps: offered,
        trigger_s: (start, start + shape.trigger.as_secs_f64()),
        trigger: shape.trigger_kind.describe(),
        edge_only,
        every_layer,
    })
}

/// Charges/s at concurrency 32 for `time`.
async fn capacity(edge: &[Channel], time: Duration, run_tag: &str) -> anyhow::Result<f64> {
    let end = Instant::now() + time;
    let started = Instant::now();
    let workers = (0..32).map(|w| {
        let mut client = PaymentsClient::new(edge[w % edge.len()].clone());
        async move {
            let mut ok = 0u64;
            let mut n = 0u64;
            while Instant::now() < end {
                n += 1;
                let request = charge_request(
                    &format!("meta-{run_tag}-cap-{w}"),
                    1,
                    Some(&format!("meta-{run_tag}-cap-{w}-{n}")),
                    Duration::from_secs(5),
                    None,
                );
                if client.charge(request).await.is_ok() {
                    ok += 1;
                }
            }
            ok
        }
    });
    let ok: u64 = join_all(workers).await.into_iter().sum();
    anyhow::ensure!(
        ok > 0,
        "no charge succeeded while measuring the chain's capacity"
    );
    Ok(ok as f64 / started.elapsed().as_secs_f64())
}

/// One completed request: when it completed (from the start), whether it was good, and
/// its key when it was answered OK.
type Done = (f64, bool, Option<String>);

async fn one_mode(
    ledger: &mut ControlClient<Channel>,
    edge: &[Channel],
    shape: Shape,
    rate: f64,
    mode: RetryMode,
    run_tag: &str,
) -> anyhow::Result<Timeline> {
    let bottom = async |ledger: &mut ControlClient<Channel>| {
        anyhow::Ok(
            ledger
                .get_stats(GetStatsRequest {})
                .await?
                .into_inner()
                .downstream_attempts,
        )
    };
    let before = bottom(ledger).await?;
    let start = Instant::now();
    let total = shape.before + shape.trigger + shape.after;
    let done: Arc<Mutex<Vec<Done>>> = Arc::default();
    let tag = format!("{run_tag}-{}", mode.as_str());
    let load = {
        let done = Arc::clone(&done);
        let edge = edge.to_vec();
        let deadline = shape.deadline;
        async move {
            let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut tasks = tokio::task::JoinSet::new();
            let mut n = 0u64;
            while start.elapsed() < total {
                ticker.tick().await;
                n += 1;
                let mut client = PaymentsClient::new(edge[n as usize % edge.len()].clone());
                let request = charge_request(
                    &format!("meta-{tag}-{}", n % 500),
                    1,
                    Some(&format!("meta-{tag}-{n}")),
                    deadline,
                    Some(mode),
                );
                let done = Arc::clone(&done);
                let key = format!("meta-{tag}-{n}");
                tasks.spawn(async move {
                    let sent = Instant::now();
                    let ok = client.charge(request).await.is_ok();
                    let good = ok && sent.elapsed() <= deadline;
                    if let Ok(mut done) = done.lock() {
                        done.push((start.elapsed().as_secs_f64(), good, ok.then_some(key)));
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
            n
        }
    };
    let mut control = ledger.clone();
    let trigger = async move {
        tokio::time::sleep_until(start + shape.before).await;
        control.set_faults(shape.trigger_kind.faults()).await?;
        tokio::time::sleep_until(start + shape.before + shape.trigger).await;
        control.set_faults(Faults::default()).await?;
        Ok::<_, anyhow::Error>(())
    };
    let (sent, triggered) = tokio::join!(load, trigger);
    triggered.context("the trigger (the ledger's faults)")?;
    let after = bottom(ledger).await?;
    let done = done.lock().map(|d| d.clone()).unwrap_or_default();
    Ok(timeline(
        mode,
        &done,
        sent,
        shape,
        total,
        after.saturating_sub(before),
    ))
}

/// Bins and judges one run's completions.
fn timeline(
    mode: RetryMode,
    done: &[Done],
    sent: u64,
    shape: Shape,
    total: Duration,
    bottom_calls: u64,
) -> Timeline {
    let bin = shape.bin.as_secs_f64();
    let bins = (total.as_secs_f64() / bin).ceil() as usize;
    let mut good = vec![0u64; bins];
    for (at, ok, _) in done {
        let i = ((at / bin) as usize).min(bins.saturating_sub(1));
        if *ok {
            good[i] += 1;
        }
    }
    let goodput: Vec<(f64, f64)> = good
        .iter()
        .enumerate()
        .map(|(i, &n)| ((i + 1) as f64 * bin, n as f64 / bin))
        .collect();
    let mean = |from: f64, to: f64| {
        let inside: Vec<f64> = goodput
            .iter()
            .filter(|(end, _)| *end > from + 1e-9 && *end <= to + 1e-9)
            .map(|(_, g)| *g)
            .collect();
        inside.iter().sum::<f64>() / inside.len().max(1) as f64
    };
    let trigger_start = shape.before.as_secs_f64();
    let trigger_end = trigger_start + shape.trigger.as_secs_f64();
    let end = total.as_secs_f64();
    // Before: from 1 s in (the load's start-up) to the trigger.
    let healthy_from = 1.0f64.min(trigger_start / 2.0);
    let before = mean(healthy_from, trigger_start);
    let window = (1.0 / bin).round().max(1.0) as usize;
    let rolling = |w: &[(f64, f64)]| w.iter().map(|(_, g)| g).sum::<f64>() / w.len() as f64;
    // The healthy seconds' own worst: "back" asks no more than that (see the module's
    // documentation).
    let healthy_worst = goodput
        .windows(window)
        .filter(|w| w[0].0 - bin >= healthy_from - 1e-9 && w[w.len() - 1].0 <= trigger_start + 1e-9)
        .map(rolling)
        .fold(f64::INFINITY, f64::min);
    // Never below 80% of the healthy mean: one stall before the trigger must not make a
    // chain still limping count as back.
    let back = (0.95 * before).min(healthy_worst.max(0.8 * before));
    let recovered_after_s = goodput
        .windows(window)
        .find(|w| w[0].0 - bin >= trigger_end - 1e-9 && rolling(w) >= back)
        .map(|w| w[0].0 - bin - trigger_end);
    let ok = done.iter().filter(|(_, good, _)| *good).count() as u64;
    Timeline {
        mode: mode.as_str().to_owned(),
        goodput_before_rps: before,
        goodput_end_rps: mean(end - 2.0, end),
        recovered_after_s,
        sent,
        ok,
        failed: done.len() as u64 - ok,
        bottom_calls,
        goodput,
        acknowledged: done.iter().filter_map(|(_, _, key)| key.clone()).collect(),
    }
}

/// Draws both timelines into one SVG at `path`, the trigger shaded.
pub fn draw(path: &std::path::Path, m: &Metastability) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE).context("drawing the chart")?;
    let end = m.edge_only.goodput.last().map_or(1.0, |(t, _)| *t).max(1.0);
    let top = m
        .edge_only
        .goodput
        .iter()
        .chain(&m.every_layer.goodput)
        .map(|(_, g)| *g)
        .fold(m.offered_rps, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "goodput at {:.0}/s offered (0.8× capacity); {} for {:.0} s",
                m.offered_rps,
                m.trigger,
                m.trigger_s.1 - m.trigger_s.0
            ),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..end, 0f64..top)
        .context("laying out the chart")?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(BLACK.mix(0.15))
        .x_desc("seconds")
        .y_desc("charges OK within the deadline / s")
        .draw()
        .context("drawing the axes")?;
    chart
        .draw_series(std::iter::once(Rectangle::new(
            [(m.trigger_s.0, 0.0), (m.trigger_s.1, top)],
            RGBColor(255, 200, 120).mix(0.35).filled(),
        )))
        .context("shading the trigger")?
        .label(format!("trigger: {}", m.trigger))
        .legend(|(x, y)| {
            Rectangle::new(
                [(x, y - 5), (x + 18, y + 5)],
                RGBColor(255, 200, 120).mix(0.6).filled(),
            )
        });
    let series = [
        (
            "edge-only + budget",
            RGBColor(30, 120, 40),
            &m.edge_only.goodput,
        ),
        ("every-layer", RGBColor(200, 30, 30), &m.every_layer.goodput),
    ];
    for (label, color, points) in series {
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .context("drawing a series")?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .context("drawing the legend")?;
    root.present().context("writing the SVG")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            before: Duration::from_secs(4),
            trigger: Duration::from_secs(2),
            after: Duration::from_secs(6),
            bin: Duration::from_millis(250),
            ..Shape::default()
        }
    }

    /// Completions at `rate`/s over [from, to).
    fn steady(done: &mut Vec<Done>, from: f64, to: f64, rate: f64) {
        let n = ((to - from) * rate) as usize;
        for i in 0..n {
            done.push((from + i as f64 / rate, true, None));
        }
    }

    #[test]
    fn recovery_is_counted_from_the_triggers_end_to_a_second_back_at_95_percent() {
        let mut done = Vec::new();
        steady(&mut done, 0.0, 4.0, 100.0);
        steady(&mut done, 7.5, 12.0, 100.0);
        let t = timeline(
            RetryMode::EdgeOnly,
            &done,
            0,
            shape(),
            Duration::from_secs(12),
            0,
        );
        assert!(
            (t.goodput_before_rps - 100.0).abs() < 5.0,
            "{}",
            t.goodput_before_rps
        );
        assert_eq!(t.recovered_after_s, Some(1.5));
    }

    #[test]
    fn back_means_as_good_as_the_healthy_seconds_worst_when_they_vary() {
        // Healthy at 100/s and 60/s by turns (a loaded machine): the mean of the healthy
        // seconds is 73/s, 95% of it 70/s, and the worst healthy second 60/s (above the
        // floor, 80% of the mean: 59/s). A recovery to 65/s is back (95% of the mean alone
        // said never); one to 50/s is not.
        let healthy = |done: &mut Vec<Done>| {
            for s in 0..4 {
                let rate = if s % 2 == 0 { 100.0 } else { 60.0 };
                steady(done, s as f64, s as f64 + 1.0, rate);
            }
        };
        let mut done = Vec::new();
        healthy(&mut done);
        steady(&mut done, 6.0, 12.0, 65.0);
        let t = timeline(
            RetryMode::EdgeOnly,
            &done,
            0,
            shape(),
            Duration::from_secs(12),
            0,
        );
        assert_eq!(t.recovered_after_s, Some(0.0), "{:?}", t.goodput);

        let mut done = Vec::new();
        healthy(&mut done);
        steady(&mut done, 6.0, 12.0, 50.0);
        let t = timeline(
            RetryMode::EdgeOnly,
            &done,
            0,
            shape(),
            Duration::from_secs(12),
            0,
        );
        assert_eq!(t.recovered_after_s, None);
    }

    #[test]
    fn a_run_that_stays_down_has_not_recovered() {
        let mut done = Vec::new();
        steady(&mut done, 0.0, 4.0, 100.0);
        steady(&mut done, 4.0, 12.0, 30.0);
        let t = timeline(
            RetryMode::EveryLayer,
            &done,
            0,
            shape(),
            Duration::from_secs(12),
            0,
        );
        assert_eq!(t.recovered_after_s, None);
        assert!(t.goodput_end_rps < 40.0);
    }
}
