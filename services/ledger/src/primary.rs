//! Following the primary of a replicated Postgres: the ledger writes only to the server
//! that accepts writes, and finds the new one after a failover.
//!
//! sqlx connects to one host (launchbadge/sqlx#179, #2290), while an HA formation is
//! several: pg_auto_failover prints `postgres://h1:p1,h2:p2/db?target_session_attrs=read-write`,
//! the libpq form. [`Hosts::parse`] reads that form (a single host is the same URL sqlx
//! reads); [`Primary`] keeps which host is the primary, and the pool ([`crate::pool`])
//! opens every new connection to the host it names at that moment:
//!
//! - **Which host**: the first, in the URL's order, that takes writes — not in recovery
//!   and not read-only, libpq's `read-write` — each asked within the round-trip bound
//!   (`--db-round-trip-timeout-ms`), so that a dead host costs no more than that. The
//!   asking is off the request path (a background watcher), so a loaded server that takes
//!   a while to accept a connection is still found.
//! - **Never a standby**: every new pooled connection is checked the same way
//!   ([`Primary::check`], when the pool opens one); one that landed on a standby (a
//!   failover the ledger has not seen yet) is refused, and the refusal is an UNAVAILABLE
//!   for the charge that wanted it, never a write.
//! - **When to look again**: a lost connection, one that could not be opened, a refused
//!   one, or a write refused as read-only (SQLSTATE 25006, a demoted primary that still
//!   takes connections) wakes the watcher ([`Primary::suspect`]) — and it wakes every 10 s
//!   anyway. It asks the hosts again and, if the primary moved,
//!   names the new one and retires every connection opened before the move
//!   ([`Primary::opened_before_move`], asked when the pool hands out an idle one).
//!
//! Meanwhile charges fail fast with UNAVAILABLE (the pool's acquire timeout and the
//! round-trip bound), and the edge's retry — or the client's, with the same key — finds
//! the new primary. Whether a COMMIT in flight when the primary died took effect is the
//! key's to say: synchronous replication makes an acknowledged charge durable on the
//! standby, and the retry replays it; an unacknowledged one the retry charges, once. While
//! the primary writes alone (`wait_primary`) nothing is answered until a standby has it:
//! see the key store's "No success without a standby's copy".

use std::{
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use sqlx::{Connection, PgConnection, postgres::PgConnectOptions};
use tokio::sync::Notify;

/// The hosts of a database URL, each as the options sqlx connects with.
#[derive(Debug, Clone)]
pub struct Hosts(Vec<PgConnectOptions>);

impl Hosts {
    /// Reads a database URL with one host or several (`postgres://u:p@h1:5432,h2:5433/db`,
    /// IPv6 literals in brackets), `target_session_attrs` included: the ledger connects to
    /// the primary whatever it says, so `read-write`, `primary` and `any` (or nothing) are
    /// accepted, and a value that asks for a standby (`read-only`, `standby`, …) is refused
    /// as a misconfiguration.
    pub fn parse(url: &str) -> anyhow::Result<Self> {
        let (scheme, rest) = url
            .split_once("://")
            .context("a database URL starts with postgres://")?;
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let path = without_target_session_attrs(path)?;
        let options = hosts
            .split(',')
            .map(|host| {
                let single = match userinfo {
                    Some(userinfo) => format!("{scheme}://{userinfo}@{host}{path}"),
                    None => format!("{scheme}://{host}{path}"),
                };
                let options = PgConnectOptions::from_str(&single)
                    .with_context(|| format!("the database URL's host {host:?}"))?;
                // sqlx keeps an IPv6 literal's brackets (`[::1]`), which no resolver takes.
                let bare = options
                    .get_host()
                    .strip_prefix('[')
                    .and_then(|h| h.strip_suffix(']'))
                    .map(str::to_owned);
                Ok(match bare {
                    Some(bare) => options.host(&bare),
                    None => options,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        anyhow::ensure!(!options.is_empty(), "the database URL names no host");
        Ok(Self(options))
    }

    /// The same hosts with `configure` applied to each (the session settings every
    /// connection carries, whichever host it goes to).
    pub fn map(self, configure: impl Fn(PgConnectOptions) -> PgConnectOptions) -> Self {
        Self(self.0.into_iter().map(configure).collect())
    }

    /// How many hosts.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is none (never, once parsed).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The options of host `i`.
    pub fn get(&self, i: usize) -> &PgConnectOptions {
        &self.0[i % self.0.len()]
    }
}

/// `path` (`/db?a=b&target_session_attrs=read-write`) without `target_session_attrs`,
/// refusing a value that would let the ledger write to a standby.
fn without_target_session_attrs(path: &str) -> anyhow::Result<String> {
    let Some((base, query)) = path.split_once('?') else {
        return Ok(path.to_owned());
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("target_session_attrs", value)) => anyhow::ensure!(
                matches!(value, "read-write" | "primary" | "any"),
                "target_session_attrs={value}: the ledger writes, so it connects to the primary only"
            ),
            _ => kept.push(pair),
        }
    }
    Ok(if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    })
}

/// How often the watcher asks the hosts even when nothing suggested the primary moved.
const RECHECK: Duration = Duration::from_secs(10);

/// The least time between two askings that found the primary where it was.
const CALM: Duration = Duration::from_millis(500);

/// Which host is the primary, and since when; see the module docs.
#[derive(Debug)]
pub struct Primary {
    /// Every host of the formation.
    hosts: Hosts,
    /// The host new connections go to.
    current: AtomicUsize,
    /// The clock's origin, for `moved_at_ns`.
    origin: std::time::Instant,
    /// When the primary last moved (ns after `origin`, 0: never); a connection opened
    /// before that, or at the same instant, may have been opened to the old one.
    moved_at_ns: AtomicU64,
    /// Wakes the watcher.
    suspected: Notify,
    /// How long one host may take to answer whether it is the primary.
    probe_timeout: Duration,
}

impl Primary {
    /// Finds the primary among `hosts` (waiting for one while none answers, up to
    /// `patience`), each asked within `probe_timeout`.
    pub async fn find(
        hosts: Hosts,
        probe_timeout: Duration,
        patience: Duration,
    ) -> anyhow::Result<Arc<Self>> {
        let primary = Arc::new(Self {
            hosts,
            current: AtomicUsize::new(0),
            origin: std::time::Instant::now(),
            moved_at_ns: AtomicU64::new(0),
            suspected: Notify::new(),
            probe_timeout,
        });
        let started = std::time::Instant::now();
        loop {
            if let Some(i) = primary.probe().await {
                primary.current.store(i, Ordering::Relaxed);
                return Ok(primary);
            }
            anyhow::ensure!(
                started.elapsed() < patience,
                "no host of the database URL accepted writes within {patience:?}"
            );
            tracing::warn!("no primary among the database hosts yet; asking again in 1 s");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// The options of the host new connections should go to now.
    pub fn options(&self) -> PgConnectOptions {
        self.hosts.get(self.current.load(Ordering::Relaxed)).clone()
    }

    /// The first host, from the current one on, that answers as a primary.
    async fn probe(&self) -> Option<usize> {
        let first = self.current.load(Ordering::Relaxed);
        for step in 0..self.hosts.len() {
            let i = (first + step) % self.hosts.len();
            let asked = tokio::time::timeout(self.probe_timeout, async {
                let mut conn = PgConnection::connect_with(self.hosts.get(i)).await?;
                let standby = is_standby(&mut conn).await;
                let _ = conn.close().await;
                standby
            })
            .await;
            if let Ok(Ok(false)) = asked {
                return Some(i);
            }
        }
        None
    }

    /// Refuses a fresh connection to a standby (asked by the pool as it opens one): a failover the
    /// ledger has not followed yet must cost a refused connection, never a write there.
    pub async fn check(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        if is_standby(conn).await? {
            self.suspect();
            return Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "the database host is a standby (in recovery): the primary has moved",
            )));
        }
        Ok(())
    }

    /// Whether a pooled connection of `age` was opened before the primary last moved, or
    /// at the same instant, and so perhaps to the old one (the pool retires it). The move
    /// is stamped after the new host was named, so a connection whose opening began with
    /// the old host's options counts as older.
    pub fn opened_before_move(&self, age: Duration) -> bool {
        let moved_at = self.moved_at_ns.load(Ordering::Acquire);
        moved_at > 0 && {
            let opened_at = self.origin.elapsed().saturating_sub(age).as_nanos();
            opened_at <= u128::from(moved_at)
        }
    }

    /// Something suggests the primary has moved: wakes the watcher (cheap, and repeated
    /// calls while it works coalesce).
    pub fn suspect(&self) {
        self.suspected.notify_one();
    }

    /// Follows the primary until the process ends: each time it is suspected to have
    /// moved, asks the hosts again and, if it has, names the new one.
    pub async fn watch(self: Arc<Self>) {
        if self.hosts.len() < 2 {
            return; // one host: nothing to follow (a standby is still refused by `check`)
        }
        loop {
            // Woken by a suspicion, or every RECHECK regardless: a failure path that forgot
            // to raise one must not leave the ledger at a dead or demoted primary for good.
            let _ = tokio::time::timeout(RECHECK, self.suspected.notified()).await;
            let Some(i) = self.probe().await else {
                // No primary yet (a failover under way): ask again shortly.
                tokio::time::sleep(Duration::from_millis(200)).await;
                self.suspect();
                continue;
            };
            if i == self.current.load(Ordering::Relaxed) {
                // Still the primary: a slow or briefly unreachable server, not a move. Ask
                // again no sooner than half a second from now, however many calls fail meanwhile.
                tokio::time::sleep(CALM).await;
                continue;
            }
            self.current.store(i, Ordering::Relaxed);
            let now = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.moved_at_ns.store(now.max(1), Ordering::Release);
            tracing::warn!(
                host = %format!("{}:{}", self.options().get_host(), self.options().get_port()),
                "the primary moved; the ledger now writes there"
            );
        }
    }
}

/// Whether the server of `conn` refuses writes: a standby, or a server whose sessions are
/// read-only — what libpq's `target_session_attrs=read-write` checks. pg_auto_failover
/// makes a promoted standby read-only until the old primary is known to have stepped
/// down, so that two servers never take writes at once.
async fn is_standby(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool",
    )
    .fetch_one(conn)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_or_several_each_with_the_user_database_and_parameters() {
        let hosts = Hosts::parse(
            "postgres://app:secret@10.0.0.1:5432,10.0.0.2:5433/ledger?target_session_attrs=read-write&sslmode=disable",
        )
        .expect("parses");
        assert_eq!(hosts.len(), 2);
        for (i, port) in [(0, 5432), (1, 5433)] {
            let options = hosts.get(i);
            assert_eq!(options.get_port(), port);
            assert_eq!(options.get_username(), "app");
            assert_eq!(options.get_database(), Some("ledger"));
        }
        assert_eq!(hosts.get(1).get_host(), "10.0.0.2");
        let one = Hosts::parse("postgres://u@db/x").expect("parses");
        assert_eq!(one.len(), 1);
        assert_eq!(one.get(0).get_host(), "db");
    }

    #[test]
    fn a_url_that_would_allow_a_standby_is_refused() {
        let refused = Hosts::parse("postgres://u@a,b/x?target_session_attrs=read-only");
        assert!(refused.is_err());
        assert!(Hosts::parse("nonsense").is_err());
    }
}
