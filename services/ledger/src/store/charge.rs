//! A charge as the idempotency library's first user: the library runs the protocol
//! ([`idempotency::Phases`]: claim, the processor call with the lease renewed, the effect
//! and the reply recorded, waiting, resuming); this module is where the ledger keeps its
//! keys ([`Persistence`] over [`super::sql`]'s statements), what its fingerprint and saved
//! reply are (the amount; the charge's id and the balance after it), and the processor
//! call as the step between the phases.

use idempotency::{
    Abandoned, Claim, KeyId, Look, Outcome, Persistence, Record, State, Step, TakeOver,
};
use sqlx::postgres::PgRow;
use tokio::time::Instant;

use super::{reply::Recorded, *};

impl KeyStore {
    /// Charges `amount` to `account` once per `key`, in phases; see the module docs of
    /// [`super`]. `process` is the processor call, made with no transaction open and no
    /// connection held, when this request holds the key (claimed, or taken over to resume).
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
        let amount = amount.get();
        let outcome = self
            .phases
            .run(
                self,
                idempotency::Request {
                    id: KeyId {
                        scope: account.as_str(),
                        key: key.as_str(),
                    },
                    caller: caller.as_str(),
                    fingerprint: &amount,
                    step_key: processor_key,
                    deadline: deadline.instant(),
                    in_flight,
                },
                |step| charge_id_once_charged(process(processor_charge(step))),
            )
            .await?;
        let saved = |recorded: Recorded| SavedReply {
            charge_id: recorded.charge_id,
            account_id: account.as_str().to_owned(),
            amount_cents: amount,
            balance_cents: recorded.balance_cents,
        };
        Ok(match outcome {
            Outcome::Executed(recorded) => ChargeOutcome::Executed(saved(recorded)),
            Outcome::Replayed(recorded) => ChargeOutcome::Replayed(saved(recorded)),
        })
    }

    /// Resumes up to `batch` keys nobody came back for (see [`TAKE_OVER`]): each taken
    /// over, its processor called again under its own processor key and amount, then
    /// finished, failed or released. Returns how many were taken over.
    pub async fn complete_abandoned<F, Fut>(
        &self,
        batch: i64,
        process: F,
    ) -> Result<usize, StoreError>
    where
        F: Fn(ProcessorCharge) -> Fut,
        Fut: Future<Output = Result<(), tonic::Status>>,
    {
        self.phases
            .complete_abandoned(self, batch, |step| {
                charge_id_once_charged(process(processor_charge(step)))
            })
            .await
    }

    /// [`StoreOptions::skip_key_claim`]: the key's record deleted unless a request holds
    /// it — the bug the chaos checker must catch.
    async fn forget_key(&self, id: KeyId<'_>, deadline: Deadline) -> Result<(), StoreError> {
        self.with_connection(deadline, async |conn, rt| {
            rt.bound(
                "forgetting the key (--test-skip-key-claim)",
                sqlx::query(
                    "DELETE FROM idempotency_keys \
                     WHERE account_id = $1 AND idempotency_key = $2 AND state <> 'started'",
                )
                .bind(id.scope)
                .bind(id.key)
                .execute(conn),
            )
            .await?;
            Ok(())
        })
        .await
    }
}

/// The processor call for a key: under the processor key saved with its claim, for the
/// amount bound to it.
fn processor_charge(step: Step<i64>) -> ProcessorCharge {
    ProcessorCharge {
        key: step.step_key,
        amount_cents: step.fingerprint,
    }
}

/// The processor's call, then the id the charge is to be recorded under: chosen once the
/// processor charged, and kept however often phase 2 is tried (a try whose commit was lost
/// and a later one cannot both insert it: the charge row's primary key).
async fn charge_id_once_charged(
    call: impl Future<Output = Result<(), tonic::Status>>,
) -> Result<Uuid, tonic::Status> {
    call.await.map(|()| Uuid::new_v4())
}

/// A key's row as [`CLAIM`] returns it.
fn record(row: &PgRow) -> Result<Record<i64, Recorded>, StoreError> {
    let reply = match (
        row.try_get::<Option<Uuid>, _>("charge_id")?,
        row.try_get::<Option<i64>, _>("balance_cents")?,
    ) {
        (Some(charge_id), Some(balance_cents)) => Some(Recorded {
            charge_id,
            balance_cents,
        }),
        _ => None,
    };
    let error = idempotency::postgres::saved_error(row)?;
    let state: String = row.try_get("state")?;
    Ok(Record {
        inserted: row.try_get("inserted")?,
        state: State::parse(&state).ok_or_else(|| {
            StoreError::Database(sqlx::Error::Protocol(format!(
                "an idempotency key in an unknown state {state:?}"
            )))
        })?,
        fingerprint: row.try_get("request_amount_cents")?,
        reply,
        owner: row.try_get("lease_owner")?,
        step_key: row.try_get("processor_key")?,
        error,
    })
}

/// The ledger's keys: [`super::sql`]'s statements on the store's pool, each under the
/// round-trip bound. A claim and a look wait for a connection behind the charges under
/// way; every write after the processor call goes ahead of them
/// (`KeyStore::finishing`).
impl Persistence for KeyStore {
    type Fingerprint = i64;
    type Reply = Recorded;
    /// The charge's id.
    type Effect = Uuid;
    type Error = StoreError;

    async fn claim(
        &self,
        claim: Claim<'_, i64>,
    ) -> Result<Option<Record<i64, Recorded>>, StoreError> {
        if self.skip_key_claim {
            self.forget_key(claim.id, Deadline::at(claim.deadline))
                .await?;
        }
        self.with_connection(Deadline::at(claim.deadline), async |conn, rt| {
            let row = rt
                .bound(
                    "claiming the key",
                    sqlx::query(CLAIM)
                        .bind(claim.id.scope)
                        .bind(claim.id.key)
                        .bind(*claim.fingerprint)
                        .bind(claim.owner)
                        .bind(claim.lease.as_secs_f64())
                        .bind(claim.step_key)
                        .bind(claim.caller)
                        .fetch_optional(&mut *conn)
                        .instrument(
                            tracing::info_span!(target: resilience::TRACE_ONLY, "claim_key"),
                        ),
                )
                .await?;
            let record = row.as_ref().map(record).transpose()?;
            // A settled key's outcome is about to be replayed: answered only once a standby
            // has it (the replay's own write is past its commit).
            if record
                .as_ref()
                .is_some_and(|r| !r.inserted && !matches!(r.state, State::Started))
            {
                self.confirm_copied(conn, rt).await?;
            }
            Ok(record)
        })
        .await
    }

    async fn finish(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        &charge_id: &Uuid,
        deadline: Instant,
    ) -> Result<Option<Recorded>, StoreError> {
        let balance = self
            .finishing(Deadline::at(deadline), async |conn, rt| {
                let balance = rt
                    .bound(
                        "recording the charge",
                        sqlx::query_scalar::<_, i64>(FINISH)
                            .bind(id.scope)
                            .bind(id.key)
                            .bind(owner)
                            .bind(charge_id)
                            .fetch_optional(&mut *conn)
                            .instrument(tracing::info_span!(
                                target: resilience::TRACE_ONLY,
                                "record_charge"
                            )),
                    )
                    .await?;
                if balance.is_some() {
                    self.confirm_copied(conn, rt).await?;
                }
                Ok(balance)
            })
            .await?;
        Ok(balance.map(|balance_cents| Recorded {
            charge_id,
            balance_cents,
        }))
    }

    async fn fail(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        error: &tonic::Status,
        deadline: Instant,
    ) -> Result<bool, StoreError> {
        let failed = self
            .finishing(Deadline::at(deadline), async |conn, rt| {
                let failed = rt
                    .bound(
                        "saving the processor's refusal",
                        sqlx::query(FAIL)
                            .bind(id.scope)
                            .bind(id.key)
                            .bind(owner)
                            .bind(error.code() as i32)
                            .bind(error.message())
                            .execute(&mut *conn),
                    )
                    .await?;
                if failed.rows_affected() > 0 {
                    self.confirm_copied(conn, rt).await?;
                }
                Ok(failed)
            })
            .await?;
        Ok(failed.rows_affected() > 0)
    }

    async fn renew(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        lease: Duration,
        deadline: Instant,
    ) -> Result<bool, StoreError> {
        let renewed = self
            .finishing(Deadline::at(deadline), async |conn, rt| {
                rt.bound(
                    "renewing the key's lease",
                    sqlx::query(RENEW)
                        .bind(id.scope)
                        .bind(id.key)
                        .bind(owner)
                        .bind(lease.as_secs_f64())
                        .execute(conn),
                )
                .await
            })
            .await?;
        Ok(renewed.rows_affected() > 0)
    }

    async fn release(
        &self,
        id: KeyId<'_>,
        owner: Uuid,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        self.finishing(Deadline::at(deadline), async |conn, rt| {
            rt.bound(
                "releasing the key",
                sqlx::query(RELEASE)
                    .bind(id.scope)
                    .bind(id.key)
                    .bind(owner)
                    .execute(conn),
            )
            .await
            .map(drop)
        })
        .await
    }

    async fn look(&self, id: KeyId<'_>, deadline: Instant) -> Result<Look, StoreError> {
        self.with_connection(Deadline::at(deadline), async |conn, rt| {
            let row = rt
                .bound(
                    "looking at a running key",
                    sqlx::query(LOOK)
                        .bind(id.scope)
                        .bind(id.key)
                        .fetch_optional(conn),
                )
                .await?;
            Ok(idempotency::postgres::look(row.as_ref())?)
        })
        .await
    }

    async fn take_over(
        &self,
        take: TakeOver,
        deadline: Instant,
    ) -> Result<Vec<Abandoned<i64>>, StoreError> {
        self.with_connection(Deadline::at(deadline), async |conn, rt| {
            let rows = rt
                .bound(
                    "taking over abandoned keys",
                    sqlx::query(TAKE_OVER)
                        .bind(take.owner)
                        .bind(take.lease.as_secs_f64())
                        .bind(take.abandoned_after.as_secs_f64())
                        .bind(take.batch)
                        .bind(take.released_after.as_secs_f64())
                        .fetch_all(conn),
                )
                .await?;
            rows.iter()
                .map(|row| {
                    Ok(Abandoned {
                        scope: row.try_get("account_id")?,
                        key: row.try_get("idempotency_key")?,
                        fingerprint: row.try_get("request_amount_cents")?,
                        step_key: row.try_get("processor_key")?,
                    })
                })
                .collect()
        })
        .await
    }
}
