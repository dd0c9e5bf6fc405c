//! The key store: idempotency keys, charges and balances in Postgres.
//!
//! # One transaction per charge
//!
//! ```text
//! BEGIN; SET LOCAL lock_timeout = <time left>      -- one round trip
//! INSERT INTO idempotency_keys … ON CONFLICT DO NOTHING    -- claim the key
//!   claimed:   processor call(s), then one statement that updates the balance,
//!              inserts the charge and saves the reply on the key row; COMMIT
//!   conflict:  SELECT the saved reply; compare parameters; replay or refuse
//! ```
//!
//! The claim is what makes concurrent duplicates safe: a second transaction inserting the
//! same (account, key) blocks on the first one's uncommitted row until it commits (the
//! second then conflicts and replays the saved reply) or rolls back (the second then claims
//! the key and charges). `lock_timeout` bounds that wait by the request's own deadline.
//! Because the key, the effect and the reply commit together, a crash at any point leaves
//! either all of them or none: a retry after a lost reply replays, a retry after a crash
//! charges afresh.

use std::{str::FromStr, time::Duration};

use resilience::Deadline;
use retrychain_node::{AccountId, AmountCents, IdempotencyKey};
use sqlx::{
    AssertSqlSafe, PgPool, Row,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use uuid::Uuid;

/// Migrations, applied at start-up.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

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
    /// Refuse at once with ABORTED, Stripe-style.
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
    /// The deadline ran out waiting for a connection or for a same-key request to finish.
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
    /// Anything else the database said.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

/// Postgres access for the ledger.
#[derive(Debug, Clone)]
pub struct KeyStore {
    /// Connections. `test_before_acquire` is off: a broken connection fails its statement
    /// anyway, and the ping would cost a round trip before every charge (sqlx still pings
    /// each connection when it is released, off the request path).
    pool: PgPool,
}

impl KeyStore {
    /// Connects with a pool of `pool_size` and applies the migrations.
    pub async fn connect(database_url: &str, pool_size: u32) -> anyhow::Result<Self> {
        use anyhow::Context;
        let options = PgConnectOptions::from_str(database_url)
            .context("parsing the database URL")?
            // Custom plans: a generic plan cached while the key table was empty (say after a
            // retention purge) can pick a sequential scan and keep it.
            .options([("plan_cache_mode", "force_custom_plan")]);
        let pool = PgPoolOptions::new()
            .max_connections(pool_size)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .context("connecting to Postgres")?;
        MIGRATOR
            .run(&pool)
            .await
            .context("applying the ledger's migrations")?;
        Ok(Self { pool })
    }

    /// The pool, for tests and tools that inspect the tables.
    pub fn pool(&self) -> &PgPool {
        &self.pool
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
        // Waits for locks end at the deadline: at least 1 ms (0 would mean "no limit"), at
        // most what Postgres accepts (a 1000-hour grpc-timeout would otherwise fail BEGIN).
        let lock_ms = deadline.remaining().as_millis().clamp(1, i32::MAX as u128);
        let begin = format!("BEGIN; SET LOCAL lock_timeout = {lock_ms}");
        let mut tx = tokio::time::timeout_at(
            deadline.instant(),
            self.pool.begin_with(AssertSqlSafe(begin)),
        )
        .await
        .map_err(|_| StoreError::DeadlineWhileWaiting("waiting for a database connection"))??;

        if in_flight == InFlight::Reject {
            // A transaction-scoped advisory lock on (account, key) tells "someone is running
            // this key" without waiting. Two keys whose hashes collide can only cause a
            // spurious ABORTED, which the caller retries.
            let free: bool =
                sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext($1), hashtext($2))")
                    .bind(account.as_str())
                    .bind(key.as_str())
                    .fetch_one(&mut *tx)
                    .await?;
            if !free {
                return Err(StoreError::InFlight);
            }
        }

        let claimed = sqlx::query(
            "INSERT INTO idempotency_keys (account_id, idempotency_key, request_amount_cents) \
             VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
        )
        .bind(account.as_str())
        .bind(key.as_str())
        .bind(amount.get())
        .execute(&mut *tx)
        .await
        .map_err(waited_too_long)?
        .rows_affected()
            == 1;

        if !claimed {
            let row = sqlx::query(
                "SELECT request_amount_cents, charge_id, balance_cents FROM idempotency_keys \
                 WHERE account_id = $1 AND idempotency_key = $2",
            )
            .bind(account.as_str())
            .bind(key.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::Purged)?;
            let saved: i64 = row.try_get("request_amount_cents")?;
            if saved != amount.get() {
                return Err(StoreError::KeyReused {
                    saved,
                    requested: amount.get(),
                });
            }
            let (Some(charge_id), Some(balance_cents)) = (
                row.try_get::<Option<Uuid>, _>("charge_id")?,
                row.try_get::<Option<i64>, _>("balance_cents")?,
            ) else {
                return Err(StoreError::Database(sqlx::Error::Protocol(
                    "a committed idempotency key has no saved reply".into(),
                )));
            };
            return Ok(ChargeOutcome::Replayed(SavedReply {
                charge_id,
                account_id: account.as_str().to_owned(),
                amount_cents: saved,
                balance_cents,
            }));
        }

        process().await.map_err(StoreError::Processor)?;

        let charge_id = Uuid::new_v4();
        let balance_cents: i64 = sqlx::query_scalar(
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
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some("22003") => {
                StoreError::BalanceOverflow
            }
            _ => waited_too_long(e),
        })?;
        tx.commit().await?;
        Ok(ChargeOutcome::Executed(SavedReply {
            charge_id,
            account_id: account.as_str().to_owned(),
            amount_cents: amount.get(),
            balance_cents,
        }))
    }

    /// An account's balance and number of charges; `None` if it was never charged.
    pub async fn account(&self, account: &AccountId) -> Result<Option<(i64, i64)>, StoreError> {
        let row = sqlx::query("SELECT balance_cents, charges FROM accounts WHERE account_id = $1")
            .bind(account.as_str())
            .fetch_optional(&self.pool)
            .await?;
        row.map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .transpose()
    }

    /// Deletes keys older than `retention`, `batch` rows per statement so no single
    /// statement holds many locks; returns how many went.
    pub async fn purge_keys_older_than(
        &self,
        retention: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let mut purged = 0;
        loop {
            let deleted = sqlx::query(
                "DELETE FROM idempotency_keys WHERE ctid IN ( \
                     SELECT ctid FROM idempotency_keys \
                     WHERE created_at < now() - make_interval(secs => $1) \
                     ORDER BY created_at LIMIT $2)",
            )
            .bind(retention.as_secs_f64())
            .bind(batch)
            .execute(&self.pool)
            .await?
            .rows_affected();
            purged += deleted;
            if deleted < batch as u64 {
                return Ok(purged);
            }
        }
    }
}

/// A lock wait cut short by `lock_timeout` (our deadline) is a deadline, not a failure.
fn waited_too_long(error: sqlx::Error) -> StoreError {
    match &error {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03") => {
            StoreError::DeadlineWhileWaiting("waiting for a request with the same key to finish")
        }
        _ => StoreError::Database(error),
    }
}
