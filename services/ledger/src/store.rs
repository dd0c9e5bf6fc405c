//! The key store: idempotency keys, charges and balances in Postgres, in atomic phases.
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
//!   Same-key requests of this process wait in memory first ([`KeyLocks`]).
//! - **The completer** ([`KeyStore::complete_abandoned`], run by the ledger every second)
//!   takes over keys nobody came back for, so no charge stays half-done: finished, or
//!   failed with the processor's error. A key whose owner vanished holding it is due 2 s
//!   after its lease passed; one its owner released after a transient failure (the caller
//!   was told, and may retry) only after a minute, then at doubling intervals — so an
//!   outage of the processor gets a trickle of the completer's calls, not a storm.
//! - **A replay waits for the synchronous standby**: the conflict branch of [`CLAIM`]
//!   writes (it counts the replay), and a transaction that writes commits only once the
//!   standby has it — so a replay never claims a success that a failover would lose.
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
use retrychain_node::{AccountId, AmountCents, Caller, IdempotencyKey};
use sqlx::{AssertSqlSafe, Connection, PgConnection, Row, postgres::PgRow};
use tonic::Code;
use tracing::Instrument;
use uuid::Uuid;

use crate::{
    key_locks::KeyLocks,
    pool::{AcquireError, Checkout, Pool, PoolOptions, Queue},
    primary::{Hosts, Primary},
};

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

/// The first pause between two looks at a key another ledger instance is running;
/// doubled each time up to [`POLL_MAX`].
const POLL_MIN: Duration = Duration::from_millis(5);

/// The longest pause between two looks.
const POLL_MAX: Duration = Duration::from_millis(50);

/// Phase 1, and every later look at a key: one statement. First the account: created
/// for the caller (`$7`) with nothing charged if it is new, else locked (the row, no new
/// version) and, only if another caller owns it, returned — and then nothing else
/// happens: no row comes back, and the request is refused before the key is looked at, so
/// one caller can neither claim a key on another's account nor be replayed its reply.
/// Then the key: a new one is inserted as started under our lease; an existing one is
/// returned as it is, except that a started key whose lease passed is taken over (if the
/// parameters match) and a settled one has its replay counted (if they match: the write
/// makes the commit wait for the synchronous standby). `inserted` tells a fresh claim from
/// a conflict.
pub const CLAIM: &str = "\
WITH account AS ( \
    INSERT INTO accounts (account_id, owner, balance_cents, charges) VALUES ($1, $7, 0, 0) \
    ON CONFLICT (account_id) DO UPDATE SET owner = accounts.owner \
    WHERE accounts.owner <> EXCLUDED.owner \
    RETURNING owner) \
INSERT INTO idempotency_keys AS k \
    (account_id, idempotency_key, request_amount_cents, state, lease_owner, lease_expires_at, processor_key) \
SELECT $1, $2, $3, 'started', $4, now() + make_interval(secs => $5), $6 \
WHERE NOT EXISTS (SELECT 1 FROM account WHERE account.owner <> $7) \
ON CONFLICT (account_id, idempotency_key) DO UPDATE SET \
    lease_owner = CASE WHEN k.state = 'started' AND k.lease_expires_at <= now() \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents \
        THEN EXCLUDED.lease_owner ELSE k.lease_owner END, \
    lease_expires_at = CASE WHEN k.state = 'started' AND k.lease_expires_at <= now() \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents \
        THEN EXCLUDED.lease_expires_at ELSE k.lease_expires_at END, \
    takeovers = k.takeovers + CASE WHEN k.state = 'started' AND k.lease_expires_at <= now() \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents THEN 1 ELSE 0 END, \
    replays = k.replays + CASE WHEN k.state <> 'started' \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents THEN 1 ELSE 0 END, \
    replayed_at = CASE WHEN k.state <> 'started' \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents THEN now() ELSE k.replayed_at END \
RETURNING (xmax = 0) AS inserted, k.state, k.request_amount_cents, k.charge_id, k.balance_cents, \
    k.lease_owner, k.processor_key, k.error_code, k.error_message";

/// Phase 2: the effect and the reply, in one statement, only while the key is ours (its
/// row locked first, so a concurrent take-over waits for it or wins before it).
pub const FINISH: &str = "\
WITH owned AS ( \
    SELECT request_amount_cents FROM idempotency_keys \
    WHERE account_id = $1 AND idempotency_key = $2 AND state = 'started' AND lease_owner = $3 \
    FOR UPDATE), \
account AS ( \
    INSERT INTO accounts (account_id, balance_cents, charges) \
    SELECT $1, request_amount_cents, 1 FROM owned \
    ON CONFLICT (account_id) DO UPDATE \
    SET balance_cents = accounts.balance_cents + EXCLUDED.balance_cents, \
        charges = accounts.charges + 1, updated_at = now() \
    RETURNING balance_cents), \
charge AS ( \
    INSERT INTO charges (charge_id, account_id, amount_cents, balance_cents, idempotency_key) \
    SELECT $4, $1, owned.request_amount_cents, account.balance_cents, $2 FROM owned, account \
    RETURNING charge_id, balance_cents) \
UPDATE idempotency_keys SET state = 'finished', charge_id = charge.charge_id, \
    balance_cents = charge.balance_cents, lease_owner = NULL, lease_expires_at = NULL, \
    finished_at = now() \
FROM charge WHERE idempotency_keys.account_id = $1 AND idempotency_keys.idempotency_key = $2 \
RETURNING charge.balance_cents";

/// Phase 2 when the processor refused for good: the error saved, while the key is ours.
pub const FAIL: &str = "\
UPDATE idempotency_keys SET state = 'failed', error_code = $4, error_message = $5, \
    lease_owner = NULL, lease_expires_at = NULL, finished_at = now() \
WHERE account_id = $1 AND idempotency_key = $2 AND state = 'started' AND lease_owner = $3";

/// The owner, while the processor works: its lease goes on (false: the key was taken).
pub const RENEW: &str = "\
UPDATE idempotency_keys SET lease_expires_at = now() + make_interval(secs => $4) \
WHERE account_id = $1 AND idempotency_key = $2 AND state = 'started' AND lease_owner = $3";

/// After a transient failure the caller was told of: the lease ends now and has no owner,
/// so the next request resumes at once, and the completer knows the caller was answered
/// (it is the caller's to retry; see [`TAKE_OVER`]).
pub const RELEASE: &str = "\
UPDATE idempotency_keys SET lease_expires_at = now(), lease_owner = NULL \
WHERE account_id = $1 AND idempotency_key = $2 AND state = 'started' AND lease_owner = $3";

/// A look at a key another instance runs, without writing (the waiting request's poll).
const LOOK: &str = "\
SELECT state, lease_expires_at <= now() AS expired FROM idempotency_keys \
WHERE account_id = $1 AND idempotency_key = $2";

/// The completer: keys nobody came back for, oldest first, taken over. A key whose owner
/// vanished holding it (its lease passed with an owner: a crash, a freeze, a lost
/// database) is due [`ABANDONED_AFTER`] after its lease passed. A key its owner released
/// after a transient failure — the caller was answered, and may retry — is due only after
/// [`RELEASED_AFTER`], doubled for every earlier take-over (at most 2⁸ times): in an
/// outage of the processor the completer adds a trickle of calls, not a retry storm; yet
/// a charge whose answer was lost after the processor made it is finished in the end.
pub const TAKE_OVER: &str = "\
UPDATE idempotency_keys AS k SET lease_owner = $1, \
    lease_expires_at = now() + make_interval(secs => $2), takeovers = k.takeovers + 1 \
FROM (SELECT account_id, idempotency_key FROM idempotency_keys \
      WHERE state = 'started' AND ( \
          (lease_owner IS NOT NULL AND lease_expires_at <= now() - make_interval(secs => $3)) \
       OR (lease_owner IS NULL AND lease_expires_at <= now() \
              - make_interval(secs => $5 * power(2, least(takeovers, 8))))) \
      ORDER BY lease_expires_at LIMIT $4 FOR UPDATE SKIP LOCKED) AS due \
WHERE k.account_id = due.account_id AND k.idempotency_key = due.idempotency_key \
RETURNING k.account_id, k.idempotency_key, k.request_amount_cents, k.processor_key";

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
    /// This request finished the charge (a fresh key, or one it resumed).
    Executed(SavedReply),
    /// The key was settled with the same parameters: its saved reply, nothing charged.
    Replayed(SavedReply),
}

/// What a same-key request does while the first one is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    /// Wait for the first to finish, then replay its outcome (or resume it, if its lease
    /// passes).
    Wait,
    /// Refuse at once with ABORTED, Stripe-style (a settled key still replays).
    Reject,
}

/// One call the processor is to make: under which key, for how much. The processor
/// remembers both, and refuses the key with other parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessorCharge {
    /// The processor's idempotency key (see `processor::ProcessorKey`).
    pub key: String,
    /// The amount.
    pub amount_cents: i64,
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
    /// The account belongs to another caller: its keys, replies and balance are not this
    /// caller's to use or see.
    #[error("the account belongs to another caller")]
    NotOwner,
    /// `--in-flight reject`: a request with this key is still running.
    #[error("a request with this idempotency key is still in flight; retry after it finishes")]
    InFlight,
    /// The deadline ran out waiting for a connection, a statement, or a same-key request
    /// to finish.
    #[error("the deadline ran out while {0}")]
    DeadlineWhileWaiting(&'static str),
    /// The balance would leave the range of a 64-bit integer.
    #[error("the charge would overflow the account balance")]
    BalanceOverflow,
    /// The payment processor failed this call: for good (the key is now failed with this
    /// error) or for now (the key stays started; a retry resumes it).
    #[error("payment processor: {}", .0.message())]
    Processor(tonic::Status),
    /// The key failed for good earlier (the processor refused it): its saved error.
    #[error("{message}")]
    Failed {
        /// The saved code.
        code: Code,
        /// The saved message.
        message: String,
    },
    /// Every database connection stayed busy while this request waited: the ledger is
    /// overloaded (answered as an overloaded service's refusal: load, not a fault).
    #[error("overloaded: {0}")]
    Busy(String),
    /// Postgres could not be reached or was too slow. Transient: a retry with the same
    /// key is safe and resumes or replays.
    #[error("database unavailable ({0}); retry with the same idempotency key")]
    Unavailable(String),
    /// The connection was lost (an I/O error, the server ended the session or shut down,
    /// a primary demoted under it): as [`StoreError::Unavailable`] for the caller, and the
    /// one kind of failure that makes the pool doubt its other connections.
    #[error("database connection lost ({0}); retry with the same idempotency key")]
    Lost(String),
    /// A serialization failure or deadlock: rolled back, safe to retry.
    #[error("database conflict ({0}); rolled back, retry")]
    Conflict(String),
    /// Anything else the database said: a bug or a broken schema, not worth retrying.
    #[error("database: {0}")]
    Database(sqlx::Error),
}

impl StoreError {
    /// Whether the connection that produced this error may be in an unknown state
    /// (mid-protocol) and must be closed rather than reused.
    fn leaves_connection_in_doubt(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable(_) | StoreError::Lost(_) | StoreError::Database(_)
        )
    }
}

/// The one classification of database failures; `service.rs` maps the result to a status.
impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        use sqlx::Error as E;
        let text = error.to_string();
        match &error {
            E::Io(_) | E::Tls(_) | E::Protocol(_) => StoreError::Lost(text),
            E::PoolTimedOut | E::PoolClosed => StoreError::Unavailable(text),
            E::Database(db) => match db.code().as_deref().unwrap_or_default() {
                // lock_not_available and query_canceled: the session's lock and statement
                // timeouts, set under the round-trip bound: the server is too slow (an
                // operator's pg_cancel_backend lands here too). Decided by code, not by
                // the message, which depends on the server's language.
                "55P03" | "57014" => StoreError::Unavailable(format!(
                    "Postgres gave up on a statement it could not finish in time ({text})"
                )),
                // numeric_value_out_of_range: only the balance can overflow.
                "22003" => StoreError::BalanceOverflow,
                "40001" | "40P01" => StoreError::Conflict(text),
                // The session is gone or useless: connection_exception (08…), admin or
                // crash shutdown, cannot connect now, database dropped, idle-session
                // timeout (57P…), idle-in-transaction timeout (25P03), and a write refused
                // as read-only (25006: a primary demoted under the connection).
                code if code.starts_with("08")
                    || code.starts_with("57P")
                    || code == "25P03"
                    || code == "25006" =>
                {
                    StoreError::Lost(text)
                }
                // Insufficient resources (53…, e.g. too many connections) and
                // statement_completion_unknown (40003: CockroachDB's ambiguous commit, as a
                // COMMIT whose answer was lost — the key tells the retry what happened).
                code if code.starts_with("53") || code == "40003" => StoreError::Unavailable(text),
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
}

/// The bound on one database round trip, by this process's clock.
#[derive(Debug, Clone, Copy)]
struct RoundTrip<'g> {
    /// [`StoreOptions::round_trip_timeout`].
    limit: Duration,
    /// Where each round trip's time goes.
    times: &'g Histogram,
}

impl RoundTrip<'_> {
    /// `work`, one round trip named `what`, or UNAVAILABLE once the bound has passed
    /// without an answer (the caller's [`Checkout`] then closes the connection).
    async fn bound<T, E: Into<StoreError>>(
        self,
        what: &'static str,
        work: impl Future<Output = Result<T, E>>,
    ) -> Result<T, StoreError> {
        let started = tokio::time::Instant::now();
        let answer = tokio::time::timeout(self.limit, work).await;
        self.times.observe(started.elapsed().as_secs_f64());
        match answer {
            Ok(result) => result.map_err(Into::into),
            Err(_) => Err(StoreError::Unavailable(format!(
                "Postgres did not answer {what} within {:?}; the connection is abandoned and the key is left for a retry",
                self.limit
            ))),
        }
    }
}

/// Postgres access for the ledger.
#[derive(Debug, Clone)]
pub struct KeyStore {
    /// Connections: nothing is sent when one is taken or given back; one is pinged before
    /// use only after a connection was lost (see [`crate::pool`]).
    pool: Pool,
    /// Same-key requests of this process queue here, holding no connection.
    keys: Arc<KeyLocks>,
    /// Gauges and counts for `/metrics`.
    gauges: Arc<StoreGauges>,
    /// Longest wait for a connection ([`StoreOptions::acquire_timeout`]).
    acquire_timeout: Duration,
    /// The bound on each round trip ([`StoreOptions::round_trip_timeout`]).
    round_trip_timeout: Duration,
    /// [`StoreOptions::skip_key_claim`].
    skip_key_claim: bool,
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

/// What the store counts for `/metrics` and Stats.
#[derive(Debug)]
struct StoreGauges {
    /// Requests waiting for a connection now.
    acquiring: AtomicU64,
    /// Requests that waited for another request with their key, since start.
    key_waits: AtomicU64,
    /// Keys taken over and resumed (a request's or the completer's), since start.
    resumed: AtomicU64,
    /// Phase 2s refused because the key had been taken over meanwhile, since start.
    stale_owner: AtomicU64,
    /// Round-trip times.
    round_trips: Histogram,
}

impl Default for StoreGauges {
    fn default() -> Self {
        Self {
            acquiring: AtomicU64::default(),
            key_waits: AtomicU64::default(),
            resumed: AtomicU64::default(),
            stale_owner: AtomicU64::default(),
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
        self.gauges.key_waits.load(Ordering::Relaxed)
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

/// One charge as the store runs it: the request's values, parsed, and its lease owner.
#[derive(Clone, Copy)]
struct Charge<'a> {
    /// Who asks: phase 1 creates the account for it, or refuses another's.
    caller: &'a Caller,
    account: &'a AccountId,
    key: &'a IdempotencyKey,
    amount: AmountCents,
    deadline: Deadline,
    /// This request's name on the key's lease.
    owner: Uuid,
    /// The processor's key for it (saved on the claim; a resumed key keeps its own).
    processor_key: &'a str,
}

/// A key's row as [`CLAIM`] returned it.
struct KeyRow {
    /// Whether this statement inserted it.
    inserted: bool,
    /// `started`, `finished` or `failed`.
    state: String,
    /// The amount the key was first used with.
    amount_cents: i64,
    /// (charge id, balance after) once finished.
    reply: Option<(Uuid, i64)>,
    /// Who holds the lease (started keys).
    owner: Option<Uuid>,
    /// The processor key saved with it.
    processor_key: Option<String>,
    /// The saved error (failed keys).
    error: Option<(i32, String)>,
}

impl KeyRow {
    fn read(row: &PgRow) -> Result<Self, sqlx::Error> {
        let reply = match (
            row.try_get::<Option<Uuid>, _>("charge_id")?,
            row.try_get::<Option<i64>, _>("balance_cents")?,
        ) {
            (Some(charge_id), Some(balance)) => Some((charge_id, balance)),
            _ => None,
        };
        let error = match (
            row.try_get::<Option<i32>, _>("error_code")?,
            row.try_get::<Option<String>, _>("error_message")?,
        ) {
            (Some(code), message) => Some((code, message.unwrap_or_default())),
            _ => None,
        };
        Ok(Self {
            inserted: row.try_get("inserted")?,
            state: row.try_get("state")?,
            amount_cents: row.try_get("request_amount_cents")?,
            reply,
            owner: row.try_get("lease_owner")?,
            processor_key: row.try_get("processor_key")?,
            error,
        })
    }
}

/// What [`CLAIM`] came to for one request.
enum Claim {
    /// The key is this request's: freshly claimed, or taken over (`resumed`).
    Ours {
        /// The processor key to call under.
        processor_key: String,
        /// Taken over from an owner whose lease passed.
        resumed: bool,
    },
    /// Settled with the same parameters: its outcome.
    Settled(Result<ChargeOutcome, StoreError>),
    /// Running under someone else's live lease.
    Running,
}

/// What the processor's call came to, as phase 2 needs it.
enum Processed {
    /// It charged.
    Charged,
    /// It refused for good: the key fails with this.
    Refused(tonic::Status),
    /// It failed for now: the key is released for a retry.
    Failed(tonic::Status),
}

/// Whether a processor failure is for good: the call reached a processor that said no
/// (a retry with the same parameters would be told the same), as against a failure to
/// reach it, a busy one, or one that ran out of time.
fn refused_for_good(status: &tonic::Status) -> bool {
    !matches!(
        status.code(),
        Code::Unavailable
            | Code::ResourceExhausted
            | Code::Aborted
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal
    )
}

impl KeyStore {
    /// Connects to the primary of `database_url` (one host, or several in libpq's
    /// multi-host form: see [`crate::primary`]) and applies the migrations, waiting up to a
    /// minute for a database that is still starting (as under docker-compose, or after a
    /// crash of both); then follows the primary for as long as the store lives.
    pub async fn connect(database_url: &str, options: StoreOptions) -> anyhow::Result<Self> {
        use anyhow::Context;
        // The server gives up on a statement a little before the ledger gives up on the
        // connection (a live but slow server cancels its own work first), and on a lock
        // wait a little before that (told apart from a slow statement in the logs).
        let statement_ms = (options.round_trip_timeout.as_millis() * 3 / 4).max(1);
        let lock_ms = (statement_ms * 4 / 5).max(1);
        let (statement_ms, lock_ms) = (statement_ms.to_string(), lock_ms.to_string());
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
                    ("statement_timeout", statement_ms.as_str()),
                    ("lock_timeout", lock_ms.as_str()),
                    // Every charge statement commits on its own; only the purge and the
                    // migrations open transactions, and none may be left open for long.
                    ("idle_in_transaction_session_timeout", "60s"),
                ])
            });
        let primary = Primary::find(hosts, options.round_trip_timeout, Duration::from_secs(60))
            .await
            .context("finding the database's primary")?;
        let pool = Pool::new(
            Arc::clone(&primary),
            PoolOptions {
                max_size: options.pool_size as usize,
                connect_timeout: options.connect_timeout,
                ping_timeout: options.round_trip_timeout,
            },
        );
        let watcher = AbortOnDrop(tokio::spawn(Arc::clone(&primary).watch()).abort_handle());
        let reaper = AbortOnDrop(
            tokio::spawn({
                let pool = pool.clone();
                let bound = options.round_trip_timeout;
                async move {
                    loop {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        pool.reap_idle(bound);
                    }
                }
            })
            .abort_handle(),
        );
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
        Ok(Self {
            pool,
            keys: Arc::new(KeyLocks::default()),
            gauges: Arc::default(),
            acquire_timeout: options.acquire_timeout,
            round_trip_timeout: options.round_trip_timeout,
            skip_key_claim: options.skip_key_claim,
            primary,
            _tasks: Arc::new([watcher, reaper]),
        })
    }

    /// Same-key requests running or waiting in this process.
    pub fn keys_in_flight(&self) -> usize {
        self.keys.len()
    }

    /// Keys taken over and resumed, and phase 2s refused to a stale owner, since start.
    pub fn takeovers(&self) -> (u64, u64) {
        (
            self.gauges.resumed.load(Ordering::Relaxed),
            self.gauges.stale_owner.load(Ordering::Relaxed),
        )
    }

    /// Charges `amount` to `account` once per `key`, in phases; see the module docs.
    /// `process` is the processor call, made with no transaction open and no connection
    /// held, when this request holds the key (claimed, or taken over to resume).
    pub async fn charge<F, Fut>(
        &self,
        request: KeyedCharge<'_>,
        process: F,
    ) -> Result<ChargeOutcome, StoreError>
    where
        F: Fn(ProcessorCharge) -> Fut,
        Fut: Future<Output = Result<(), tonic::Status>>,
    {
        let KeyedCharge {
            caller,
            account,
            key,
            amount,
            deadline,
            in_flight,
            processor_key,
        } = request;
        // Same-key requests of this process: one at a time, the others waiting in memory
        // (or, with --in-flight reject, only a look at the key's row).
        let _turn = match self.keys.try_lock(account.as_str(), key.as_str()) {
            Some(turn) => Some(turn),
            None if in_flight == InFlight::Reject => None,
            None => {
                self.gauges.key_waits.fetch_add(1, Ordering::Relaxed);
                let turn = tokio::time::timeout_at(
                    deadline.instant(),
                    self.keys.lock(account.as_str(), key.as_str()),
                )
                .await
                .map_err(|_| {
                    StoreError::DeadlineWhileWaiting(
                        "waiting for a request with the same key to finish",
                    )
                })?;
                Some(turn)
            }
        };
        let charge = Charge {
            caller,
            account,
            key,
            amount,
            deadline,
            owner: Uuid::new_v4(),
            processor_key,
        };
        if self.skip_key_claim {
            self.forget_key(&charge).await?;
        }
        let mut poll = POLL_MIN;
        loop {
            match self.claim(&charge).await? {
                Claim::Settled(outcome) => return outcome,
                Claim::Ours {
                    processor_key,
                    resumed,
                } => {
                    if resumed {
                        self.gauges.resumed.fetch_add(1, Ordering::Relaxed);
                        tracing::info!("resuming a charge whose owner's lease passed");
                    }
                    let call = ProcessorCharge {
                        key: processor_key,
                        amount_cents: amount.get(),
                    };
                    let Some(processed) = self.holding_lease(&charge, process(call)).await else {
                        // Taken over while the processor worked: its new owner settles it.
                        self.stale::<()>();
                        continue;
                    };
                    match self.settle_phase_two(&charge, processed).await? {
                        Some(outcome) => return outcome,
                        // Taken over meanwhile: its new owner settles it; wait for that.
                        None => continue,
                    }
                }
                Claim::Running if in_flight == InFlight::Reject => {
                    return Err(StoreError::InFlight);
                }
                Claim::Running => {
                    if poll == POLL_MIN {
                        self.gauges.key_waits.fetch_add(1, Ordering::Relaxed);
                    }
                    self.wait_while_running(&charge, &mut poll).await?;
                }
            }
        }
    }

    /// [`StoreOptions::skip_key_claim`]: the key's record deleted unless a request holds
    /// it — the bug the chaos checker must catch.
    async fn forget_key(&self, charge: &Charge<'_>) -> Result<(), StoreError> {
        self.with_connection(charge.deadline, async |conn, rt| {
            rt.bound(
                "forgetting the key (--test-skip-key-claim)",
                sqlx::query(
                    "DELETE FROM idempotency_keys \
                     WHERE account_id = $1 AND idempotency_key = $2 AND state <> 'started'",
                )
                .bind(charge.account.as_str())
                .bind(charge.key.as_str())
                .execute(conn),
            )
            .await?;
            Ok(())
        })
        .await
    }

    /// Phase 1, or a later look at the key ([`CLAIM`]).
    async fn claim(&self, charge: &Charge<'_>) -> Result<Claim, StoreError> {
        let row = self
            .with_connection(charge.deadline, async |conn, rt| {
                let row = rt
                    .bound(
                        "claiming the key",
                        sqlx::query(CLAIM)
                            .bind(charge.account.as_str())
                            .bind(charge.key.as_str())
                            .bind(charge.amount.get())
                            .bind(charge.owner)
                            .bind(LEASE.as_secs_f64())
                            .bind(charge.processor_key)
                            .bind(charge.caller.as_str())
                            .fetch_optional(conn)
                            .instrument(
                                tracing::info_span!(target: resilience::TRACE_ONLY, "claim_key"),
                            ),
                    )
                    .await?;
                Ok(row.as_ref().map(KeyRow::read).transpose()?)
            })
            .await?;
        match row {
            Some(row) => Ok(judge(charge, row)),
            None => Err(StoreError::NotOwner),
        }
    }

    /// `call` (the processor's), while this request renews its lease on the key every
    /// third of [`LEASE`]; `None` if a renewal found the key taken over (the call is then
    /// dropped: the processor deduplicates, and the new owner calls it again).
    async fn holding_lease<Fut>(&self, charge: &Charge<'_>, call: Fut) -> Option<Processed>
    where
        Fut: Future<Output = Result<(), tonic::Status>>,
    {
        let renewing = async {
            loop {
                tokio::time::sleep(LEASE / 3).await;
                let renewed = self
                    .finishing(Deadline::after(LEASE / 3), async |conn, rt| {
                        rt.bound(
                            "renewing the key's lease",
                            sqlx::query(RENEW)
                                .bind(charge.account.as_str())
                                .bind(charge.key.as_str())
                                .bind(charge.owner)
                                .bind(LEASE.as_secs_f64())
                                .execute(conn),
                        )
                        .await
                    })
                    .await;
                match renewed {
                    Ok(done) if done.rows_affected() == 0 => return,
                    // Renewed; or the database did not answer: go on (phase 2's guard
                    // still refuses a stale owner).
                    _ => {}
                }
            }
        };
        tokio::select! {
            answered = call => Some(match answered {
                Ok(()) => Processed::Charged,
                Err(status) if refused_for_good(&status) => Processed::Refused(status),
                Err(status) => Processed::Failed(status),
            }),
            () = renewing => None,
        }
    }

    /// Waits, holding no connection, until the key another instance runs is settled or
    /// its lease passes (then the caller claims again), or the deadline.
    async fn wait_while_running(
        &self,
        charge: &Charge<'_>,
        pause: &mut Duration,
    ) -> Result<(), StoreError> {
        loop {
            let left = charge.deadline.remaining();
            if left <= *pause {
                return Err(StoreError::DeadlineWhileWaiting(
                    "waiting for a request with the same key to finish",
                ));
            }
            tokio::time::sleep(*pause).await;
            *pause = (*pause * 2).min(POLL_MAX);
            let changed = self
                .with_connection(charge.deadline, async |conn, rt| {
                    let row = rt
                        .bound(
                            "looking at a running key",
                            sqlx::query(LOOK)
                                .bind(charge.account.as_str())
                                .bind(charge.key.as_str())
                                .fetch_optional(conn),
                        )
                        .await?;
                    Ok(match row {
                        None => true,
                        Some(row) => {
                            let state: String = row.try_get("state")?;
                            let expired: Option<bool> = row.try_get("expired")?;
                            state != "started" || expired.unwrap_or(true)
                        }
                    })
                })
                .await?;
            if changed {
                return Ok(());
            }
        }
    }

    /// Phase 2 for `processed`: finished, failed, or released. `None` when the key was
    /// taken over meanwhile (nothing written; its new owner settles it).
    async fn settle_phase_two(
        &self,
        charge: &Charge<'_>,
        processed: Processed,
    ) -> Result<Option<Result<ChargeOutcome, StoreError>>, StoreError> {
        // Phase 2 outlives the request's deadline if it must: the processor has answered,
        // and what it did is to be recorded now rather than resumed later. The round-trip
        // and acquire bounds hold for each try.
        let phase_two = Deadline::after(self.acquire_timeout + self.round_trip_timeout);
        match processed {
            Processed::Charged => {
                let charge_id = Uuid::new_v4();
                let patience = Deadline::after(PHASE_TWO_PATIENCE);
                let finished = loop {
                    // Each try waits for a connection while the pool's queue moves, within
                    // patience; one that ends because none came back is tried again.
                    let finished = self
                        .finishing(
                            patience,
                            async |conn, rt| {
                                rt.bound(
                                    "recording the charge",
                                    sqlx::query_scalar::<_, i64>(FINISH)
                                        .bind(charge.account.as_str())
                                        .bind(charge.key.as_str())
                                        .bind(charge.owner)
                                        .bind(charge_id)
                                        .fetch_optional(conn)
                                        .instrument(tracing::info_span!(target: resilience::TRACE_ONLY, "record_charge")),
                                )
                                .await
                            },
                        )
                        .await;
                    match finished {
                        // The database did not answer: it may be restarting or failing
                        // over; tried again, briefly spaced, while patience lasts (a try
                        // whose commit was lost finds the key finished: no row, handled as
                        // taken over, and the claim then replays it).
                        Err(
                            StoreError::Unavailable(_) | StoreError::Lost(_) | StoreError::Busy(_),
                        ) if patience.remaining() > Duration::from_millis(100) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        other => break other,
                    }
                };
                match finished {
                    Ok(Some(balance_cents)) => Ok(Some(Ok(ChargeOutcome::Executed(SavedReply {
                        charge_id,
                        account_id: charge.account.as_str().to_owned(),
                        amount_cents: charge.amount.get(),
                        balance_cents,
                    })))),
                    Ok(None) => Ok(self.stale()),
                    // The balance cannot take it: the key fails with that, for good.
                    Err(StoreError::BalanceOverflow) => {
                        let status =
                            tonic::Status::out_of_range(StoreError::BalanceOverflow.to_string());
                        self.fail(charge, &status)
                            .await
                            .map(|done| done.then_some(Err(StoreError::BalanceOverflow)))
                    }
                    Err(error) => Err(error),
                }
            }
            Processed::Refused(status) => Ok(self
                .fail(charge, &status)
                .await?
                .then_some(Err(StoreError::Processor(status)))),
            Processed::Failed(status) => {
                // Best effort: if the release is lost, the lease passes by itself.
                let _ = self
                    .finishing(phase_two, async |conn, rt| {
                        rt.bound(
                            "releasing the key",
                            sqlx::query(RELEASE)
                                .bind(charge.account.as_str())
                                .bind(charge.key.as_str())
                                .bind(charge.owner)
                                .execute(conn),
                        )
                        .await
                    })
                    .await;
                Ok(Some(Err(StoreError::Processor(status))))
            }
        }
    }

    /// The key failed for good with `status`; false when it was taken over meanwhile.
    async fn fail(&self, charge: &Charge<'_>, status: &tonic::Status) -> Result<bool, StoreError> {
        let phase_two = Deadline::after(self.acquire_timeout + self.round_trip_timeout);
        let failed = self
            .finishing(phase_two, async |conn, rt| {
                rt.bound(
                    "saving the processor's refusal",
                    sqlx::query(FAIL)
                        .bind(charge.account.as_str())
                        .bind(charge.key.as_str())
                        .bind(charge.owner)
                        .bind(status.code() as i32)
                        .bind(status.message())
                        .execute(conn),
                )
                .await
            })
            .await?;
        if failed.rows_affected() == 0 {
            let _ = self.stale::<()>();
            return Ok(false);
        }
        Ok(true)
    }

    /// The key is someone else's now (phase 2 refused, or a renewal found it taken): this
    /// request writes nothing more, and waits for the new owner's outcome.
    fn stale<T>(&self) -> Option<T> {
        self.gauges.stale_owner.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "the key was taken over while this request held it (its lease passed): it writes nothing more; the new owner settles it"
        );
        None
    }

    /// Resumes up to `batch` keys whose lease passed [`ABANDONED_AFTER`] ago and nobody
    /// came back for: each taken over ([`TAKE_OVER`]), its processor called again under its
    /// own processor key and parameters, then finished, failed or released. Returns how
    /// many were taken over.
    pub async fn complete_abandoned<F, Fut>(
        &self,
        batch: i64,
        process: F,
    ) -> Result<usize, StoreError>
    where
        F: Fn(ProcessorCharge) -> Fut,
        Fut: Future<Output = Result<(), tonic::Status>>,
    {
        let owner = Uuid::new_v4();
        let rows = self
            .with_connection(
                Deadline::after(self.acquire_timeout + self.round_trip_timeout),
                async |conn, rt| {
                    rt.bound(
                        "taking over abandoned keys",
                        sqlx::query(TAKE_OVER)
                            .bind(owner)
                            .bind(LEASE.as_secs_f64())
                            .bind(ABANDONED_AFTER.as_secs_f64())
                            .bind(batch)
                            .bind(RELEASED_AFTER.as_secs_f64())
                            .fetch_all(conn),
                    )
                    .await
                },
            )
            .await?;
        let taken = rows.len();
        for row in rows {
            let account: String = row.try_get("account_id")?;
            let key: String = row.try_get("idempotency_key")?;
            let amount: i64 = row.try_get("request_amount_cents")?;
            let processor_key: Option<String> = row.try_get("processor_key")?;
            // Rows were written by this code (or are finished): they parse.
            let (Ok(account), Ok(key), Ok(amount)) = (
                AccountId::parse(&account),
                IdempotencyKey::parse(&key),
                AmountCents::parse(amount),
            ) else {
                tracing::error!(
                    account,
                    key,
                    amount,
                    "an abandoned key does not parse; left as it is"
                );
                continue;
            };
            let processor_key = processor_key.unwrap_or_default();
            // The completer never claims (the key is claimed, so its account is settled):
            // the caller is not asked for.
            let nobody = Caller::anonymous();
            let charge = Charge {
                caller: &nobody,
                account: &account,
                key: &key,
                amount,
                deadline: Deadline::after(COMPLETER_CALL),
                owner,
                processor_key: &processor_key,
            };
            self.gauges.resumed.fetch_add(1, Ordering::Relaxed);
            let call = ProcessorCharge {
                key: processor_key.clone(),
                amount_cents: amount.get(),
            };
            let outcome = match self.holding_lease(&charge, process(call)).await {
                Some(processed) => self.settle_phase_two(&charge, processed).await,
                None => Ok(self.stale()),
            };
            tracing::info!(
                account = %account, key = %key,
                outcome = match &outcome {
                    Ok(Some(Ok(_))) => "finished".to_owned(),
                    Ok(Some(Err(error))) => format!("not finished: {error}"),
                    Ok(None) => "taken over by another instance".to_owned(),
                    Err(error) => format!("not finished: {error}"),
                },
                "completer resumed an abandoned charge"
            );
        }
        Ok(taken)
    }

    /// An account's balance and number of charges; `None` if it was never charged (an
    /// account is made by its first charge's claim, so it may exist with none yet); for
    /// another caller's account, [`StoreError::NotOwner`].
    pub async fn account(
        &self,
        caller: &Caller,
        account: &AccountId,
        deadline: Deadline,
    ) -> Result<Option<(i64, i64)>, StoreError> {
        let row = self
            .with_connection(deadline, async |conn, rt| {
                let row = rt
                    .bound(
                        "reading the account",
                        sqlx::query(
                            "SELECT balance_cents, charges, owner FROM accounts WHERE account_id = $1",
                        )
                        .bind(account.as_str())
                        .fetch_optional(conn),
                    )
                    .await?;
                Ok(row
                    .map(|row| {
                        Ok::<_, sqlx::Error>((
                            row.try_get::<i64, _>(0)?,
                            row.try_get::<i64, _>(1)?,
                            row.try_get::<String, _>(2)?,
                        ))
                    })
                    .transpose()?)
            })
            .await?;
        match row {
            Some((_, _, owner)) if owner != caller.as_str() => Err(StoreError::NotOwner),
            Some((_, 0, _)) | None => Ok(None),
            Some((balance, charges, _)) => Ok(Some((balance, charges))),
        }
    }

    /// What the simulated processor keeps (see `processor.rs`): its record of a call under
    /// `charge.key`, inserted or, for a repeat, counted. Returns the amount the key was
    /// first charged with.
    pub async fn processor_record(
        &self,
        charge: &ProcessorCharge,
        deadline: Deadline,
    ) -> Result<i64, StoreError> {
        self.finishing(deadline, async |conn, rt| {
            rt.bound(
                "the processor's record",
                sqlx::query_scalar::<_, i64>(
                    "INSERT INTO processor_charges (processor_key, amount_cents) VALUES ($1, $2) \
                     ON CONFLICT (processor_key) DO UPDATE \
                     SET calls = processor_charges.calls + 1, last_call_at = now() \
                     RETURNING amount_cents",
                )
                .bind(&charge.key)
                .bind(charge.amount_cents)
                .fetch_one(conn),
            )
            .await
        })
        .await
    }

    /// Deletes keys older than `retention`, `batch` rows per statement so no single
    /// statement holds many locks; returns how many went. Each statement is bounded by
    /// [`PURGE_STATEMENT_BOUND`] (past it, UNAVAILABLE and the connection closed), so a
    /// stalled database does not hold the purge, or its connection, for good. A key still
    /// started is left to the completer. The processor's own records age out the same way.
    pub async fn purge_keys_older_than(
        &self,
        retention: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let mut conn = self
            .acquire(Deadline::after(self.acquire_timeout), Queue::Back)
            .await?;
        let purge = async {
            let mut purged = 0;
            for statement in [
                "DELETE FROM idempotency_keys WHERE ctid IN ( \
                     SELECT ctid FROM idempotency_keys \
                     WHERE created_at < now() - make_interval(secs => $1) AND state <> 'started' \
                     ORDER BY created_at LIMIT $2)",
                "DELETE FROM processor_charges WHERE ctid IN ( \
                     SELECT ctid FROM processor_charges \
                     WHERE first_call_at < now() - make_interval(secs => $1) \
                     ORDER BY first_call_at LIMIT $2)",
            ] {
                loop {
                    // In a transaction of its own with a server-side statement timeout a
                    // little under the client's bound, so a batch cut off here does not
                    // run on.
                    let batch_done = async {
                        let server_ms = PURGE_STATEMENT_BOUND.as_millis() * 9 / 10;
                        let mut tx = conn
                            .get()
                            .begin_with(AssertSqlSafe(format!(
                                "BEGIN; SET LOCAL statement_timeout = {server_ms}"
                            )))
                            .await?;
                        let deleted = sqlx::query(statement)
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
                        break;
                    }
                }
            }
            Ok(purged)
        };
        let result = purge.await;
        // Any failure here (a batch cut off, a statement refused) may leave the batch's
        // transaction open on the server: the connection is closed, not given back.
        conn.settle(result.is_ok());
        result.map_err(|error| self.noted(error))
    }

    /// `work` on a pooled connection taken within `deadline` (see [`Self::acquire`]),
    /// under the round-trip bound; the connection goes back if the work ended in a known
    /// state, and is closed otherwise.
    async fn with_connection<T>(
        &self,
        deadline: Deadline,
        work: impl AsyncFnOnce(&mut PgConnection, RoundTrip<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.with_connection_from(deadline, Queue::Back, work).await
    }

    /// [`Self::with_connection`] for a charge under way (its key claimed: the lease
    /// renewed, the processor's record, the outcome recorded): ahead of the charges
    /// waiting to start, which hold nothing yet.
    async fn finishing<T>(
        &self,
        deadline: Deadline,
        work: impl AsyncFnOnce(&mut PgConnection, RoundTrip<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        // The deadline here is the store's own bound on finishing, not a caller's: a wait
        // for a connection that outlasted it is the database not keeping up (a stall, a
        // queue that moved too slowly), said as such — UNAVAILABLE, never the caller's
        // DEADLINE_EXCEEDED.
        self.with_connection_from(deadline, Queue::Front, work)
            .await
            .map_err(|error| match error {
                StoreError::DeadlineWhileWaiting(what) => StoreError::Unavailable(format!(
                    "the database gave no connection in time ({what})"
                )),
                other => other,
            })
    }

    async fn with_connection_from<T>(
        &self,
        deadline: Deadline,
        queue: Queue,
        work: impl AsyncFnOnce(&mut PgConnection, RoundTrip<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut conn = self.acquire(deadline, queue).await?;
        let rt = RoundTrip {
            limit: self.round_trip_timeout,
            times: &self.gauges.round_trips,
        };
        let result = work(conn.get(), rt).await;
        conn.settle(!matches!(&result, Err(error) if error.leaves_connection_in_doubt()));
        result.map_err(|error| self.noted(error))
    }

    /// A pooled connection within the deadline: while connections come back (a busy
    /// database, a queue that moves) the wait lasts as long as the deadline allows — and
    /// a wait the queue's pace says would not end in time is not begun; when none has come
    /// back for the acquire timeout it ends there (a stalled or unreachable database is
    /// said fast). Openings that fail (the server down, restarting, or a standby now) are
    /// tried again by the pool while callers wait: a restart shorter than the acquire
    /// timeout costs a wait, not an error. A wait that ends (or is not begun) because
    /// every connection was busy is load: [`StoreError::Busy`], with nothing about the
    /// pool changed.
    async fn acquire(&self, deadline: Deadline, queue: Queue) -> Result<Checkout, StoreError> {
        let waiting = Waiting::enter(&self.gauges.acquiring);
        let acquired = self
            .pool
            .acquire(deadline.instant(), self.acquire_timeout, queue)
            .await;
        drop(waiting);
        let error = match acquired {
            Ok(conn) => return Ok(conn),
            Err(error) => error,
        };
        if deadline.is_spent() {
            return Err(StoreError::DeadlineWhileWaiting(
                "waiting for a database connection",
            ));
        }
        Err(match error {
            AcquireError::Busy => StoreError::Busy(AcquireError::Busy.to_string()),
            // The pool has raised its own suspicion and asked where the primary is.
            AcquireError::CannotOpen(error) | AcquireError::Refused(error) => {
                match StoreError::from(error) {
                    StoreError::Lost(text) => StoreError::Unavailable(format!(
                        "no connection to Postgres could be opened: {text}"
                    )),
                    other => other,
                }
            }
        })
    }

    /// Tells the pool and the primary's watcher what a failure suggests: a lost connection
    /// makes the other connections suspect (a restart broke them all); any unavailability
    /// may mean the primary moved (a failover breaks connections, demotes the old one, or
    /// leaves it silent), so the watcher asks — cheap, coalesced, and it changes nothing
    /// unless another host answers as the primary. Neither can shrink the pool by itself.
    fn noted(&self, error: StoreError) -> StoreError {
        match &error {
            StoreError::Lost(_) => {
                self.pool.connection_lost();
                self.primary.suspect();
            }
            StoreError::Unavailable(_) => self.primary.suspect(),
            _ => {}
        }
        error
    }
}

/// What a key's row (as [`CLAIM`] returned it) means for `charge`.
fn judge(charge: &Charge<'_>, row: KeyRow) -> Claim {
    let requested = charge.amount.get();
    if row.amount_cents != requested {
        return Claim::Settled(Err(StoreError::KeyReused {
            saved: row.amount_cents,
            requested,
        }));
    }
    match row.state.as_str() {
        "finished" => Claim::Settled(match row.reply {
            Some((charge_id, balance_cents)) => Ok(ChargeOutcome::Replayed(SavedReply {
                charge_id,
                account_id: charge.account.as_str().to_owned(),
                amount_cents: row.amount_cents,
                balance_cents,
            })),
            // A finished key is written with its reply in one statement, so a finished
            // row without one means the schema or the code is broken.
            None => Err(StoreError::Database(sqlx::Error::Protocol(
                "a finished idempotency key has no saved reply".into(),
            ))),
        }),
        "failed" => {
            let (code, message) = row.error.unwrap_or((Code::Unknown as i32, String::new()));
            Claim::Settled(Err(StoreError::Failed {
                code: Code::from_i32(code),
                message,
            }))
        }
        _ if row.owner == Some(charge.owner) => Claim::Ours {
            processor_key: row
                .processor_key
                .unwrap_or_else(|| charge.processor_key.to_owned()),
            resumed: !row.inserted,
        },
        _ => Claim::Running,
    }
}

/// Whether `error` is Postgres's `lock_not_available` (a `lock_timeout`).
fn is_lock_timeout(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_failures_are_classified_for_retries() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(StoreError::from(io), StoreError::Lost(_)));
        assert!(matches!(
            StoreError::from(sqlx::Error::PoolTimedOut),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            StoreError::from(sqlx::Error::RowNotFound),
            StoreError::Database(_)
        ));
    }

    #[test]
    fn only_a_processor_that_said_no_fails_a_key_for_good() {
        for code in [
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::PermissionDenied,
        ] {
            assert!(
                refused_for_good(&tonic::Status::new(code, "no")),
                "{code:?}"
            );
        }
        for code in [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
            Code::Aborted,
        ] {
            assert!(
                !refused_for_good(&tonic::Status::new(code, "later")),
                "{code:?}"
            );
        }
    }
}
