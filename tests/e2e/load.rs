//! The load the fault tests put on a chain, and the invariant they check after it: charges
//! under fresh keys from closed-loop workers ([`Load`]) or in one batch ([`send_keys`]),
//! each remembered with what its client saw ([`Sent`]); then every key re-sent and the
//! database checked ([`resend_and_check`], [`assert_exactly_once`]).

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use crate::support::*;
use futures::StreamExt;
use retrychain_proto::v1::payments_client::PaymentsClient;
use tonic::{Code, transport::Channel};

/// The deadline of each charge in the load.
pub const LOAD_DEADLINE: Duration = Duration::from_secs(5);

/// The tests that load a chain and time its recovery run one at a time, so that two of
/// them do not share the two cores and measure each other.
pub static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One charge the load sent: its key, and what the client saw.
#[derive(Debug, Clone)]
pub struct Sent {
    pub account: String,
    pub key: String,
    pub amount: i64,
    pub code: Code,
    /// The status message, when the call failed.
    pub message: String,
    /// When the call was made and how long it took.
    pub started: Instant,
    pub took: Duration,
}

impl Sent {
    /// Charges `amount` to `account` under a fresh key, once; what happened.
    pub async fn charge(client: &PaymentsClient<Channel>, account: String, amount: i64) -> Sent {
        let key = new_key();
        let started = Instant::now();
        let (code, message) =
            match charge_on(client, &account, amount, Some(&key), LOAD_DEADLINE).await {
                Ok(_) => (Code::Ok, String::new()),
                Err(status) => (status.code(), status.message().to_owned()),
            };
        Sent {
            account,
            key,
            amount,
            code,
            message,
            started,
            took: started.elapsed(),
        }
    }
}

/// Charges under fresh keys from a few closed-loop workers until stopped.
pub struct Load {
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<Vec<Sent>>>,
}

impl Load {
    pub fn start(edge: &str, workers: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let accounts: Vec<String> = (0..4).map(|_| new_account()).collect();
        let workers = (0..workers)
            .map(|w| {
                let stop = Arc::clone(&stop);
                let edge = edge.to_owned();
                let accounts = accounts.clone();
                tokio::spawn(async move {
                    let channel = tonic::transport::Endpoint::from_shared(edge)
                        .unwrap()
                        .connect_lazy();
                    let client = PaymentsClient::new(channel);
                    let mut sent = Vec::new();
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let account = accounts[(w + i) % accounts.len()].clone();
                        let amount = 100 + (i as i64 % 900);
                        sent.push(Sent::charge(&client, account, amount).await);
                        i += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    sent
                })
            })
            .collect();
        Load { stop, workers }
    }

    pub async fn finish(self) -> Vec<Sent> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for worker in self.workers {
            all.extend(worker.await.unwrap());
        }
        all
    }
}

/// Sends `count` charges under fresh keys, `concurrency` at a time, each once.
pub async fn send_keys(edge: &str, count: usize, concurrency: usize) -> Vec<Sent> {
    let client = PaymentsClient::new(connect(edge).await);
    let accounts: Vec<String> = (0..4).map(|_| new_account()).collect();
    futures::stream::iter(0..count)
        .map(|i| {
            let client = client.clone();
            let account = accounts[i % accounts.len()].clone();
            async move { Sent::charge(&client, account, 100 + i as i64).await }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await
}

/// How long after `at` the first charge sent from then on was answered OK, if one was.
pub fn first_success_after(sent: &[Sent], at: Instant) -> Option<Duration> {
    sent.iter()
        .filter(|s| s.started >= at && s.code == Code::Ok)
        .map(|s| s.started + s.took - at)
        .min()
}

/// Re-sends every key once the fault is over, then checks the invariant in the database.
/// A re-send the edge refuses as overloaded is sent again once its pushback has passed, as
/// an A6 client would: after a fault the edge trusts its estimate only as deep as it has
/// measured it again (docs/overload.md), and refuses a burst past that depth.
pub async fn resend_and_check(edge: &str, database_url: &str, sent: &[Sent]) {
    assert!(!sent.is_empty(), "the load sent nothing");
    let client = PaymentsClient::new(connect(edge).await);
    let resent: Vec<(Sent, Result<(), tonic::Status>)> = futures::stream::iter(sent.to_vec())
        .map(|s| {
            let client = client.clone();
            async move {
                let give_up = Instant::now() + Duration::from_secs(20);
                let result = loop {
                    let left = give_up.saturating_duration_since(Instant::now());
                    let result = charge_on(&client, &s.account, s.amount, Some(&s.key), left)
                        .await
                        .map(|_| ());
                    match &result {
                        Err(status)
                            if !left.is_zero()
                                && resilience::wire::is_overloaded(status.metadata().as_ref()) =>
                        {
                            let after = match resilience::wire::pushback(status) {
                                resilience::wire::Pushback::RetryAfter(after) => after,
                                _ => Duration::from_millis(50),
                            };
                            tokio::time::sleep(after).await;
                        }
                        _ => break result,
                    }
                };
                (s, result)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for (s, result) in &resent {
        assert!(result.is_ok(), "re-sending {}: {result:?}", s.key);
    }
    let seen: Vec<Code> = sent.iter().map(|s| s.code).collect();
    assert!(
        !seen.contains(&Code::Internal) && !seen.contains(&Code::Unknown),
        "a client saw INTERNAL or UNKNOWN: {:?}",
        codes(sent)
    );
    assert_exactly_once(database_url, sent).await;
}

/// Every key of `sent` has exactly one charge, nothing else was charged, every balance is
/// the sum of its distinct keys' amounts, and no session is idle in a transaction.
pub async fn assert_exactly_once(database_url: &str, sent: &[Sent]) {
    let pool = sqlx::PgPool::connect(database_url).await.unwrap();
    let charges: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT account_id, idempotency_key, count(*) FROM charges GROUP BY 1, 2")
            .fetch_all(&pool)
            .await
            .unwrap();
    let by_key: HashMap<(String, String), i64> =
        charges.into_iter().map(|(a, k, n)| ((a, k), n)).collect();
    let mut expected_balance: HashMap<String, i64> = HashMap::new();
    for s in sent {
        let n = by_key
            .get(&(s.account.clone(), s.key.clone()))
            .copied()
            .unwrap_or(0);
        assert_eq!(n, 1, "key {} on {} has {n} charges", s.key, s.account);
        *expected_balance.entry(s.account.clone()).or_default() += s.amount;
    }
    assert_eq!(by_key.len(), sent.len(), "charges under keys nobody sent");
    let balances: Vec<(String, i64, i64)> =
        sqlx::query_as("SELECT account_id, balance_cents, charges FROM accounts")
            .fetch_all(&pool)
            .await
            .unwrap();
    for (account, balance, _) in &balances {
        if let Some(expected) = expected_balance.get(account) {
            assert_eq!(balance, expected, "balance of {account}");
        }
    }
    assert_no_session_idle_in_transaction(&pool).await;
    pool.close().await;
}

/// No session of this database sits idle inside a transaction (connections being closed
/// may take a moment to go).
pub async fn assert_no_session_idle_in_transaction(pool: &sqlx::PgPool) {
    let query = "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND state LIKE 'idle in transaction%'";
    let start = Instant::now();
    loop {
        let idle: i64 = sqlx::query_scalar(query).fetch_one(pool).await.unwrap();
        if idle == 0 {
            return;
        }
        if start.elapsed() > Duration::from_secs(5) {
            let sessions: Vec<(i32, String)> = sqlx::query_as(
                "SELECT pid, query FROM pg_stat_activity \
                 WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
            )
            .fetch_all(pool)
            .await
            .unwrap();
            panic!("{idle} session(s) idle in transaction: {sessions:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn codes(sent: &[Sent]) -> HashMap<String, usize> {
    let mut codes = HashMap::new();
    for s in sent {
        *codes.entry(format!("{:?}", s.code)).or_default() += 1;
    }
    codes
}

pub fn p99(mut times: Vec<Duration>) -> Duration {
    if times.is_empty() {
        return Duration::ZERO;
    }
    times.sort();
    times[(times.len() * 99 / 100).min(times.len() - 1)]
}

/// Every charge whose client saw OK is in the database at `database_url`, once — checked
/// before anything is re-sent, since a re-send would charge a lost one again and hide the
/// loss.
pub async fn assert_acknowledged_kept(database_url: &str, sent: &[Sent]) {
    let pool = sqlx::PgPool::connect(database_url).await.unwrap();
    let acknowledged: Vec<&Sent> = sent.iter().filter(|s| s.code == Code::Ok).collect();
    let keys: Vec<String> = acknowledged.iter().map(|s| s.key.clone()).collect();
    let found: Vec<(String, i64)> = sqlx::query_as(
        "SELECT idempotency_key, count(*) FROM charges WHERE idempotency_key = ANY($1) GROUP BY 1",
    )
    .bind(&keys)
    .fetch_all(&pool)
    .await
    .unwrap();
    let found: HashMap<String, i64> = found.into_iter().collect();
    let lost: Vec<&str> = keys
        .iter()
        .filter(|k| !found.contains_key(*k))
        .map(String::as_str)
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged charges are not in the database: {lost:?}",
        lost.len(),
        keys.len()
    );
    let twice: Vec<(&String, &i64)> = found.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "charged more than once: {twice:?}");
    pool.close().await;
}
