//! What the screen shows, computed from scrapes: per service the rates over the last
//! interval, for the chain the amplification over a longer window. Pure: snapshots and
//! instants in, numbers out, so every figure is unit-tested here.
//!
//! Prometheus counters only go up; a total that went down means the service restarted
//! (`up` restarts a service that exits), and then the new total is what happened since, as
//! Prometheus' `rate()` counts it.

use std::{collections::BTreeMap, time::Instant};

use crate::scrape::{Histogram, Snapshot};

/// One scrape of every service, when it finished; `None` where a service did not answer.
#[derive(Debug, Clone)]
pub struct Round {
    /// When the scrape finished (rates divide by the time between two rounds).
    pub at: Instant,
    /// By position, edge first, ledger last.
    pub snapshots: Vec<Option<Snapshot>>,
}

/// One service's row.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceView {
    /// Its `service` label, else the name of its position.
    pub name: String,
    /// Whether its admin port answered the last scrape.
    pub up: bool,
    /// Over the last interval; `None` until two scrapes in a row answered.
    pub rates: Option<Rates>,
    /// Tokens in its retry budget now (services without a budget have none).
    pub budget_tokens: Option<f64>,
}

/// A service's figures between two scrapes.
#[derive(Debug, Clone, PartialEq)]
pub struct Rates {
    /// Payments calls received per second.
    pub requests_per_s: f64,
    /// Calls finished OK / all calls finished; `None` when none finished.
    pub success_ratio: Option<f64>,
    /// Median latency in seconds, interpolated within its histogram bucket.
    pub p50_s: Option<f64>,
    /// 99th percentile latency in seconds.
    pub p99_s: Option<f64>,
    /// Attempts per downstream call (1 = no retry); `None` when no call finished.
    pub attempts_per_call: Option<f64>,
    /// Retries per second by the code that caused them, largest first, zeros left out.
    pub retries_per_s: Vec<(String, f64)>,
    /// Retries refused per second, by `budget` or `deadline`, zeros left out.
    pub refused_per_s: Vec<(String, f64)>,
}

/// The chain's amplification: bottom calls (the ledger's processor calls) per request that
/// reached the edge — 243 for one request retried at every layer, 3 at the edge only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Amplification {
    /// The ledger's downstream attempts in the window.
    pub bottom_calls: f64,
    /// Requests the edge received in the window (more than zero).
    pub edge_requests: f64,
}

impl Amplification {
    /// Bottom calls per edge request.
    pub fn ratio(&self) -> f64 {
        self.bottom_calls / self.edge_requests
    }
}

/// Everything one screen shows.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainView {
    /// One per admin address, in order.
    pub services: Vec<ServiceView>,
    /// Over the window; `None` when the edge received nothing in it (or edge or ledger
    /// did not answer at both ends).
    pub amplification: Option<Amplification>,
    /// The window's length in seconds.
    pub window_s: f64,
}

/// The view of `current`, with rates since `previous` and amplification since
/// `window_start` (which may be `previous`). `names` name the positions of services that
/// give no `service` label.
pub fn chain(
    names: &[String],
    window_start: &Round,
    previous: &Round,
    current: &Round,
) -> ChainView {
    let interval_s = seconds(previous, current);
    let services = current
        .snapshots
        .iter()
        .enumerate()
        .map(|(i, now)| {
            let before = previous.snapshots.get(i).and_then(Option::as_ref);
            let name = now
                .as_ref()
                .or(before)
                .and_then(|s| s.service.clone())
                .or_else(|| names.get(i).cloned())
                .unwrap_or_else(|| format!("#{}", i + 1));
            ServiceView {
                name,
                up: now.is_some(),
                rates: match (before, now) {
                    (Some(before), Some(now)) if interval_s > 0.0 => {
                        Some(rates(before, now, interval_s))
                    }
                    _ => None,
                },
                budget_tokens: now.as_ref().and_then(|s| s.budget_tokens),
            }
        })
        .collect();
    ChainView {
        services,
        amplification: amplification(&window_start.snapshots, &current.snapshots),
        window_s: seconds(window_start, current),
    }
}

/// A service's figures from two of its snapshots `interval_s` seconds apart.
pub fn rates(before: &Snapshot, now: &Snapshot, interval_s: f64) -> Rates {
    let codes = deltas(&before.requests_by_code, &now.requests_by_code);
    let finished: f64 = codes.values().sum();
    let ok = codes.get("OK").copied().unwrap_or(0.0);
    let latency = now.latency.since(&before.latency);
    Rates {
        requests_per_s: increase(before.received, now.received) / interval_s,
        success_ratio: (finished > 0.0).then(|| ok / finished),
        p50_s: latency.quantile(0.5),
        p99_s: latency.quantile(0.99),
        attempts_per_call: now
            .attempts_per_call
            .since(&before.attempts_per_call)
            .mean(),
        retries_per_s: per_second(
            deltas(&before.retries_by_reason, &now.retries_by_reason),
            interval_s,
        ),
        refused_per_s: per_second(deltas(&before.refused_by, &now.refused_by), interval_s),
    }
}

/// Ledger downstream attempts / edge requests received between two rounds: the first
/// position is the edge, the last the ledger.
pub fn amplification(
    before: &[Option<Snapshot>],
    now: &[Option<Snapshot>],
) -> Option<Amplification> {
    let (Some(Some(edge_before)), Some(Some(edge_now))) = (before.first(), now.first()) else {
        return None;
    };
    let (Some(Some(ledger_before)), Some(Some(ledger_now))) = (before.last(), now.last()) else {
        return None;
    };
    let edge_requests = increase(edge_before.received, edge_now.received);
    (edge_requests > 0.0).then(|| Amplification {
        bottom_calls: increase(
            ledger_before.downstream_attempts,
            ledger_now.downstream_attempts,
        ),
        edge_requests,
    })
}

impl Histogram {
    /// What was observed between `earlier` and this one (all of this one after a restart).
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        if self.count < earlier.count {
            return self.clone();
        }
        let buckets = self
            .buckets
            .iter()
            .map(|&(le, count)| {
                let before = earlier
                    .buckets
                    .iter()
                    .find(|(l, _)| *l == le)
                    .map_or(0.0, |&(_, c)| c);
                (le, (count - before).max(0.0))
            })
            .collect();
        Histogram {
            buckets,
            sum: self.sum - earlier.sum,
            count: self.count - earlier.count,
        }
    }

    /// The `q` quantile (0 < q ≤ 1) as Prometheus' `histogram_quantile` estimates it:
    /// linear within the bucket that holds it, from 0 below the first bound; in the `+Inf`
    /// bucket, the highest finite bound. `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, count) in &self.buckets {
            if count >= rank {
                if le.is_infinite() {
                    return Some(lower);
                }
                if count <= below {
                    return Some(le);
                }
                return Some(lower + (le - lower) * (rank - below) / (count - below));
            }
            (lower, below) = (le, count);
        }
        Some(lower)
    }

    /// Sum / count; `None` without observations.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }
}

/// A counter's increase from `before` to `now`; `now` itself if the service restarted.
fn increase(before: f64, now: f64) -> f64 {
    if now >= before { now - before } else { now }
}

/// Each labelled counter's increase.
fn deltas(before: &BTreeMap<String, f64>, now: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    now.iter()
        .map(|(label, &n)| {
            let b = before.get(label).copied().unwrap_or(0.0);
            (label.clone(), increase(b, n))
        })
        .collect()
}

/// Non-zero increases per second, largest first.
fn per_second(deltas: BTreeMap<String, f64>, interval_s: f64) -> Vec<(String, f64)> {
    let mut rates: Vec<_> = deltas
        .into_iter()
        .filter(|&(_, d)| d > 0.0)
        .map(|(label, d)| (label, d / interval_s))
        .collect();
    rates.sort_by(|a, b| b.1.total_cmp(&a.1));
    rates
}

/// Seconds from one round to a later one.
fn seconds(from: &Round, to: &Round) -> f64 {
    to.at.saturating_duration_since(from.at).as_secs_f64()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn close(actual: Option<f64>, expected: f64) {
        let actual = actual.unwrap();
        assert!((actual - expected).abs() < 1e-9, "{actual} != {expected}");
    }

    fn map(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|&(k, v)| (k.to_owned(), v)).collect()
    }

    fn hist(buckets: &[(f64, f64)], sum: f64) -> Histogram {
        Histogram {
            buckets: buckets.to_vec(),
            sum,
            count: buckets.last().map_or(0.0, |b| b.1),
        }
    }

    fn service(name: &str, received: f64, downstream: f64) -> Snapshot {
        Snapshot {
            service: Some(name.to_owned()),
            received,
            downstream_attempts: downstream,
            ..Snapshot::default()
        }
    }

    fn round(at: Instant, snapshots: Vec<Option<Snapshot>>) -> Round {
        Round { at, snapshots }
    }

    const INF: f64 = f64::INFINITY;

    #[test]
    fn one_request_retried_at_every_layer_amplifies_243_times() {
        let before = [10.0, 30.0, 90.0, 270.0, 810.0];
        let calls =
            |i: usize, extra: f64| Some(service("s", before[i] + extra, 3.0 * (before[i] + extra)));
        let t0 = Instant::now();
        let start = round(t0, (0..5).map(|i| calls(i, 0.0)).collect());
        // One more edge request: 3, 9, 27, 81 at the layers below, 243 processor calls.
        let end = round(
            t0 + Duration::from_secs(2),
            (0..5).map(|i| calls(i, 3f64.powi(i as i32))).collect(),
        );
        let names: Vec<String> = ["edge", "hop2", "hop3", "hop4", "ledger"]
            .map(String::from)
            .into();
        let view = chain(&names, &start, &start, &end);
        let amplification = view.amplification.unwrap();
        assert_eq!(amplification.bottom_calls, 243.0);
        assert_eq!(amplification.edge_requests, 1.0);
        assert_eq!(amplification.ratio(), 243.0);
        assert_eq!(view.window_s, 2.0);
        let rates: Vec<f64> = view
            .services
            .iter()
            .map(|s| s.rates.as_ref().unwrap().requests_per_s)
            .collect();
        assert_eq!(rates, [0.5, 1.5, 4.5, 13.5, 40.5]);
    }

    #[test]
    fn edge_only_retries_make_three_bottom_calls_and_no_edge_request_no_figure() {
        let before = vec![
            Some(service("edge", 5.0, 15.0)),
            Some(service("ledger", 15.0, 45.0)),
        ];
        let now = vec![
            Some(service("edge", 6.0, 18.0)),
            Some(service("ledger", 18.0, 48.0)),
        ];
        assert_eq!(amplification(&before, &now).unwrap().ratio(), 3.0);
        assert_eq!(amplification(&now, &now), None);
        let down = vec![Some(service("edge", 6.0, 18.0)), None];
        assert_eq!(amplification(&before, &down), None);
    }

    #[test]
    fn rates_success_latency_attempts_and_retries_over_an_interval() {
        let before = Snapshot {
            received: 100.0,
            requests_by_code: map(&[("OK", 90.0), ("UNAVAILABLE", 10.0)]),
            retries_by_reason: map(&[("UNAVAILABLE", 20.0)]),
            refused_by: map(&[("budget", 1.0), ("deadline", 0.0)]),
            latency: hist(
                &[
                    (0.001, 10.0),
                    (0.0025, 50.0),
                    (0.005, 90.0),
                    (0.01, 100.0),
                    (INF, 100.0),
                ],
                0.3,
            ),
            attempts_per_call: hist(
                &[(1.0, 80.0), (2.0, 90.0), (3.0, 100.0), (INF, 100.0)],
                130.0,
            ),
            budget_tokens: Some(10.0),
            ..Snapshot::default()
        };
        // 10 more calls in 2 s: 8 OK, 2 UNAVAILABLE; latency 0–1 ms ×0, 1–2.5 ms ×4,
        // 2.5–5 ms ×5, 5–10 ms ×1; 10 downstream calls, 16 attempts; 6 retries, 2 refused.
        let now = Snapshot {
            received: 110.0,
            requests_by_code: map(&[("OK", 98.0), ("UNAVAILABLE", 12.0)]),
            retries_by_reason: map(&[("UNAVAILABLE", 24.0), ("ABORTED", 2.0)]),
            refused_by: map(&[("budget", 3.0), ("deadline", 0.0)]),
            latency: hist(
                &[
                    (0.001, 10.0),
                    (0.0025, 54.0),
                    (0.005, 99.0),
                    (0.01, 110.0),
                    (INF, 110.0),
                ],
                0.33,
            ),
            attempts_per_call: hist(
                &[(1.0, 86.0), (2.0, 96.0), (3.0, 110.0), (INF, 110.0)],
                146.0,
            ),
            budget_tokens: Some(7.5),
            ..Snapshot::default()
        };
        let r = rates(&before, &now, 2.0);
        assert_eq!(r.requests_per_s, 5.0);
        assert_eq!(r.success_ratio, Some(0.8));
        // p50: rank 5 falls in 2.5–5 ms, 1 of its 5 in: 2.5 + 2.5 × 1/5 = 3 ms.
        close(r.p50_s, 0.003);
        // p99: rank 9.9 falls in 5–10 ms, 0.9 of its 1: 5 + 5 × 0.9 = 9.5 ms.
        close(r.p99_s, 0.0095);
        assert_eq!(r.attempts_per_call, Some(1.6));
        assert_eq!(
            r.retries_per_s,
            vec![("UNAVAILABLE".to_owned(), 2.0), ("ABORTED".to_owned(), 1.0)]
        );
        assert_eq!(r.refused_per_s, vec![("budget".to_owned(), 1.0)]);
    }

    #[test]
    fn quantiles_at_the_edges_of_the_histogram() {
        assert_eq!(hist(&[(1.0, 0.0), (INF, 0.0)], 0.0).quantile(0.5), None);
        // All in the first bucket: interpolated from 0.
        assert_eq!(
            hist(&[(0.004, 4.0), (INF, 4.0)], 0.0).quantile(0.5),
            Some(0.002)
        );
        // Beyond the last finite bound: that bound.
        assert_eq!(
            hist(&[(30.0, 1.0), (INF, 10.0)], 0.0).quantile(0.99),
            Some(30.0)
        );
    }

    #[test]
    fn a_restarted_service_counts_from_zero_and_a_silent_one_is_down() {
        let t0 = Instant::now();
        let mut before = service("edge", 1000.0, 0.0);
        before.latency = hist(&[(0.001, 1000.0), (INF, 1000.0)], 0.5);
        let mut after = service("edge", 4.0, 0.0);
        after.latency = hist(&[(0.001, 4.0), (INF, 4.0)], 0.002);
        let start = round(t0, vec![Some(before), Some(service("ledger", 0.0, 0.0))]);
        let end = round(t0 + Duration::from_secs(1), vec![Some(after), None]);
        let view = chain(&["edge".into(), "ledger".into()], &start, &start, &end);
        let edge = &view.services[0];
        assert!(edge.up);
        let rates = edge.rates.as_ref().unwrap();
        assert_eq!(rates.requests_per_s, 4.0);
        assert_eq!(rates.p50_s, Some(0.0005));
        let ledger = &view.services[1];
        assert_eq!(ledger.name, "ledger");
        assert!(!ledger.up);
        assert_eq!(ledger.rates, None);
        assert_eq!(view.amplification, None);
    }
}
