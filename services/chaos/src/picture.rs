//! A picture of the run, read the way Jepsen's latency plots are: every operation's
//! latency over time (log scale), coloured by how it ended; below it, answers per second;
//! behind both, each fault's window shaded and labelled.

use std::{collections::HashMap, path::Path};

use anyhow::Context;
use plotters::prelude::*;

use crate::history::{FaultWindow, History, Op, Outcome, Request};

/// How an operation ended, as the picture colours it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Charged,
    Replayed,
    Read,
    Unavailable,
    Deadline,
    Shed,
    NoAnswer,
    Other,
}

impl Class {
    const ALL: [Class; 8] = [
        Class::Charged,
        Class::Replayed,
        Class::Read,
        Class::Unavailable,
        Class::Deadline,
        Class::Shed,
        Class::NoAnswer,
        Class::Other,
    ];

    fn of(op: &Op) -> Self {
        match (&op.outcome, &op.request) {
            (Outcome::Charged { replayed: true, .. }, _) => Class::Replayed,
            (Outcome::Charged { .. }, _) => Class::Charged,
            (Outcome::Read { .. }, _) | (_, Request::Read { .. }) if op.outcome.ok() => Class::Read,
            (Outcome::Unanswered | Outcome::ConnectionLost { .. }, _) => Class::NoAnswer,
            (Outcome::Failed { code, .. }, _) => match code.as_str() {
                "UNAVAILABLE" => Class::Unavailable,
                "DEADLINE_EXCEEDED" => Class::Deadline,
                "RESOURCE_EXHAUSTED" | "ABORTED" => Class::Shed,
                _ => Class::Other,
            },
            _ => Class::Other,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Class::Charged => "charged",
            Class::Replayed => "replayed",
            Class::Read => "read",
            Class::Unavailable => "UNAVAILABLE",
            Class::Deadline => "DEADLINE_EXCEEDED",
            Class::Shed => "RESOURCE_EXHAUSTED / ABORTED",
            Class::NoAnswer => "no answer, connection lost (edge down)",
            Class::Other => "other failure",
        }
    }

    fn colour(self) -> RGBColor {
        match self {
            Class::Charged => RGBColor(46, 139, 87),
            Class::Replayed => RGBColor(65, 105, 225),
            Class::Read => RGBColor(150, 150, 150),
            Class::Unavailable => RGBColor(255, 140, 0),
            Class::Deadline => RGBColor(220, 20, 60),
            Class::Shed => RGBColor(148, 0, 211),
            Class::NoAnswer => RGBColor(0, 0, 0),
            Class::Other => RGBColor(139, 69, 19),
        }
    }
}

/// About how many operations the latency chart draws.
const POINTS: usize = 12_000;

/// The shade of a fault's window, by what it hits.
fn shade(window: &FaultWindow) -> RGBColor {
    match window.kind.as_str() {
        "kill" | "freeze" | "stop" => RGBColor(255, 99, 71),
        k if k.starts_with("pg-") || k == "db-partition" => RGBColor(70, 130, 180),
        "partition" | "loss" | "latency" => RGBColor(218, 165, 32),
        _ => RGBColor(147, 112, 219),
    }
}

/// Draws `history` into an SVG file at `path`.
pub fn draw(path: &Path, history: &History) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (1200, 720)).into_drawing_area();
    root.fill(&WHITE).context("drawing the picture")?;
    let (upper, lower) = root.split_vertically(470);
    let seconds = history
        .ops
        .iter()
        .map(|op| op.completed_ms)
        .fold(history.load_ended_ms, f64::max)
        / 1000.0;
    let seconds = seconds.ceil().max(1.0);
    let slowest = history.ops.iter().map(Op::took_ms).fold(10.0, f64::max) * 2.0;

    let mut latency = ChartBuilder::on(&upper)
        .caption(
            "retrychain chaos: latency of every operation",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..seconds, (0.5f64..slowest).log_scale())
        .context("laying out the latency chart")?;
    latency
        .configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(BLACK.mix(0.1))
        .x_desc("seconds")
        .y_desc("latency, ms (log scale)")
        .draw()
        .context("drawing the axes")?;
    latency
        .draw_series(history.faults.iter().map(|w| {
            Rectangle::new(
                [(w.began_ms / 1000.0, 0.5), (w.healed_ms / 1000.0, slowest)],
                shade(w).mix(0.15).filled(),
            )
        }))
        .context("drawing the fault windows")?;
    latency
        .draw_series(history.faults.iter().enumerate().map(|(i, w)| {
            // Labels step down in turn, so that the labels of faults close together
            // (a composite fault) do not print over each other.
            let y = slowest / 1.6f64.powi(1 + (i % 4) as i32);
            Text::new(
                format!("{} {}", w.kind, w.target),
                (w.began_ms / 1000.0, y),
                ("sans-serif", 11).into_font().color(&shade(w)),
            )
        }))
        .context("labelling the fault windows")?;
    // Where the faults and the load stopped and settling began.
    let ended = history.load_ended_ms / 1000.0;
    latency
        .draw_series([PathElement::new(
            [(ended, 0.5), (ended, slowest)],
            BLACK.mix(0.5).stroke_width(1),
        )])
        .context("marking the end of the faults")?;
    latency
        .draw_series([Text::new(
            "faults over; settling",
            (ended, slowest / 1.3),
            ("sans-serif", 11).into_font(),
        )])
        .context("marking the end of the faults")?;
    // At most so many points per second and class, so that a long run stays a picture a
    // browser opens at once: the busy classes are thinned evenly, the rare ones (the
    // failures worth seeing) drawn whole.
    let classes = Class::ALL
        .iter()
        .filter(|c| history.ops.iter().any(|op| Class::of(op) == **c))
        .count()
        .max(1);
    let per_bucket = (POINTS / (seconds as usize * classes)).max(3);
    for class in Class::ALL {
        let colour = class.colour();
        let second = |op: &Op| (op.invoked_ms / 1000.0) as u64;
        let mut in_bucket: HashMap<u64, usize> = HashMap::new();
        for op in history.ops.iter().filter(|op| Class::of(op) == class) {
            *in_bucket.entry(second(op)).or_default() += 1;
        }
        let mut seen: HashMap<u64, usize> = HashMap::new();
        let points: Vec<(f64, f64)> = history
            .ops
            .iter()
            .filter(|op| Class::of(op) == class)
            .filter(|op| {
                // Every stride-th operation of its second.
                let stride = in_bucket[&second(op)].div_ceil(per_bucket);
                let n = seen.entry(second(op)).or_default();
                *n += 1;
                (*n - 1).is_multiple_of(stride)
            })
            .map(|op| (op.invoked_ms / 1000.0, op.took_ms().max(0.5)))
            .collect();
        if points.is_empty() {
            continue;
        }
        latency
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 2, colour.mix(0.6).filled())),
            )
            .context("drawing the operations")?
            .label(class.label())
            .legend(move |(x, y)| Circle::new((x + 8, y), 4, colour.filled()));
    }
    latency
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 12))
        .draw()
        .context("drawing the legend")?;

    // Answers per second, by the second they completed in.
    let buckets = seconds as usize + 1;
    let mut ok = vec![0u32; buckets];
    let mut failed = vec![0u32; buckets];
    for op in &history.ops {
        let second = ((op.completed_ms / 1000.0) as usize).min(buckets - 1);
        if op.outcome.ok() {
            ok[second] += 1;
        } else {
            failed[second] += 1;
        }
    }
    let top = ok.iter().chain(&failed).copied().max().unwrap_or(1).max(1) as f64 * 1.1;
    let mut rate = ChartBuilder::on(&lower)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..seconds, 0f64..top)
        .context("laying out the throughput chart")?;
    rate.configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(BLACK.mix(0.1))
        .x_desc("seconds")
        .y_desc("answers per second")
        .draw()
        .context("drawing the axes")?;
    rate.draw_series(history.faults.iter().map(|w| {
        Rectangle::new(
            [(w.began_ms / 1000.0, 0.0), (w.healed_ms / 1000.0, top)],
            shade(w).mix(0.15).filled(),
        )
    }))
    .context("drawing the fault windows")?;
    for (label, colour, counts) in [
        ("OK", Class::Charged.colour(), &ok),
        ("failed", Class::Deadline.colour(), &failed),
    ] {
        rate.draw_series(LineSeries::new(
            counts
                .iter()
                .enumerate()
                .map(|(s, n)| (s as f64 + 0.5, f64::from(*n))),
            colour.stroke_width(2),
        ))
        .context("drawing the throughput")?
        .label(label)
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
    }
    rate.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 12))
        .draw()
        .context("drawing the legend")?;
    root.present().context("writing the picture")?;
    Ok(())
}
