//! Retention: settled keys older than the retention window are deleted in small batches.

use super::*;
use crate::database::{PurgeError, purge_in_batches};

/// One batch of the purge: settled keys older than the window, oldest first.
const PURGE_KEYS: &str = "DELETE FROM idempotency_keys WHERE ctid IN ( \
    SELECT ctid FROM idempotency_keys \
    WHERE created_at < now() - make_interval(secs => $1) AND state <> 'started' \
    ORDER BY created_at LIMIT $2)";

impl KeyStore {
    /// Deletes keys older than `retention`, `batch` rows per statement so no single
    /// statement holds many locks; returns how many went. Each statement is bounded by
    /// [`PURGE_STATEMENT_BOUND`] (past it, UNAVAILABLE and the connection closed), so a
    /// stalled database does not hold the purge, or its connection, for good. A key still
    /// started is left to the completer.
    pub async fn purge_keys_older_than(
        &self,
        retention: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let mut conn = self
            .acquire(Deadline::after(self.acquire_timeout), Queue::Back)
            .await?;
        let result = purge_in_batches(
            conn.get(),
            PURGE_KEYS,
            retention,
            batch,
            PURGE_STATEMENT_BOUND,
        )
        .await
        .map_err(|error| match error {
            PurgeError::Database(error) => StoreError::from(error),
            slow @ PurgeError::TooSlow(_) => StoreError::Unavailable(slow.to_string()),
        });
        // Any failure here (a batch cut off, a statement refused) may leave the batch's
        // transaction open on the server: the connection is closed, not given back.
        conn.settle(result.is_ok());
        result.map_err(|error| self.noted(error))
    }
}
