//! The key store: idempotency keys, charges and balances in Postgres, in atomic phases.
//!
//! The protocol (which phase comes when, the lease, waiting, resuming, the completer) is
//! the `idempotency` library's, [`idempotency::Phases`]; the ledger is its first user. What
//! is the ledger's own is here: a charge's statements, one per phase ([`sql`]; the
//! [`idempotency::Persistence`] in `charge.rs`), its connections and their bounds, and how
//! a failure is classified ([`StoreError`]).
//!
//! # Why phases
//!
//! The payment processor stands for a remote system (a card network, a provider). Held
//! inside one database transaction, its call couples the two: a rollback after the
//! processor charged makes the ledger forget a charge it caused, and the processor's
//! latency holds a pooled connection (a 200 ms processor and 32 connections cap the ledger
//! at 160 charges/s). So, after Stripe and Brandur Leach's "atomic phases": every step that
//! talks to Postgres is one statement that commits on its own; the processor is called
//! between them with no transaction open and no connection held; and the key's row says how
//! far the charge got, so whoever comes back — the client's retry, another ledger
//! instance, the completer — resumes it from there. The design notes' rule still holds for
//! the local effect: the balance, the charge row and the saved reply commit together.
//!
//! # A key's states (the `state` column)
//!
//! ```text
//!             claim                             finish
//!  (no row) ────────▶ started ─────────────────────────────────▶ finished
//!                     │  ▲   │ fail (the processor refused for good)
//!                     │  │   └────────────────────────────────▶ failed
//!        release, or  │  │ take over (same parameters,
//!        lease passes ▼  │ a new owner and expiry)
//!                     started, lease expired
//! ```
//!
//! | transition | who | statement (each its own transaction) | guarded by |
//! |---|---|---|---|
//! | none → started | a request | [`CLAIM`]: insert with the parameters, the processor key, a lease (owner, expiry) | the primary key |
//! | started, expired → started, ours | a request with the same parameters; the completer | [`CLAIM`]'s conflict branch; [`TAKE_OVER`] | `lease_expires_at <= now()`, under the row lock |
//! | started, ours → finished | the owner, after the processor answered | [`FINISH`]: balance, charge row, reply | `lease_owner` is ours (row locked first) |
//! | started, ours → failed | the owner, the processor refused for good | [`FAIL`]: the error saved | the same |
//! | started, ours → started, expired | the owner, a transient failure | [`RELEASE`]: the lease ends now | the same |
//! | finished, failed | — | the saved reply or error, replayed by [`CLAIM`]'s conflict branch (which counts the replay) | — |
//!
//! - **Parameters are bound at the claim**: the amount (the account is the key's scope)
//!   is saved with the key, and a request with other parameters is FAILED_PRECONDITION in
//!   every state — also while the first is running, or after it stopped half-way.
//! - **The lease** is short ([`LEASE`], 2 s) and renewed by its owner every third of it
//!   while the processor works ([`RENEW`]), so a crashed or frozen owner's key is free to
//!   resume within about [`LEASE`], whatever the request's deadline. The owner's phase 2
//!   is refused once someone else took the key over (a frozen owner that wakes finishes
//!   nothing; a renewal that finds the key taken stops its processor call); an owner whose
//!   lease passed unnoticed, and nobody took over, may still finish.
//! - **Resuming** calls the processor again under the same processor key with the same
//!   parameters; the processor deduplicates (it answers a repeat with its first answer), so
//!   the charge happens once at the processor and once here.
//! - **A request that finds the key running** under a live lease waits for it (polling the
//!   row, holding no connection between polls) and replays its outcome, takes it over once
//!   the lease passes, or — with `--in-flight reject` — is refused with ABORTED at once.
//!   Same-key requests of this process wait in memory first ([`idempotency::KeyLocks`]).
//! - **The completer** ([`KeyStore::complete_abandoned`], run by the ledger every second)
//!   takes over keys nobody came back for, so no charge stays half-done: finished, or
//!   failed with the processor's error. A key whose owner vanished holding it is due 2 s
//!   after its lease passed; one its owner released after a transient failure (the caller
//!   was told, and may retry) only after a minute, then at doubling intervals — so an
//!   outage of the processor gets a trickle of the completer's calls, not a storm.
//! - **A replay waits for the synchronous standby**: the conflict branch of [`CLAIM`]
//!   writes (it counts the replay), and a transaction that writes commits only once the
//!   standby has it — so a replay never claims a success that a failover would lose.
//! - **No success without a standby's copy**, with [`StoreOptions::standby_copy`] (by
//!   default when `DATABASE_URL` names several hosts): synchronous replication alone does
//!   not promise it. pg_auto_failover turns it off whenever it finds no healthy standby
//!   (`wait_primary`) — after a standby died, after every failover until the old primary
//!   rejoins, and, in pg_auto_failover 2.0, for a moment in a user's failover while the old
//!   primary still takes writes (its issue #774) — and the node then promoted lacks what
//!   the primary committed alone. So after every outcome it answers (a charge recorded, a
//!   refusal saved, a replay), the ledger asks the server it committed on how far its
//!   standbys have flushed ([`COPIED`]) and answers only once one is past that commit;
//!   none connected, or none there within the round-trip bound, is
//!   [`StoreError::NotCopied`], UNAVAILABLE, and the retry replays it when a standby has
//!   it. The price: a two-node formation charges
//!   nothing while one node is down (docs/failover.md).
//!
//! # When the database or this process misbehaves
//!
//! - **Postgres down or restarting**: a wait for a connection during which none comes
//!   back is bounded by `acquire_timeout` (the pool keeps opening connections on its own
//!   clock: see [`crate::pool`]), answered UNAVAILABLE, retried by the edge under its
//!   budget. A
//!   connection a restart broke fails its statement ([`StoreError::Lost`]); every other
//!   connection last seen working before then is pinged once before its next use.
//! - **Overload**: while connections keep coming back, a charge waits for one as long as
//!   its deadline allows (charges under way ahead of new ones): queueing is not a fault;
//!   one whose wait the queue's pace says would outlast its deadline is refused at once.
//!   Either is [`StoreError::Busy`] — refused as an overloaded service refuses, nothing
//!   about the pool changed.
//! - **A statement unanswered** (a frozen or unreachable server): every round trip is
//!   bounded by the ledger's clock ([`StoreOptions::round_trip_timeout`]); past it,
//!   UNAVAILABLE and the connection is closed. The server's own `statement_timeout` and
//!   `lock_timeout` (set for each session when it opens, a little under that bound) cancel
//!   a slow statement first on a live server. Whether an unanswered phase committed is the
//!   row's to say: the retry finds the key started (and waits out the lease, or takes it
//!   over), or finished (and replays).
//! - **This process crashes or freezes** between the phases: the key stays started; its
//!   lease passes; the client's retry or the completer takes it over and resumes.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use prometheus_client::metrics::histogram::Histogram;
use resilience::Deadline;
use retrychain_domain::{AccountId, AmountCents, Caller, IdempotencyKey};
use sqlx::{AssertSqlSafe, PgConnection, Row};

use tracing::Instrument;
use uuid::Uuid;

use crate::{
    database::{Database, DatabaseOptions},
    pool::{AcquireError, Checkout, Pool, Queue},
    primary::Primary,
};

mod charge;
mod connection;
mod error;
mod reads;
mod reply;
mod retention;
pub mod sql;

pub use error::StoreError;
use error::{RoundTrip, is_lock_timeout};
pub use idempotency::InFlight;
pub use reply::{ChargeOutcome, Recorded, SavedReply};
use sql::LOOK;
pub use sql::{CLAIM, FAIL, FINISH, RELEASE, RENEW, TAKE_OVER};

/// The longest one statement of a retention purge may take (see
/// [`KeyStore::purge_keys_older_than`]); the server cancels it a little earlier.
const PURGE_STATEMENT_BOUND: Duration = Duration::from_secs(60);

/// The longest the migrations may take at start-up.
const MIGRATION_BOUND: Duration = Duration::from_secs(60);

/// A key's lease: how long its owner holds it without renewing. Its owner renews it every
/// third of that while the processor works.
pub const LEASE: Duration = Duration::from_secs(2);

/// How long after its lease passed a started key whose owner vanished is taken over by the
/// completer (the client's own retry usually comes sooner, and resumes it itself).
pub const ABANDONED_AFTER: Duration = Duration::from_secs(2);

/// How long after a transient failure a released key nobody retried is taken over by the
/// completer, the first time; doubled for each take-over after (see [`TAKE_OVER`]).
pub const RELEASED_AFTER: Duration = Duration::from_secs(60);

/// The longest the completer's processor call may take.
pub const COMPLETER_CALL: Duration = Duration::from_secs(5);

/// How long phase 2 is tried again, after the processor charged, while the database does
/// not answer (a restart, a failover): recorded now rather than resumed later.
pub const PHASE_TWO_PATIENCE: Duration = Duration::from_secs(3);

/// One call the processor is to make: under which key, for how much. The processor
/// remembers both, and refuses the key with other parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessorCharge {
    /// The processor's idempotency key (see `processor::ProcessorKey`).
    pub key: String,
    /// The amount.
    pub amount_cents: i64,
}

/// How the ledger talks to Postgres.
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    /// Connections in the pool.
    pub pool_size: u32,
    /// Longest wait for a connection while none comes back to the pool (a stalled or
    /// unreachable database); past it, UNAVAILABLE. While connections come back, a wait
    /// lasts as long as the call's deadline allows.
    pub acquire_timeout: Duration,
    /// Longest one opening of a connection may take; the pool's own bound, never a
    /// caller's (see [`crate::pool`]).
    pub connect_timeout: Duration,
    /// Longest wait for one round trip (a statement) by the ledger's clock; past it,
    /// UNAVAILABLE and the connection closed. See the module docs.
    pub round_trip_timeout: Duration,
    /// Testing only, and wrong on purpose: every charge first deletes what its key
    /// recorded (unless a request holds it), so a retry of a settled charge charges again.
    /// The chaos checker's own end-to-end test runs a ledger broken this way and must
    /// catch it; nothing else sets it.
    pub skip_key_claim: bool,
    /// Answer an outcome only once a standby has flushed its commit (see the module docs,
    /// "No success without a standby's copy"): on for a replicated database, where a
    /// failover may otherwise take back a success; off for one server, which has no
    /// standby to wait for.
    pub standby_copy: bool,
}

/// Postgres access for the ledger.
#[derive(Debug, Clone)]
pub struct KeyStore {
    /// Connections: nothing is sent when one is taken or given back; one is pinged before
    /// use only after a connection was lost (see [`crate::pool`]).
    pool: Pool,
    /// The protocol, shared by every charge of this process: same-key requests queue in
    /// it, holding no connection, and it counts waits and take-overs.
    phases: Arc<idempotency::Phases>,
    /// Gauges and counts for `/metrics`.
    gauges: Arc<StoreGauges>,
    /// Longest wait for a connection ([`StoreOptions::acquire_timeout`]).
    acquire_timeout: Duration,
    /// The bound on each round trip ([`StoreOptions::round_trip_timeout`]).
    round_trip_timeout: Duration,
    /// [`StoreOptions::skip_key_claim`].
    skip_key_claim: bool,
    /// [`StoreOptions::standby_copy`].
    standby_copy: bool,
    /// Which host the pool writes to; told when a failure suggests it moved.
    primary: Arc<Primary>,
    /// The pool and the primary's follower, stopped with the last clone of the store.
    _database: Database,
}

/// What the store counts for `/metrics` and Stats.
#[derive(Debug)]
struct StoreGauges {
    /// Requests waiting for a connection now.
    acquiring: AtomicU64,
    /// Round-trip times.
    round_trips: Histogram,
}

impl Default for StoreGauges {
    fn default() -> Self {
        Self {
            acquiring: AtomicU64::default(),
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
        status.open.saturating_sub(status.idle) as u64
    }

    fn connections_idle(&self) -> u64 {
        self.pool.status().idle as u64
    }

    fn acquires_waiting(&self) -> u64 {
        self.gauges.acquiring.load(Ordering::Relaxed)
    }

    fn key_waits_total(&self) -> u64 {
        self.phases.key_waits()
    }

    fn round_trip_seconds(&self) -> Histogram {
        self.gauges.round_trips.clone()
    }

    fn takeovers(&self) -> (u64, u64) {
        KeyStore::takeovers(self)
    }
}

/// A charge as the ledger asks the store for it: the request's values, parsed.
#[derive(Debug, Clone, Copy)]
pub struct KeyedCharge<'a> {
    /// Who asks (the account must be theirs, or new).
    pub caller: &'a Caller,
    /// The account charged.
    pub account: &'a AccountId,
    /// The client's idempotency key, scoped to the account.
    pub key: &'a IdempotencyKey,
    /// How much.
    pub amount: AmountCents,
    /// When the caller stops waiting.
    pub deadline: Deadline,
    /// What a request does while another with its key runs.
    pub in_flight: InFlight,
    /// The processor's key for it (saved with the claim).
    pub processor_key: &'a str,
}

impl KeyStore {
    /// Connects to the primary of `database_url` (one host, or several in libpq's
    /// multi-host form: see [`crate::primary`]) and applies the migrations, waiting up to a
    /// minute for a database that is still starting (as under docker-compose, or after a
    /// crash of both); then follows the primary for as long as the store lives.
    pub async fn connect(database_url: &str, options: StoreOptions) -> anyhow::Result<Self> {
        use anyhow::Context;
        let database = Database::open(
            database_url,
            DatabaseOptions {
                application_name: "retrychain-ledger",
                pool_size: options.pool_size as usize,
                connect_timeout: options.connect_timeout,
                round_trip_timeout: options.round_trip_timeout,
            },
        )
        .await?;
        let (pool, primary) = (database.pool.clone(), Arc::clone(&database.primary));
        // The session's statement timeout, restored after the migrations lift it.
        let statement_ms = (options.round_trip_timeout.as_millis() * 3 / 4).max(1);
        let started = std::time::Instant::now();
        loop {
            let by =
                tokio::time::Instant::now() + options.acquire_timeout.max(options.connect_timeout);
            let patience = by.saturating_duration_since(tokio::time::Instant::now());
            let migrated = match pool.acquire(by, patience, Queue::Back).await {
                Ok(mut conn) => {
                    // Bounded, so a database that freezes mid-migration fails the start
                    // (the unsettled connection is closed, and its locks with it). The
                    // migrations set their own lock timeouts; the session's statement
                    // timeout is lifted for them (an index built on a large table).
                    let migrated = tokio::time::timeout(MIGRATION_BOUND, async {
                        sqlx::query("SET statement_timeout = 0")
                            .execute(&mut *conn.get())
                            .await?;
                        crate::migrations::migrator().run(conn.get()).await?;
                        sqlx::query(AssertSqlSafe(format!(
                            "SET statement_timeout = {statement_ms}"
                        )))
                        .execute(&mut *conn.get())
                        .await?;
                        Ok::<_, sqlx::migrate::MigrateError>(())
                    })
                    .await
                    .unwrap_or(Err(sqlx::migrate::MigrateError::Execute(
                        sqlx::Error::PoolTimedOut,
                    )));
                    conn.settle(migrated.is_ok());
                    migrated
                }
                Err(AcquireError::CannotOpen(error) | AcquireError::Refused(error)) => {
                    Err(sqlx::migrate::MigrateError::Execute(error))
                }
                Err(AcquireError::Busy) => Err(sqlx::migrate::MigrateError::Execute(
                    sqlx::Error::PoolTimedOut,
                )),
            };
            let error = match migrated {
                Ok(()) => break,
                // A migration's lock_timeout: other instances' statements hold the table;
                // they end within their bounds, so try again rather than queue every new
                // charge behind the ALTER.
                Err(sqlx::migrate::MigrateError::Execute(error)) if is_lock_timeout(&error) => {
                    StoreError::Unavailable(format!("a migration waited for a table lock: {error}"))
                }
                Err(sqlx::migrate::MigrateError::Execute(error)) => StoreError::from(error),
                Err(error) => return Err(error).context("applying the ledger's migrations"),
            };
            if !matches!(error, StoreError::Unavailable(_) | StoreError::Lost(_))
                || started.elapsed() > Duration::from_secs(60)
            {
                return Err(error).context("applying the ledger's migrations");
            }
            tracing::warn!(%error, "database not reachable yet; retrying in 1 s");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        if options.standby_copy {
            may_read_standbys(&pool, &options).await?;
        }
        Ok(Self {
            pool,
            phases: Arc::new(idempotency::Phases::new(idempotency::Policy {
                lease: LEASE,
                abandoned_after: ABANDONED_AFTER,
                released_after: RELEASED_AFTER,
                phase_two_patience: PHASE_TWO_PATIENCE,
                write_within: options.acquire_timeout + options.round_trip_timeout,
                ..idempotency::Policy::default()
            })),
            gauges: Arc::default(),
            acquire_timeout: options.acquire_timeout,
            round_trip_timeout: options.round_trip_timeout,
            skip_key_claim: options.skip_key_claim,
            standby_copy: options.standby_copy,
            primary,
            _database: database,
        })
    }

    /// Same-key requests running or waiting in this process.
    pub fn keys_in_flight(&self) -> usize {
        self.phases.keys_in_flight()
    }

    /// Keys taken over and resumed, and phase 2s refused to a stale owner, since start.
    pub fn takeovers(&self) -> (u64, u64) {
        self.phases.takeovers()
    }
}

/// Refuses to start a ledger that is to confirm standby copies but may not see where the
/// standbys stand: it would answer no charge at all (every position it reads is NULL).
async fn may_read_standbys(pool: &Pool, options: &StoreOptions) -> anyhow::Result<()> {
    let by = tokio::time::Instant::now() + options.acquire_timeout.max(options.connect_timeout);
    let mut conn = pool
        .acquire(by, options.acquire_timeout, Queue::Back)
        .await
        .map_err(|_| anyhow::anyhow!("no database connection to check the role's rights"))?;
    let may: bool = tokio::time::timeout(
        options.round_trip_timeout,
        sqlx::query_scalar(sql::MAY_READ_STANDBYS).fetch_one(&mut *conn.get()),
    )
    .await
    .map_err(|_| {
        anyhow::anyhow!("the database did not say whether this role may read pg_stat_replication")
    })??;
    conn.settle(true);
    anyhow::ensure!(
        may,
        "the ledger confirms every charge is on a standby before answering (--standby-copy), \
         and its database role cannot read where the standbys stand: GRANT pg_monitor TO \
         the ledger's role, or run with --standby-copy off (a failover may then take back \
         charges already answered)"
    );
    Ok(())
}

impl KeyStore {
    /// With [`StoreOptions::standby_copy`], returns once a standby of the server `conn` is
    /// on has flushed that server's WAL as far as it had flushed when first asked — past
    /// the outcome `conn` just committed — or [`StoreError::NotCopied`]: at once when no
    /// standby is connected (one that must first reconnect and catch up will not have it
    /// within a round trip, and the pooled connection is not held for nothing while every
    /// retry would hold another), else after the round-trip bound. A connected standby is
    /// asked again at growing intervals (1 ms, doubled, at most 50 ms): under synchronous
    /// replication the first answer nearly always suffices.
    async fn confirm_copied(
        &self,
        conn: &mut PgConnection,
        rt: RoundTrip<'_>,
    ) -> Result<(), StoreError> {
        if !self.standby_copy {
            return Ok(());
        }
        let until = tokio::time::Instant::now() + self.round_trip_timeout;
        let mut target = None;
        let mut pause = Duration::from_millis(1);
        loop {
            let (flushed, copied): (i64, Option<i64>) = rt
                .bound(
                    "where the standbys stand",
                    sqlx::query_as(sql::COPIED).fetch_one(&mut *conn),
                )
                .await?;
            let target = *target.get_or_insert(flushed);
            match copied {
                Some(copied) if copied >= target => return Ok(()),
                None => return Err(StoreError::NotCopied("no standby is connected".into())),
                Some(_) => {}
            }
            if tokio::time::Instant::now() + pause >= until {
                return Err(StoreError::NotCopied(format!(
                    "no standby confirmed a copy within {:?}",
                    self.round_trip_timeout
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }
}
