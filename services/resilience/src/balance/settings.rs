//! How a hop's balancer ejects replicas.

use std::time::Duration;

/// How a [`Balancer`](super::Balancer) ejects replicas; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BalanceSettings {
    /// Own failures in a row that eject a replica (0: never eject).
    pub consecutive_failures: u32,
    /// How long a first ejection lasts; the n-th lasts n times as long.
    pub base_ejection: Duration,
    /// The longest an ejection lasts (or the base, if longer).
    pub max_ejection: Duration,
    /// The most replicas ejected at once, in percent of them (at least one may be, unless
    /// it is 0: then none is).
    pub max_ejection_percent: u32,
    /// Failure-percentage detection: a replica whose own failures exceed this percentage
    /// of its attempts in an interval is ejected (above 100: never).
    pub failure_percentage_threshold: u32,
    /// ... only when at least this many replicas had enough attempts in the interval to
    /// be judged (a replica is an outlier only beside others).
    pub failure_percentage_minimum_hosts: u32,
    /// ... and only replicas with at least this many attempts in the interval are judged.
    pub failure_percentage_request_volume: u32,
    /// How often failure percentages are judged (and their counts started again).
    pub interval: Duration,
}

impl Default for BalanceSettings {
    /// gRFC A50's defaults.
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(30),
            max_ejection: Duration::from_secs(300),
            max_ejection_percent: 10,
            failure_percentage_threshold: 85,
            failure_percentage_minimum_hosts: 5,
            failure_percentage_request_volume: 50,
            interval: Duration::from_secs(10),
        }
    }
}
