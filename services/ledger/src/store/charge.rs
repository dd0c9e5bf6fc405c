//! The charge protocol: phase 1 (claim the key), the processor called with no transaction
//! open and the lease renewed meanwhile, phase 2 (the effect and the reply together), and
//! what a request does when it finds its key running or settled.

use super::*;

impl KeyStore {
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
    pub(super) async fn forget_key(&self, charge: &Charge<'_>) -> Result<(), StoreError> {
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
    pub(super) async fn claim(&self, charge: &Charge<'_>) -> Result<Claim, StoreError> {
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
    pub(super) async fn holding_lease<Fut>(
        &self,
        charge: &Charge<'_>,
        call: Fut,
    ) -> Option<Processed>
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
    pub(super) async fn wait_while_running(
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
    pub(super) async fn settle_phase_two(
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
    pub(super) async fn fail(
        &self,
        charge: &Charge<'_>,
        status: &tonic::Status,
    ) -> Result<bool, StoreError> {
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
    pub(super) fn stale<T>(&self) -> Option<T> {
        self.gauges.stale_owner.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "the key was taken over while this request held it (its lease passed): it writes nothing more; the new owner settles it"
        );
        None
    }
}
