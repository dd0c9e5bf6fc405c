//! The completer's step: take over the keys nobody came back for and finish them, so that
//! no charge stays half-done.

use super::*;

impl KeyStore {
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
}
