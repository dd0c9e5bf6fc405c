//! Reads: an account's balance for `GetAccount`.

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
}
