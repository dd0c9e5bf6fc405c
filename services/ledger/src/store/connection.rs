//! Connections for one step: taken from the pool within the request's deadline (charges
//! under way first), every round trip bounded, and a failure that says the primary moved
//! passed on to whoever follows it.

use super::*;

impl KeyStore {
    /// `work` on a pooled connection taken within `deadline` (see [`Self::acquire`]),
    /// under the round-trip bound; the connection goes back if the work ended in a known
    /// state, and is closed otherwise.
    pub(super) async fn with_connection<T>(
        &self,
        deadline: Deadline,
        work: impl AsyncFnOnce(&mut PgConnection, RoundTrip<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.with_connection_from(deadline, Queue::Back, work).await
    }

    /// [`Self::with_connection`] for a charge under way (its key claimed: the lease
    /// renewed, the processor's record, the outcome recorded): ahead of the charges
    /// waiting to start, which hold nothing yet.
    pub(super) async fn finishing<T>(
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

    pub(super) async fn with_connection_from<T>(
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
    pub(super) async fn acquire(
        &self,
        deadline: Deadline,
        queue: Queue,
    ) -> Result<Checkout, StoreError> {
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
    pub(super) fn noted(&self, error: StoreError) -> StoreError {
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
