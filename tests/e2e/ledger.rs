//! The ledger on its own, through its gRPC port, on real Postgres: exactly-once charges
//! under lost replies, duplicates, races, bad input and retention.

use std::time::{Duration, Instant};

use crate::support::*;
use retrychain_proto::v1::{
    ChargeReply, Faults, GetAccountRequest, GetStatsRequest, control_client::ControlClient,
    payments_client::PaymentsClient,
};
use tonic::{Code, transport::Channel};

const T: Duration = Duration::from_secs(10);

struct Ledger {
    _service: InProcessService,
    url: String,
    payments: PaymentsClient<Channel>,
    control: ControlClient<Channel>,
}

async fn ledger(configure: impl FnOnce(&mut LedgerArgs)) -> Ledger {
    let (service, url) = start_ledger(configure).await;
    Ledger {
        payments: PaymentsClient::new(connect(&service.addr.url).await),
        control: ControlClient::new(connect(&service.addr.admin_url).await),
        _service: service,
        url,
    }
}

impl Ledger {
    /// Charges `amount` to `account` under `key`, with the tests' 10 s deadline.
    async fn charge(
        &self,
        account: &str,
        amount: i64,
        key: Option<&str>,
    ) -> Result<tonic::Response<ChargeReply>, tonic::Status> {
        let request = charge(account, amount, key, T, &[]);
        self.payments.clone().charge(request).await
    }

    async fn faults(&self, faults: Faults) {
        self.control.clone().set_faults(faults).await.unwrap();
    }
    async fn executions(&self) -> u64 {
        self.control
            .clone()
            .get_stats(GetStatsRequest {})
            .await
            .unwrap()
            .into_inner()
            .executions
    }
    async fn bottom_calls(&self) -> u64 {
        bottom_calls(&self.control).await
    }

    /// A charge in a task of its own, to be in flight while the test goes on.
    fn spawn_charge(
        &self,
        account: &'static str,
        key: &str,
    ) -> tokio::task::JoinHandle<Result<tonic::Response<ChargeReply>, tonic::Status>> {
        let (client, key) = (self.payments.clone(), key.to_owned());
        tokio::spawn(async move { charge_on(&client, account, 500, Some(&key), T).await })
    }
    /// Waits until the processor has been called `n` times: the first request then holds
    /// its key (the processor is called after the claim), whatever the machine's load.
    async fn until_bottom_calls(&self, n: u64) {
        let start = Instant::now();
        while self.bottom_calls().await < n {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the processor was never called"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn balance(&self, account: &str) -> Option<(i64, i64)> {
        match self
            .payments
            .clone()
            .get_account(GetAccountRequest {
                account_id: account.into(),
            })
            .await
        {
            Ok(r) => Some((r.get_ref().balance_cents, r.get_ref().charges)),
            Err(s) if s.code() == Code::NotFound => None,
            Err(s) => panic!("{s:?}"),
        }
    }
}

#[tokio::test]
async fn a_lost_reply_retried_with_the_same_key_charges_once() {
    let l = ledger(|_| {}).await;
    let key = new_key();
    l.faults(losing_replies(1.0)).await;

    let lost = l.charge("alice", 500, Some(&key)).await;
    assert_eq!(lost.expect_err("reply dropped").code(), Code::Unavailable);

    l.faults(faults()).await;
    let retry = l.charge("alice", 500, Some(&key)).await.expect("retry");
    assert_eq!(header(&retry, IDEMPOTENT_REPLAYED).as_deref(), Some("true"));
    let pool = sqlx::PgPool::connect(&l.url).await.unwrap();
    let committed: uuid::Uuid = sqlx::query_scalar("SELECT charge_id FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        retry.get_ref().charge_id,
        committed.to_string(),
        "the retry got the original charge's reply"
    );
    assert_eq!(retry.get_ref().balance_cents, 500);
    assert_eq!(l.executions().await, 1);
    assert_eq!(l.balance("alice").await, Some((500, 1)));
}

#[tokio::test]
async fn a_lost_reply_retried_with_a_fresh_key_charges_twice() {
    let l = ledger(|_| {}).await;
    l.faults(losing_replies(1.0)).await;
    let lost = l.charge("bob", 500, Some(&new_key())).await;
    assert_eq!(lost.expect_err("reply dropped").code(), Code::Unavailable);
    l.faults(faults()).await;
    let retry = l.charge("bob", 500, Some(&new_key())).await.expect("retry");
    assert_eq!(header(&retry, IDEMPOTENT_REPLAYED), None);
    assert_eq!(l.executions().await, 2);
    assert_eq!(l.balance("bob").await, Some((1000, 2)));
}

#[tokio::test]
async fn the_same_key_with_another_amount_is_refused_and_changes_nothing() {
    let l = ledger(|_| {}).await;
    let key = new_key();
    l.charge("carol", 500, Some(&key)).await.expect("first");
    let status = l
        .charge("carol", 900, Some(&key))
        .await
        .expect_err("different parameters");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status
            .message()
            .contains("reused with different parameters"),
        "{}",
        status.message()
    );
    assert_eq!(l.balance("carol").await, Some((500, 1)));
    assert_eq!(l.executions().await, 1);
}

#[tokio::test]
async fn concurrent_requests_with_one_key_execute_once() {
    let l = ledger(|_| {}).await;
    l.faults(delayed(200)).await;
    let key = new_key();
    let (c1, c2) = (l.payments.clone(), l.payments.clone());
    let start = Instant::now();
    let (a, b) = tokio::join!(
        charge_on(&c1, "dave", 500, Some(&key), T),
        charge_on(&c2, "dave", 500, Some(&key), T),
    );
    let elapsed = start.elapsed();
    let (a, b) = (a.expect("first"), b.expect("second"));
    println!("two concurrent charges with one key and a 200 ms processor: {elapsed:?}");
    assert_eq!(a.get_ref().charge_id, b.get_ref().charge_id);
    assert_eq!(l.executions().await, 1);
    let replayed = [&a, &b]
        .iter()
        .filter(|r| header(r, IDEMPOTENT_REPLAYED).is_some())
        .count();
    assert_eq!(replayed, 1, "one executed, one replayed");

    let key = new_key();
    let calls = (0..50).map(|_| {
        let client = l.payments.clone();
        let key = key.clone();
        async move { charge_on(&client, "erin", 700, Some(&key), T).await }
    });
    let replies = futures::future::join_all(calls).await;
    let ids: std::collections::HashSet<String> = replies
        .into_iter()
        .map(|r| r.expect("every duplicate succeeds").into_inner().charge_id)
        .collect();
    assert_eq!(ids.len(), 1, "all 50 got the same charge");
    assert_eq!(l.balance("erin").await, Some((700, 1)));
    assert_eq!(l.executions().await, 2);
}

#[tokio::test]
async fn in_flight_reject_answers_aborted_while_the_first_commits() {
    let l = ledger(|l| l.in_flight = InFlightArg::Reject).await;
    l.faults(delayed(500)).await;
    let key = new_key();
    let first = l.spawn_charge("frank", &key);
    l.until_bottom_calls(1).await;
    let second = l.charge("frank", 500, Some(&key)).await;
    assert_eq!(second.expect_err("in flight").code(), Code::Aborted);
    first.await.unwrap().expect("the first commits");
    assert_eq!(l.executions().await, 1);
    let after = l.charge("frank", 500, Some(&key)).await.expect("replay");
    assert_eq!(header(&after, IDEMPOTENT_REPLAYED).as_deref(), Some("true"));
}

#[tokio::test]
async fn in_flight_wait_is_bounded_by_the_waiters_deadline() {
    let l = ledger(|_| {}).await;
    l.faults(delayed(2000)).await;
    let key = new_key();
    let first = l.spawn_charge("gina", &key);
    l.until_bottom_calls(1).await;
    let short = Duration::from_millis(400);
    let waiter = charge_on(&l.payments, "gina", 500, Some(&key), short).await;
    assert_eq!(waiter.expect_err("gave up").code(), Code::DeadlineExceeded);
    assert!(
        !first.is_finished(),
        "the waiter gave up at its own deadline, while the first was still running"
    );
    first.await.unwrap().expect("the first commits");
    assert_eq!(l.executions().await, 1);
}

#[tokio::test]
async fn keys_are_scoped_per_account() {
    let l = ledger(|_| {}).await;
    let key = new_key();
    let a = l.charge("henry", 500, Some(&key)).await.unwrap();
    let b = l.charge("irene", 500, Some(&key)).await.unwrap();
    assert_ne!(a.get_ref().charge_id, b.get_ref().charge_id);
    assert_eq!(header(&b, IDEMPOTENT_REPLAYED), None);
    assert_eq!(l.executions().await, 2);
}

#[tokio::test]
async fn bad_input_is_invalid_argument_and_writes_nothing() {
    let l = ledger(|_| {}).await;
    let long_key = "k".repeat(256);
    let long_account = "a".repeat(65);
    let cases: Vec<(&str, tonic::Request<_>)> = vec![
        ("no key", charge("jack", 500, None, T, &[])),
        ("empty key", charge("jack", 500, Some(""), T, &[])),
        ("key over 255", charge("jack", 500, Some(&long_key), T, &[])),
        (
            "key with a space",
            charge("jack", 500, Some("two words"), T, &[]),
        ),
        ("empty account", charge("", 500, Some("k1"), T, &[])),
        (
            "account over 64",
            charge(&long_account, 500, Some("k1"), T, &[]),
        ),
        ("zero amount", charge("jack", 0, Some("k1"), T, &[])),
        ("negative amount", charge("jack", -5, Some("k1"), T, &[])),
        (
            "amount over the maximum",
            charge("jack", 1_000_000_000_001, Some("k1"), T, &[]),
        ),
        (
            "malformed grpc-timeout",
            charge("jack", 500, Some("k1"), T, &[(TIMEOUT_HEADER, "soon")]),
        ),
        (
            "nine-digit grpc-timeout",
            charge(
                "jack",
                500,
                Some("k1"),
                T,
                &[(TIMEOUT_HEADER, "100000000m")],
            ),
        ),
        (
            "unknown retry mode",
            charge("jack", 500, Some("k1"), T, &[(RETRY_MODE, "sometimes")]),
        ),
    ];
    for (what, request) in cases {
        let status = l.payments.clone().charge(request).await.expect_err(what);
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
    }
    assert_eq!(l.bottom_calls().await, 0, "no processor call for bad input");
    assert_eq!(row_counts(&l.url).await, (0, 0, 0));
    // The largest valid amount is accepted.
    l.charge("jack", 1_000_000_000_000, Some("k1"))
        .await
        .expect("max amount");
}

#[tokio::test]
async fn a_failing_processor_commits_nothing_and_retries_only_in_every_layer_mode() {
    let l = ledger(|l| {
        l.service.backoff_base_ms = 1;
        l.service.backoff_cap_ms = 5;
    })
    .await;
    l.faults(failing()).await;
    let status = l
        .payments
        .clone()
        .charge(charge(
            "kate",
            500,
            Some(&new_key()),
            T,
            &[(RETRY_MODE, "every-layer")],
        ))
        .await
        .expect_err("processor down");
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("3 attempts"),
        "{}",
        status.message()
    );
    assert_eq!(l.bottom_calls().await, 3, "max-attempts processor calls");

    let status = l.charge("kate", 500, Some(&new_key())).await;
    assert_eq!(
        status.expect_err("processor down").code(),
        Code::Unavailable
    );
    assert_eq!(l.bottom_calls().await, 4, "edge-only: one processor call");
    assert_eq!(
        row_counts(&l.url).await,
        (0, 0, 2),
        "nothing charged; the two keys claimed, left started for a retry to resume"
    );
    let pool = sqlx::PgPool::connect(&l.url).await.unwrap();
    let released: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys \
         WHERE state = 'started' AND lease_expires_at <= now() AND lease_owner IS NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        released, 2,
        "each released at once: a retry resumes it without waiting"
    );
}

#[tokio::test]
async fn a_key_past_retention_is_purged_and_charges_anew() {
    let l = ledger(|l| {
        l.key_retention = Duration::from_secs(1);
        l.service.max_deadline_ms = 1000;
        l.service.default_deadline_ms = 1000;
    })
    .await;
    let key = new_key();
    l.charge("liam", 500, Some(&key)).await.expect("first");
    let replay = l.charge("liam", 500, Some(&key)).await.expect("replay");
    assert_eq!(
        header(&replay, IDEMPOTENT_REPLAYED).as_deref(),
        Some("true")
    );

    // The processor keeps its record through sessions of its own, not the key store's.
    let pool = sqlx::PgPool::connect(&l.url).await.unwrap();
    let processor_sessions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'retrychain-processor'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(processor_sessions >= 1, "{processor_sessions}");
    // The key, and the processor's own record of its call (purged by the processor's own
    // connections, on the same window).
    let start = Instant::now();
    loop {
        let records: i64 = sqlx::query_scalar("SELECT count(*) FROM processor_charges")
            .fetch_one(&pool)
            .await
            .unwrap();
        if row_counts(&l.url).await.2 == 0 && records == 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the key or the processor's record was never purged"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A new request under the old key, with another amount: neither the ledger nor the
    // processor remembers the first.
    let again = l.charge("liam", 700, Some(&key)).await.expect("new charge");
    assert_eq!(header(&again, IDEMPOTENT_REPLAYED), None);
    assert_eq!(l.balance("liam").await, Some((1200, 2)));
}

#[tokio::test]
async fn the_longest_grpc_timeout_is_served_and_breaks_nothing() {
    let l = ledger(|_| {}).await;
    for i in 0..40 {
        let reply = l
            .payments
            .clone()
            .charge(charge(
                "mona",
                100,
                Some(&format!("long-{i}")),
                T,
                &[(TIMEOUT_HEADER, "99999999H")],
            ))
            .await;
        assert!(reply.is_ok(), "{reply:?}");
    }
    assert_eq!(l.balance("mona").await, Some((4000, 40)));
}

#[tokio::test]
async fn set_faults_needs_fault_injection() {
    let url = database().await;
    let mut command = ServiceCommand::defaults("ledger", &url).unwrap();
    command.service_mut().listen = Some("127.0.0.1:0".parse().unwrap());
    let service = InProcessService::start("ledger", command).await.unwrap();
    let mut control = ControlClient::new(connect(&service.addr.admin_url).await);
    let status = control.set_faults(failing()).await.expect_err("refused");
    assert_eq!(status.code(), Code::PermissionDenied);
    let stats = control
        .get_stats(GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.service, "ledger");
}

#[test]
fn a_key_retention_shorter_than_the_longest_deadline_is_refused_at_start() {
    let output = std::process::Command::new(BIN)
        .args(["ledger", "--listen", "127.0.0.1:0", "--key-retention", "0s"])
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--key-retention 0s is shorter than --max-deadline-ms 300000"),
        "{stderr}"
    );
}
