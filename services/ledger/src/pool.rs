//! The key store's connections: a deadpool of `PgConnection`s, opened to the primary and
//! checked only when something suggests they are broken.
//!
//! Why not sqlx's own pool: it pings every connection given back to it (sqlx-core's
//! `return_to_pool`), with no option to turn that off. For the ledger that is a fifth round
//! trip per charge beside BEGIN, the claim, the charge and COMMIT — a Postgres wake-up that
//! pgbench running the same transaction does not pay — and, against a frozen server, a ping
//! that holds the pool's permit until TCP gives up (transact-rs/sqlx#4349). Here giving a
//! connection back costs nothing, and everything that can wait on the server is bounded by
//! the caller's clock:
//!
//! - **Opening** ([`Connections::create`]): to the host [`Primary`] names now; a connection
//!   that landed on a standby is refused ([`Primary::check`]). The caller bounds the wait
//!   (the store's acquire timeout and the request's deadline).
//! - **Taking one that was idle** ([`Connections::recycle`]): retired if it was opened
//!   before the primary last moved or is older than [`MAX_LIFETIME`]; pinged first only
//!   while [`Suspicion`] is raised (a lost connection a moment ago means a restart may have
//!   broken every idle one).
//! - **Giving it back** ([`Checkout`]): only a connection whose state is known — no
//!   transaction open, no statement cut off — goes back; any other is dropped, which closes
//!   its socket at once, and the server rolls back whatever it had open.
//! - **Idle ones** are closed after [`IDLE_TIMEOUT`] ([`reap_idle`]).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use sqlx::{Connection, PgConnection};

use crate::primary::Primary;

/// How long after a lost connection idle connections are pinged before use.
pub const SUSPICION: Duration = Duration::from_secs(10);

/// A connection older than this is closed rather than reused (sqlx's default lifetime):
/// server-side memory a long session accumulates goes back, and connections spread again
/// over whatever a DNS name resolves to now.
pub const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// A connection not taken from the pool for this long is closed (sqlx's default idle
/// timeout): a burst's connections do not stay open on the server for good.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// The pool.
pub type Pool = managed::Pool<Connections>;

/// One pooled connection.
#[derive(Debug)]
pub struct Pooled {
    /// The connection.
    conn: PgConnection,
    /// When its opening began: a connection whose opening began before the primary moved
    /// may have been opened to the old one, however late it finished.
    opening_began: Instant,
}

/// Opens and recycles the key store's connections; see the module docs.
#[derive(Debug)]
pub struct Connections {
    /// Which host to open connections to.
    primary: Arc<Primary>,
    /// Whether idle connections are suspect right now.
    suspicion: Arc<Suspicion>,
    /// The longest a suspect connection's ping may take (the store's round-trip bound).
    ping_timeout: Duration,
}

impl Connections {
    /// A manager opening connections to `primary`'s current host, pinging a suspect one
    /// for at most `ping_timeout`.
    pub fn new(primary: Arc<Primary>, suspicion: Arc<Suspicion>, ping_timeout: Duration) -> Self {
        Self {
            primary,
            suspicion,
            ping_timeout,
        }
    }
}

impl managed::Manager for Connections {
    type Type = Pooled;
    type Error = sqlx::Error;

    async fn create(&self) -> Result<Pooled, sqlx::Error> {
        let opening_began = Instant::now();
        let mut conn = PgConnection::connect_with(&self.primary.options()).await?;
        self.primary.check(&mut conn).await?;
        // Begun with the old primary's options and finished after the move: perhaps to a
        // primary that has not yet stepped down.
        if self.primary.opened_before_move(opening_began.elapsed()) {
            return Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "opened while the primary moved, perhaps to the old one",
            )));
        }
        Ok(Pooled {
            conn,
            opening_began,
        })
    }

    async fn recycle(&self, pooled: &mut Pooled, _: &Metrics) -> RecycleResult<sqlx::Error> {
        let age = pooled.opening_began.elapsed();
        if self.primary.opened_before_move(age) {
            return Err(RecycleError::message(
                "opened before the primary moved: perhaps to the old one",
            ));
        }
        if age > MAX_LIFETIME {
            return Err(RecycleError::message("older than the connection lifetime"));
        }
        // A failed ping retires this connection; the pool then tries the next idle one or
        // opens a fresh one.
        if self.suspicion.active() {
            tokio::time::timeout(self.ping_timeout, pooled.conn.ping())
                .await
                .map_err(|_| RecycleError::message("the ping went unanswered"))??;
        }
        Ok(())
    }
}

/// A connection taken from the pool for one use. Unless the use ended in a known state
/// ([`Checkout::settle`]), dropping it closes the connection instead of returning it: that
/// covers the cases no error reports, such as the caller's future dropped mid-statement (a
/// cancelled BEGIN leaves the session inside a transaction that sqlx does not know about).
pub struct Checkout {
    /// The pooled connection; taken only by `drop`.
    pooled: Option<managed::Object<Connections>>,
    /// Whether the connection's state is known to be clean.
    settled: bool,
}

impl Checkout {
    /// A connection just taken from the pool, its state not yet known to be clean.
    pub fn new(pooled: managed::Object<Connections>) -> Self {
        Self {
            pooled: Some(pooled),
            settled: false,
        }
    }

    /// The connection.
    pub fn get(&mut self) -> &mut PgConnection {
        let pooled = self.pooled.as_mut().expect("taken only when dropped");
        &mut pooled.conn
    }

    /// Marks the use as over: when dropped, the connection goes back to the pool if
    /// `clean` and no transaction is left open on it, and is closed otherwise.
    pub fn settle(&mut self, clean: bool) {
        self.settled = clean && !self.get().is_in_transaction();
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        let Some(pooled) = self.pooled.take() else {
            return;
        };
        if !self.settled {
            // Out of the pool's count, then dropped: the socket closes now, with no round
            // trip to a server that may not answer, and the server rolls back what was open.
            drop(managed::Object::take(pooled));
        }
        // Settled: dropping the object gives the connection back, with no I/O.
    }
}

/// Closes, politely and within `bound` each, the idle connections not taken from the pool
/// for [`IDLE_TIMEOUT`]; called now and then by the store's maintenance task.
pub fn reap_idle(pool: &Pool, bound: Duration) {
    let idle = pool.retain(|_, metrics| metrics.last_used() < IDLE_TIMEOUT);
    for pooled in idle.removed {
        tokio::spawn(async move {
            let _ = tokio::time::timeout(bound, pooled.conn.close()).await;
        });
    }
}

/// After a connection was lost, idle connections are suspect (a restart broke them all)
/// until this window closes: each is pinged before use.
#[derive(Debug)]
pub struct Suspicion {
    /// The clock's origin.
    since: Instant,
    /// Until when (ms after `since`) idle connections are pinged before use.
    until_ms: AtomicU64,
}

impl Default for Suspicion {
    fn default() -> Self {
        Self {
            since: Instant::now(),
            until_ms: AtomicU64::new(0),
        }
    }
}

impl Suspicion {
    fn now_ms(&self) -> u64 {
        self.since.elapsed().as_millis() as u64
    }

    /// A connection was just lost: suspect idle ones for [`SUSPICION`] from now.
    pub fn raise(&self) {
        let until = self.now_ms() + SUSPICION.as_millis() as u64;
        self.until_ms.fetch_max(until, Ordering::Relaxed);
    }

    /// Whether idle connections are suspect now.
    pub fn active(&self) -> bool {
        self.now_ms() < self.until_ms.load(Ordering::Relaxed)
    }
}
