//! Atomic phases: the processor is called with no transaction open and no connection
//! held, a key is bound to its parameters from its first attempt, and a charge cut off
//! between the phases — by its deadline, a killed or frozen ledger, a restarted Postgres —
//! is resumed, by a retry or by the completer, and charged once, the processor called under
//! one key with one set of parameters.

use std::time::{Duration, Instant};

use crate::support::*;
use retrychain_proto::v1::{Faults, payments_client::PaymentsClient};
use tonic::Code;

/// The processor's record of `key` on `account`: (amount it was first charged with,
/// calls), if it was called.
async fn processor_record(url: &str, account: &str, key: &str) -> Option<(i64, i64)> {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let processor_key = format!("{}:{account}:{key}", account.len());
    let row = sqlx::query_as(
        "SELECT amount_cents, calls FROM processor_charges WHERE processor_key = $1",
    )
    .bind(processor_key)
    .fetch_optional(&pool)
    .await
    .unwrap();
    pool.close().await;
    row
}

/// The key's state column.
async fn key_state(url: &str, account: &str, key: &str) -> Option<String> {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let state = sqlx::query_scalar(
        "SELECT state FROM idempotency_keys WHERE account_id = $1 AND idempotency_key = $2",
    )
    .bind(account)
    .bind(key)
    .fetch_optional(&pool)
    .await
    .unwrap();
    pool.close().await;
    state
}

/// Charges of `key` on `account`.
async fn charges_of(url: &str, account: &str, key: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM charges WHERE account_id = $1 AND idempotency_key = $2",
    )
    .bind(account)
    .bind(key)
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.close().await;
    n
}

/// Waits until the processor has charged `key` (its record is there).
async fn until_processor_called(url: &str, account: &str, key: &str) {
    let start = Instant::now();
    while processor_record(url, account, key).await.is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the processor was never called"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The red team's deadline cut: a charge of 300 under key K cut off by its 1 s deadline
/// after the processor was called; a request under K with 301 while it is cut off, and
/// after. Each is FAILED_PRECONDITION, nothing is charged twice, and the processor saw K
/// with 300 only.
#[tokio::test]
async fn a_key_is_bound_to_its_parameters_from_its_first_attempt() {
    let (ledger, url) = start_ledger(|_| {}).await;
    let control = retrychain_proto::v1::control_client::ControlClient::new(
        connect(&ledger.addr.admin_url).await,
    );
    // The processor answers at once; the ledger then holds 2 s before phase 2.
    control
        .clone()
        .set_faults(Faults {
            finish_delay_ms: 2000,
            ..Faults::default()
        })
        .await
        .unwrap();
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let (account, key) = (new_account(), new_key());
    let cut = charge_on(&client, &account, 300, Some(&key), Duration::from_secs(1))
        .await
        .expect_err("cut off by its deadline");
    assert_eq!(cut.code(), Code::DeadlineExceeded, "{cut:?}");
    assert_eq!(processor_record(&url, &account, &key).await, Some((300, 1)));
    assert_eq!(
        key_state(&url, &account, &key).await.as_deref(),
        Some("started")
    );
    // While the first attempt is still between its phases:
    let other = charge_on(&client, &account, 301, Some(&key), Duration::from_secs(5))
        .await
        .expect_err("another amount under the same key");
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    assert!(
        other.message().contains("different parameters"),
        "{other:?}"
    );
    // Once it finished (the spawned charge goes on past its caller's deadline):
    let start = Instant::now();
    while key_state(&url, &account, &key).await.as_deref() != Some("finished") {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the charge never finished"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    control.clone().set_faults(Faults::default()).await.unwrap();
    let again = charge_on(&client, &account, 301, Some(&key), Duration::from_secs(5))
        .await
        .expect_err("still another amount");
    assert_eq!(again.code(), Code::FailedPrecondition);
    let replay = charge_on(&client, &account, 300, Some(&key), Duration::from_secs(5))
        .await
        .expect("the same amount replays");
    assert_eq!(
        header(&replay, IDEMPOTENT_REPLAYED).as_deref(),
        Some("true")
    );
    assert_eq!(charges_of(&url, &account, &key).await, 1);
    assert_eq!(processor_record(&url, &account, &key).await, Some((300, 1)));
    let stats = control
        .clone()
        .get_stats(retrychain_proto::v1::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.processor_conflicts, 0);
}

/// A processor call cut off by the deadline before it charged, then another amount: the
/// key was bound at the claim, so FAILED_PRECONDITION; then the first amount resumes and
/// charges once.
#[tokio::test]
async fn a_key_whose_first_attempt_never_reached_the_processor_is_bound_too() {
    let (ledger, url) = start_ledger(|_| {}).await;
    let control = retrychain_proto::v1::control_client::ControlClient::new(
        connect(&ledger.addr.admin_url).await,
    );
    control.clone().set_faults(delayed(3000)).await.unwrap();
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let (account, key) = (new_account(), new_key());
    let cut = charge_on(
        &client,
        &account,
        300,
        Some(&key),
        Duration::from_millis(500),
    )
    .await
    .expect_err("cut off by its deadline");
    assert_eq!(cut.code(), Code::DeadlineExceeded, "{cut:?}");
    control.clone().set_faults(Faults::default()).await.unwrap();
    let other = charge_on(&client, &account, 301, Some(&key), Duration::from_secs(5))
        .await
        .expect_err("another amount");
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    charge_on(&client, &account, 300, Some(&key), Duration::from_secs(10))
        .await
        .expect("the first amount resumes");
    assert_eq!(charges_of(&url, &account, &key).await, 1);
    let (amount, _) = processor_record(&url, &account, &key).await.unwrap();
    assert_eq!(amount, 300);
}

/// The processor refuses a charge for good (here: FAILED_PRECONDITION, as a card declined):
/// the key ends failed with that error, and a repeat gets the error replayed, not a new
/// charge.
#[tokio::test]
async fn a_refusal_for_good_is_saved_and_replayed() {
    let (ledger, url) = start_ledger(|_| {}).await;
    let control = retrychain_proto::v1::control_client::ControlClient::new(
        connect(&ledger.addr.admin_url).await,
    );
    control
        .clone()
        .set_faults(failing_with(Code::PermissionDenied))
        .await
        .unwrap();
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let (account, key) = (new_account(), new_key());
    let first = charge_on(&client, &account, 300, Some(&key), Duration::from_secs(5))
        .await
        .expect_err("refused");
    assert_eq!(first.code(), Code::PermissionDenied, "{first:?}");
    control.clone().set_faults(Faults::default()).await.unwrap();
    let repeat = charge_on(&client, &account, 300, Some(&key), Duration::from_secs(5))
        .await
        .expect_err("the saved error");
    assert_eq!(repeat.code(), Code::PermissionDenied, "{repeat:?}");
    assert_eq!(
        status_header(&repeat, IDEMPOTENT_REPLAYED).as_deref(),
        Some("true")
    );
    assert_eq!(
        key_state(&url, &account, &key).await.as_deref(),
        Some("failed")
    );
    assert_eq!(charges_of(&url, &account, &key).await, 0);
}

/// SIGKILL of the ledger after the processor answered and before phase 2, then a retry
/// with the same key: one charge, the processor called under one key with one amount, and
/// the reply replayed consistently afterwards.
#[tokio::test]
async fn a_ledger_killed_between_the_phases_is_resumed_by_the_retry() {
    let url = database().await;
    let mut ledger = spawn_ledger_on(&url).await;
    let admin = retrychain_proto::v1::control_client::ControlClient::new(
        connect(&ledger.addr.admin_url).await,
    );
    admin
        .clone()
        .set_faults(Faults {
            finish_delay_ms: 5000,
            ..Faults::default()
        })
        .await
        .unwrap();
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let (account, key) = (new_account(), new_key());
    let first = {
        let (client, account, key) = (client.clone(), account.clone(), key.clone());
        tokio::spawn(async move {
            charge_on(&client, &account, 500, Some(&key), Duration::from_secs(20)).await
        })
    };
    until_processor_called(&url, &account, &key).await;
    ledger.crash().await;
    assert!(
        first.await.unwrap().is_err(),
        "the ledger died under the call"
    );
    assert_eq!(
        key_state(&url, &account, &key).await.as_deref(),
        Some("started")
    );
    ledger.restart().await.unwrap();
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let retry = charge_on(&client, &account, 500, Some(&key), Duration::from_secs(20))
        .await
        .expect("the retry resumes the charge");
    let again = charge_on(&client, &account, 500, Some(&key), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(header(&again, IDEMPOTENT_REPLAYED).as_deref(), Some("true"));
    assert_eq!(again.get_ref().charge_id, retry.get_ref().charge_id);
    assert_eq!(charges_of(&url, &account, &key).await, 1);
    assert_eq!(
        processor_record(&url, &account, &key).await,
        Some((500, 2)),
        "called twice under one key, with one amount"
    );
    ledger.stop().await;
}

/// The same kill with no retry: the completer of the restarted ledger finishes the
/// charge on its own.
#[tokio::test]
async fn a_charge_nobody_comes_back_for_is_finished_by_the_completer() {
    let url = database().await;
    let mut ledger = spawn_ledger_on(&url).await;
    let admin = retrychain_proto::v1::control_client::ControlClient::new(
        connect(&ledger.addr.admin_url).await,
    );
    admin
        .clone()
        .set_faults(Faults {
            finish_delay_ms: 5000,
            ..Faults::default()
        })
        .await
        .unwrap();
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let (account, key) = (new_account(), new_key());
    let first = {
        let (client, account, key) = (client.clone(), account.clone(), key.clone());
        tokio::spawn(async move {
            charge_on(&client, &account, 700, Some(&key), Duration::from_secs(20)).await
        })
    };
    until_processor_called(&url, &account, &key).await;
    ledger.crash().await;
    let _ = first.await;
    ledger.restart().await.unwrap();
    let start = Instant::now();
    while key_state(&url, &account, &key).await.as_deref() != Some("finished") {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the completer never finished it"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(charges_of(&url, &account, &key).await, 1);
    assert_eq!(processor_record(&url, &account, &key).await, Some((700, 2)));
    // The completer logs after it committed: its line may reach the pipe a moment later.
    let start = Instant::now();
    while !ledger.log().contains("completer resumed an abandoned key") {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the completer says what it did"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ledger.stop().await;
}

/// Two ledger instances on one database. The first is frozen (SIGSTOP) after its processor
/// call, for longer than the lease; a request under the same key at the second takes the
/// key over and charges; the first wakes and writes nothing. One charge.
#[tokio::test]
async fn a_frozen_owner_is_taken_over_and_its_phase_two_refused() {
    let url = database().await;
    let a = spawn_ledger_on(&url).await;
    let b = spawn_ledger_on(&url).await;
    let admin_a =
        retrychain_proto::v1::control_client::ControlClient::new(connect(&a.addr.admin_url).await);
    admin_a
        .clone()
        .set_faults(Faults {
            finish_delay_ms: 3000,
            ..Faults::default()
        })
        .await
        .unwrap();
    let (account, key) = (new_account(), new_key());
    let at_a = {
        let client = PaymentsClient::new(connect(&a.addr.url).await);
        let (account, key) = (account.clone(), key.clone());
        tokio::spawn(async move {
            charge_on(&client, &account, 900, Some(&key), Duration::from_secs(30)).await
        })
    };
    until_processor_called(&url, &account, &key).await;
    a.signal("STOP").await.unwrap();
    // Longer than the lease (2 s): the key is free to take over.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let at_b = PaymentsClient::new(connect(&b.addr.url).await);
    let reply = charge_on(&at_b, &account, 900, Some(&key), Duration::from_secs(10))
        .await
        .expect("the second instance takes the key over and charges");
    a.signal("CONT").await.unwrap();
    // A, awake, finds the key taken and replays B's outcome to its own caller.
    let from_a = at_a.await.unwrap().expect("A's caller gets the outcome");
    assert_eq!(from_a.get_ref().charge_id, reply.get_ref().charge_id);
    assert_eq!(charges_of(&url, &account, &key).await, 1);
    assert_eq!(
        processor_record(&url, &account, &key).await.map(|r| r.0),
        Some(900)
    );
    let stats_a = admin_a
        .clone()
        .get_stats(retrychain_proto::v1::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        stats_a.stale_owner_refusals >= 1,
        "A was told the key was taken: {stats_a:?}"
    );
    a.stop().await;
    b.stop().await;
}

/// Postgres restarted between the phases: the charge is recorded once it is back (the
/// owner tries phase 2 again), or resumed by the retry; one charge either way.
#[tokio::test]
async fn postgres_restarted_between_the_phases_charges_once() {
    let _one = crate::load::ONE_AT_A_TIME.lock().await;
    let cluster = own_cluster().await;
    let url = cluster.url("postgres");
    let (ledger, _) = start_ledger_on(&url, |_| {}).await;
    let admin = retrychain_proto::v1::control_client::ControlClient::new(
        connect(&ledger.addr.admin_url).await,
    );
    admin
        .clone()
        .set_faults(Faults {
            finish_delay_ms: 1500,
            ..Faults::default()
        })
        .await
        .unwrap();
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let (account, key) = (new_account(), new_key());
    let first = {
        let (client, account, key) = (client.clone(), account.clone(), key.clone());
        tokio::spawn(async move {
            charge_on(&client, &account, 400, Some(&key), Duration::from_secs(20)).await
        })
    };
    until_processor_called(&url, &account, &key).await;
    let cluster = restart_postgres(cluster).await;
    admin.clone().set_faults(Faults::default()).await.unwrap();
    let _ = first.await.unwrap();
    let mut tries = 0;
    let reply = loop {
        tries += 1;
        match charge_on(&client, &account, 400, Some(&key), Duration::from_secs(20)).await {
            Ok(reply) => break reply,
            Err(status) if tries < 10 && status.code() == Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    };
    assert_eq!(reply.get_ref().amount_cents, 400);
    assert_eq!(charges_of(&url, &account, &key).await, 1);
    assert_eq!(
        processor_record(&url, &account, &key).await.map(|r| r.0),
        Some(400)
    );
    drop(cluster);
}

/// The key sent only as `idempotency-key-bin` (as gRPC clients send binary metadata),
/// twice, or empty: INVALID_ARGUMENT at the edge, nothing charged — never a fresh key made
/// up instead.
#[tokio::test]
async fn other_spellings_of_the_key_are_refused_and_charge_nothing() {
    let chain = Chain::spawn(Options::default()).await;
    let account = new_account();
    let edge = chain.edge().await;
    let mut binary = charge(&account, 100, None, Duration::from_secs(5), &[]);
    binary.metadata_mut().insert_bin(
        "idempotency-key-bin",
        tonic::metadata::MetadataValue::from_bytes(b"order-1"),
    );
    let refused = edge.clone().charge(binary).await.expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let mut twice = charge(&account, 100, Some("k-1"), Duration::from_secs(5), &[]);
    twice
        .metadata_mut()
        .append("idempotency-key", "k-2".parse().unwrap());
    let refused = edge.clone().charge(twice).await.expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let mut other_name = charge(&account, 100, None, Duration::from_secs(5), &[]);
    other_name
        .metadata_mut()
        .insert("x-idempotency-key", "k-3".parse().unwrap());
    let refused = edge.clone().charge(other_name).await.expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(chain.account(&account).await, None, "nothing was charged");
}
