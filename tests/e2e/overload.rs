//! Overload, on real processes and a real Postgres: 1,500 charges in flight against a chain
//! that does about a thousand a second, with one of the ledger's database sessions ended
//! in the middle (the trigger that used to drain its pool to zero for good); and load at
//! 0.8× capacity with the processor slowed for two seconds (the metastability scenario).
//! After each, no key is charged twice and every acknowledged charge is there.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::load::{ONE_AT_A_TIME, assert_no_session_idle_in_transaction};
use crate::support::*;
use retrychain_proto::v1::payments_client::PaymentsClient;
use tonic::Code;

/// One call of the hammer: its key, what came back, when, how long it took.
#[derive(Debug, Clone)]
struct Call {
    account: String,
    key: String,
    amount: i64,
    code: Code,
    /// Refused as overloaded by the edge itself (not relayed from below): it reached
    /// nothing, so it must have changed nothing.
    shed_at_edge: bool,
    /// Refused as overloaded, by the edge or relayed from below.
    overloaded: bool,
    /// The status message of a failure.
    message: String,
    /// Seconds from the start of the load when it completed.
    done_at: f64,
    took: Duration,
}

/// `workers` closed-loop clients over `connections` connections for `time`, each waiting
/// a refusal's `grpc-retry-pushback-ms` before its next call (as gRFC A6 clients do).
async fn hammer(edge: &str, workers: usize, connections: usize, time: Duration) -> Vec<Call> {
    let mut channels = Vec::new();
    for _ in 0..connections {
        channels.push(connect(edge).await);
    }
    let accounts: Vec<String> = (0..200).map(|_| new_account()).collect();
    let calls: Arc<Mutex<Vec<Call>>> = Arc::default();
    let start = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let client = PaymentsClient::new(channels[w % connections].clone());
            let account = accounts[w % accounts.len()].clone();
            let calls = Arc::clone(&calls);
            tokio::spawn(async move {
                let mut n = 0i64;
                while start.elapsed() < time {
                    n += 1;
                    let key = new_key();
                    let amount = 1 + n % 7;
                    let sent = Instant::now();
                    let result = charge_on(
                        &client,
                        &account,
                        amount,
                        Some(&key),
                        Duration::from_secs(5),
                    )
                    .await;
                    let took = sent.elapsed();
                    let (code, shed_at_edge, overloaded, pushback) = match &result {
                        Ok(_) => (Code::Ok, false, false, None),
                        Err(status) => {
                            let overloaded = status
                                .metadata()
                                .get(resilience::wire::OVERLOADED)
                                .is_some();
                            let relayed =
                                status.metadata().get(resilience::wire::RELAYED).is_some();
                            let pushback = match resilience::wire::pushback(status) {
                                resilience::wire::Pushback::RetryAfter(after) => Some(after),
                                _ => None,
                            };
                            (status.code(), overloaded && !relayed, overloaded, pushback)
                        }
                    };
                    calls.lock().unwrap().push(Call {
                        account: account.clone(),
                        key,
                        amount,
                        code,
                        shed_at_edge,
                        overloaded,
                        message: result
                            .as_ref()
                            .err()
                            .map(|s| s.message().to_owned())
                            .unwrap_or_default(),
                        done_at: start.elapsed().as_secs_f64(),
                        took,
                    });
                    if let Some(pushback) = pushback {
                        tokio::time::sleep(pushback).await;
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    Arc::try_unwrap(calls).unwrap().into_inner().unwrap()
}

/// Charges answered OK per second, in whole seconds of the load.
fn goodput_per_second(calls: &[Call], seconds: usize) -> Vec<usize> {
    let mut per = vec![0; seconds];
    for call in calls.iter().filter(|c| c.code == Code::Ok) {
        let i = (call.done_at as usize).min(seconds - 1);
        per[i] += 1;
    }
    per
}

/// What the ledger recorded of `call`'s key, its times in seconds from `started_at` (the
/// database's clock at the load's start): what a failure that waited out its deadline
/// left behind, to tell where it waited.
async fn key_story(pool: &sqlx::PgPool, started_at: f64, call: &Call) -> String {
    // Each time as text, in seconds from the load's start ($1).
    const QUERY: &str = "SELECT state, takeovers, \
        round((extract(epoch FROM created_at)::float8 - $1)::numeric, 3)::text, \
        round((extract(epoch FROM lease_expires_at)::float8 - $1)::numeric, 3)::text, \
        round((extract(epoch FROM finished_at)::float8 - $1)::numeric, 3)::text, \
        round((extract(epoch FROM p.first_call_at)::float8 - $1)::numeric, 3)::text, p.calls \
        FROM idempotency_keys k LEFT JOIN processor_charges p ON p.processor_key = k.processor_key \
        WHERE k.account_id = $2 AND k.idempotency_key = $3";
    type Row = (
        String,
        i32,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<i64>,
    );
    let row: Option<Row> = sqlx::query_as(QUERY)
        .bind(started_at)
        .bind(&call.account)
        .bind(&call.key)
        .fetch_optional(pool)
        .await
        .unwrap();
    match row {
        None => "no record".to_owned(),
        Some((state, takeovers, created, lease, finished, processor, calls)) => format!(
            "{state}, claimed at {created:?}, lease until {lease:?}, finished at {finished:?}, \
             {takeovers} take-overs, processor called at {processor:?} ({calls:?} calls)"
        ),
    }
}

/// The ledger's sessions on the database at `url` now.
async fn ledger_sessions(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'retrychain-ledger'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// After an overload: every call refused by the edge itself left nothing; every other
/// failure is re-sent until it settles; then every key is charged once (none twice), each
/// acknowledged one is there, and every balance is the sum of its charges.
async fn assert_once_after_overload(edge: &str, url: &str, calls: &[Call]) {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let shed: Vec<String> = calls
        .iter()
        .filter(|c| c.shed_at_edge)
        .map(|c| c.key.clone())
        .collect();
    let touched: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE idempotency_key = ANY($1)")
            .bind(&shed)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        touched, 0,
        "a call the edge refused as overloaded left a key behind"
    );
    let client = PaymentsClient::new(connect(edge).await);
    let unsettled: Vec<&Call> = calls
        .iter()
        .filter(|c| c.code != Code::Ok && !c.shed_at_edge)
        .collect();
    for call in &unsettled {
        let mut tries = 0;
        loop {
            tries += 1;
            match charge_on(
                &client,
                &call.account,
                call.amount,
                Some(&call.key),
                Duration::from_secs(10),
            )
            .await
            {
                Ok(_) => break,
                Err(status) if tries < 20 && status.code() == Code::Unavailable => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(status) => panic!("re-sending {}: {status:?}", call.key),
            }
        }
    }
    let charged: Vec<(String, i64)> = sqlx::query_as(
        "SELECT idempotency_key, count(*) FROM charges GROUP BY 1 HAVING count(*) > 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(charged.is_empty(), "charged more than once: {charged:?}");
    let must: Vec<String> = calls
        .iter()
        .filter(|c| !c.shed_at_edge)
        .map(|c| c.key.clone())
        .collect();
    let found: i64 =
        sqlx::query_scalar("SELECT count(*) FROM charges WHERE idempotency_key = ANY($1)")
            .bind(&must)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        found as usize,
        must.len(),
        "acknowledged or re-sent charges missing"
    );
    let off: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT a.account_id, a.balance_cents, sum(c.amount_cents)::bigint FROM accounts a \
         JOIN charges c USING (account_id) GROUP BY 1, 2 HAVING a.balance_cents <> sum(c.amount_cents)",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(off.is_empty(), "balances off their charges: {off:?}");
    assert_no_session_idle_in_transaction(&pool).await;
    pool.close().await;
}

/// The red-team trial that drained the ledger's pool: 1,500 charges in flight for 10 s
/// and one ledger session (a busy one, if any) ended by `pg_terminate_backend` at 3 s. The pool must come
/// back (its sessions), goodput in the last three seconds must hold at least 80% of its
/// level before the trigger, the excess must be refused by the edge itself in
/// milliseconds (its own refusal-time histogram), and no call may wait out its deadline.
/// (`scripts/test` runs it alone: it measures goodput second by second.)
#[tokio::test]
async fn a_session_ended_under_1500_in_flight_leaves_the_pool_whole_and_goodput_up() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut options = Options::processes();
    options.spec.ledger().db_pool_size = 32;
    let chain = Chain::spawn(options).await;
    let url = chain.database_url.clone().unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();

    let seconds = 10;
    // The database's clock at the load's start, to place a key's timestamps in the run.
    let started_at: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
            .fetch_one(&pool)
            .await
            .unwrap();
    let load = hammer(&chain.addrs[EDGE], 1500, 15, Duration::from_secs(seconds));
    let watch = async {
        let mut sessions = Vec::new();
        for second in 1..=seconds {
            tokio::time::sleep(Duration::from_secs(1)).await;
            sessions.push(ledger_sessions(&pool).await);
            if second == 3 {
                let ended: i64 = sqlx::query_scalar(
                    "SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM pg_stat_activity \
                     WHERE datname = current_database() AND application_name = 'retrychain-ledger' \
                     ORDER BY state = 'idle' LIMIT 1) one",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                assert_eq!(
                    ended, 1,
                    "one ledger session to end (a busy one if there is one)"
                );
            }
        }
        sessions
    };
    let (calls, sessions) = tokio::join!(load, watch);

    let per_second = goodput_per_second(&calls, seconds as usize);
    // Seconds 1 and 2 (after the load's first second, before the trigger) against the
    // last three.
    let first = per_second[1..3].iter().sum::<usize>() as f64 / 2.0;
    let last = per_second[seconds as usize - 3..].iter().sum::<usize>() as f64 / 3.0;
    // How long the successes took: how close an admitted call comes to its deadline.
    let mut took: Vec<Duration> = calls
        .iter()
        .filter(|c| c.code == Code::Ok)
        .map(|c| c.took)
        .collect();
    took.sort();
    let at = |q: f64| took[((took.len() - 1) as f64 * q) as usize];
    let (p50, p99, slowest) = (at(0.5), at(0.99), at(1.0));
    eprintln!(
        "goodput per second {per_second:?}; ledger sessions per second {sessions:?}; {} calls, {} refused by the edge; successes took p50 {p50:.2?}, p99 {p99:.2?}, at most {slowest:.2?}",
        calls.len(),
        calls.iter().filter(|c| c.shed_at_edge).count()
    );
    assert!(
        last >= 0.8 * first,
        "goodput fell: {first:.0}/s before the trigger, {last:.0}/s in the last seconds ({per_second:?})"
    );
    let peak = *sessions.iter().max().unwrap();
    assert!(
        *sessions.last().unwrap() as f64 >= 0.8 * peak as f64,
        "the ledger's pool did not come back: sessions {sessions:?}"
    );
    // The excess is refused where it enters: at least 90% of the refusals by the edge
    // itself, before any service below worked on the call.
    let refused_below = calls
        .iter()
        .filter(|c| c.code == Code::Unavailable && !c.shed_at_edge && c.overloaded)
        .count();
    let refused_at_edge = calls.iter().filter(|c| c.shed_at_edge).count();
    let below: Vec<&String> = calls
        .iter()
        .filter(|c| c.code == Code::Unavailable && !c.shed_at_edge && c.overloaded)
        .map(|c| &c.message)
        .take(3)
        .collect();
    assert!(
        refused_below * 10 <= refused_at_edge + refused_below,
        "{refused_below} refused below the edge, {refused_at_edge} at it: {below:?}"
    );
    let waited_out = calls
        .iter()
        .filter(|c| c.code != Code::Ok && c.took >= Duration::from_secs(4))
        .count();
    let mut examples = Vec::new();
    for call in calls
        .iter()
        .filter(|c| c.code != Code::Ok && c.took >= Duration::from_secs(4))
        .take(5)
    {
        examples.push(format!(
            "{:?} {:?} sent at {:.2} s, done at {:.2} s; its key: {}",
            call.code,
            call.message,
            call.done_at - call.took.as_secs_f64(),
            call.done_at,
            key_story(&pool, started_at, call).await
        ));
    }
    assert_eq!(
        waited_out, 0,
        "failures that waited out their deadline: {examples:#?}"
    );
    // The edge's refusals, if any, timed at the edge: from a call's arrival to its
    // refusal.
    if calls.iter().any(|c| c.shed_at_edge) {
        let metrics = scrape_metrics(&chain.admins[EDGE]).await;
        let (p50, p99) = histogram_quantiles(&metrics, "retrychain_shed_seconds");
        eprintln!("edge refusals answered in p50 {p50:?}, p99 {p99:?}");
        assert!(
            p99 <= Duration::from_millis(5),
            "refusals at the edge p99 {p99:?}"
        );
    }
    let mut codes: HashMap<String, usize> = HashMap::new();
    for call in &calls {
        *codes.entry(format!("{:?}", call.code)).or_default() += 1;
    }
    for bad in [Code::Internal, Code::Unknown, Code::Cancelled] {
        assert!(
            !calls.iter().any(|c| c.code == bad),
            "a client saw {bad:?}: {codes:?}"
        );
    }
    assert_once_after_overload(&chain.addrs[EDGE], &url, &calls).await;
}

/// The metastability scenario (the demo's g) on the chain's own edge, as configured: load
/// at 0.8× the measured capacity, the processor slowed to 500 ms for 2 s. With edge-only
/// retries under the budget (the default), goodput is back to 95% of its level before the
/// trigger within 2 s of its end; every-layer's timeline is printed beside it. Every
/// acknowledged charge is then there once.
#[tokio::test]
async fn goodput_is_back_within_2_s_of_a_triggers_end_with_edge_only_retries() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut options = Options::processes();
    options.spec.ledger().db_pool_size = 32;
    let chain = Chain::spawn(options).await;
    let url = chain.database_url.clone().unwrap();
    let mut edge = Vec::new();
    for _ in 0..4 {
        edge.push(chain.channel(EDGE).await);
    }
    let m = retrychain_experiments::metastable::run(
        &chain.client.control(LEDGER),
        &edge,
        retrychain_experiments::metastable::Shape::default(),
        "test",
    )
    .await
    .unwrap();
    for t in [&m.edge_only, &m.every_layer] {
        eprintln!(
            "{}: before {:.0}/s, end {:.0}/s, back after {:?} s, {} ok, {} failed, {} bottom calls; goodput {:?}",
            t.mode,
            t.goodput_before_rps,
            t.goodput_end_rps,
            t.recovered_after_s,
            t.ok,
            t.failed,
            t.bottom_calls,
            t.goodput
        );
    }
    let back = m
        .edge_only
        .recovered_after_s
        .expect("edge-only goodput came back within the run");
    assert!(back <= 2.0, "edge-only goodput back after {back} s");
    // Every acknowledged charge is there, once; nothing is charged twice.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let acknowledged: Vec<String> = m
        .edge_only
        .acknowledged
        .iter()
        .chain(&m.every_layer.acknowledged)
        .cloned()
        .collect();
    let found: i64 =
        sqlx::query_scalar("SELECT count(*) FROM charges WHERE idempotency_key = ANY($1)")
            .bind(&acknowledged)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(found as usize, acknowledged.len());
    let twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM charges GROUP BY account_id, idempotency_key HAVING count(*) > 1) t",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(twice, 0, "keys charged twice");
    pool.close().await;
}

/// The 50th and 99th percentiles of a Prometheus histogram in `text` (summed over its
/// series), as the upper bounds of the buckets they fall in.
fn histogram_quantiles(text: &str, name: &str) -> (Duration, Duration) {
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(&format!("{name}_bucket{{")) else {
            continue;
        };
        let le = rest
            .split("le=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap();
        let count: f64 = rest.rsplit(' ').next().unwrap().parse().unwrap();
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap()
        };
        match buckets.iter_mut().find(|(b, _)| *b == le) {
            Some(bucket) => bucket.1 += count,
            None => buckets.push((le, count)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last().map_or(0.0, |b| b.1);
    assert!(total > 0.0, "{name} has no observations");
    let at = |q: f64| {
        let bound = buckets
            .iter()
            .find(|(_, n)| *n >= q * total)
            .map_or(f64::INFINITY, |b| b.0);
        Duration::from_secs_f64(bound.min(3600.0))
    };
    (at(0.5), at(0.99))
}

/// Two callers of one edge (plaintext: each its own connection): one bursts 600 calls at
/// once, again and again, far past what the edge predicts it can answer in time (a 100 ms
/// latency objective); the other makes 60 calls one at a time. A caller holding less than
/// its share is never refused because another holds more: all 60 succeed (one refusal in
/// six, as the per-caller cap allowed before fair shares, would fail this with
/// probability 1 − (5/6)^60 > 0.9999). The burst is refused at the edge, UNAVAILABLE,
/// marked overloaded, with a pushback.
#[tokio::test]
async fn a_caller_one_call_at_a_time_is_never_refused_while_another_bursts_past_the_limit() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut options = Options::processes();
    options.spec.edge().service.latency_objective_ms = Some(100);
    let chain = Chain::spawn(options).await;
    chain.set_faults(LEDGER, delayed(10)).await;
    let edge = chain.addrs[EDGE].clone();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let greedy = tokio::spawn({
        let client = PaymentsClient::new(connect(&edge).await);
        let stop = Arc::clone(&stop);
        async move {
            let account = new_account();
            let mut answers = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                answers.extend(
                    futures::future::join_all((0..600).map(|_| {
                        let (client, account) = (client.clone(), account.clone());
                        async move {
                            charge_on(
                                &client,
                                &account,
                                1,
                                Some(&new_key()),
                                Duration::from_secs(5),
                            )
                            .await
                        }
                    }))
                    .await,
                );
            }
            answers
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let light = PaymentsClient::new(connect(&edge).await);
    let account = new_account();
    let mut refused = Vec::new();
    let started = Instant::now();
    for _ in 0..60 {
        if let Err(status) = charge_on(
            &light,
            &account,
            1,
            Some(&new_key()),
            Duration::from_secs(5),
        )
        .await
        {
            refused.push(status);
        }
    }
    let light_took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let greedy = greedy.await.unwrap();

    let greedy_ok = greedy.iter().filter(|a| a.is_ok()).count();
    let greedy_refused: Vec<&tonic::Status> =
        greedy.iter().filter_map(|a| a.as_ref().err()).collect();
    eprintln!(
        "the light caller: {} of 60 refused, 60 calls in {light_took:?}; the greedy caller: {greedy_ok} served, {} refused",
        refused.len(),
        greedy_refused.len()
    );
    assert!(
        refused.is_empty(),
        "the light caller was refused: {refused:?}"
    );
    assert!(
        !greedy_refused.is_empty(),
        "600 at once and nothing refused: the burst never filled the edge"
    );
    for status in &greedy_refused {
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("overloaded"), "{status:?}");
        assert!(
            status.metadata().get(resilience::wire::RELAYED).is_none(),
            "refused below the edge: {status:?}"
        );
        assert!(
            matches!(
                resilience::wire::pushback(status),
                resilience::wire::Pushback::RetryAfter(_)
            ),
            "{status:?}"
        );
    }
    assert!(greedy_ok > 0, "the greedy caller is served its share");
}

/// The edge's line at the door (`--door-wait-share`), through the real wire. The ledger
/// answers a charge in 300 ms and the edge's estimate is measured on charges sent one
/// after another, so a second charge sent while one is in flight is predicted to take
/// about 600 ms, more than the half of its 1.1 s it may (about 540 ms). Without a wait
/// share it is refused at once; with half its time to wait, it waits at the edge and is
/// served once the first is answered. Both are the same caller's (one connection), so no
/// fair share lets the second in.
#[tokio::test]
async fn a_charge_that_does_not_fit_now_waits_at_the_door_with_a_wait_share_refused_without() {
    let _one = ONE_AT_A_TIME.lock().await;
    for share in [0.0, 0.5] {
        let mut options = Options::default();
        options.spec.edge().door_wait_share = share;
        options.spec.edge().service.min_concurrency = 1;
        let chain = Chain::spawn(options).await;
        chain.set_faults(LEDGER, delayed(300)).await;
        let client = PaymentsClient::new(chain.channel(EDGE).await);
        let account = new_account();
        let deadline = Duration::from_millis(1100);
        // One at a time: a window of the estimate closes after 8 answers.
        for _ in 0..10 {
            charge_on(&client, &account, 1, Some(&new_key()), deadline)
                .await
                .expect("one at a time, each fits");
        }
        let key = new_key();
        let first = charge_on(&client, &account, 1, Some(&key), deadline);
        let second = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let sent = Instant::now();
            let answer = charge_on(&client, &account, 1, Some(&new_key()), deadline).await;
            (answer, sent.elapsed())
        };
        let (first, (second, took)) = tokio::join!(first, second);
        first.expect("the first fits");
        eprintln!(
            "wait share {share}: the second {:?} after {took:?}",
            second.as_ref().map(|_| ()).map_err(|s| s.message())
        );
        if share == 0.0 {
            let status = second.expect_err("refused");
            assert_eq!(status.code(), Code::Unavailable, "{status:?}");
            assert!(status.message().contains("overloaded"), "{status:?}");
            assert!(
                status.metadata().get(resilience::wire::RELAYED).is_none(),
                "refused at the edge: {status:?}"
            );
            assert!(
                took < Duration::from_millis(250),
                "refused at once: {took:?}"
            );
        } else {
            second.expect("waited at the door, then served");
            assert!(
                took >= Duration::from_millis(400),
                "it waited for the first (about 250 ms) and was then served (300 ms): {took:?}"
            );
        }
    }
}

/// An outage's failures do not outlive it at the door: eight every-layer charges against
/// a processor that is down (243 failing calls each), then the processor back and 32
/// charges at once, every one served. The edge's drain estimate had been learned from
/// those failures alone, and the build before refused the 16 past the least limit
/// ("behind the 16 calls in flight this one would take about 4173 ms, more than the 1247
/// ms it may"), and went on refusing such bursts until an EWMA had forgotten the figure.
#[tokio::test]
async fn a_burst_after_an_every_layer_outage_is_served_not_refused_for_the_outages_failures() {
    let _one = ONE_AT_A_TIME.lock().await;
    let chain = Chain::spawn(Options::processes()).await;
    chain.fail_processor().await;
    let outage = futures::future::join_all(
        (0..8).map(|_| chain.charge_new(Duration::from_secs(30), &[(RETRY_MODE, "every-layer")])),
    )
    .await;
    for failed in outage {
        let status = failed.expect_err("the processor is down");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    }
    assert_eq!(chain.stats(LEDGER).await.downstream_attempts, 8 * 243);
    chain.set_faults(LEDGER, faults()).await;

    let burst =
        futures::future::join_all((0..32).map(|_| chain.charge_new(Duration::from_secs(5), &[])))
            .await;
    let refused: Vec<String> = burst
        .iter()
        .filter_map(|answer| answer.as_ref().err())
        .map(|status| format!("{:?}: {}", status.code(), status.message()))
        .collect();
    assert!(
        refused.is_empty(),
        "{} of 32 refused after the outage: {refused:?}",
        refused.len()
    );
}
