//! Reads: an account's balance for `GetAccount`, and the simulated processor's own record
//! of a charge.

use super::*;

impl KeyStore {
    /// An account's balance and number of charges; `None` if it was never charged (an
    /// account is made by its first charge's claim, so it may exist with none yet); for
    /// another caller's account, [`StoreError::NotOwner`].
    pub async fn account(
        &self,
        caller: &Caller,
        account: &AccountId,
        deadline: Deadline,
    ) -> Result<Option<(i64, i64)>, StoreError> {
        let row = self
            .with_connection(deadline, async |conn, rt| {
                let row = rt
                    .bound(
                        "reading the account",
                        sqlx::query(
                            "SELECT balance_cents, charges, owner FROM accounts WHERE account_id = $1",
                        )
                        .bind(account.as_str())
                        .fetch_optional(conn),
                    )
                    .await?;
                Ok(row
                    .map(|row| {
                        Ok::<_, sqlx::Error>((
                            row.try_get::<i64, _>(0)?,
                            row.try_get::<i64, _>(1)?,
                            row.try_get::<String, _>(2)?,
                        ))
                    })
                    .transpose()?)
            })
            .await?;
        match row {
            Some((_, _, owner)) if owner != caller.as_str() => Err(StoreError::NotOwner),
            Some((_, 0, _)) | None => Ok(None),
            Some((balance, charges, _)) => Ok(Some((balance, charges))),
        }
    }

    /// What the simulated processor keeps (see `processor.rs`): its record of a call under
    /// `charge.key`, inserted or, for a repeat, counted. Returns the amount the key was
    /// first charged with.
    pub async fn processor_record(
        &self,
        charge: &ProcessorCharge,
        deadline: Deadline,
    ) -> Result<i64, StoreError> {
        self.finishing(deadline, async |conn, rt| {
            rt.bound(
                "the processor's record",
                sqlx::query_scalar::<_, i64>(
                    "INSERT INTO processor_charges (processor_key, amount_cents) VALUES ($1, $2) \
                     ON CONFLICT (processor_key) DO UPDATE \
                     SET calls = processor_charges.calls + 1, last_call_at = now() \
                     RETURNING amount_cents",
                )
                .bind(&charge.key)
                .bind(charge.amount_cents)
                .fetch_one(conn),
            )
            .await
        })
        .await
    }
}
