//! The processor's own record: what a provider keeps on its side, one row per processor
//! key with the amount it was first charged with and how often it was called. It stands for
//! another system's database, so it has its own connections (sessions named
//! `retrychain-processor`, on the primary it follows itself), its own statements and its
//! own purge; it knows nothing of the ledger's keys. The `processor_charges` table lives in
//! the ledger's database for want of a second one (its migration is the ledger's).

use std::time::Duration;

use resilience::Deadline;
use tonic::Status;

use crate::{
    database::{Database, DatabaseOptions, PurgeError, purge_in_batches},
    pool::{AcquireError, Queue},
    store::{ProcessorCharge, StoreError},
};

/// A call recorded: inserted, or for a repeat counted. Returns the amount the key was first
/// charged with.
const RECORD: &str = "\
INSERT INTO processor_charges (processor_key, amount_cents) VALUES ($1, $2) \
ON CONFLICT (processor_key) DO UPDATE \
SET calls = processor_charges.calls + 1, last_call_at = now() \
RETURNING amount_cents";

/// The purge: records older than the retention window, oldest first, a batch at a time.
const PURGE: &str = "\
DELETE FROM processor_charges WHERE ctid IN ( \
    SELECT ctid FROM processor_charges \
    WHERE first_call_at < now() - make_interval(secs => $1) \
    ORDER BY first_call_at LIMIT $2)";

/// The longest one purge batch may take; the server cancels it a little earlier.
const PURGE_BATCH_BOUND: Duration = Duration::from_secs(60);

/// How the processor reaches its record.
#[derive(Debug, Clone, Copy)]
pub struct RecordOptions {
    /// Connections at most.
    pub pool_size: usize,
    /// Longest wait for a connection while none comes back.
    pub acquire_timeout: Duration,
    /// Longest one opening may take.
    pub connect_timeout: Duration,
    /// The bound on one round trip.
    pub round_trip_timeout: Duration,
}

/// The processor's record; see the module docs.
#[derive(Debug, Clone)]
pub struct ProcessorRecord {
    database: Database,
    options: RecordOptions,
}

impl ProcessorRecord {
    /// Connects to the primary of `database_url` with connections of its own.
    pub async fn open(database_url: &str, options: RecordOptions) -> anyhow::Result<Self> {
        let database = Database::open(
            database_url,
            DatabaseOptions {
                application_name: "retrychain-processor",
                pool_size: options.pool_size,
                connect_timeout: options.connect_timeout,
                round_trip_timeout: options.round_trip_timeout,
            },
        )
        .await?;
        Ok(Self { database, options })
    }

    /// Records a call under `call.key` (see [`RECORD`]), waiting for a connection within
    /// `deadline`; the amount the key was first charged with. A record that could not be
    /// written is the provider unreachable: UNAVAILABLE (the key is released for a retry).
    pub async fn record(&self, call: &ProcessorCharge, deadline: Deadline) -> Result<i64, Status> {
        let unreachable = |why: String| {
            Status::unavailable(format!(
                "payment processor unreachable: its record could not be written ({why})"
            ))
        };
        let mut conn = self
            .database
            .pool
            .acquire(
                deadline.instant(),
                self.options.acquire_timeout,
                Queue::Front,
            )
            .await
            .map_err(|error| unreachable(acquire_failure(error)))?;
        let bound = self.options.round_trip_timeout;
        let answer = tokio::time::timeout(
            bound,
            crate::database::statement(
                "recording the processor's call",
                bound,
                sqlx::query_scalar::<_, i64>(RECORD)
                    .bind(&call.key)
                    .bind(call.amount_cents)
                    .fetch_one(conn.get()),
            ),
        )
        .await;
        let result = match answer {
            Ok(Ok(amount)) => Ok(amount),
            Ok(Err(error)) => Err(self.noted(error)),
            Err(_) => {
                // A server that does not answer may be a primary that moved or froze.
                self.database.primary.suspect();
                Err(format!("no answer within {bound:?}"))
            }
        };
        // Only an answered statement leaves the connection in a known state.
        conn.settle(result.is_ok());
        result.map_err(unreachable)
    }

    /// Deletes records older than `retention`, `batch` rows per statement (see
    /// [`purge_in_batches`]); returns how many went.
    pub async fn purge_older_than(&self, retention: Duration, batch: i64) -> anyhow::Result<u64> {
        let by = tokio::time::Instant::now() + self.options.acquire_timeout;
        let mut conn = self
            .database
            .pool
            .acquire(by, self.options.acquire_timeout, Queue::Back)
            .await
            .map_err(|error| anyhow::anyhow!(acquire_failure(error)))?;
        let result = purge_in_batches(conn.get(), PURGE, retention, batch, PURGE_BATCH_BOUND)
            .await
            .map_err(|error| match error {
                PurgeError::Database(error) => anyhow::anyhow!(self.noted(error)),
                slow => anyhow::anyhow!(slow),
            });
        // A batch cut off may leave its transaction open on the server: closed, not reused.
        conn.settle(result.is_ok());
        result
    }

    /// What a failure suggests, passed on as the key store does: a lost connection makes
    /// the pool's others suspect, and any unavailability may mean the primary moved.
    fn noted(&self, error: sqlx::Error) -> String {
        let text = error.to_string();
        match StoreError::from(error) {
            StoreError::Lost(_) => {
                self.database.pool.connection_lost();
                self.database.primary.suspect();
            }
            StoreError::Unavailable(_) => self.database.primary.suspect(),
            _ => {}
        }
        text
    }
}

/// Why no connection could be had, in words.
fn acquire_failure(error: AcquireError) -> String {
    match error {
        AcquireError::Busy => "every connection stayed busy".to_owned(),
        AcquireError::CannotOpen(error) | AcquireError::Refused(error) => error.to_string(),
    }
}
