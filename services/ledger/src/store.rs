//! The key store: idempotency keys, charges and balances in Postgres.
//!
//! # One transaction per charge
//!
//! ```text
//! (same key already running in this process? wait for it in memory: key_locks)
//! BEGIN; SET LOCAL statement_timeout = <time left, at most 3/4 of the bound>,
//!        lock_timeout = <4/5 of that>,
//!        idle_in_transaction_session_timeout = <time left + slack>   -- one round trip
//! INSERT INTO idempotency_keys … ON CONFLICT DO NOTHING    -- claim the key
//!   claimed:   processor call(s), then one statement that updates the balance,
//!              inserts the charge and saves the reply on the key row; COMMIT
//!   conflict:  SELECT the saved reply; compare parameters; count the replay on the
//!              key row and COMMIT (which returns once the reply is on the synchronous
//!              standby: see `replicated`); replay — or refuse
//! ```
//!
//! The claim is what makes concurrent duplicates safe: a second transaction inserting the
//! same (account, key) blocks on the first one's uncommitted row until it commits (the
//! second then conflicts and replays the saved reply) or rolls back (the second then claims
//! the key and charges). `lock_timeout` bounds that wait by the request's own deadline.
//! Because the key, the effect and the reply commit together, a crash at any point leaves
//! either all of them or none: a retry after a lost reply replays, a retry after a crash
//! charges afresh.
//!
//! # When the database or this process misbehaves
//!
//! - **Postgres down or restarting**: waiting for a connection (opening one included) is
//!   bounded by `acquire_timeout`, well under any caller's deadline, and answers
//!   UNAVAILABLE, which the edge retries under its budget. A pooled connection that a
//!   restart broke fails its first statement (UNAVAILABLE); after such a failure every
//!   idle connection is pinged before use for a while ([`crate::pool::SUSPICION`]), so a
//!   restart costs about one failed attempt rather than one per pooled connection.
//! - **A statement cut short** (our deadline, a lost connection, a commit whose answer
//!   never came): the connection's state is unknown — a cancelled BEGIN can leave the
//!   session inside a transaction that sqlx does not count — so it is closed, never reused.
//!   Giving a connection back sends nothing ([`crate::pool`]), so no stalled server can
//!   hold one there.
//!   Whether a cut-off COMMIT took effect is unknown too; the caller's retry with the same
//!   key finds out (replay, or a fresh charge).
//! - **The database frozen or unreachable mid-charge** (SIGSTOP, a host that stopped
//!   answering, a network path that black-holes packets): a frozen server cannot apply its
//!   own `statement_timeout`, so every round trip of a charge is also bounded by the
//!   ledger's clock ([`StoreOptions::round_trip_timeout`]). Past it the charge answers
//!   UNAVAILABLE, its connection is closed (never reused), and whether anything committed
//!   is left to the key: the server rolls the abandoned transaction back when it notices
//!   the closed connection (or when its idle-in-transaction timeout fires), and the
//!   caller's retry with the same key replays or charges. The server's own timeouts
//!   (statements at three quarters of that bound, lock waits a little less) sit below it, so a live but slow
//!   server cancels its own work first. A wait for another ledger instance's transaction
//!   on the same key is a lock wait, not a silent server: it is taken in turns of that
//!   length, each a fresh transaction, until the request's deadline. Every transaction
//!   that does not commit is rolled back within the bound too, not left for the pool.
//! - **This process frozen** (SIGSTOP, a stalled VM) while it holds a key: Postgres ends
//!   the session once it has sat idle in its transaction longer than the request could
//!   have lived, which rolls it back and frees the key for another ledger instance; TCP
//!   keepalives do the same for a host that vanished. When the frozen process wakes, its
//!   connection is gone and it commits nothing.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use prometheus_client::metrics::histogram::Histogram;
use resilience::Deadline;
use retrychain_node::{AccountId, AmountCents, IdempotencyKey};
use sqlx::{AssertSqlSafe, Connection, PgConnection, Postgres, Row};
use tracing::Instrument;
use uuid::Uuid;

use crate::{
    key_locks::KeyLocks,
    pool::{Checkout, Connections, Pool, Suspicion},
    primary::{Hosts, Primary},
};

/// Migrations, applied at start-up.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Added to the request's remaining time for `idle_in_transaction_session_timeout`: the
/// transaction is idle while the processor works, which ends before the deadline; past
/// deadline plus this, only a frozen client is still "working".
const IDLE_SLACK_MS: u128 = 500;

/// The longest one statement of a retention purge may take (see
/// [`KeyStore::purge_keys_older_than`]); the server cancels it a little earlier.
const PURGE_STATEMENT_BOUND: Duration = Duration::from_secs(60);

/// The longest the migrations may take at start-up.
const MIGRATION_BOUND: Duration = Duration::from_secs(60);

/// A committed charge's reply, as saved on its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedReply {
    /// The charge's id.
    pub charge_id: Uuid,
    /// The account charged.
    pub account_id: String,
    /// The amount charged.
    pub amount_cents: i64,
    /// The balance right after the charge.
    pub balance_cents: i64,
}

/// What a charge request came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// The key was new: the charge ran and committed.
    Executed(SavedReply),
    /// The key was known with the same parameters: its saved reply, nothing charged.
    Replayed(SavedReply),
}

/// What a same-key request does while the first one is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    /// Wait for the first to finish, then replay its reply (or charge, if it rolled back).
    Wait,
    /// Refuse at once with ABORTED, Stripe-style (a completed key still replays).
    Reject,
}

/// Why a charge did not commit. Each variant maps to one status in `service.rs`.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The key was used before on this account with different parameters.
    #[error(
        "idempotency key was reused with different parameters: it was first used with amount_cents={saved}, this request has amount_cents={requested}"
    )]
    KeyReused {
        /// The amount saved with the key.
        saved: i64,
        /// The amount this request carried.
        requested: i64,
    },
    /// `--in-flight reject`: a request with this key is still running.
    #[error("a request with this idempotency key is still in flight; retry after it finishes")]
    InFlight,
    /// The deadline ran out waiting for a connection, a lock, a statement, or a same-key
    /// request to finish.
    #[error("the deadline ran out while {0}")]
    DeadlineWhileWaiting(&'static str),
    /// The balance would leave the range of a 64-bit integer.
    #[error("the charge would overflow the account balance")]
    BalanceOverflow,
    /// The payment processor refused; nothing was saved, so a retry charges afresh.
    #[error("payment processor: {}", .0.message())]
    Processor(tonic::Status),
    /// A key row vanished between conflict and read (purged by retention meanwhile).
    #[error("the idempotency key was purged while this request read it; retry")]
    Purged,
    /// Postgres could not be reached, refused connections, shut down, or the connection
    /// was lost. Transient: a retry with the same key is safe and will find out whether a
    /// commit that was in flight took effect.
    #[error("database unavailable ({0}); retry with the same idempotency key")]
    Unavailable(String),
    /// A serialization failure or deadlock: rolled back, safe to retry.
    #[error("database conflict ({0}); rolled back, retry")]
    Conflict(String),
    /// Anything else the database said: a bug or a broken schema, not worth retrying.
    #[error("database: {0}")]
    Database(sqlx::Error),
}

impl StoreError {
    /// Whether the connection that produced this error may be in an unknown state
    /// (mid-transaction, mid-protocol) and must be closed rather than reused.
    fn leaves_connection_in_doubt(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Database(_))
    }
}

/// The one classification of database failures; `service.rs` maps the result to a status.
impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        use sqlx::Error as E;
        let text = error.to_string();
        match &error {
            E::Io(_) | E::Tls(_) | E::Protocol(_) | E::PoolTimedOut | E::PoolClosed => {
                StoreError::Unavailable(text)
            }
            E::Database(db) => match db.code().as_deref().unwrap_or_default() {
                // lock_not_available: our lock_timeout, which is the request's deadline.
                "55P03" => StoreError::DeadlineWhileWaiting(
                    "waiting for a request with the same key to finish",
                ),
                // query_canceled: our statement_timeout, which is the request's deadline
                // (an operator's pg_cancel_backend lands here too; both are worth a retry
                // while the caller's deadline has room). Decided by code, not by the
                // message, which depends on the server's language.
                "57014" => StoreError::DeadlineWhileWaiting("a database statement ran"),
                // numeric_value_out_of_range: only the balance can overflow.
                "22003" => StoreError::BalanceOverflow,
                "40001" | "40P01" => StoreError::Conflict(text),
                // connection_exception (08…), admin/crash shutdown, cannot connect now,
                // database dropped, insufficient resources (53…, e.g. too many
                // connections), idle-in-transaction / idle-session timeouts, a write
                // refused as read-only (25006: a primary demoted under the connection), and
                // statement_completion_unknown (40003: CockroachDB's ambiguous commit, as a
                // COMMIT whose answer was lost — the key tells the retry what happened).
                code if code.starts_with("08")
                    || code.starts_with("53")
                    || code.starts_with("57P")
                    || code == "25P03"
                    || code == "25006"
                    || code == "40003" =>
                {
                    StoreError::Unavailable(text)
                }
                _ => StoreError::Database(error),
            },
            _ => StoreError::Database(error),
        }
    }
}

/// How the ledger talks to Postgres.
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    /// Connections in the pool.
    pub pool_size: u32,
    /// Longest wait for a connection, opening one included; past it, UNAVAILABLE.
    pub acquire_timeout: Duration,
    /// Longest wait for one round trip (a statement, BEGIN, COMMIT) by the ledger's clock;
    /// past it, UNAVAILABLE and the connection closed. See the module docs.
    pub round_trip_timeout: Duration,
}

/// The bound on one database round trip, by this process's clock, within one request.
#[derive(Debug, Clone, Copy)]
struct RoundTrip<'g> {
    /// [`StoreOptions::round_trip_timeout`].
    limit: Duration,
    /// Where each round trip's time goes.
    times: &'g Histogram,
    /// The request's deadline: a server-side timeout that fires before it was set from
    /// this bound (the server was too slow), not from the request's time.
    deadline: Deadline,
}

impl RoundTrip<'_> {
    /// `work`, one round trip named `what`, or UNAVAILABLE once the bound has passed
    /// without an answer (the caller's [`Checkout`] then closes the connection).
    async fn bound<T, E: Into<StoreError>>(
        self,
        what: &'static str,
        work: impl Future<Output = Result<T, E>>,
    ) -> Result<T, StoreError> {
        self.answer(what, work)
            .await?
            .map_err(|error| self.judge(what, error.into()))
    }

    /// `work`'s own result, or UNAVAILABLE once the bound has passed without an answer.
    async fn answer<T, E>(
        self,
        what: &'static str,
        work: impl Future<Output = Result<T, E>>,
    ) -> Result<Result<T, E>, StoreError> {
        let started = tokio::time::Instant::now();
        let answer = tokio::time::timeout(self.limit, work).await;
        self.times.observe(started.elapsed().as_secs_f64());
        answer.map_err(|_| {
            StoreError::Unavailable(format!(
                "Postgres did not answer {what} within {:?}; the connection is abandoned and the key is left for a retry",
                self.limit
            ))
        })
    }

    /// A server-side statement or lock timeout while the request still has time was set
    /// from this bound: the database is too slow (UNAVAILABLE), the request is not late.
    fn judge(self, what: &'static str, error: StoreError) -> StoreError {
        match error {
            StoreError::DeadlineWhileWaiting(_) if self.has_time() => StoreError::Unavailable(
                format!("Postgres took longer than {:?} for {what}", self.limit),
            ),
            other => other,
        }
    }

    /// Whether the request still has time.
    fn has_time(self) -> bool {
        !self.deadline.remaining().is_zero()
    }

    /// The server's `statement_timeout` within a request with `left_ms` to go: the
    /// request's time, but under this bound, so a live server cancels its own statement
    /// before this process gives up on the connection.
    fn statement_timeout_ms(self, left_ms: u128) -> u128 {
        left_ms.min(self.limit.as_millis() * 3 / 4).max(1)
    }
}

/// Postgres access for the ledger.
#[derive(Debug, Clone)]
pub struct KeyStore {
    /// Connections: nothing is sent when one is taken or given back; idle ones are pinged
    /// before use only while `suspicion` is raised (see [`crate::pool`]).
    pool: Pool,
    /// Raised by a lost connection; see [`Suspicion`].
    suspicion: Arc<Suspicion>,
    /// Same-key requests of this process queue here, holding no connection.
    keys: Arc<KeyLocks>,
    /// Gauges and counts for `/metrics`.
    gauges: Arc<StoreGauges>,
    /// Longest wait for a connection, opening one included ([`StoreOptions::acquire_timeout`]).
    acquire_timeout: Duration,
    /// The bound on each round trip ([`StoreOptions::round_trip_timeout`]).
    round_trip_timeout: Duration,
    /// Which host the pool writes to; told when a failure suggests it moved.
    primary: Arc<Primary>,
    /// The tasks that follow the primary and close idle connections, stopped with the
    /// last clone of the store.
    _tasks: Arc<[AbortOnDrop; 2]>,
}

/// Aborts a task when dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the store counts for `/metrics`.
#[derive(Debug)]
struct StoreGauges {
    /// Requests waiting for a connection now.
    acquiring: AtomicU64,
    /// Requests that waited for another request with their key, since start.
    key_waits: AtomicU64,
    /// Round-trip times.
    round_trips: Histogram,
}

impl Default for StoreGauges {
    fn default() -> Self {
        Self {
            acquiring: AtomicU64::default(),
            key_waits: AtomicU64::default(),
            round_trips: Histogram::new(retrychain_node::metrics::round_trip_buckets()),
        }
    }
}

/// One request counted in a gauge while it waits, however the wait ends (cancellation
/// included).
struct Waiting<'a>(&'a AtomicU64);

impl<'a> Waiting<'a> {
    fn enter(gauge: &'a AtomicU64) -> Self {
        gauge.fetch_add(1, Ordering::Relaxed);
        Self(gauge)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl retrychain_node::metrics::DatabaseGauges for KeyStore {
    fn connections_in_use(&self) -> u64 {
        let status = self.pool.status();
        status.size.saturating_sub(status.available) as u64
    }

    fn connections_idle(&self) -> u64 {
        self.pool.status().available as u64
    }

    fn acquires_waiting(&self) -> u64 {
        self.gauges.acquiring.load(Ordering::Relaxed)
    }

    fn key_waits_total(&self) -> u64 {
        self.gauges.key_waits.load(Ordering::Relaxed)
    }

    fn round_trip_seconds(&self) -> Histogram {
        self.gauges.round_trips.clone()
    }
}

impl KeyStore {
    /// Connects to the primary of `database_url` (one host, or several in libpq's
    /// multi-host form: see [`crate::primary`]) and applies the migrations, waiting up to a
    /// minute for a database that is still starting (as under docker-compose, or after a
    /// crash of both); then follows the primary for as long as the store lives.
    pub async fn connect(database_url: &str, options: StoreOptions) -> anyhow::Result<Self> {
        use anyhow::Context;
        let hosts = Hosts::parse(database_url)
            .context("parsing the database URL")?
            .map(|host| {
                // Named, so that an operator (and the failover tests) can tell the
                // ledger's sessions in pg_stat_activity.
                let host = match host.get_application_name() {
                    Some(_) => host,
                    None => host.application_name("retrychain-ledger"),
                };
                host.options([
                    // Custom plans: a generic plan cached while the key table was empty (say
                    // after a retention purge) can pick a sequential scan and keep it.
                    ("plan_cache_mode", "force_custom_plan"),
                    // The server notices a client host that vanished (no FIN, no RST) within
                    // about 25 s and ends its session, releasing its locks.
                    ("tcp_keepalives_idle", "10"),
                    ("tcp_keepalives_interval", "5"),
                    ("tcp_keepalives_count", "3"),
                    // A backstop for sessions outside a charge (each charge sets its own).
                    ("idle_in_transaction_session_timeout", "60s"),
                ])
            });
        let primary = Primary::find(hosts, options.round_trip_timeout, Duration::from_secs(60))
            .await
            .context("finding the database's primary")?;
        let suspicion = Arc::new(Suspicion::default());
        let pool = Pool::builder(Connections::new(
            Arc::clone(&primary),
            Arc::clone(&suspicion),
            options.round_trip_timeout,
        ))
        .max_size(options.pool_size as usize)
        // The most recently used first: under light load the same few sessions stay warm
        // and the rest go idle long enough to be closed.
        .queue_mode(deadpool::managed::QueueMode::Lifo)
        .build()
        .context("building the connection pool")?;
        let watcher = AbortOnDrop(tokio::spawn(Arc::clone(&primary).watch()).abort_handle());
        let reaper = AbortOnDrop(
            tokio::spawn({
                let pool = pool.clone();
                let bound = options.round_trip_timeout;
                async move {
                    loop {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        crate::pool::reap_idle(&pool, bound);
                    }
                }
            })
            .abort_handle(),
        );
        let started = std::time::Instant::now();
        loop {
            let migrated = match tokio::time::timeout(options.acquire_timeout, pool.get()).await {
                Ok(Ok(conn)) => {
                    let mut conn = Checkout::new(conn);
                    // Bounded, so a database that freezes mid-migration fails the start
                    // (the unsettled connection is closed, and its locks with it).
                    let migrated = tokio::time::timeout(MIGRATION_BOUND, MIGRATOR.run(conn.get()))
                        .await
                        .unwrap_or(Err(sqlx::migrate::MigrateError::Execute(
                            sqlx::Error::PoolTimedOut,
                        )));
                    conn.settle(migrated.is_ok());
                    migrated
                }
                Ok(Err(error)) => Err(sqlx::migrate::MigrateError::Execute(pool_error(error))),
                Err(_) => Err(sqlx::migrate::MigrateError::Execute(
                    sqlx::Error::PoolTimedOut,
                )),
            };
            let error = match migrated {
                Ok(()) => break,
                // A migration's lock_timeout: other instances' charges hold the table; they
                // end within their deadlines, so try again rather than queue every new
                // charge behind the ALTER.
                Err(sqlx::migrate::MigrateError::Execute(error)) if is_lock_timeout(&error) => {
                    StoreError::Unavailable(format!("a migration waited for a table lock: {error}"))
                }
                Err(sqlx::migrate::MigrateError::Execute(error)) => StoreError::from(error),
                Err(error) => return Err(error).context("applying the ledger's migrations"),
            };
            if !matches!(error, StoreError::Unavailable(_))
                || started.elapsed() > Duration::from_secs(60)
            {
                return Err(error).context("applying the ledger's migrations");
            }
            tracing::warn!(%error, "database not reachable yet; retrying in 1 s");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Ok(Self {
            pool,
            suspicion,
            keys: Arc::new(KeyLocks::default()),
            gauges: Arc::default(),
            acquire_timeout: options.acquire_timeout,
            round_trip_timeout: options.round_trip_timeout,
            primary,
            _tasks: Arc::new([watcher, reaper]),
        })
    }

    /// Same-key requests running or waiting in this process.
    pub fn keys_in_flight(&self) -> usize {
        self.keys.len()
    }

    /// Charges `amount` to `account` once per `key`; see the module docs. `process` is the
    /// payment processor call, made only when this request claimed the key, inside the
    /// transaction: if it fails, the claim rolls back with everything else.
    pub async fn charge<F, Fut>(
        &self,
        account: &AccountId,
        key: &IdempotencyKey,
        amount: AmountCents,
        deadline: Deadline,
        in_flight: InFlight,
        process: F,
    ) -> Result<ChargeOutcome, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), tonic::Status>>,
    {
        let _turn = match in_flight {
            InFlight::Wait => match self.keys.try_lock(account.as_str(), key.as_str()) {
                Some(turn) => turn,
                None => {
                    self.gauges.key_waits.fetch_add(1, Ordering::Relaxed);
                    tokio::time::timeout_at(
                        deadline.instant(),
                        self.keys.lock(account.as_str(), key.as_str()),
                    )
                    .await
                    .map_err(|_| {
                        StoreError::DeadlineWhileWaiting(
                            "waiting for a request with the same key to finish",
                        )
                    })?
                }
            },
            InFlight::Reject => match self.keys.try_lock(account.as_str(), key.as_str()) {
                Some(turn) => turn,
                // Running here now — unless it already finished and this is a repeat.
                None => {
                    let mut conn = self.acquire(deadline).await?;
                    let rt = self.round_trip(deadline);
                    let charge = Charge {
                        account,
                        key,
                        amount,
                        deadline,
                        in_flight,
                    };
                    let result = replay_or_in_flight(conn.get(), rt, &charge).await;
                    return self.settle(conn, result);
                }
            },
        };
        let mut conn = self.acquire(deadline).await?;
        let result = charge_in_transaction(
            conn.get(),
            self.round_trip(deadline),
            Charge {
                account,
                key,
                amount,
                deadline,
                in_flight,
            },
            process,
        )
        .await;
        self.settle(conn, result)
    }

    /// An account's balance and number of charges; `None` if it was never charged.
    pub async fn account(
        &self,
        account: &AccountId,
        deadline: Deadline,
    ) -> Result<Option<(i64, i64)>, StoreError> {
        let mut conn = self.acquire(deadline).await?;
        let read = async {
            let row = self
                .round_trip(deadline)
                .bound(
                    "reading the account",
                    sqlx::query(
                        "SELECT balance_cents, charges FROM accounts WHERE account_id = $1",
                    )
                    .bind(account.as_str())
                    .fetch_optional(conn.get()),
                )
                .await?;
            row.map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                .transpose()
        };
        let result = read.await;
        self.settle(conn, result)
    }

    /// Deletes keys older than `retention`, `batch` rows per statement so no single
    /// statement holds many locks; returns how many went. Each statement is bounded by
    /// [`PURGE_STATEMENT_BOUND`] (past it, UNAVAILABLE and the connection closed), so a
    /// stalled database does not hold the purge, or its connection, for good.
    pub async fn purge_keys_older_than(
        &self,
        retention: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let mut conn = self.acquire(Deadline::after(self.acquire_timeout)).await?;
        let purge = async {
            let mut purged = 0;
            loop {
                // In a transaction of its own with a server-side statement timeout a
                // little under the client's bound, so a batch cut off here does not run on.
                let batch_done = async {
                    let server_ms = PURGE_STATEMENT_BOUND.as_millis() * 9 / 10;
                    let mut tx = conn
                        .get()
                        .begin_with(AssertSqlSafe(format!(
                            "BEGIN; SET LOCAL statement_timeout = {server_ms}"
                        )))
                        .await?;
                    let deleted = sqlx::query(
                        "DELETE FROM idempotency_keys WHERE ctid IN ( \
                             SELECT ctid FROM idempotency_keys \
                             WHERE created_at < now() - make_interval(secs => $1) \
                             ORDER BY created_at LIMIT $2)",
                    )
                    .bind(retention.as_secs_f64())
                    .bind(batch)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>(deleted)
                };
                let deleted = tokio::time::timeout(PURGE_STATEMENT_BOUND, batch_done)
                    .await
                    .map_err(|_| {
                        StoreError::Unavailable(format!(
                            "Postgres did not finish a purge batch within {PURGE_STATEMENT_BOUND:?}"
                        ))
                    })??;
                purged += deleted;
                if deleted < batch as u64 {
                    return Ok(purged);
                }
            }
        };
        let result = purge.await;
        // Any failure here (a batch cut off, a statement refused) may leave the batch's
        // transaction open on the server: the connection is closed, not given back.
        conn.settle(result.is_ok());
        result.map_err(|error| self.noted(error))
    }

    /// The round-trip bound for a request ending at `deadline`.
    fn round_trip(&self, deadline: Deadline) -> RoundTrip<'_> {
        RoundTrip {
            limit: self.round_trip_timeout,
            times: &self.gauges.round_trips,
            deadline,
        }
    }

    /// A pooled connection within the deadline and the acquire timeout. Opening one that
    /// fails (the server down, restarting, or a standby now) is tried again, briefly
    /// spaced, until then: a restart shorter than the acquire timeout costs a wait, not an
    /// error.
    async fn acquire(&self, deadline: Deadline) -> Result<Checkout, StoreError> {
        let waiting = Waiting::enter(&self.gauges.acquiring);
        let by = deadline
            .instant()
            .min(tokio::time::Instant::now() + self.acquire_timeout);
        let mut pause = Duration::from_millis(5);
        let mut failed = None;
        let acquired = loop {
            match tokio::time::timeout_at(by, self.pool.get()).await {
                Ok(Ok(conn)) => break Some(Checkout::new(conn)),
                Ok(Err(error)) => {
                    let error = pool_error(error);
                    let transient = opening_may_succeed_later(&error);
                    failed = Some(error);
                    if !transient || tokio::time::Instant::now() + pause >= by {
                        break None;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Err(_) => break None,
            }
        };
        drop(waiting);
        if let Some(conn) = acquired {
            return Ok(conn);
        }
        if deadline.is_spent() {
            return Err(StoreError::DeadlineWhileWaiting(
                "waiting for a database connection",
            ));
        }
        if let Some(error) = failed {
            return Err(self.noted(error.into()));
        }
        // Every connection busy is load, not a lost database: no suspicion then.
        let status = self.pool.status();
        if status.size >= status.max_size && status.available == 0 {
            return Err(StoreError::Unavailable(
                "every database connection is busy; none came free within the acquire timeout"
                    .into(),
            ));
        }
        self.lost_connection();
        Err(StoreError::Unavailable(
            "no connection to Postgres could be had within the acquire timeout".into(),
        ))
    }

    /// Ends the use of `conn` with `result`: a connection whose state is in doubt is closed
    /// instead of going back to the pool, and a lost connection raises suspicion.
    fn settle<T>(
        &self,
        mut conn: Checkout,
        result: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        conn.settle(!matches!(&result, Err(error) if error.leaves_connection_in_doubt()));
        result.map_err(|error| self.noted(error))
    }

    /// Raises suspicion for errors that mean the connection was lost, and asks whether the
    /// primary moved (it may have: a failover breaks connections and demotes the old one).
    fn noted(&self, error: StoreError) -> StoreError {
        if let StoreError::Unavailable(_) = &error {
            self.lost_connection();
        }
        error
    }

    /// A connection was lost, or none could be opened: ping idle connections before use for
    /// a while, and ask whether the primary moved. Every such path comes here — one that
    /// did not would leave the ledger knocking at a dead primary for good.
    fn lost_connection(&self) {
        self.suspicion.raise();
        self.primary.suspect();
    }
}

/// Whether opening a connection that failed with `error` may work if tried again shortly:
/// the server unreachable, restarting, refusing connections for now or out of them, or a
/// standby (the primary is moving). Bad credentials or a missing database are answered at
/// once.
fn opening_may_succeed_later(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08") || code.starts_with("53") || code.starts_with("57P")
        }),
        _ => false,
    }
}

/// The sqlx error a failed [`Pool::get`] stands for (only `Backend` occurs: the pool has
/// no timeouts or hooks of its own and is never closed).
fn pool_error(error: deadpool::managed::PoolError<sqlx::Error>) -> sqlx::Error {
    use deadpool::managed::PoolError;
    match error {
        PoolError::Backend(error) => error,
        PoolError::Closed => sqlx::Error::PoolClosed,
        PoolError::Timeout(_) | PoolError::NoRuntimeSpecified | PoolError::PostCreateHook(_) => {
            sqlx::Error::PoolTimedOut
        }
    }
}

/// The transaction of one charge; see the module docs. A turn that found the key held by
/// another transaction (another ledger instance) rolls back and starts over, until the
/// request's deadline; so a wait for a live lock is told apart from a server that stopped
/// answering.
async fn charge_in_transaction<F, Fut>(
    conn: &mut PgConnection,
    rt: RoundTrip<'_>,
    charge: Charge<'_>,
    process: F,
) -> Result<ChargeOutcome, StoreError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(), tonic::Status>>,
{
    let Charge {
        account,
        key,
        amount,
        deadline,
        ..
    } = charge;
    let mut tx = loop {
        let mut tx = begin(&mut *conn, rt, deadline).await?;
        match claim(&mut tx, rt, &charge).await {
            Ok(Claim::Claimed) => break tx,
            Ok(Claim::Settled(outcome)) => {
                // The replay was counted on the key row (`replicated`): this COMMIT returns
                // once the saved reply is on the synchronous standby.
                rt.bound("COMMIT", tx.commit()).await?;
                return Ok(outcome);
            }
            Ok(Claim::Busy) => {
                rt.bound("ROLLBACK", tx.rollback()).await?;
                if deadline.remaining().is_zero() {
                    return Err(StoreError::DeadlineWhileWaiting(
                        "waiting for a request with the same key to finish",
                    ));
                }
            }
            Err(error) => return Err(rolled_back(tx, rt, error).await),
        }
    };

    let recorded = async {
        process().await.map_err(StoreError::Processor)?;
        record_charge(&mut tx, rt, account, key, amount).await
    }
    .await;
    let (charge_id, balance_cents) = match recorded {
        Ok(recorded) => recorded,
        Err(error) => return Err(rolled_back(tx, rt, error).await),
    };
    // A COMMIT that does not answer in time is an ambiguous outcome: UNAVAILABLE, and the
    // caller's retry with the same key finds out which (replay, or a fresh charge).
    rt.bound(
        "COMMIT",
        tx.commit()
            .instrument(tracing::info_span!(target: resilience::TRACE_ONLY, "commit")),
    )
    .await?;
    Ok(ChargeOutcome::Executed(SavedReply {
        charge_id,
        account_id: account.as_str().to_owned(),
        amount_cents: amount.get(),
        balance_cents,
    }))
}

/// Updates the balance, inserts the charge and saves the reply on the key row, in one
/// statement: the charge's id and the balance after it.
async fn record_charge(
    tx: &mut PgConnection,
    rt: RoundTrip<'_>,
    account: &AccountId,
    key: &IdempotencyKey,
    amount: AmountCents,
) -> Result<(Uuid, i64), StoreError> {
    let charge_id = Uuid::new_v4();
    let balance_cents: i64 = rt
        .bound(
            "recording the charge",
            sqlx::query_scalar(
                "WITH account AS ( \
                     INSERT INTO accounts (account_id, balance_cents, charges) VALUES ($1, $2, 1) \
                     ON CONFLICT (account_id) DO UPDATE \
                     SET balance_cents = accounts.balance_cents + EXCLUDED.balance_cents, \
                         charges = accounts.charges + 1, updated_at = now() \
                     RETURNING balance_cents), \
                 charge AS ( \
                     INSERT INTO charges (charge_id, account_id, amount_cents, balance_cents, idempotency_key) \
                     SELECT $3, $1, $2, balance_cents, $4 FROM account \
                     RETURNING charge_id, balance_cents) \
                 UPDATE idempotency_keys SET charge_id = charge.charge_id, balance_cents = charge.balance_cents \
                 FROM charge WHERE idempotency_keys.account_id = $1 AND idempotency_keys.idempotency_key = $4 \
                 RETURNING charge.balance_cents",
            )
            .bind(account.as_str())
            .bind(amount.get())
            .bind(charge_id)
            .bind(key.as_str())
            .fetch_one(&mut *tx)
            .instrument(tracing::info_span!(target: resilience::TRACE_ONLY, "record_charge")),
        )
        .await?;
    Ok((charge_id, balance_cents))
}

/// `error`, once `tx` is rolled back within the round-trip bound — not left for sqlx to
/// queue a ROLLBACK that would only go out with the connection's next use, the
/// transaction's locks held meanwhile (giving a connection back sends nothing). A
/// connection already in doubt is not asked: it will be closed. A ROLLBACK that does not
/// answer in time is the error then (UNAVAILABLE: the connection is closed).
async fn rolled_back(
    tx: sqlx::Transaction<'_, Postgres>,
    rt: RoundTrip<'_>,
    error: StoreError,
) -> StoreError {
    if error.leaves_connection_in_doubt() {
        return error;
    }
    match rt.bound("ROLLBACK", tx.rollback()).await {
        Ok(()) => error,
        Err(rollback) => rollback,
    }
}

/// What one charge is: the request's values, parsed, and how it waits.
#[derive(Clone, Copy)]
struct Charge<'a> {
    account: &'a AccountId,
    key: &'a IdempotencyKey,
    amount: AmountCents,
    deadline: Deadline,
    in_flight: InFlight,
}

/// What one turn of claiming a key came to.
enum Claim {
    /// This request holds the key, in the open transaction: charge.
    Claimed,
    /// The key was already there (or running elsewhere, with `--in-flight reject`).
    Settled(ChargeOutcome),
    /// Another transaction holds the key and did not finish within this turn.
    Busy,
}

/// BEGIN, with the transaction's timeouts, in one round trip.
async fn begin<'c>(
    conn: &'c mut PgConnection,
    rt: RoundTrip<'_>,
    deadline: Deadline,
) -> Result<sqlx::Transaction<'c, Postgres>, StoreError> {
    // Every statement ends by the deadline and under the round-trip bound: at least 1 ms
    // (0 would mean "no limit"), at most what Postgres accepts (a 1000-hour timeout
    // would otherwise fail BEGIN). The session ends if it idles in this transaction well
    // past the deadline: only a frozen ledger does that, and its key must not stay locked.
    let left_ms = deadline.remaining().as_millis().clamp(1, i32::MAX as u128);
    let statement_ms = rt.statement_timeout_ms(left_ms);
    // A lock wait ends a little before the statement would: `lock_not_available` (a turn
    // of waiting for another transaction) is then told apart from `query_canceled`.
    let lock_ms = (statement_ms * 4 / 5).max(1);
    let idle_ms = (left_ms + IDLE_SLACK_MS).min(i32::MAX as u128);
    let begin = format!(
        "BEGIN; SET LOCAL lock_timeout = {lock_ms}; SET LOCAL statement_timeout = {statement_ms}; \
         SET LOCAL idle_in_transaction_session_timeout = {idle_ms}"
    );
    // Whatever went wrong in BEGIN, the session's state is unknown (sqlx counts the
    // transaction only once BEGIN has answered): the connection is not to be reused.
    rt.bound("BEGIN", conn.begin_with(AssertSqlSafe(begin)))
        .await
        .map_err(|error| match error {
            in_doubt @ (StoreError::Unavailable(_) | StoreError::Database(_)) => in_doubt,
            other => StoreError::Unavailable(format!("BEGIN failed: {other}")),
        })
}

/// One turn of claiming the charge's key in `tx`; see [`charge_in_transaction`].
async fn claim(
    tx: &mut PgConnection,
    rt: RoundTrip<'_>,
    charge: &Charge<'_>,
) -> Result<Claim, StoreError> {
    let Charge {
        account,
        key,
        amount,
        in_flight,
        ..
    } = *charge;
    if in_flight == InFlight::Reject {
        // A transaction-scoped advisory lock on (account, key) tells "another ledger
        // instance is running this key" without waiting. Two keys whose hashes collide can
        // only cause a spurious ABORTED, which the caller retries.
        let free: bool = rt
            .bound(
                "taking the key's advisory lock",
                sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext($1), hashtext($2))")
                    .bind(account.as_str())
                    .bind(key.as_str())
                    .fetch_one(&mut *tx),
            )
            .await?;
        if !free {
            return match saved(tx, rt, account, key).await? {
                Some(row) => settled(tx, rt, charge, row).await,
                None => Err(StoreError::InFlight),
            };
        }
    }
    let inserted = rt
        .answer(
            "claiming the key",
            sqlx::query(
                "INSERT INTO idempotency_keys (account_id, idempotency_key, request_amount_cents) \
                 VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            )
            .bind(account.as_str())
            .bind(key.as_str())
            .bind(amount.get())
            .execute(&mut *tx)
            .instrument(tracing::info_span!(target: resilience::TRACE_ONLY, "claim_key")),
        )
        .await?;
    match inserted {
        Ok(done) if done.rows_affected() == 1 => Ok(Claim::Claimed),
        Ok(_) => {
            let row = saved(tx, rt, account, key)
                .await?
                .ok_or(StoreError::Purged)?;
            settled(tx, rt, charge, row).await
        }
        // lock_not_available, our lock_timeout, with time left: this turn is over, not the
        // request.
        Err(error) if is_lock_timeout(&error) && rt.has_time() => Ok(Claim::Busy),
        Err(error) => Err(rt.judge("claiming the key", error.into())),
    }
}

/// A repeat of a committed key: its saved reply, once the replay is counted on the key
/// row (`replicated`); another turn if that row is locked past this turn's lock timeout.
async fn settled(
    tx: &mut PgConnection,
    rt: RoundTrip<'_>,
    charge: &Charge<'_>,
    row: KeyRow,
) -> Result<Claim, StoreError> {
    let outcome = row.replay(charge.account, charge.amount)?;
    Ok(if replicated(tx, rt, charge.account, charge.key).await? {
        Claim::Settled(outcome)
    } else {
        Claim::Busy
    })
}

/// Whether `error` is Postgres's `lock_not_available` (our `lock_timeout`).
fn is_lock_timeout(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

/// `--in-flight reject`, when this key is already running in this process: its saved
/// reply if it has in fact finished (read without waiting for the key's first request;
/// the replay then counted, and waited for the synchronous standby, as in [`settled`],
/// in a transaction of its own), else ABORTED.
async fn replay_or_in_flight(
    conn: &mut PgConnection,
    rt: RoundTrip<'_>,
    charge: &Charge<'_>,
) -> Result<ChargeOutcome, StoreError> {
    let mut tx = begin(conn, rt, charge.deadline).await?;
    let replayed = match saved(&mut tx, rt, charge.account, charge.key).await {
        Ok(Some(row)) if row.reply.is_some() => settled(&mut tx, rt, charge, row).await,
        Ok(_) => Err(StoreError::InFlight),
        Err(error) => Err(error),
    };
    match replayed {
        Ok(Claim::Settled(outcome)) => {
            rt.bound("COMMIT", tx.commit()).await?;
            Ok(outcome)
        }
        // Claimed cannot come from `settled`; Busy: another replay holds the row.
        Ok(Claim::Busy | Claim::Claimed) => Err(rolled_back(tx, rt, StoreError::InFlight).await),
        Err(error) => Err(rolled_back(tx, rt, error).await),
    }
}

/// Counts a replay on the key's row (false: the row stayed locked past this turn's lock
/// timeout); the caller's COMMIT then returns only once the saved reply is on the
/// synchronous standby too (on a server without one: at once).
///
/// A replay must not claim a success the standby lacks. A commit that waited for the
/// standby and was cut short (its session cancelled or ended: an operator, a pooler's
/// timeout, a fast shutdown) stays committed, and visible, on the primary alone; a retry
/// that read it there and answered OK would be lost with the primary. A transaction that
/// writes nothing commits without waiting for the standby, so a replay writes: its commit
/// record follows the saved reply's in the WAL, and with `synchronous_commit` the commit
/// returns once the standby has flushed both. If the standby is not confirming, the
/// round-trip bound ends the wait: UNAVAILABLE, and the key is retried later. The cost is
/// one statement and one WAL flush per replay, which are rare.
async fn replicated(
    conn: &mut PgConnection,
    rt: RoundTrip<'_>,
    account: &AccountId,
    key: &IdempotencyKey,
) -> Result<bool, StoreError> {
    let counted = rt
        .answer(
            "counting the replay",
            sqlx::query(
                "UPDATE idempotency_keys SET replays = replays + 1, replayed_at = now() \
                 WHERE account_id = $1 AND idempotency_key = $2",
            )
            .bind(account.as_str())
            .bind(key.as_str())
            .execute(conn)
            .instrument(tracing::info_span!(target: resilience::TRACE_ONLY, "count_replay")),
        )
        .await?;
    match counted {
        Ok(_) => Ok(true),
        // Another replay of this key (another ledger instance) holds the row: this turn is
        // over, not the request.
        Err(error) if is_lock_timeout(&error) && rt.has_time() => Ok(false),
        Err(error) => Err(rt.judge("counting the replay", error.into())),
    }
}

/// A key's row as committed.
struct KeyRow {
    /// The amount the key was first used with.
    amount_cents: i64,
    /// (charge id, balance after) once the charge committed.
    reply: Option<(Uuid, i64)>,
}

impl KeyRow {
    /// The saved reply for a repeat of this key with `amount`.
    fn replay(self, account: &AccountId, amount: AmountCents) -> Result<ChargeOutcome, StoreError> {
        if self.amount_cents != amount.get() {
            return Err(StoreError::KeyReused {
                saved: self.amount_cents,
                requested: amount.get(),
            });
        }
        let Some((charge_id, balance_cents)) = self.reply else {
            // Key rows are inserted and completed in one transaction, so a committed row
            // without its reply means the schema or the code is broken.
            return Err(StoreError::Database(sqlx::Error::Protocol(
                "a committed idempotency key has no saved reply".into(),
            )));
        };
        Ok(ChargeOutcome::Replayed(SavedReply {
            charge_id,
            account_id: account.as_str().to_owned(),
            amount_cents: self.amount_cents,
            balance_cents,
        }))
    }
}

/// The committed row of (account, key), if any.
async fn saved(
    conn: &mut PgConnection,
    rt: RoundTrip<'_>,
    account: &AccountId,
    key: &IdempotencyKey,
) -> Result<Option<KeyRow>, StoreError> {
    let row = rt
        .bound(
            "reading the key's saved reply",
            sqlx::query(
                "SELECT request_amount_cents, charge_id, balance_cents FROM idempotency_keys \
                 WHERE account_id = $1 AND idempotency_key = $2",
            )
            .bind(account.as_str())
            .bind(key.as_str())
            .fetch_optional(conn),
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    let reply = match (
        row.try_get::<Option<Uuid>, _>("charge_id")?,
        row.try_get::<Option<i64>, _>("balance_cents")?,
    ) {
        (Some(charge_id), Some(balance)) => Some((charge_id, balance)),
        _ => None,
    };
    Ok(Some(KeyRow {
        amount_cents: row.try_get("request_amount_cents")?,
        reply,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_failures_are_classified_for_retries() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(StoreError::from(io), StoreError::Unavailable(_)));
        assert!(matches!(
            StoreError::from(sqlx::Error::PoolTimedOut),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            StoreError::from(sqlx::Error::RowNotFound),
            StoreError::Database(_)
        ));
    }
}
