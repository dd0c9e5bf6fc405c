//! Balancing a hop's calls over the replicas of the service below it.
//!
//! A hop's `--downstream` names one URL, several (`http://a:50053,http://b:50053`), or a
//! DNS name (`dns:///hop3:50053`) whose addresses are the replicas — what a Kubernetes
//! headless Service or Docker's embedded DNS for a scaled compose service answers. A name
//! is resolved again every few seconds ([`Balancer::start`]): replicas that appear join,
//! those that vanish leave, and a call in flight keeps the replica it was sent to.
//!
//! [`Balancer`] is the tower service at the bottom of the downstream stack, under the retry
//! loop, so that every attempt is balanced on its own:
//!
//! - **Which replica**: the power of two choices — two replicas drawn at random, the one
//!   with the lower cost taken — where the cost is a peak-EWMA of the replica's response
//!   times multiplied by its calls in flight plus one (Finagle's and Linkerd's load
//!   estimate). A slow replica, or one with a queue, is chosen less, without any replica
//!   being starved of the samples that would show it recovered.
//! - **A retry goes elsewhere**: the retry engine puts a [`Tried`] in each call's
//!   attempts; the balancer records there the replica each attempt went to, and the next
//!   attempt of the same call is drawn from the replicas not yet tried, when there is one
//!   (Envoy's `previous_hosts`). Hedged copies of a call go to distinct replicas the same
//!   way.
//!
//! - **A replica that stops answering costs one per-attempt timeout** (`--per-try-timeout-ms`,
//!   Envoy's `per_try_timeout`): an attempt gets at most that long (its `grpc-timeout` says
//!   so too), then fails UNAVAILABLE, which the caller may retry elsewhere.
//! - **Outlier ejection** (gRFC A50's consecutive-failures detection, its defaults): a
//!   replica whose own failures — connection errors, per-attempt timeouts, UNAVAILABLE,
//!   INTERNAL, UNKNOWN or DATA_LOSS it answers itself — reach 5 in a row is taken out of
//!   rotation for 30 s × the times it has been ejected (at most 300 s), then re-admitted;
//!   never more than 10% of the replicas at once, but always one may be. A failure a
//!   replica *relays* from below (marked [`wire::RELAYED`] by the hop that relays it) is
//!   not held against it: a ledger outage ejects no healthy hop3. An ejected replica is
//!   still used when every other one has been tried or is ejected too. gRFC A50's
//!   failure-percentage detection runs beside it: every 10 s, among replicas with at least
//!   50 attempts in that interval, and when there are at least 5 such, one whose own
//!   failures exceed 85% of its attempts is ejected the same way. At 85% it adds little to
//!   five in a row; with a lower `--failure-percentage-threshold` (50) it catches a replica
//!   that fails half its calls but never five in a row. Every ejection and re-admission is one log
//!   line; [`Balancer::endpoints`] has each replica's calls, failures and ejections.
//!
//! Why not `tower::balance::p2c`: its choice cannot exclude the replicas a call already
//! tried, and its endpoints must be polled ready one by one; tonic's own balanced channel
//! evicts a failed endpoint for good. The estimate itself is the one `tower::load::PeakEwma`
//! keeps, kept here per replica so that it can be read without owning the service.

use std::{
    sync::{Arc, Mutex, RwLock, Weak},
    task::{Context, Poll},
    time::Duration,
};

use rand::{RngExt, rngs::SmallRng};
use tokio::time::Instant;
use tonic::{
    Code, Status,
    body::Body,
    transport::{Channel, Endpoint},
};
use tower::{Service, ServiceExt};

use crate::wire;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = std::pin::Pin<Box<dyn Future<Output = T> + Send>>;

/// How often a DNS name is resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(5);

/// The response time a replica is assumed to have before its first answer: optimistic, so
/// that a replica that joins (or comes back) is tried at once and its real time learnt.
const DEFAULT_RTT: Duration = Duration::from_millis(1);

/// How fast the estimate forgets a slow answer: a sample's weight halves in about 7 s.
const DECAY: Duration = Duration::from_secs(10);

/// How a [`Balancer`] bounds attempts and ejects replicas; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BalanceSettings {
    /// The longest one attempt may take at one replica (`None`: until the call's
    /// deadline).
    pub per_try_timeout: Option<Duration>,
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
    /// gRFC A50's defaults; no per-attempt timeout.
    fn default() -> Self {
        Self {
            per_try_timeout: None,
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

/// A call's own per-attempt timeout (a method config's `retrychainPerTryTimeout`, put on
/// the request by the retry layer), which the balancer takes over its own setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerTryTimeout(pub Duration);

/// Where a hop's calls go: its `--downstream`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Downstream {
    /// One URL or several, each a replica.
    Urls(Vec<String>),
    /// Every address `host` resolves to, on `port`, resolved again every
    /// [`RESOLVE_EVERY`].
    Dns {
        /// The name.
        host: String,
        /// The port of every replica.
        port: u16,
    },
}

/// Why a `--downstream` value was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DownstreamError {
    /// Nothing was given.
    #[error("--downstream is empty")]
    Empty,
    /// A URL was not `http://host:port` (or https).
    #[error("--downstream {0:?} is not a URL such as http://hop3:50053")]
    BadUrl(String),
    /// A `dns:` target without a port, or with a bad one.
    #[error("--downstream {0:?}: a DNS target is dns:///host:port, e.g. dns:///hop3:50053")]
    BadDns(String),
}

impl Downstream {
    /// Reads `--downstream`: `dns:///host:port` (gRPC's name syntax; `dns:host:port` too),
    /// or one or more comma-separated `http(s)://host:port` URLs.
    pub fn parse(spec: &str) -> Result<Self, DownstreamError> {
        let spec = spec.trim();
        if spec.is_empty() {
            return Err(DownstreamError::Empty);
        }
        if let Some(target) = spec.strip_prefix("dns:") {
            // dns:///host:port (empty authority) or dns:host:port; an authority (a DNS
            // server of its own choosing, dns://8.8.8.8/host:port) is not supported.
            let target = target.strip_prefix("///").unwrap_or(target);
            let bad = || DownstreamError::BadDns(spec.to_owned());
            let (host, port) = target.rsplit_once(':').ok_or_else(bad)?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if host.is_empty() || host.contains('/') {
                return Err(bad());
            }
            let port = port
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(bad)?;
            return Ok(Self::Dns {
                host: host.to_owned(),
                port,
            });
        }
        let urls = spec
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(|url| {
                let uri: http::Uri = url
                    .parse()
                    .map_err(|_| DownstreamError::BadUrl(url.to_owned()))?;
                let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
                if !scheme_ok || uri.host().is_none() {
                    return Err(DownstreamError::BadUrl(url.to_owned()));
                }
                Ok(url.trim_end_matches('/').to_owned())
            })
            .collect::<Result<Vec<_>, _>>()?;
        if urls.is_empty() {
            return Err(DownstreamError::Empty);
        }
        Ok(Self::Urls(urls))
    }
}

impl std::fmt::Display for Downstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Urls(urls) => f.write_str(&urls.join(",")),
            Self::Dns { host, port } => write!(f, "dns:///{host}:{port}"),
        }
    }
}

/// The replicas one call has been sent to, shared by its attempts (the retry engine puts
/// one in every call it drives; see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Tried(Arc<Mutex<Vec<u64>>>);

impl Tried {
    fn contains(&self, id: u64) -> bool {
        self.0.lock().map(|t| t.contains(&id)).unwrap_or(false)
    }

    fn push(&self, id: u64) {
        if let Ok(mut tried) = self.0.lock() {
            tried.push(id);
        }
    }

    /// How many attempts of the call were sent to a replica.
    pub fn len(&self) -> usize {
        self.0.lock().map(|t| t.len()).unwrap_or(0)
    }

    /// Whether none was.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One replica: its channel and what the balancer has seen of it.
#[derive(Debug)]
struct Replica {
    /// Unique for the life of the process: a replica that leaves and comes back at the same
    /// address is a new one, its history not inherited.
    id: u64,
    /// `http://host:port`.
    url: String,
    /// Connected on first use, reconnected as needed.
    channel: Channel,
    /// The load estimate.
    load: Mutex<Load>,
    /// Outlier ejection's view of it.
    health: Mutex<Health>,
}

/// A replica's own failures in a row, and its ejection.
#[derive(Debug, Default)]
struct Health {
    /// Own failures since its last good answer.
    consecutive: u32,
    /// Out of rotation until then.
    ejected_until: Option<Instant>,
    /// How many times it has been ejected (the ejection time's multiplier); one is
    /// forgiven for each base ejection time it then goes without one.
    ejections: u32,
    /// When it was last re-admitted.
    readmitted: Option<Instant>,
    /// Attempts and own failures in the current interval (failure-percentage detection).
    interval_calls: u32,
    interval_failures: u32,
    /// Since it joined: attempts, own failures, ejections (for `/metrics`).
    calls_total: u64,
    failures_total: u64,
    ejections_total: u64,
}

/// One replica as `/metrics` and `retrychain top` show it.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointStats {
    /// `http://host:port`.
    pub url: String,
    /// Attempts sent to it since it joined.
    pub calls: u64,
    /// Failures of its own among them (see the module docs).
    pub failures: u64,
    /// Times it was ejected.
    pub ejections: u64,
    /// Whether it is out of rotation now.
    pub ejected: bool,
    /// Attempts in flight to it now.
    pub in_flight: u32,
    /// Its load estimate now (peak-EWMA response time), in seconds.
    pub rtt_seconds: f64,
}

/// How an attempt at a replica ended, for its health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// It answered, well or with a failure of its own making not held against it.
    Answered,
    /// A failure of its own: no connection, no answer in time, or a server failure it
    /// did not relay.
    Failed,
}

/// A replica's calls in flight and its peak-EWMA response time.
#[derive(Debug)]
struct Load {
    pending: u32,
    /// Nanoseconds.
    rtt_ns: f64,
    updated: Instant,
}

impl Load {
    fn new() -> Self {
        Self {
            pending: 0,
            rtt_ns: DEFAULT_RTT.as_nanos() as f64,
            updated: Instant::now(),
        }
    }

    /// The cost of sending one more call here, `now`: the estimate decayed for the time
    /// since its last sample (as `tower::load::PeakEwma` does), so that a replica not
    /// chosen for a while — its last answers slow, or its first one slowed by the
    /// connection's set-up — looks cheaper until it is tried again and measured afresh.
    fn cost(&self, now: Instant) -> f64 {
        let idle = now.saturating_duration_since(self.updated).as_secs_f64();
        let estimate = self.rtt_ns * (-idle / DECAY.as_secs_f64()).exp();
        estimate * f64::from(self.pending + 1)
    }

    /// A new sample: taken at once if slower (the peak), else averaged in with a weight
    /// that grows with the time since the last sample.
    fn observe(&mut self, rtt: Duration, now: Instant) {
        let sample = rtt.as_nanos() as f64;
        if sample > self.rtt_ns {
            self.rtt_ns = sample;
        } else {
            let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
            let keep = (-elapsed / DECAY.as_secs_f64()).exp();
            self.rtt_ns = self.rtt_ns * keep + sample * (1.0 - keep);
        }
        self.updated = now;
    }
}

/// Which replicas a draw may take.
type Eligible<'a> = &'a dyn Fn(&Arc<Replica>) -> bool;

/// What every clone of a [`Balancer`] shares.
#[derive(Debug)]
struct Shared {
    /// What `--downstream` said, for messages.
    downstream: Downstream,
    /// The replicas now; replaced whole when the set changes.
    replicas: RwLock<Arc<Vec<Arc<Replica>>>>,
    /// Ids for new replicas.
    next_id: std::sync::atomic::AtomicU64,
    /// The random draws of the two choices.
    rng: Mutex<SmallRng>,
    /// Per-attempt timeout and ejection.
    settings: BalanceSettings,
    /// When failure percentages were last judged.
    swept: Mutex<Instant>,
}

/// The bottom of a hop's downstream stack; see the module docs.
#[derive(Debug, Clone)]
pub struct Balancer {
    shared: Arc<Shared>,
}

impl Balancer {
    /// A balancer over `downstream`'s replicas. A DNS name is resolved once before this
    /// returns (a failure is logged, not fatal: the service below may not exist yet, and
    /// its calls then answer UNAVAILABLE until it does), then again every
    /// [`RESOLVE_EVERY`] for as long as a clone of the balancer lives.
    pub async fn start(downstream: Downstream, settings: BalanceSettings) -> Self {
        let balancer = Self::with_urls(downstream.clone(), &[], settings);
        match &downstream {
            Downstream::Urls(urls) => balancer.shared.update(urls),
            Downstream::Dns { host, port } => {
                if let Some(urls) = resolve(host, *port).await {
                    balancer.shared.update(&urls);
                }
                tokio::spawn(follow(
                    Arc::downgrade(&balancer.shared),
                    host.clone(),
                    *port,
                ));
            }
        }
        balancer
    }

    fn with_urls(downstream: Downstream, urls: &[String], settings: BalanceSettings) -> Self {
        let shared = Arc::new(Shared {
            downstream,
            replicas: RwLock::new(Arc::new(Vec::new())),
            next_id: std::sync::atomic::AtomicU64::new(1),
            rng: Mutex::new(rand::make_rng()),
            settings,
            swept: Mutex::new(Instant::now()),
        });
        shared.update(urls);
        Self { shared }
    }

    /// The replicas' URLs now.
    pub fn replicas(&self) -> Vec<String> {
        self.shared
            .current()
            .iter()
            .map(|r| r.url.clone())
            .collect()
    }

    /// Each replica's calls, failures and ejections, in the order of the set.
    pub fn endpoints(&self) -> Vec<EndpointStats> {
        let now = Instant::now();
        self.shared
            .current()
            .iter()
            .map(|r| {
                let (calls, failures, ejections, ejected) =
                    r.health.lock().map_or((0, 0, 0, false), |h| {
                        (
                            h.calls_total,
                            h.failures_total,
                            h.ejections_total,
                            h.ejected_until.is_some_and(|until| until > now),
                        )
                    });
                let (in_flight, rtt_seconds) = r.load.lock().map_or((0, 0.0), |l| {
                    (l.pending, l.cost(now) / f64::from(l.pending + 1) / 1e9)
                });
                EndpointStats {
                    url: r.url.clone(),
                    calls,
                    failures,
                    ejections,
                    ejected,
                    in_flight,
                    rtt_seconds,
                }
            })
            .collect()
    }

    /// Sets the replicas to `urls` (those already known keep their channel and history),
    /// as a resolution of the name does; for tests of churn.
    pub fn set_replicas(&self, urls: &[String]) {
        self.shared.update(urls);
    }
}

impl Shared {
    fn current(&self) -> Arc<Vec<Arc<Replica>>> {
        match self.replicas.read() {
            Ok(replicas) => Arc::clone(&replicas),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Makes the replica set `urls`: known ones stay, new ones join, the rest leave.
    fn update(&self, urls: &[String]) {
        let current = self.current();
        let same = urls.len() == current.len()
            && urls.iter().all(|url| current.iter().any(|r| &r.url == url));
        if same {
            return;
        }
        let mut next = Vec::with_capacity(urls.len());
        for url in urls {
            if next.iter().any(|r: &Arc<Replica>| &r.url == url) {
                continue;
            }
            match current.iter().find(|r| &r.url == url) {
                Some(known) => next.push(Arc::clone(known)),
                None => match channel(url) {
                    Ok(channel) => next.push(Arc::new(Replica {
                        id: self
                            .next_id
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                        url: url.clone(),
                        channel,
                        load: Mutex::new(Load::new()),
                        health: Mutex::new(Health::default()),
                    })),
                    Err(error) => tracing::warn!(%url, %error, "replica address refused"),
                },
            }
        }
        let joined: Vec<&str> = next
            .iter()
            .filter(|r| !current.iter().any(|c| c.id == r.id))
            .map(|r| r.url.as_str())
            .collect();
        let left: Vec<&str> = current
            .iter()
            .filter(|c| !next.iter().any(|r| r.id == c.id))
            .map(|c| c.url.as_str())
            .collect();
        tracing::info!(
            downstream = %self.downstream,
            ?joined,
            ?left,
            replicas = next.len(),
            "downstream replicas changed"
        );
        let next = Arc::new(next);
        match self.replicas.write() {
            Ok(mut replicas) => *replicas = next,
            Err(poisoned) => *poisoned.into_inner() = next,
        }
    }

    /// The replica for the next attempt of a call that has tried `tried`: two drawn at
    /// random among those in rotation the call has not tried, the cheaper taken. With none
    /// such, among those in rotation; then among the untried; then among all.
    fn pick(&self, tried: Option<&Tried>) -> Option<Arc<Replica>> {
        let replicas = self.current();
        let now = Instant::now();
        self.readmit(&replicas, now);
        let untried = |r: &Arc<Replica>| tried.is_none_or(|t| !t.contains(r.id));
        let in_rotation = |r: &Arc<Replica>| {
            r.health
                .lock()
                .map(|h| h.ejected_until.is_none())
                .unwrap_or(true)
        };
        let levels: [Eligible<'_>; 4] = [
            &|r| untried(r) && in_rotation(r),
            &in_rotation,
            &untried,
            &|_| true,
        ];
        let (eligible, count) = levels.into_iter().find_map(|eligible| {
            let count = replicas.iter().filter(|r| eligible(r)).count();
            (count > 0).then_some((eligible, count))
        })?;
        let nth = |n: usize| replicas.iter().filter(|r| eligible(r)).nth(n).cloned();
        if count == 1 {
            return nth(0);
        }
        let (a, b) = {
            let mut rng = self.rng.lock().ok()?;
            let a = rng.random_range(0..count);
            let b = (a + rng.random_range(1..count)) % count;
            (a, b)
        };
        let (a, b) = (nth(a)?, nth(b)?);
        let cost = |r: &Replica| r.load.lock().map(|l| l.cost(now)).unwrap_or(f64::MAX);
        Some(if cost(&b) < cost(&a) { b } else { a })
    }

    /// Puts back into rotation every replica whose ejection is over.
    fn readmit(&self, replicas: &[Arc<Replica>], now: Instant) {
        for replica in replicas {
            let Ok(mut health) = replica.health.lock() else {
                continue;
            };
            if health.ejected_until.is_some_and(|until| until <= now) {
                health.ejected_until = None;
                health.consecutive = 0;
                health.readmitted = Some(now);
                // A fresh start: the slow answers that led to the ejection are not held
                // against it once more by the load estimate.
                if let Ok(mut load) = replica.load.lock() {
                    load.rtt_ns = DEFAULT_RTT.as_nanos() as f64;
                    load.updated = now;
                }
                tracing::info!(
                    downstream = %self.downstream,
                    replica = %replica.url,
                    "replica re-admitted after its ejection"
                );
            }
        }
    }

    /// Records how an attempt at `replica` ended; ejects it after too many own failures
    /// in a row, and judges failure percentages once an interval is over.
    fn record(&self, replica: &Replica, outcome: Outcome, now: Instant) {
        let settings = &self.settings;
        let Ok(mut health) = replica.health.lock() else {
            return;
        };
        health.calls_total += 1;
        health.interval_calls = health.interval_calls.saturating_add(1);
        match outcome {
            Outcome::Answered => {
                health.consecutive = 0;
                // One ejection forgiven per base time gone by without one.
                if let Some(readmitted) = health.readmitted
                    && now.saturating_duration_since(readmitted) >= settings.base_ejection
                {
                    health.ejections = health.ejections.saturating_sub(1);
                    health.readmitted = (health.ejections > 0).then_some(now);
                }
                drop(health);
            }
            Outcome::Failed => {
                health.consecutive += 1;
                health.failures_total += 1;
                health.interval_failures = health.interval_failures.saturating_add(1);
                let due = settings.consecutive_failures > 0
                    && health.consecutive >= settings.consecutive_failures
                    && health.ejected_until.is_none();
                let failures = health.consecutive;
                drop(health);
                if due {
                    self.eject(
                        replica,
                        now,
                        &format!("{failures} failures of its own in a row"),
                    );
                }
            }
        }
        self.sweep(now);
    }

    /// gRFC A50's failure-percentage detection, once per interval: among the replicas
    /// with enough attempts, when there are enough of them, those whose own failures
    /// exceed the threshold are ejected; then every replica's interval counts restart.
    fn sweep(&self, now: Instant) {
        let settings = &self.settings;
        {
            // Whoever holds it is judging this interval already.
            let Ok(mut swept) = self.swept.try_lock() else {
                return;
            };
            if now.saturating_duration_since(*swept) < settings.interval {
                return;
            }
            *swept = now;
        }
        let replicas = self.current();
        let counts: Vec<(u32, u32)> = replicas
            .iter()
            .map(|r| {
                r.health.lock().map_or((0, 0), |mut h| {
                    let counts = (h.interval_calls, h.interval_failures);
                    (h.interval_calls, h.interval_failures) = (0, 0);
                    counts
                })
            })
            .collect();
        let judged = counts
            .iter()
            .filter(|(calls, _)| *calls >= settings.failure_percentage_request_volume)
            .count();
        if settings.failure_percentage_threshold > 100
            || judged < settings.failure_percentage_minimum_hosts as usize
        {
            return;
        }
        for (replica, (calls, failures)) in replicas.iter().zip(counts) {
            let over = calls >= settings.failure_percentage_request_volume
                && u64::from(failures) * 100
                    > u64::from(settings.failure_percentage_threshold) * u64::from(calls);
            if over {
                self.eject(
                    replica,
                    now,
                    &format!("{failures} of its {calls} attempts failed on its own"),
                );
            }
        }
    }

    /// Takes `replica` out of rotation for its next ejection time, unless it is out
    /// already or the limit on ejected replicas is reached.
    fn eject(&self, replica: &Replica, now: Instant, why: &str) {
        let settings = &self.settings;
        let replicas = self.current();
        let ejected = replicas
            .iter()
            .filter(|r| r.health.lock().is_ok_and(|h| h.ejected_until.is_some()))
            .count();
        // At least one may be ejected, unless the percentage is 0 (ejection off, as A50).
        let allowed = match replicas.len() * settings.max_ejection_percent as usize / 100 {
            0 if settings.max_ejection_percent > 0 => 1,
            allowed => allowed,
        };
        if ejected >= allowed || !replicas.iter().any(|r| r.id == replica.id) {
            return; // at the limit, or the replica has left the set
        }
        let Ok(mut health) = replica.health.lock() else {
            return;
        };
        if health.ejected_until.is_some() {
            return;
        }
        health.ejections += 1;
        health.ejections_total += 1;
        let longest = settings.max_ejection.max(settings.base_ejection);
        let time = (settings.base_ejection * health.ejections).min(longest);
        health.ejected_until = Some(now + time);
        tracing::warn!(
            downstream = %self.downstream,
            replica = %replica.url,
            why,
            ejected_for_s = time.as_secs_f64(),
            "replica ejected"
        );
    }
}

/// A lazily connected channel to `url`, with the settings every hop uses.
fn channel(url: &str) -> Result<Channel, tonic::transport::Error> {
    Ok(Endpoint::from_shared(url.to_owned())?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy())
}

/// The replicas' URLs for `host:port`, or `None` when the name does not resolve now.
async fn resolve(host: &str, port: u16) -> Option<Vec<String>> {
    match tokio::net::lookup_host((host, port)).await {
        Ok(addrs) => {
            let mut urls: Vec<String> = addrs.map(|addr| format!("http://{addr}")).collect();
            urls.sort();
            urls.dedup();
            Some(urls)
        }
        Err(error) => {
            tracing::warn!(%host, port, %error, "could not resolve the downstream's name; keeping its replicas as they were");
            None
        }
    }
}

/// Resolves `host` again every [`RESOLVE_EVERY`] while the balancer lives.
async fn follow(shared: Weak<Shared>, host: String, port: u16) {
    loop {
        tokio::time::sleep(RESOLVE_EVERY).await;
        let urls = resolve(&host, port).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if let Some(urls) = urls {
            shared.update(&urls);
        }
    }
}

/// A call in flight to a replica: counted in its load until dropped.
struct InFlight {
    replica: Arc<Replica>,
    sent: Instant,
}

impl InFlight {
    fn start(replica: Arc<Replica>) -> Self {
        if let Ok(mut load) = replica.load.lock() {
            load.pending += 1;
        }
        Self {
            replica,
            sent: Instant::now(),
        }
    }

    /// The answer came: its time is a sample.
    fn answered(&self) {
        let now = Instant::now();
        if let Ok(mut load) = self.replica.load.lock() {
            load.observe(now - self.sent, now);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut load) = self.replica.load.lock() {
            load.pending = load.pending.saturating_sub(1);
        }
    }
}

impl Service<http::Request<Body>> for Balancer {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    /// Always ready: readiness is each replica's channel's, awaited in the call.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let tried = request.extensions().get::<Tried>().cloned();
        let Some(replica) = self.shared.pick(tried.as_ref()) else {
            let message = format!(
                "no replica of {} is known (the name resolved to no address)",
                self.shared.downstream
            );
            return Box::pin(
                async move { Err(Box::new(Status::unavailable(message)) as BoxError) },
            );
        };
        if let Some(tried) = &tried {
            tried.push(replica.id);
        }
        let per_try = request
            .extensions()
            .get::<PerTryTimeout>()
            .map(|p| p.0)
            .or(self.shared.settings.per_try_timeout);
        // The per-attempt timeout, when it is shorter than the call's own time left.
        let mut capped = None;
        if let Some(per_try) = per_try {
            // The replica is told too, so that it gives up when this attempt does.
            let left = wire::timeout_of(request.headers()).ok().flatten();
            if left.is_none_or(|left| per_try < left) {
                wire::set_timeout(request.headers_mut(), per_try);
                capped = Some(per_try);
            }
        }
        let shared = Arc::clone(&self.shared);
        let channel = replica.channel.clone();
        let in_flight = InFlight::start(Arc::clone(&replica));
        Box::pin(async move {
            let sent = channel.oneshot(request);
            let mut answer = match per_try {
                Some(per_try) => match tokio::time::timeout(per_try, sent).await {
                    Ok(answer) => answer.map_err(BoxError::from),
                    Err(_) => Err(Box::new(Status::unavailable(format!(
                        "{} did not answer within the per-attempt timeout ({} ms)",
                        replica.url,
                        per_try.as_millis()
                    ))) as BoxError),
                },
                None => sent.await.map_err(BoxError::from),
            };
            if let (Some(per_try), Ok(response)) = (capped, &mut answer) {
                per_try_expired(response, &replica.url, per_try);
            }
            let outcome = outcome(&answer);
            // Only an answer is a sample of its time: a refused connection, answered in
            // microseconds, must not make a dead replica look cheap.
            if outcome == Outcome::Answered {
                in_flight.answered();
            }
            shared.record(&replica, outcome, Instant::now());
            answer
        })
    }
}

/// A replica that was sent the per-attempt timeout as its `grpc-timeout` usually gives up
/// a moment before the balancer's own timer, answering DEADLINE_EXCEEDED itself (or
/// relaying it from below). Either way it is this attempt's timeout, not the call's: told
/// as the balancer tells it, UNAVAILABLE, which the caller may retry elsewhere whatever
/// its policy thinks of DEADLINE_EXCEEDED. (Held against the replica unless relayed.)
fn per_try_expired(response: &mut http::Response<Body>, url: &str, per_try: Duration) {
    let expired = Status::from_header_map(response.headers())
        .is_some_and(|status| status.code() == Code::DeadlineExceeded);
    if expired {
        let status = Status::unavailable(format!(
            "{url} did not answer within the per-attempt timeout ({} ms)",
            per_try.as_millis()
        ));
        let headers = response.headers_mut();
        headers.remove("grpc-status-details-bin");
        let _ = status.add_header(headers);
    }
}

/// Whether an attempt's answer is a failure of the replica's own.
fn outcome(answer: &Result<http::Response<Body>, BoxError>) -> Outcome {
    let Ok(response) = answer else {
        return Outcome::Failed; // no connection, a broken one, no answer in time
    };
    let own_failure = Status::from_header_map(response.headers()).is_some_and(|status| {
        matches!(
            status.code(),
            Code::Unavailable | Code::Internal | Code::Unknown | Code::DataLoss
        ) && !wire::is_relayed(response.headers())
    });
    if own_failure {
        Outcome::Failed
    } else {
        Outcome::Answered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_urls_and_dns_targets() {
        assert_eq!(
            Downstream::parse("http://a:1, http://b:2/"),
            Ok(Downstream::Urls(vec![
                "http://a:1".into(),
                "http://b:2".into()
            ]))
        );
        assert_eq!(
            Downstream::parse("dns:///hop3:50053"),
            Ok(Downstream::Dns {
                host: "hop3".into(),
                port: 50053
            })
        );
        assert_eq!(
            Downstream::parse("dns:hop3:50053"),
            Ok(Downstream::Dns {
                host: "hop3".into(),
                port: 50053
            })
        );
        for bad in [
            "",
            "dns:///hop3",
            "dns:///hop3:0",
            "dns://8.8.8.8/hop3:1",
            "hop3:50053",
            "ftp://a:1",
        ] {
            assert!(Downstream::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_estimate_takes_peaks_at_once_and_forgets_them_slowly() {
        let start = Instant::now();
        let mut load = Load::new();
        load.observe(Duration::from_millis(100), start);
        assert_eq!(load.rtt_ns, 100e6);
        load.observe(Duration::from_millis(1), start + Duration::from_millis(10));
        assert!(
            load.rtt_ns > 99e6,
            "10 ms later a fast answer barely moves it"
        );
        load.observe(Duration::from_millis(1), start + Duration::from_secs(60));
        assert!(
            load.rtt_ns < 2e6,
            "a minute later it has forgotten the peak"
        );
    }

    #[tokio::test]
    async fn a_call_that_tried_some_replicas_goes_to_another_while_one_is_left() {
        let urls: Vec<String> = (1..=3).map(|i| format!("http://127.0.0.1:{i}")).collect();
        let balancer = Balancer::with_urls(
            Downstream::Urls(urls.clone()),
            &urls,
            BalanceSettings::default(),
        );
        for _ in 0..100 {
            let tried = Tried::default();
            let mut seen = Vec::new();
            for _ in 0..3 {
                let replica = balancer.shared.pick(Some(&tried)).expect("a replica");
                tried.push(replica.id);
                seen.push(replica.url.clone());
            }
            seen.sort();
            assert_eq!(seen, urls, "three attempts, three replicas");
            // Every one tried: the fourth may go anywhere.
            assert!(balancer.shared.pick(Some(&tried)).is_some());
        }
    }

    #[tokio::test]
    async fn the_cheaper_of_two_is_taken() {
        let urls: Vec<String> = (1..=2).map(|i| format!("http://127.0.0.1:{i}")).collect();
        let balancer = Balancer::with_urls(
            Downstream::Urls(urls.clone()),
            &urls,
            BalanceSettings::default(),
        );
        let replicas = balancer.shared.current();
        replicas[0]
            .load
            .lock()
            .unwrap()
            .observe(Duration::from_millis(50), Instant::now());
        for _ in 0..50 {
            let picked = balancer.shared.pick(None).expect("a replica");
            assert_eq!(
                picked.url, urls[1],
                "the slow one is never the cheaper of the two"
            );
        }
    }

    #[tokio::test]
    async fn a_changed_set_keeps_known_replicas_and_their_history() {
        let a = "http://127.0.0.1:1".to_owned();
        let b = "http://127.0.0.1:2".to_owned();
        let c = "http://127.0.0.1:3".to_owned();
        let balancer = Balancer::with_urls(
            Downstream::Urls(vec![a.clone()]),
            &[a.clone(), b.clone()],
            BalanceSettings::default(),
        );
        let before = balancer.shared.current();
        balancer.set_replicas(&[b.clone(), c.clone()]);
        let after = balancer.shared.current();
        assert_eq!(balancer.replicas(), vec![b.clone(), c]);
        assert_eq!(after[0].id, before[1].id, "b is the same replica");
        assert!(after.iter().all(|r| r.url != a), "a left");
    }

    #[tokio::test(start_paused = true)]
    async fn a_replica_failing_on_its_own_is_ejected_then_readmitted_one_at_a_time() {
        let urls: Vec<String> = (1..=3).map(|i| format!("http://127.0.0.1:{i}")).collect();
        let settings = BalanceSettings {
            base_ejection: Duration::from_secs(1),
            ..BalanceSettings::default()
        };
        let balancer = Balancer::with_urls(Downstream::Urls(urls.clone()), &urls, settings);
        let shared = &balancer.shared;
        let replicas = shared.current();
        let ejected = |r: &Replica| r.health.lock().unwrap().ejected_until.is_some();
        for _ in 0..4 {
            shared.record(&replicas[0], Outcome::Failed, Instant::now());
        }
        shared.record(&replicas[0], Outcome::Answered, Instant::now());
        for _ in 0..4 {
            shared.record(&replicas[0], Outcome::Failed, Instant::now());
        }
        assert!(
            !ejected(&replicas[0]),
            "an answer in between starts the count again"
        );
        shared.record(&replicas[0], Outcome::Failed, Instant::now());
        assert!(ejected(&replicas[0]), "five in a row");
        for _ in 0..50 {
            assert_ne!(
                shared.pick(None).unwrap().id,
                replicas[0].id,
                "out of rotation"
            );
        }
        for _ in 0..5 {
            shared.record(&replicas[1], Outcome::Failed, Instant::now());
        }
        assert!(!ejected(&replicas[1]), "10% of three: only one at a time");
        tokio::time::advance(Duration::from_millis(1100)).await;
        shared.pick(None);
        assert!(!ejected(&replicas[0]), "back after its ejection time");
        for _ in 0..5 {
            shared.record(&replicas[0], Outcome::Failed, Instant::now());
        }
        let until = replicas[0].health.lock().unwrap().ejected_until.unwrap();
        assert_eq!(
            until - Instant::now(),
            Duration::from_secs(2),
            "the second ejection lasts twice as long"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_replica_failing_most_calls_is_ejected_by_its_failure_percentage() {
        let urls: Vec<String> = (1..=5).map(|i| format!("http://127.0.0.1:{i}")).collect();
        let settings = BalanceSettings {
            max_ejection_percent: 40,
            failure_percentage_threshold: 50,
            ..BalanceSettings::default()
        };
        let balancer = Balancer::with_urls(Downstream::Urls(urls.clone()), &urls, settings);
        let shared = &balancer.shared;
        let replicas = shared.current();
        let ejected = |r: &Replica| r.health.lock().unwrap().ejected_until.is_some();
        // Replica 0 fails 3 of 4, never 5 in a row; replica 1 fails 1 of 3 (under 50%);
        // the others answer.
        for round in 0..60 {
            for (i, replica) in replicas.iter().enumerate() {
                let failed = match i {
                    0 => round % 4 != 0,
                    1 => round % 3 == 0,
                    _ => false,
                };
                let outcome = if failed {
                    Outcome::Failed
                } else {
                    Outcome::Answered
                };
                shared.record(replica, outcome, Instant::now());
            }
        }
        assert!(
            replicas.iter().all(|r| !ejected(r)),
            "not judged before the interval ends"
        );
        tokio::time::advance(Duration::from_secs(10)).await;
        shared.record(&replicas[2], Outcome::Answered, Instant::now());
        let stats = balancer.endpoints();
        let rate = |i: usize| stats[i].failures as f64 / stats[i].calls as f64;
        assert!(rate(0) > 0.5 && rate(1) < 0.5, "{} {}", rate(0), rate(1));
        assert!(ejected(&replicas[0]), "over 50%");
        assert!(!ejected(&replicas[1]), "under 50%");
        assert_eq!(stats[0].ejections, 1);
        // Four judged replicas are fewer than the minimum of five: nobody is ejected.
        let few = Balancer::with_urls(Downstream::Urls(urls[..4].to_vec()), &urls[..4], settings);
        let replicas = few.shared.current();
        for _ in 0..60 {
            for replica in replicas.iter() {
                few.shared.record(replica, Outcome::Failed, Instant::now());
                few.shared
                    .record(replica, Outcome::Answered, Instant::now());
            }
            few.shared
                .record(&replicas[0], Outcome::Failed, Instant::now());
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        few.shared
            .record(&replicas[1], Outcome::Answered, Instant::now());
        assert!(replicas.iter().all(|r| !ejected(r)));
    }
}
