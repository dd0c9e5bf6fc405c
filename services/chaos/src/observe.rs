//! Reading back what the run left: the database's charges, accounts and the processor's
//! record under the run's id, and the ledgers' count of processor conflicts.

use std::time::Duration;

use anyhow::Context;
use retrychain_proto::v1::{GetStatsRequest, control_client::ControlClient};
use sqlx::{Connection, PgConnection};
use tonic::transport::Channel;

use crate::check::{AccountRow, ChargeRow, Observed, ProcessorRow};

/// Reads the rows of the run `run` from the database at `database_url` (retrying for up to
/// a minute: it may still be failing over), and sums the conflicts of `ledgers`.
pub async fn observe(
    database_url: &str,
    run: &str,
    ledgers: &[ControlClient<Channel>],
) -> anyhow::Result<Observed> {
    let started = tokio::time::Instant::now();
    let mut observed = loop {
        match read(database_url, run).await {
            Ok(observed) => break observed,
            Err(error) if started.elapsed() < Duration::from_secs(60) => {
                eprintln!("chaos: reading the database: {error:#}; again in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(error) => return Err(error),
        }
    };
    for ledger in ledgers {
        let mut ledger = ledger.clone();
        if let Ok(Ok(stats)) =
            tokio::time::timeout(Duration::from_secs(5), ledger.get_stats(GetStatsRequest {})).await
        {
            observed.processor_conflicts += stats.get_ref().processor_conflicts;
        }
    }
    Ok(observed)
}

async fn read(database_url: &str, run: &str) -> anyhow::Result<Observed> {
    let mut conn =
        tokio::time::timeout(Duration::from_secs(10), PgConnection::connect(database_url))
            .await
            .context("connecting to the database: no answer in 10 s")?
            .context("connecting to the database")?;
    // The run's id holds only letters, digits and '-': no LIKE pattern characters.
    let accounts = format!("{run}-%");
    let charges: Vec<(String, String, String, i64, i64)> = sqlx::query_as(
        "SELECT charge_id::text, account_id, idempotency_key, amount_cents, balance_cents \
         FROM charges WHERE account_id LIKE $1",
    )
    .bind(&accounts)
    .fetch_all(&mut conn)
    .await
    .context("reading the charges")?;
    let account_rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT account_id, balance_cents, charges FROM accounts WHERE account_id LIKE $1",
    )
    .bind(&accounts)
    .fetch_all(&mut conn)
    .await
    .context("reading the accounts")?;
    // A processor key is `<length of the account>:<account>:<key>`.
    let processor: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT processor_key, amount_cents, calls FROM processor_charges \
         WHERE strpos(processor_key, $1) > 0",
    )
    .bind(format!(":{run}-"))
    .fetch_all(&mut conn)
    .await
    .context("reading the processor's record")?;
    let _ = conn.close().await;
    Ok(Observed {
        charges: charges
            .into_iter()
            .map(
                |(charge_id, account, key, amount_cents, balance_cents)| ChargeRow {
                    charge_id,
                    account,
                    key,
                    amount_cents,
                    balance_cents,
                },
            )
            .collect(),
        accounts: account_rows
            .into_iter()
            .map(|(account, balance_cents, charges)| AccountRow {
                account,
                balance_cents,
                charges,
            })
            .collect(),
        processor: processor
            .into_iter()
            .map(|(processor_key, amount_cents, calls)| ProcessorRow {
                processor_key,
                amount_cents,
                calls,
            })
            .collect(),
        processor_conflicts: 0,
    })
}
