//! Why a database step failed, classified once: the ledger's service maps each
//! [`StoreError`] to one status, and the store decides from it whether a connection is
//! still to be trusted. Also the bound on one round trip, which makes an unanswered
//! statement one of these errors.

use std::time::Duration;

use prometheus_client::metrics::histogram::Histogram;
use tonic::Code;

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
    /// The outcome committed on the primary, but no standby is connected, or none confirmed
    /// having it within the round-trip bound (down, catching up, a failover under way):
    /// a success a failover could take back is not answered. For the caller as
    /// [`StoreError::Unavailable`]: the retry with the same key replays the outcome once a
    /// standby has it — or, if a failover lost it, charges it, once.
    #[error("the outcome committed on the primary, but {0}; retry with the same idempotency key")]
    NotCopied(String),
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
    pub(super) fn leaves_connection_in_doubt(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable(_) | StoreError::Lost(_) | StoreError::Database(_)
        )
    }
}

/// How the idempotency phases treat a store error: a database that did not answer, lost a
/// connection or was busy may answer a moment later (phase 2 is tried again, briefly); a
/// balance that cannot take the charge fails its key for good.
impl idempotency::Failure for StoreError {
    fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable(_) | StoreError::Lost(_) | StoreError::Busy(_)
        )
    }

    fn fails_key(&self) -> Option<tonic::Status> {
        matches!(self, StoreError::BalanceOverflow)
            .then(|| tonic::Status::out_of_range(StoreError::BalanceOverflow.to_string()))
    }
}

/// What the idempotency phases came to, as the ledger says it: the fingerprint is the amount.
impl From<idempotency::Error<i64, StoreError>> for StoreError {
    fn from(error: idempotency::Error<i64, StoreError>) -> Self {
        use idempotency::Error as E;
        match error {
            E::Reused { saved, requested } => StoreError::KeyReused { saved, requested },
            E::ScopeRefused => StoreError::NotOwner,
            E::InFlight => StoreError::InFlight,
            E::DeadlineWhileWaiting(what) => StoreError::DeadlineWhileWaiting(what),
            E::Step(status) => StoreError::Processor(status),
            E::Failed(saved) => StoreError::Failed {
                code: Code::from_i32(saved.code),
                message: saved.message,
            },
            E::NoReply => StoreError::Database(sqlx::Error::Protocol(
                "a finished idempotency key has no saved reply".into(),
            )),
            E::Store(error) => error,
        }
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

/// The bound on one database round trip, by this process's clock.
#[derive(Debug, Clone, Copy)]
pub(super) struct RoundTrip<'g> {
    /// [`StoreOptions::round_trip_timeout`](super::StoreOptions::round_trip_timeout).
    pub(super) limit: Duration,
    /// Where each round trip's time goes.
    pub(super) times: &'g Histogram,
}

impl RoundTrip<'_> {
    /// `work`, one round trip named `what`, or UNAVAILABLE once the bound has passed
    /// without an answer (the caller's [`Checkout`](crate::pool::Checkout) then closes the connection).
    pub(super) async fn bound<T, E: Into<StoreError>>(
        self,
        what: &'static str,
        work: impl Future<Output = Result<T, E>>,
    ) -> Result<T, StoreError> {
        let started = tokio::time::Instant::now();
        let answer = tokio::time::timeout(
            self.limit,
            crate::database::statement(what, self.limit, work),
        )
        .await;
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

/// Whether `error` is Postgres's `lock_not_available` (a `lock_timeout`).
pub(super) fn is_lock_timeout(error: &sqlx::Error) -> bool {
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
}
