//! Retention: settled keys older than the retention window are deleted in small batches.

use super::*;

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
        let purge = async {
            let mut purged = 0;
            loop {
                // In a transaction of its own with a server-side statement timeout a little
                // under the client's bound, so a batch cut off here does not run on.
                let batch_done = async {
                    let server_ms = PURGE_STATEMENT_BOUND.as_millis() * 9 / 10;
                    let mut tx = conn
                        .get()
                        .begin_with(AssertSqlSafe(format!(
                            "BEGIN; SET LOCAL statement_timeout = {server_ms}"
                        )))
                        .await?;
                    let deleted = sqlx::query(PURGE_KEYS)
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
}
