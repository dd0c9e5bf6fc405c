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
//!   Envoy's `per_try_timeout`): the retry engine above cuts each attempt at that timeout
//!   (its `grpc-timeout` says so, and [`PerAttemptTimeout`] tells the balancer); the
//!   balancer keeps the timer, and an attempt past it fails UNAVAILABLE, which the caller
//!   may retry elsewhere, and is a sample of that replica's slowness.
//! - **Outlier ejection** (gRFC A50's consecutive-failures detection, its defaults): a
//!   replica whose own failures — connection errors, per-attempt timeouts, UNAVAILABLE,
//!   INTERNAL, UNKNOWN or DATA_LOSS it answers itself — reach 5 in a row is taken out of
//!   rotation for 30 s × the times it has been ejected (at most 300 s), then re-admitted;
//!   never more than 10% of the replicas at once, but always one may be — and never the
//!   last one in rotation (ejecting it would help nobody: calls would go to it anyway). A failure a
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
//!
//! # Layout
//!
//! - [`settings`]: [`BalanceSettings`], ejection's thresholds.
//! - [`resolve`]: where the calls go — `--downstream` read, names resolved, connectors.
//! - [`connection`]: one replica's HTTP/2 connection, and the call's timer.
//! - [`replica`]: one replica as the balancer knows it — its load estimate, its health,
//!   a call in flight to it.
//! - [`ejection`]: outlier ejection over the replicas, and who is spared it.
//! - here: the balancer itself — picking a replica (power of two choices over peak-EWMA,
//!   a retry elsewhere), following a DNS name, the per-attempt timeout, and the tower
//!   service.

mod connection;
mod ejection;
mod replica;
mod resolve;
mod settings;

use ejection::Ejector;
use replica::{Health, InFlight, Load, Outcome, Replica};
pub use resolve::{Connector, Downstream, DownstreamError, RESOLVE_EVERY};
use resolve::{connection, resolve};
pub use settings::BalanceSettings;

use std::{
    sync::{Arc, Mutex, RwLock, Weak},
    task::{Context, Poll},
    time::Duration,
};

use rand::{RngExt, rngs::SmallRng};
use tokio::time::Instant;
use tonic::{Code, Status, body::Body};
use tower::Service;

use crate::{deadline::PerAttemptTimeout, wire};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = std::pin::Pin<Box<dyn Future<Output = T> + Send>>;

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

/// Which replicas a draw may take.
type Eligible<'a> = &'a dyn Fn(&Arc<Replica>) -> bool;

/// What every clone of a [`Balancer`] shares.
#[derive(Debug)]
struct Shared {
    /// What `--downstream` said, for messages.
    downstream: Downstream,
    /// How connections are opened (over TLS, say); `None`: plain TCP.
    connector: Option<Connector>,
    /// The replicas now; replaced whole when the set changes.
    replicas: RwLock<Arc<Vec<Arc<Replica>>>>,
    /// Ids for new replicas.
    next_id: std::sync::atomic::AtomicU64,
    /// The random draws of the two choices.
    rng: Mutex<SmallRng>,
    /// Outlier ejection, with the settings (the per-attempt timeout among them).
    ejector: Ejector,
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
        Self::start_with(downstream, settings, None).await
    }

    /// [`Balancer::start`] with every replica's connections opened by `connector` — over
    /// TLS, one that presents this service's certificate and accepts only the tier below's
    /// identity; a DNS name's addresses become `https://` URLs.
    pub async fn start_with_connector(
        downstream: Downstream,
        settings: BalanceSettings,
        connector: Connector,
    ) -> Self {
        Self::start_with(downstream, settings, Some(connector)).await
    }

    async fn start_with(
        downstream: Downstream,
        settings: BalanceSettings,
        connector: Option<Connector>,
    ) -> Self {
        let balancer = Self::new(downstream.clone(), &[], settings, connector);
        match &downstream {
            Downstream::Urls(urls) => balancer.shared.update(urls),
            Downstream::Dns { host, port } => {
                if let Some(urls) = resolve(host, *port, balancer.shared.scheme()).await {
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

    #[cfg(test)]
    fn with_urls(downstream: Downstream, urls: &[String], settings: BalanceSettings) -> Self {
        Self::new(downstream, urls, settings, None)
    }

    fn new(
        downstream: Downstream,
        urls: &[String],
        settings: BalanceSettings,
        connector: Option<Connector>,
    ) -> Self {
        let shared = Arc::new(Shared {
            connector,
            replicas: RwLock::new(Arc::new(Vec::new())),
            next_id: std::sync::atomic::AtomicU64::new(1),
            rng: Mutex::new(rand::make_rng()),
            ejector: Ejector::new(settings, downstream.to_string()),
            downstream,
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

    /// Sets the replicas to `urls` (those already known keep their connection and history),
    /// as a resolution of the name does; for tests of churn.
    pub fn set_replicas(&self, urls: &[String]) {
        self.shared.update(urls);
    }
}

impl Shared {
    /// The scheme of a resolved replica's URL: `https` when a connector opens the
    /// connections (the only kind this library is given one for).
    fn scheme(&self) -> &'static str {
        if self.connector.is_some() {
            "https"
        } else {
            "http"
        }
    }

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
                None => match connection(url, self.connector.as_ref()) {
                    Ok(connection) => next.push(Arc::new(Replica {
                        id: self
                            .next_id
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                        url: url.clone(),
                        connection,
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

    /// Records how an attempt at `replica` ended, for outlier ejection.
    fn record(&self, replica: &Replica, outcome: Outcome, now: Instant) {
        self.ejector.record(&self.current(), replica, outcome, now);
    }

    /// The replica for the next attempt of a call that has tried `tried`: two drawn at
    /// random among those in rotation the call has not tried, the cheaper taken. With none
    /// such, among those in rotation; then among the untried; then among all.
    fn pick(&self, tried: Option<&Tried>) -> Option<Arc<Replica>> {
        let replicas = self.current();
        let now = Instant::now();
        self.ejector.readmit(&replicas, now);
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
}

/// Resolves `host` again every [`RESOLVE_EVERY`] while the balancer lives.
async fn follow(shared: Weak<Shared>, host: String, port: u16) {
    loop {
        tokio::time::sleep(RESOLVE_EVERY).await;
        let scheme = match shared.upgrade() {
            Some(shared) => shared.scheme(),
            None => return,
        };
        let urls = resolve(&host, port, scheme).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if let Some(urls) = urls {
            shared.update(&urls);
        }
    }
}

impl Service<http::Request<Body>> for Balancer {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    /// Always ready: a replica's connection is opened, when it must be, in the call.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
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
        // The per-attempt timeout, where the engine cut this attempt to it (it wrote it as
        // the attempt's `grpc-timeout`, so the replica gives up when this attempt does).
        let per_try = request
            .extensions()
            .get::<PerAttemptTimeout>()
            .map(|cut| cut.0);
        // The attempt's timer: its `grpc-timeout`, which is the per-attempt timeout when
        // there is one (the shorter of the two, should a caller have written another).
        let timeout = match (wire::timeout_of(request.headers()).ok().flatten(), per_try) {
            (Some(sent), Some(per_try)) => Some(sent.min(per_try)),
            (sent, per_try) => sent.or(per_try),
        };
        let shared = Arc::clone(&self.shared);
        let in_flight = InFlight::start(Arc::clone(&replica));
        Box::pin(async move {
            // Where the engine cut the attempt to its per-attempt timeout, the timer's
            // expiry is this attempt's failure, never the call's deadline — told as such,
            // and a sample of the replica's slowness.
            let mut answer = replica.connection.send(request, timeout).await;
            let mut timed_out = false;
            if let Some(per_try) = per_try {
                match &mut answer {
                    Ok(response) => per_try_expired(response, &replica.url, per_try),
                    Err(error) if crate::classify::is_local_timeout(&**error) => {
                        timed_out = true;
                        answer = Err(Box::new(Status::unavailable(format!(
                            "{} did not answer within the per-attempt timeout ({} ms)",
                            replica.url,
                            per_try.as_millis()
                        ))));
                    }
                    Err(_) => {}
                }
            }
            let outcome = outcome(&answer);
            // Only an answer is a sample of its time: a refused connection, answered in
            // microseconds, must not make a dead replica look cheap.
            // A per-attempt timeout is a sample too: "at least this slow". A frozen
            // replica then costs more than the others at once, and the next calls go
            // elsewhere before its failures eject it.
            match outcome {
                Outcome::Answered => in_flight.answered(),
                Outcome::Shed => in_flight.shed(),
                Outcome::Failed if timed_out => in_flight.answered(),
                Outcome::Failed => {}
            }
            shared.record(&replica, outcome, Instant::now());
            answer
        })
    }
}

/// A replica that was sent the per-attempt timeout as its `grpc-timeout` usually gives up
/// a moment before the balancer's own timer, answering DEADLINE_EXCEEDED itself (or
/// relaying it from below) — or CANCELLED "Timeout expired", as a plain tonic server
/// enforcing the header does. Either way it is this attempt's timeout, not the call's:
/// told as the balancer tells it, UNAVAILABLE, which the caller may retry elsewhere
/// whatever its policy thinks of DEADLINE_EXCEEDED. (Held against the replica unless
/// relayed.)
fn per_try_expired(response: &mut http::Response<Body>, url: &str, per_try: Duration) {
    let expired = matches!(
        wire::status_code(response.headers()),
        Some(Code::DeadlineExceeded | Code::Cancelled)
    );
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
    let headers = response.headers();
    let Some(code) = wire::status_code(headers) else {
        return Outcome::Answered;
    };
    if wire::is_relayed(headers) {
        return Outcome::Answered;
    }
    if wire::is_overloaded(headers) {
        return Outcome::Shed;
    }
    if matches!(
        code,
        Code::Unavailable | Code::Internal | Code::Unknown | Code::DataLoss
    ) {
        Outcome::Failed
    } else {
        Outcome::Answered
    }
}

#[cfg(test)]
mod tests;
