//! The storm's per-second samples as an SVG chart: throughput, errors and bottom calls per
//! second on one time axis, so an outage can be looked at rather than read.

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;
use serde::Serialize;

/// A line of the chart: its label, its colour, and the value it plots.
type Series = (&'static str, RGBColor, fn(&Sample) -> u64);

/// Draws `samples` into an SVG file at `path`.
pub fn draw(path: &Path, samples: &[Sample]) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE).context("drawing the chart")?;
    let seconds = samples.last().map_or(1.0, |s| s.second).ceil().max(1.0);
    let top = samples
        .iter()
        .flat_map(|s| [s.ok, s.errors, s.bottom_calls])
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("retrychain storm: per second", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..seconds, 0f64..top)
        .context("laying out the chart")?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(BLACK.mix(0.15))
        .x_desc("seconds")
        .y_desc("per second")
        .draw()
        .context("drawing the axes")?;
    let series: [Series; 3] = [
        ("requests OK", GREEN, |s| s.ok),
        ("requests failed", RED, |s| s.errors),
        ("bottom calls", BLUE, |s| s.bottom_calls),
    ];
    for (label, color, value) in series {
        chart
            .draw_series(LineSeries::new(
                samples.iter().map(|s| (s.second, value(s) as f64)),
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

/// One interval (about a second) of the run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Seconds since the start at the end of the interval.
    pub second: f64,
    /// Requests completed OK in that second.
    pub ok: u64,
    /// Requests failed in that second.
    pub errors: u64,
    /// Bottom calls in that second.
    pub bottom_calls: u64,
}
