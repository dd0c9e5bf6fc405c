//! Crashes: a ledger killed (SIGKILL) while the processor works leaves its key started
//! (claimed, nothing charged), and the retry after its restart resumes it and charges
//! exactly once.

use std::time::Duration;

use crate::support::*;
use tonic::Code;

#[tokio::test]
async fn a_ledger_killed_mid_charge_loses_nothing_and_charges_once_on_retry() {
    let mut chain = Chain::spawn(Options::processes()).await;
    let database_url = chain.database_url.clone().unwrap();
    let account = new_account();
    let key = new_key();
    // The processor call comes after the key is claimed (phase 1, committed).
    chain.set_faults(LEDGER, delayed(3000)).await;

    let edge = chain.edge().await;
    let in_flight = {
        let (account, key) = (account.clone(), key.clone());
        tokio::spawn(async move {
            charge_on(&edge, &account, 500, Some(&key), Duration::from_secs(20)).await
        })
    };
    // Wait until the processor is running: the key is claimed.
    let start = std::time::Instant::now();
    while chain.stats(LEDGER).await.downstream_attempts < 1 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the charge never reached the processor"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        row_counts(&database_url).await,
        (0, 0, 1),
        "the key is claimed, nothing charged"
    );
    chain.services[LEDGER].crash().await;

    let status = in_flight.await.unwrap().expect_err("the ledger died");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(
        status_header(&status, IDEMPOTENCY_KEY).as_deref(),
        Some(key.as_str()),
        "the client learns the key to retry with"
    );
    assert_eq!(
        row_counts(&database_url).await,
        (0, 0, 1),
        "the key stays claimed (started), nothing charged"
    );

    chain.services[LEDGER].restart().await.unwrap();
    let retry = chain
        .charge(&account, 500, Some(&key), Duration::from_secs(20), &[])
        .await
        .expect("the retry resumes the charge once the dead owner's lease passed");
    assert_eq!(
        header(&retry, IDEMPOTENT_REPLAYED),
        None,
        "the first attempt never finished"
    );
    let again = chain
        .charge(&account, 500, Some(&key), Duration::from_secs(20), &[])
        .await
        .unwrap();
    assert_eq!(header(&again, IDEMPOTENT_REPLAYED).as_deref(), Some("true"));
    assert_eq!(again.get_ref().charge_id, retry.get_ref().charge_id);
    assert_eq!(chain.account(&account).await, Some((500, 1)));
    assert_eq!(row_counts(&database_url).await, (1, 1, 1));
}

#[tokio::test]
async fn a_relay_killed_and_restarted_is_retried_around() {
    let mut chain = Chain::spawn(Options::processes()).await;
    let account = new_account();
    chain.services[2].crash().await;
    let status = chain
        .charge(&account, 500, None, Duration::from_secs(5), &[])
        .await;
    let status = status.expect_err("hop3 is down");
    assert_eq!(status.code(), Code::Unavailable);
    let key = status_header(&status, IDEMPOTENCY_KEY).expect("key returned on failure");

    chain.services[2].restart().await.unwrap();
    let reply = chain
        .charge(&account, 500, Some(&key), Duration::from_secs(5), &[])
        .await
        .expect("hop3 is back");
    assert_eq!(reply.get_ref().balance_cents, 500);
    assert_eq!(chain.account(&account).await, Some((500, 1)));
}
