//! [`PgKeys`]: keys in one Postgres table of their own, for any service whose reply can be
//! saved as bytes (an encoded protobuf message) and whose fingerprint is bytes (the encoded
//! request). The service's own effect runs inside phase 2's transaction ([`PgEffect`]), so
//! the effect and the saved reply commit together.
//!
//! A key belongs to the caller that claimed it: another caller's request under it is
//! refused ([`crate::Error::ScopeRefused`]), never replayed the reply. Create the table
//! with [`SCHEMA`] (in your migrations, or [`PgKeys::create_schema`]).

use std::{sync::Arc, time::Duration};

use futures::future::BoxFuture;
use sqlx::{Connection, PgConnection, PgPool, Row, postgres::PgRow};
use tokio::time::Instant;
use uuid::Uuid;

use crate::{
    decide::{Record, SavedError, State},
    persistence::{Abandoned, Claim, Failure, KeyId, Look, Persistence, TakeOver},
};

/// The table, its indexes and its checks; every statement is `IF NOT EXISTS`, so running
/// it again changes nothing.
pub const SCHEMA: &str = "\
CREATE TABLE IF NOT EXISTS idempotency_records ( \
    scope            TEXT NOT NULL, \
    key              TEXT NOT NULL, \
    caller           TEXT NOT NULL, \
    fingerprint      BYTEA NOT NULL, \
    state            TEXT NOT NULL CHECK (state IN ('started', 'finished', 'failed')), \
    lease_owner      UUID, \
    lease_expires_at TIMESTAMPTZ, \
    step_key         TEXT, \
    reply            BYTEA, \
    error_code       INTEGER, \
    error_message    TEXT, \
    takeovers        INTEGER NOT NULL DEFAULT 0, \
    replays          BIGINT NOT NULL DEFAULT 0, \
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(), \
    finished_at      TIMESTAMPTZ, \
    PRIMARY KEY (scope, key)); \
CREATE INDEX IF NOT EXISTS idempotency_records_abandoned \
    ON idempotency_records (lease_expires_at) WHERE state = 'started'; \
CREATE INDEX IF NOT EXISTS idempotency_records_created_at ON idempotency_records (created_at);";

/// Whether a started key's lease passed and the claiming request is the same: then the
/// claim takes it over.
const TAKEN_OVER: &str = "r.state = 'started' AND r.lease_expires_at <= now() \
    AND r.fingerprint = EXCLUDED.fingerprint";

/// Phase 1 (see [`Claim`]), its text built once: a new key inserted as started under the
/// lease; an existing one returned as it is — taken over if its lease passed and the
/// request is the same, its replay counted if settled — unless another caller owns it (no
/// row).
fn claim_sql() -> &'static str {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "INSERT INTO idempotency_records AS r \
             (scope, key, caller, fingerprint, state, lease_owner, lease_expires_at, step_key) \
         VALUES ($1, $2, $3, $4, 'started', $5, now() + make_interval(secs => $6), $7) \
         ON CONFLICT (scope, key) DO UPDATE SET \
             lease_owner = CASE WHEN {TAKEN_OVER} THEN EXCLUDED.lease_owner ELSE r.lease_owner END, \
             lease_expires_at = CASE WHEN {TAKEN_OVER} \
                 THEN EXCLUDED.lease_expires_at ELSE r.lease_expires_at END, \
             takeovers = r.takeovers + CASE WHEN {TAKEN_OVER} THEN 1 ELSE 0 END, \
             replays = r.replays + CASE WHEN r.state <> 'started' \
                 AND r.fingerprint = EXCLUDED.fingerprint THEN 1 ELSE 0 END \
         WHERE r.caller = EXCLUDED.caller \
         RETURNING (xmax = 0) AS inserted, r.state, r.fingerprint, r.reply, r.lease_owner, \
             r.step_key, r.error_code, r.error_message"
        )
    });
    &SQL
}

/// Phase 2's guard: the key, locked, while it is still ours.
const OWNED: &str = "SELECT 1 FROM idempotency_records \
    WHERE scope = $1 AND key = $2 AND state = 'started' AND lease_owner = $3 FOR UPDATE";

/// Phase 2's last statement, in the effect's transaction: the reply saved.
const FINISH: &str = "UPDATE idempotency_records SET state = 'finished', reply = $3, \
    lease_owner = NULL, lease_expires_at = NULL, finished_at = now() \
    WHERE scope = $1 AND key = $2";

/// Phase 2 for a refusal: the error saved, while the key is ours.
const FAIL: &str = "UPDATE idempotency_records SET state = 'failed', error_code = $4, \
    error_message = $5, lease_owner = NULL, lease_expires_at = NULL, finished_at = now() \
    WHERE scope = $1 AND key = $2 AND state = 'started' AND lease_owner = $3";

/// The owner's lease goes on.
const RENEW: &str = "UPDATE idempotency_records \
    SET lease_expires_at = now() + make_interval(secs => $4) \
    WHERE scope = $1 AND key = $2 AND state = 'started' AND lease_owner = $3";

/// The lease ends now, with no owner.
const RELEASE: &str = "UPDATE idempotency_records SET lease_expires_at = now(), lease_owner = NULL \
    WHERE scope = $1 AND key = $2 AND state = 'started' AND lease_owner = $3";

/// A look, writing nothing.
const LOOK: &str = "SELECT state, lease_expires_at <= now() AS expired FROM idempotency_records \
    WHERE scope = $1 AND key = $2";

/// The completer's take-over (see [`TakeOver`]).
const TAKE_OVER: &str = "\
UPDATE idempotency_records AS r SET lease_owner = $1, \
    lease_expires_at = now() + make_interval(secs => $2), takeovers = r.takeovers + 1 \
FROM (SELECT scope, key FROM idempotency_records \
      WHERE state = 'started' AND ( \
          (lease_owner IS NOT NULL AND lease_expires_at <= now() - make_interval(secs => $3)) \
       OR (lease_owner IS NULL AND lease_expires_at <= now() \
              - make_interval(secs => $5 * power(2, least(takeovers, 8))))) \
      ORDER BY lease_expires_at LIMIT $4 FOR UPDATE SKIP LOCKED) AS due \
WHERE r.scope = due.scope AND r.key = due.key \
RETURNING r.scope, r.key, r.fingerprint, r.step_key";

/// Why a [`PgKeys`] step failed.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// What Postgres (or the connection to it) said.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// No answer by the step's deadline (the connection is dropped with its transaction).
    #[error("the database did not answer in time")]
    Timeout,
    /// The effect refused the request (a constraint it would break): the key fails with
    /// this status, for good.
    #[error("{}", .0.message())]
    Refused(tonic::Status),
    /// A record this code cannot read (a state it does not know).
    #[error("an idempotency record cannot be read: {0}")]
    Corrupt(String),
}

impl Failure for PgError {
    fn is_transient(&self) -> bool {
        match self {
            PgError::Timeout => true,
            PgError::Database(error) => is_transient(error),
            PgError::Refused(_) | PgError::Corrupt(_) => false,
        }
    }

    fn fails_key(&self) -> Option<tonic::Status> {
        match self {
            PgError::Refused(status) => Some(status.clone()),
            _ => None,
        }
    }
}

/// Whether a database error may pass if the statement is tried again: the connection
/// lost, the server restarting or busy, a serialization failure or deadlock.
pub fn is_transient(error: &sqlx::Error) -> bool {
    use sqlx::Error as E;
    match error {
        E::Io(_) | E::Tls(_) | E::Protocol(_) | E::PoolTimedOut => true,
        E::Database(db) => {
            let code = db.code().unwrap_or_default();
            code.starts_with("08")
                || code.starts_with("57P")
                || code.starts_with("53")
                || code == "40001"
                || code == "40P01"
                || code == "25006"
        }
        _ => false,
    }
}

/// The service's effect, run in phase 2's transaction after the key's guard and before its
/// reply is saved: it writes what the call does to the service's own tables and returns the
/// reply to save, or refuses the request (`Err(PgError::Refused(..))`, the key then fails
/// for good with that status). It may run more than once if a commit's answer is lost and
/// phase 2 is tried again; only one run commits.
#[derive(Clone)]
pub struct PgEffect(Arc<EffectFn>);

/// The function inside a [`PgEffect`].
type EffectFn =
    dyn for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<Vec<u8>, PgError>> + Send + Sync;

impl PgEffect {
    /// An effect written by `effect` on the transaction's connection.
    pub fn new(
        effect: impl for<'c> Fn(&'c mut PgConnection) -> BoxFuture<'c, Result<Vec<u8>, PgError>>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self(Arc::new(effect))
    }

    /// No local effect: the reply alone is saved (the work's effect was elsewhere, under
    /// the step key).
    pub fn reply(reply: Vec<u8>) -> Self {
        Self::new(move |_| {
            let reply = reply.clone();
            Box::pin(async move { Ok(reply) })
        })
    }
}

impl std::fmt::Debug for PgEffect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PgEffect")
    }
}

/// Keys in [`SCHEMA`]'s table, over a [`PgPool`].
#[derive(Debug, Clone)]
pub struct PgKeys {
    pool: PgPool,
}

impl PgKeys {
    /// Keys kept through `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Runs [`SCHEMA`].
    pub async fn create_schema(&self) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(SCHEMA).execute(&self.pool).await.map(drop)
    }

    /// `work` on a pooled connection, bounded by `deadline`. A connection whose work was
    /// cut off is closed, never given back: its statement may still be running, or its
    /// transaction open. (Give the pool's sessions a server-side `statement_timeout` and
    /// `lock_timeout` under your deadlines too, so the server stops such work itself.)
    async fn bounded<T>(
        &self,
        deadline: Instant,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, PgError>,
    ) -> Result<T, PgError> {
        let mut conn = tokio::time::timeout_at(deadline, self.pool.acquire())
            .await
            .map_err(|_| PgError::Timeout)??;
        let done = tokio::time::timeout_at(deadline, work(&mut conn)).await;
        match done {
            Ok(Err(PgError::Database(error))) if !is_answer(&error) => {
                conn.close_on_drop();
                Err(PgError::Database(error))
            }
            Ok(result) => result,
            Err(_) => {
                conn.close_on_drop();
                Err(PgError::Timeout)
            }
        }
    }
}

/// Whether `error` is the server's answer to a statement (the session is in a known state)
/// rather than a failure of the connection itself.
fn is_answer(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(_) | sqlx::Error::RowNotFound)
}

/// A claimed record, as [`claim_sql`] returns it.
fn record(row: &PgRow) -> Result<Record<Vec<u8>, Vec<u8>>, PgError> {
    let state: String = row.try_get("state")?;
    let error = saved_error(row)?;
    Ok(Record {
        inserted: row.try_get("inserted")?,
        state: State::parse(&state).ok_or_else(|| PgError::Corrupt(format!("state {state:?}")))?,
        fingerprint: row.try_get("fingerprint")?,
        reply: row.try_get("reply")?,
        owner: row.try_get("lease_owner")?,
        step_key: row.try_get("step_key")?,
        error,
    })
}

impl Persistence for PgKeys {
    type Fingerprint = Vec<u8>;
    type Reply = Vec<u8>;
    type Effect = PgEffect;
    type Error = PgError;

    async fn claim(
        &self,
        claim: Claim<'_, Vec<u8>>,
    ) -> Result<Option<Record<Vec<u8>, Vec<u8>>>, PgError> {
        self.bounded(claim.deadline, async |conn| {
            let row = sqlx::query(sqlx::AssertSqlSafe(claim_sql()))
                .bind(claim.id.scope)
                .bind(claim.id.key)
                .bind(claim.caller)
                .bind(claim.fingerprint)
                .bind(claim.owner)
                .bind(claim.lease.as_secs_f64())
                .bind(claim.step_key)
                .fetch_optional(conn)
                .await?;
            row.as_ref().map(record).transpose()
        })
        .await
    }

    async fn finish(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        effect: &PgEffect,
        deadline: Instant,
    ) -> Result<Option<Vec<u8>>, PgError> {
        self.bounded(deadline, async |conn| {
            let mut tx = conn.begin().await?;
            let owned = sqlx::query(OWNED)
                .bind(id.scope)
                .bind(id.key)
                .bind(owner)
                .fetch_optional(&mut *tx)
                .await?;
            if owned.is_none() {
                return Ok(None);
            }
            let reply = (effect.0)(&mut tx).await?;
            sqlx::query(FINISH)
                .bind(id.scope)
                .bind(id.key)
                .bind(&reply)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(Some(reply))
        })
        .await
    }

    async fn fail(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        error: &tonic::Status,
        deadline: Instant,
    ) -> Result<bool, PgError> {
        self.bounded(deadline, async |conn| {
            let done = sqlx::query(FAIL)
                .bind(id.scope)
                .bind(id.key)
                .bind(owner)
                .bind(error.code() as i32)
                .bind(error.message())
                .execute(conn)
                .await?;
            Ok(done.rows_affected() > 0)
        })
        .await
    }

    async fn renew(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        lease: Duration,
        deadline: Instant,
    ) -> Result<bool, PgError> {
        self.bounded(deadline, async |conn| {
            let done = sqlx::query(RENEW)
                .bind(id.scope)
                .bind(id.key)
                .bind(owner)
                .bind(lease.as_secs_f64())
                .execute(conn)
                .await?;
            Ok(done.rows_affected() > 0)
        })
        .await
    }

    async fn release(&self, id: KeyId<'_>, owner: Uuid, deadline: Instant) -> Result<(), PgError> {
        self.bounded(deadline, async |conn| {
            sqlx::query(RELEASE)
                .bind(id.scope)
                .bind(id.key)
                .bind(owner)
                .execute(conn)
                .await?;
            Ok(())
        })
        .await
    }

    async fn look(&self, id: KeyId<'_>, deadline: Instant) -> Result<Look, PgError> {
        self.bounded(deadline, async |conn| {
            let row = sqlx::query(LOOK)
                .bind(id.scope)
                .bind(id.key)
                .fetch_optional(conn)
                .await?;
            Ok(look(row.as_ref())?)
        })
        .await
    }

    async fn take_over(
        &self,
        take: TakeOver,
        deadline: Instant,
    ) -> Result<Vec<Abandoned<Vec<u8>>>, PgError> {
        self.bounded(deadline, async |conn| {
            let rows = sqlx::query(TAKE_OVER)
                .bind(take.owner)
                .bind(take.lease.as_secs_f64())
                .bind(take.abandoned_after.as_secs_f64())
                .bind(take.batch)
                .bind(take.released_after.as_secs_f64())
                .fetch_all(conn)
                .await?;
            rows.iter()
                .map(|row| {
                    Ok(Abandoned {
                        scope: row.try_get("scope")?,
                        key: row.try_get("key")?,
                        fingerprint: row.try_get("fingerprint")?,
                        step_key: row.try_get("step_key")?,
                    })
                })
                .collect()
        })
        .await
    }
}

/// The error a failed key saved, from a row's `error_code` and `error_message` columns
/// (a persistence over its own tables may name them so and read them with this).
pub fn saved_error(row: &PgRow) -> Result<Option<SavedError>, sqlx::Error> {
    Ok(match row.try_get::<Option<i32>, _>("error_code")? {
        Some(code) => Some(SavedError {
            code,
            message: row
                .try_get::<Option<String>, _>("error_message")?
                .unwrap_or_default(),
        }),
        None => None,
    })
}

/// What a look's row says: `state` and `expired`, or no row.
pub fn look(row: Option<&PgRow>) -> Result<Look, sqlx::Error> {
    let Some(row) = row else {
        return Ok(Look::Gone);
    };
    let state: String = row.try_get("state")?;
    let expired: Option<bool> = row.try_get("expired")?;
    Ok(match State::parse(&state) {
        Some(State::Started) => Look::Started {
            expired: expired.unwrap_or(true),
        },
        _ => Look::Settled,
    })
}
