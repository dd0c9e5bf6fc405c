//! What a storm measured, and how it is told: the report, its latency quantiles, the
//! per-second CSV.

use crate::chart::Sample;
use anyhow::Context;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::{collections::BTreeMap, path::PathBuf};

/// What one storm measured.
#[derive(Debug, Clone, Serialize)]
pub struct StormReport {
    /// Requests completed.
    pub requests: u64,
    /// Requests that succeeded.
    pub ok: u64,
    /// ok / requests.
    pub success_rate: f64,
    /// Completed requests per final status code.
    pub codes: BTreeMap<String, u64>,
    /// Requests the edge received during the run (its `requests_received`).
    pub first_attempts: u64,
    /// Processor calls the ledgers made during the run (their `downstream_attempts`, summed).
    pub bottom_calls: u64,
    /// How many ledgers' counters were read for `bottom_calls`.
    pub ledgers_read: usize,
    /// bottom_calls / first_attempts.
    pub amplification: f64,
    /// Completed requests per second.
    pub throughput_rps: f64,
    /// Requests answered OK within their deadline, per second.
    pub goodput_rps: f64,
    /// Requests refused as overloaded (UNAVAILABLE marked by the refusing service).
    pub shed: u64,
    /// Whether refused calls' pushbacks were waited out (--honour-pushback).
    pub honoured_pushback: bool,
    /// With --honour-pushback: the pushbacks waited out, and their sum in seconds (worker
    /// seconds spent sending nothing).
    pub pushback_waits: u64,
    /// See [`StormReport::pushback_waits`].
    pub pushback_wait_s: f64,
    /// Wall time of the run, in seconds.
    pub duration_s: f64,
    /// Latency percentiles, in ms.
    pub latency_ms: Latency,
    /// Latency percentiles of the requests answered OK, in ms.
    pub ok_latency_ms: Latency,
    /// Latency percentiles of the failed requests, in ms.
    pub failed_latency_ms: Latency,
    /// Latency percentiles of the requests refused as overloaded, in ms.
    pub shed_latency_ms: Latency,
    /// Per-second samples.
    pub samples: Vec<Sample>,
}

/// Latency percentiles of completed requests, in ms.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Slowest.
    pub max: f64,
}

impl Latency {
    /// The quantiles of `histogram` (microseconds), in milliseconds; zeros when none.
    pub(super) fn of(histogram: Option<&Histogram<u64>>) -> Self {
        histogram.map_or(
            Latency {
                p50: 0.0,
                p90: 0.0,
                p99: 0.0,
                p999: 0.0,
                max: 0.0,
            },
            |h| Latency {
                p50: h.value_at_quantile(0.5) as f64 / 1e3,
                p90: h.value_at_quantile(0.9) as f64 / 1e3,
                p99: h.value_at_quantile(0.99) as f64 / 1e3,
                p999: h.value_at_quantile(0.999) as f64 / 1e3,
                max: h.max() as f64 / 1e3,
            },
        )
    }
}

pub(super) fn write_csv(path: &PathBuf, samples: &[Sample]) -> anyhow::Result<()> {
    let mut text = String::from("second,ok,errors,bottom_calls\n");
    for s in samples {
        text.push_str(&format!(
            "{:.2},{},{},{}\n",
            s.second, s.ok, s.errors, s.bottom_calls
        ));
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Prints the report for people.
pub fn print_report(r: &StormReport) {
    println!("requests        {}", r.requests);
    println!(
        "success rate    {:.2}% ({} ok)",
        r.success_rate * 100.0,
        r.ok
    );
    let codes: Vec<String> = r.codes.iter().map(|(c, n)| format!("{c} {n}")).collect();
    println!("status codes    {}", codes.join(", "));
    println!("first attempts  {}", r.first_attempts);
    println!(
        "bottom calls    {} (the processor calls of {} ledger{})",
        r.bottom_calls,
        r.ledgers_read,
        if r.ledgers_read == 1 { "" } else { "s" }
    );
    println!(
        "amplification   {:.3} bottom calls per first attempt",
        r.amplification
    );
    println!(
        "throughput      {:.0} requests/s over {:.1} s",
        r.throughput_rps, r.duration_s
    );
    println!(
        "goodput         {:.0} requests/s OK within the deadline; {} refused as overloaded",
        r.goodput_rps, r.shed
    );
    if r.honoured_pushback {
        println!(
            "pushback        {} waited out, {:.1} worker-seconds sending nothing (on average {:.1} workers idle)",
            r.pushback_waits,
            r.pushback_wait_s,
            r.pushback_wait_s / r.duration_s.max(1e-9)
        );
    }
    for (what, l) in [
        ("latency ms     ", r.latency_ms),
        ("  of OK        ", r.ok_latency_ms),
        ("  of failures  ", r.failed_latency_ms),
        ("  of refusals  ", r.shed_latency_ms),
    ] {
        println!(
            "{what} p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            l.p50, l.p90, l.p99, l.p999, l.max
        );
    }
}
