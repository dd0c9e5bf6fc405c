//! Real faults, not injected ones: Postgres restarted and stopped, the ledger killed and
//! frozen, replies lost at every hop, transactions cut off, duplicates in bursts, hostile
//! callers. Real Postgres and real signals; `retrychain` processes where one is killed,
//! frozen or restarted, the same services in this runtime elsewhere.
//!
//! Most tests follow one shape: load the chain with charges under fresh keys, break
//! something mid-stream, mend it, then re-send **every** key and check the invariant —
//! every key has exactly one charge, each account's balance is the sum of its distinct
//! keys' amounts, no client ever saw INTERNAL or UNKNOWN, and no session is left idle in a
//! transaction.

use std::{
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{load::*, support::*};
use futures::StreamExt;
use retrychain_proto::v1::{
    ChargeRequest, GetStatsRequest, ResetStatsRequest, control_client::ControlClient,
    payments_client::PaymentsClient,
};
use tonic::Code;

/// A cluster of this test's own, a database on it, and a chain over that database.
async fn own_postgres_chain() -> (tempgres::TempCluster, String, Chain) {
    let cluster = own_cluster().await;
    let url = cluster.url("postgres");
    let chain = Chain::spawn_on(Options::default(), url.clone()).await;
    (cluster, url, chain)
}

#[tokio::test]
async fn postgres_restarted_mid_stream_loses_nothing_and_charges_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (cluster, url, chain) = own_postgres_chain().await;
    let load = Load::start(&chain.addrs[EDGE], 4);
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let cluster = restart_postgres(cluster).await;
    let restarted = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let sent = load.finish().await;

    let after: Vec<&Sent> = sent.iter().filter(|s| s.started > restarted).collect();
    assert!(
        after.iter().any(|s| s.code == Code::Ok),
        "charges succeed after the restart: {:?}",
        codes(&sent)
    );
    println!(
        "restart: {} charges, {:?}; after the restart {} of {} succeeded",
        sent.len(),
        codes(&sent),
        after.iter().filter(|s| s.code == Code::Ok).count(),
        after.len()
    );
    resend_and_check(&chain.addrs[EDGE], &url, &sent).await;
    drop(chain);
    drop(cluster);
}

#[tokio::test]
async fn postgres_stopped_for_3_s_is_a_fast_unavailable_within_the_budget() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (cluster, url, chain) = own_postgres_chain().await;
    let load = Load::start(&chain.addrs[EDGE], 4);
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let before = chain.all_stats().await;
    let cluster = Arc::new(cluster);
    let stopping = Arc::clone(&cluster);
    off_runtime(move || stopping.stop_server().expect("pg_ctl stop")).await;
    let down = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after_outage = chain.all_stats().await;
    let starting = Arc::clone(&cluster);
    off_runtime(move || starting.start_server().expect("pg_ctl start")).await;
    let up = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = load.finish().await;

    // During the outage: failures are UNAVAILABLE, and fast.
    let failed: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.started >= down && s.started < up && s.code != Code::Ok)
        .collect();
    assert!(!failed.is_empty(), "the outage failed some charges");
    for s in &failed {
        assert_eq!(s.code, Code::Unavailable, "{s:?}");
    }
    // (UNAVAILABLE, not DEADLINE_EXCEEDED: answered without waiting out the deadline. How
    // fast is a figure, printed below, not an assertion.)
    let p99_failed = p99(failed.iter().map(|s| s.took).collect());
    // The budget keeps the ledger's load near one call per request.
    let requests = after_outage[EDGE].requests_received - before[EDGE].requests_received;
    let reaching_ledger = after_outage[LEDGER].requests_received - before[LEDGER].requests_received;
    let amplification = reaching_ledger as f64 / requests as f64;
    assert!(
        reaching_ledger as f64 <= requests as f64 * 1.1 + 11.0,
        "{reaching_ledger} ledger calls for {requests} requests"
    );
    // Service resumes within the 2 s the load runs on after Postgres is back.
    let resumed = first_success_after(&sent, up).expect("charges succeed once Postgres is back");
    println!(
        "postgres down 3 s: {} failed calls, p99 {p99_failed:?}; {requests} requests, \
         {reaching_ledger} ledger calls ({amplification:.2}x); first success {resumed:?} after start",
        failed.len()
    );
    resend_and_check(&chain.addrs[EDGE], &url, &sent).await;
}

// Multi-threaded: the test blocks while it waits for processes, and the load must go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_killed_mid_stream_and_restarted_charges_each_key_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut chain = Chain::spawn(Options::processes()).await;
    let url = chain.database_url.clone().unwrap();
    let load = Load::start(&chain.addrs[EDGE], 4);
    tokio::time::sleep(Duration::from_millis(1000)).await;

    chain.services[LEDGER].crash().await; // SIGKILL, mid-transaction for some charges
    tokio::time::sleep(Duration::from_millis(500)).await;
    chain.services[LEDGER].restart().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let sent = load.finish().await;

    println!("ledger killed: {} charges, {:?}", sent.len(), codes(&sent));
    resend_and_check(&chain.addrs[EDGE], &url, &sent).await;
}

/// `retrychain up` run as a user runs it, with a PATH that lacks the Postgres binaries
/// (Debian keeps them in /usr/lib/postgresql/<major>/bin): it finds them, and when its
/// ledger is SIGKILLed its supervisor starts it again while the rest keep serving.
// Multi-threaded: the test blocks while it waits for processes, and the load must go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_finds_postgres_off_path_and_restarts_a_killed_ledger() {
    let _one = ONE_AT_A_TIME.lock().await;
    let base = free_base_port();
    let path: Vec<std::path::PathBuf> =
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .filter(|dir| !dir.join("initdb").exists())
            .collect();
    let (mut up, lines) = start_up(&["--base-port", &base.to_string()], |up| {
        up.env("PATH", std::env::join_paths(path).unwrap())
            .env_remove("DATABASE_URL");
    });
    let wait_for = |what: &mut dyn FnMut(&str) -> bool| -> String {
        let start = Instant::now();
        loop {
            let line = lines
                .recv_timeout(Duration::from_secs(90).saturating_sub(start.elapsed()))
                .unwrap_or_else(|_| panic!("retrychain up never printed the expected line"));
            if what(&line) {
                return line;
            }
        }
    };
    let mut pg_port = None;
    let mut ledger_pid = None;
    wait_for(&mut |l| {
        if let Some(rest) = l.split("throwaway cluster on 127.0.0.1:").nth(1) {
            pg_port = rest
                .split_whitespace()
                .next()
                .and_then(|p| p.parse::<u16>().ok());
        }
        if l.starts_with("ledger | started, pid") {
            ledger_pid = Some(pid_of(l));
        }
        l.starts_with("retrychain is up")
    });
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        pg_port.expect("up names its Postgres")
    );
    let ledger_pid = ledger_pid.expect("up names the ledger's pid");
    let edge = format!("http://127.0.0.1:{base}");

    let load = Load::start(&edge, 4);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        Command::new("kill")
            .args(["-KILL", &ledger_pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let restarted = wait_for(&mut |l| l.starts_with("ledger | started, pid"));
    assert_ne!(pid_of(&restarted), ledger_pid, "a new process");
    wait_for(&mut |l| l.contains("ledger restarted"));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let sent = load.finish().await;
    println!(
        "ledger killed under up: {} charges, {:?}",
        sent.len(),
        codes(&sent)
    );
    resend_and_check(&edge, &url, &sent).await;

    let _ = Command::new("kill")
        .args(["-TERM", &up.0.id().to_string()])
        .status();
    let status = up.0.wait().unwrap();
    assert!(status.success(), "up stops cleanly on SIGTERM: {status}");
}

fn pid_of(line: &str) -> u32 {
    line.split("pid ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A ledger frozen (SIGSTOP) while its processor works holds its key only for its lease:
/// another instance takes the key over once the lease passes (2 s, the frozen owner does
/// not renew it) and charges; the frozen one, woken, writes nothing — its caller gets the
/// other's outcome, or an error — and one charge exists. (`phases::` has the same with the
/// freeze after the processor answered.)
#[tokio::test]
async fn a_frozen_ledger_releases_its_key_to_another_instance_and_commits_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let url = database().await;
    let frozen = spawn_ledger_on(&url).await;
    let other = spawn_ledger_on(&url).await;
    let frozen_control = ControlClient::new(connect(&frozen.addr.admin_url).await);
    frozen_control
        .clone()
        .set_faults(
            delayed(1000), // the processor answers while the ledger is frozen
        )
        .await
        .unwrap();
    let account = new_account();
    let key = new_key();

    // The first instance claims the key, calls the processor, and freezes.
    let mut first = PaymentsClient::new(connect(&frozen.addr.url).await);
    let request = charge(&account, 700, Some(&key), Duration::from_secs(3), &[]);
    let first_call = tokio::spawn(async move { first.charge(request).await });
    let start = Instant::now();
    while bottom_calls(&frozen_control).await == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "never claimed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    frozen.signal("STOP").await.unwrap();

    // The second instance gets the key once its lease passes.
    let taken_over = Instant::now();
    let reply = PaymentsClient::new(connect(&other.addr.url).await)
        .charge(charge(
            &account,
            700,
            Some(&key),
            Duration::from_secs(20),
            &[],
        ))
        .await
        .expect("the other ledger charges");
    let waited = taken_over.elapsed();
    assert_eq!(
        header(&reply, IDEMPOTENT_REPLAYED),
        None,
        "resumed, not replayed"
    );
    println!("the key was free for the other ledger after {waited:?}");
    assert!(
        waited < Duration::from_secs(4),
        "the frozen owner's lease (2 s) held the key for {waited:?}"
    );

    // Woken up, the first instance finds the key taken: it writes nothing, and its caller
    // gets the other's outcome (or an error, if its deadline won).
    frozen.signal("CONT").await.unwrap();
    if let Ok(first) = first_call.await.unwrap() {
        assert_eq!(first.get_ref().charge_id, reply.get_ref().charge_id);
    }
    let stats = frozen_control
        .clone()
        .get_stats(GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.executions, 0, "the frozen ledger committed nothing");
    assert_eq!(row_counts(&url).await, (1, 1, 1), "one charge, one key");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    assert_no_session_idle_in_transaction(&pool).await;
}

#[tokio::test]
async fn replies_lost_at_every_hop_still_charge_each_of_1000_keys_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let chain = Chain::spawn(Options::default()).await;
    for i in 0..5 {
        chain.set_faults(i, losing_replies(0.2)).await;
    }
    let sent = send_keys(&chain.addrs[EDGE], 1000, 16).await;
    for i in 0..5 {
        chain.set_faults(i, faults()).await;
    }
    let lost = sent.iter().filter(|s| s.code != Code::Ok).count();
    println!(
        "replies lost at 20% per hop: {lost} of 1000 calls failed; {:?}",
        codes(&sent)
    );
    assert!(lost > 0, "the faults were in force");
    resend_and_check(
        &chain.addrs[EDGE],
        chain.database_url.as_ref().unwrap(),
        &sent,
    )
    .await;
}

/// How many polls `charge` takes to finish, polled as the cut-off test polls (a yield and
/// 300 µs for the database between polls).
async fn polls_to_finish<F: std::future::Future>(charge: F) -> u64 {
    let mut charge = std::pin::pin!(charge);
    let mut polls = 0;
    loop {
        tokio::task::yield_now().await;
        polls += 1;
        if futures::poll!(charge.as_mut()).is_ready() {
            return polls;
        }
        tokio::time::sleep(Duration::from_micros(300)).await;
    }
}

/// Charges cut off at every point — waiting for a connection, in the claim, in the
/// processor, in phase 2 — by dropping the store's future, as a caller that gives up does.
/// After each cut no session is idle in a transaction, and the pool keeps serving with
/// every charge whole (a cut key is left started, never settled without its charge).
#[tokio::test]
async fn charges_cut_off_at_any_point_leak_no_transaction() {
    use retrychain_domain::{AccountId, AmountCents, IdempotencyKey};
    use retrychain_ledger::InFlight;

    let url = database().await;
    let store = key_store(&url, 2).await;
    let account = AccountId::parse(&new_account()).unwrap();
    let anonymous = retrychain_domain::Caller::anonymous();
    let deadline = || resilience::Deadline::after(Duration::from_secs(5));
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    // How many polls a whole charge takes here (the fewest of five): the cut points are
    // spread below it, so that nearly every charge is cut somewhere however fast this
    // machine and its database answer.
    let mut needed = u64::MAX;
    for _ in 0..5 {
        let key = IdempotencyKey::parse(&new_key()).unwrap();
        let charge = store.charge(
            retrychain_ledger::KeyedCharge {
                caller: &anonymous,
                account: &account,
                key: &key,
                amount: AmountCents::parse(100).unwrap(),
                deadline: deadline(),
                in_flight: InFlight::Wait,
                processor_key: "processor-key",
            },
            |_| async {
                tokio::task::yield_now().await;
                Ok(())
            },
        );
        needed = needed.min(polls_to_finish(charge).await);
    }
    println!("a whole charge takes {needed} polls here");
    assert!(
        needed >= 2,
        "a charge finished within {needed} polls: nothing to cut"
    );
    let mut cut = 0;
    for i in 0..240u64 {
        let key = IdempotencyKey::parse(&new_key()).unwrap();
        let amount = AmountCents::parse(100).unwrap();
        // Cut after 0 to needed - 1 polls of the charge: in acquire, the claim, the
        // processor, phase 2 (polling by hand, so the cut points do not depend on the
        // timer's resolution).
        let polls = i % needed;
        let mut charge = Box::pin(store.charge(
            retrychain_ledger::KeyedCharge {
                caller: &anonymous,
                account: &account,
                key: &key,
                amount,
                deadline: deadline(),
                in_flight: InFlight::Wait,
                processor_key: "processor-key",
            },
            |_| async {
                tokio::task::yield_now().await;
                Ok(())
            },
        ));
        let mut finished = false;
        for _ in 0..=polls {
            tokio::task::yield_now().await;
            if futures::poll!(charge.as_mut()).is_ready() {
                finished = true;
                break;
            }
            // Let the database answer something before the next poll.
            tokio::time::sleep(Duration::from_micros(300)).await;
        }
        if finished {
            continue;
        }
        drop(charge); // the caller gives up: the future is gone
        cut += 1;
        // Right after each cut: the connection must not linger inside a transaction
        // (the pool recovers or closes it, which takes a moment) — not even one that the
        // next charge on the pool would silently absorb.
        assert_no_session_idle_in_transaction(&pool).await;
    }
    // Every charge polled fewer times than a whole one needs is cut, unless it was
    // quicker than the quickest of the five: at least half of those.
    let expected = 240 * (needed - 1) / needed;
    println!("{cut} of 240 charges cut off ({expected} expected)");
    assert!(
        cut * 2 >= expected,
        "most charges were cut off ({cut} of 240; {expected} expected)"
    );

    // The pool still serves, and every charge is whole: a charge row always has its key
    // row pointing at it, and the balance is the sum of the charges.
    for _ in 0..20 {
        let key = IdempotencyKey::parse(&new_key()).unwrap();
        store
            .charge(
                retrychain_ledger::KeyedCharge {
                    caller: &retrychain_domain::Caller::anonymous(),
                    account: &account,
                    key: &key,
                    amount: AmountCents::parse(1).unwrap(),
                    deadline: deadline(),
                    in_flight: InFlight::Wait,
                    processor_key: "processor-key",
                },
                |_| async { Ok(()) },
            )
            .await
            .expect("the pool serves after the cut-offs");
    }
    let orphans: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM charges c LEFT JOIN idempotency_keys k \
         ON k.account_id = c.account_id AND k.idempotency_key = c.idempotency_key \
         WHERE k.charge_id IS DISTINCT FROM c.charge_id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(orphans, 0, "every charge has its key and saved reply");
    // A charge cut between its phases leaves its key started (claimed, nothing charged),
    // for a retry or the completer to resume; never finished without its charge.
    let unfinished: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE charge_id IS NULL AND state <> 'started'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(unfinished, 0, "no key settled without its charge");
    let (sum, balance): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT coalesce(sum(amount_cents), 0)::BIGINT FROM charges), \
                (SELECT coalesce(sum(balance_cents), 0)::BIGINT FROM accounts)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(sum, balance);
    println!("{cut} of 240 charges cut off; no leaked transaction");
}

/// After Postgres restarts, every pooled connection is broken, but a charge meets at most
/// one of them: the first failure makes the store ping idle connections before use.
#[tokio::test]
async fn after_a_restart_only_the_first_charge_meets_a_broken_connection() {
    use retrychain_domain::{AccountId, AmountCents, IdempotencyKey};
    use retrychain_ledger::{InFlight, KeyStore};

    let _one = ONE_AT_A_TIME.lock().await;
    let cluster = own_cluster().await;
    let store = key_store(&cluster.url("postgres"), 6).await;
    let account = AccountId::parse(&new_account()).unwrap();
    let charge = |store: KeyStore| {
        let account = account.clone();
        async move {
            store
                .charge(
                    retrychain_ledger::KeyedCharge {
                        caller: &retrychain_domain::Caller::anonymous(),
                        account: &account,
                        key: &IdempotencyKey::parse(&new_key()).unwrap(),
                        amount: AmountCents::parse(100).unwrap(),
                        deadline: resilience::Deadline::after(Duration::from_secs(5)),
                        in_flight: InFlight::Wait,
                        processor_key: "processor-key",
                    },
                    |_| async {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok(())
                    },
                )
                .await
        }
    };
    // Six charges at once fill the pool with six idle connections.
    let warm: Vec<_> = (0..6)
        .map(|_| tokio::spawn(charge(store.clone())))
        .collect();
    for w in warm {
        w.await.unwrap().expect("warm-up charge");
    }
    let cluster = restart_postgres(cluster).await;

    let mut failures = 0;
    for _ in 0..6 {
        if let Err(error) = charge(store.clone()).await {
            assert!(
                matches!(
                    error,
                    retrychain_ledger::StoreError::Lost(_)
                        | retrychain_ledger::StoreError::Unavailable(_)
                ),
                "{error:?}"
            );
            failures += 1;
        }
    }
    assert!(
        failures <= 1,
        "{failures} of 6 charges met a broken connection"
    );
    drop(cluster);
}

/// Giving a connection back to the pool sends Postgres nothing, and an idle pool says
/// nothing: read off the wire by a proxy, every message the key store sends over 20
/// charges is one of the charges' own — its two phases, one statement each (Bind,
/// Execute, Close, Sync), and nothing else: no BEGIN, no COMMIT (each phase commits on its
/// own), no ping. sqlx's pool pinged every connection given back (a lone Sync): one more
/// message, and Postgres wake-up, per charge.
#[tokio::test]
async fn giving_a_connection_back_sends_postgres_nothing() {
    use retrychain_domain::{AccountId, AmountCents, IdempotencyKey};
    use retrychain_ledger::InFlight;

    let _one = ONE_AT_A_TIME.lock().await;
    let cluster = own_cluster().await;
    let tap = Tap::start(cluster.port()).await;
    let store = key_store(
        &format!("postgres://postgres@127.0.0.1:{}/postgres", tap.port),
        4,
    )
    .await;
    let account = AccountId::parse(&new_account()).unwrap();
    let charge = || async {
        let key = IdempotencyKey::parse(&new_key()).unwrap();
        store
            .charge(
                retrychain_ledger::KeyedCharge {
                    caller: &retrychain_domain::Caller::anonymous(),
                    account: &account,
                    key: &key,
                    amount: AmountCents::parse(100).unwrap(),
                    deadline: resilience::Deadline::after(Duration::from_secs(5)),
                    in_flight: InFlight::Wait,
                    processor_key: "processor-key",
                },
                |_| async { Ok(()) },
            )
            .await
    };
    // The connection opened and checked, the statements prepared.
    charge().await.expect("warm-up charge");
    let before = tap.sent().len();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(tap.sent().len(), before, "an idle pool sent something");

    for _ in 0..20 {
        charge().await.expect("charge");
    }
    let sent = tap.sent().split_off(before);
    let count = |kind: u8| sent.iter().filter(|(k, _)| *k == kind).count();
    let simple: Vec<String> = sent
        .iter()
        .filter(|(kind, _)| *kind == b'Q')
        .map(|(_, body)| {
            String::from_utf8_lossy(body)
                .trim_end_matches('\0')
                .to_owned()
        })
        .collect();
    assert!(simple.is_empty(), "no transaction is opened: {simple:#?}");
    assert_eq!(count(b'E'), 40, "two statements per charge: its two phases");
    // Each statement: Bind, Execute, Close (its portal), Sync.
    assert_eq!(count(b'B'), 40);
    assert_eq!(count(b'C'), 40);
    assert_eq!(
        count(b'S'),
        count(b'E'),
        "a Sync of its own (a ping) was sent beside the statements"
    );
    let kinds: std::collections::BTreeSet<char> =
        sent.iter().map(|(kind, _)| char::from(*kind)).collect();
    assert!(
        kinds.iter().all(|kind| "BECS".contains(*kind)),
        "unexpected messages: {kinds:?}"
    );
    drop(cluster);
}

/// A proxy in front of Postgres that reads the messages clients send (the frontend
/// protocol: after the untyped startup messages, a type byte and a length each) and
/// passes everything on unchanged.
struct Tap {
    /// Where clients connect.
    port: u16,
    /// Every typed message sent so far, over all connections.
    sent: SentLog,
}

/// Typed frontend messages, in the order they were sent: type byte and body.
type SentLog = std::sync::Arc<std::sync::Mutex<Vec<(u8, Vec<u8>)>>>;

impl Tap {
    async fn start(target: u16) -> Tap {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let sent = std::sync::Arc::default();
        let log = std::sync::Arc::clone(&sent);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (mut server_read, server_write) = server.into_split();
                tokio::spawn(Self::read_frontend(
                    client_read,
                    server_write,
                    std::sync::Arc::clone(&log),
                ));
                tokio::spawn(async move {
                    let mut client_write = client_write;
                    let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                });
            }
        });
        Tap { port, sent }
    }

    /// The messages sent so far.
    fn sent(&self) -> Vec<(u8, Vec<u8>)> {
        self.sent.lock().unwrap().clone()
    }

    /// Forwards a client's bytes to the server, logging each whole typed message.
    async fn read_frontend(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        log: SentLog,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        /// SSLRequest and GSSENCRequest: more untyped messages follow.
        const ENCRYPTION_REQUESTS: [u32; 2] = [80_877_103, 80_877_104];
        let mut pending = Vec::new();
        let mut started = false;
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
            pending.extend_from_slice(&buf[..n]);
            loop {
                let header = if started { 5 } else { 8 };
                if pending.len() < header {
                    break;
                }
                let at = usize::from(started);
                let len = u32::from_be_bytes(pending[at..at + 4].try_into().unwrap()) as usize;
                let whole = at + len;
                if pending.len() < whole {
                    break;
                }
                if started {
                    log.lock()
                        .unwrap()
                        .push((pending[0], pending[5..whole].to_vec()));
                } else {
                    let code = u32::from_be_bytes(pending[4..8].try_into().unwrap());
                    started = !ENCRYPTION_REQUESTS.contains(&code);
                }
                pending.drain(..whole);
            }
        }
        let _ = to.shutdown().await;
    }
}

/// The ledger's key store in this process, on `url`, with `pool_size` connections.
async fn key_store(url: &str, pool_size: u32) -> retrychain_ledger::KeyStore {
    retrychain_ledger::KeyStore::connect(
        url,
        retrychain_ledger::StoreOptions {
            pool_size,
            acquire_timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(5),
            round_trip_timeout: Duration::from_secs(1),
            skip_key_claim: false,
            standby_copy: false,
        },
    )
    .await
    .unwrap()
}

/// The same through the wire: deadlines from 1 ms to 60 ms against a ledger whose
/// processor takes 10 ms, so the deadline falls at every step: before the claim, between
/// the phases, in phase 2.
#[tokio::test]
async fn deadlines_cut_at_every_step_leave_the_ledgers_pool_clean() {
    let (ledger, url) = start_ledger(|l| l.db_pool_size = 2).await;
    ControlClient::new(connect(&ledger.addr.admin_url).await)
        .set_faults(delayed(10))
        .await
        .unwrap();
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let account = new_account();
    for ms in 1..=60 {
        let result = charge_on(
            &client,
            &account,
            100,
            Some(&new_key()),
            Duration::from_millis(ms),
        )
        .await;
        // Cut off by its deadline; or, while earlier charges (which run on after their
        // callers left) hold both connections, refused at once as overloaded because the
        // pool's queue would not reach it in time — never any other failure.
        if let Err(status) = result {
            let overloaded = status.code() == Code::Unavailable
                && status.metadata().get("retrychain-overloaded").is_some();
            assert!(
                overloaded || matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
                "{ms} ms: {status:?}"
            );
        }
    }
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    assert_no_session_idle_in_transaction(&pool).await;
    for _ in 0..10 {
        charge_on(
            &client,
            &account,
            100,
            Some(&new_key()),
            Duration::from_secs(5),
        )
        .await
        .expect("the pool serves");
    }
    // Keys cut between their phases are started (claimed, for a retry or the completer to
    // resume); every settled key has its charge.
    let settled_without: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE charge_id IS NULL AND state <> 'started'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(settled_without, 0, "no key settled without its charge");
    // Both counts in one statement, one snapshot: the completer may finish a key cut
    // between its phases (its owner's lease passed) at any moment.
    let (charges, finished): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM charges), \
                (SELECT count(*) FROM idempotency_keys WHERE state = 'finished')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(charges, finished, "one charge per finished key");
}

#[tokio::test]
async fn in_flight_reject_replays_50_concurrent_repeats_of_a_completed_key() {
    let (ledger, url) = start_ledger(|l| l.in_flight = InFlightArg::Reject).await;
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let account = new_account();
    let key = new_key();
    let first = charge_on(&client, &account, 500, Some(&key), Duration::from_secs(5))
        .await
        .expect("first charge")
        .into_inner();

    let repeats: Vec<_> =
        futures::stream::iter(0..50)
            .map(|_| {
                let client = client.clone();
                let (account, key) = (account.clone(), key.clone());
                async move {
                    charge_on(&client, &account, 500, Some(&key), Duration::from_secs(5)).await
                }
            })
            .buffer_unordered(50)
            .collect()
            .await;
    for repeat in &repeats {
        let reply = repeat.as_ref().expect("a replay, not ABORTED");
        assert_eq!(header(reply, IDEMPOTENT_REPLAYED).as_deref(), Some("true"));
        assert_eq!(reply.get_ref().charge_id, first.charge_id);
    }
    assert_eq!(row_counts(&url).await, (1, 1, 1));
}

#[tokio::test]
async fn waiting_duplicates_do_not_starve_other_accounts() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (ledger, url) = start_ledger(|l| l.db_pool_size = 4).await;
    let control = ControlClient::new(connect(&ledger.addr.admin_url).await);
    control.clone().set_faults(delayed(2000)).await.unwrap();
    let client = PaymentsClient::new(connect(&ledger.addr.url).await);
    let (account, key) = (new_account(), new_key());
    let duplicates: Vec<_> = (0..20)
        .map(|_| {
            let client = client.clone();
            let (account, key) = (account.clone(), key.clone());
            tokio::spawn(async move {
                charge_on(&client, &account, 500, Some(&key), Duration::from_secs(15)).await
            })
        })
        .collect();
    let start = Instant::now();
    while bottom_calls(&control).await == 0 {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await; // all 20 are waiting now
    control.clone().set_faults(faults()).await.unwrap();

    // Another account's charge gets a connection while 19 duplicates wait.
    charge_on(
        &client,
        &new_account(),
        100,
        Some(&new_key()),
        Duration::from_millis(1500),
    )
    .await
    .expect("another account is served while duplicates wait");

    let mut executed = 0;
    for duplicate in duplicates {
        let reply = duplicate
            .await
            .unwrap()
            .expect("each duplicate gets the reply");
        if header(&reply, IDEMPOTENT_REPLAYED).is_none() {
            executed += 1;
        }
    }
    assert_eq!(executed, 1, "one execution, 19 replays");
    let metrics = scrape_metrics(&ledger.addr.admin_url).await;
    assert!(
        metrics.contains("retrychain_ledger_in_flight_waits_total{service=\"ledger\"} 19"),
        "19 duplicates waited, in memory:\n{metrics}"
    );
    assert_eq!(row_counts(&url).await.1, 2);
}

/// A codec that sends raw bytes, to put something that is not a protobuf on the wire.
#[derive(Debug, Clone, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

async fn raw_charge(addr: &str, body: Vec<u8>) -> tonic::Status {
    let mut grpc = tonic::client::Grpc::new(connect(addr).await);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(body);
    request.metadata_mut().insert(
        IDEMPOTENCY_KEY,
        tonic::metadata::MetadataValue::try_from(new_key()).unwrap(),
    );
    grpc.unary::<Vec<u8>, Vec<u8>, _>(
        request,
        http::uri::PathAndQuery::from_static("/retrychain.v1.Payments/Charge"),
        RawCodec,
    )
    .await
    .expect_err("refused")
}

/// What a hostile or careless caller can send, at the edge and straight at each service
/// below it: each gets its documented code and nothing is written.
#[tokio::test]
async fn hostile_input_gets_its_documented_code_and_writes_nothing() {
    let chain = Chain::spawn(Options::default()).await;
    let url = chain.database_url.clone().unwrap();
    let big_header = "x".repeat(8 * 1024);
    let huge_account = "a".repeat(100 * 1024);
    let cases: Vec<HostileCase> = vec![
        (
            "NUL in the account id",
            request("a\u{0}b", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "BEL in the account id",
            request("bell\u{7}", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "newline in the account id",
            request("a\nb", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "DEL in the account id",
            request("del\u{7f}", 500),
            vec![],
            Code::InvalidArgument,
        ),
        // Ids that look like `alice`, `bob` or `café` on a screen but are other strings.
        (
            "a zero-width space in the account id",
            request("ali\u{200b}ce", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "a BOM before the account id",
            request("\u{feff}alice", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "a right-to-left override in the account id",
            request("\u{202e}ecila", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "a word joiner after the account id",
            request("bob\u{2060}", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "an account id in NFD",
            request("cafe\u{301}", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "a Cyrillic letter among Latin ones",
            request("\u{430}lice", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "a fullwidth letter",
            request("\u{ff41}lice", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "a private-use character",
            request("bob\u{e000}", 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "65 multi-byte characters",
            request(&"é".repeat(65), 500),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "zero amount",
            request("ok", 0),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "negative amount",
            request("ok", -5),
            vec![],
            Code::InvalidArgument,
        ),
        (
            "an 8 KiB idempotency key",
            request("ok", 500),
            vec![(IDEMPOTENCY_KEY, big_header.clone())],
            Code::InvalidArgument,
        ),
        (
            "a key with a space",
            request("ok", 500),
            vec![(IDEMPOTENCY_KEY, "has space".into())],
            Code::InvalidArgument,
        ),
        (
            "a malformed grpc-timeout",
            request("ok", 500),
            vec![(TIMEOUT_HEADER, "soon".into())],
            Code::InvalidArgument,
        ),
        (
            "a malformed x-retry-mode",
            request("ok", 500),
            vec![(RETRY_MODE, "sometimes".into())],
            Code::InvalidArgument,
        ),
        (
            "a message over 64 KiB",
            request(&huge_account, 500),
            vec![],
            Code::ResourceExhausted,
        ),
    ];
    // Every service, the relays too: they forward a message unread, and what they pass on
    // is refused by the ledger, which decodes it, with the same code.
    for (target, addr) in ["edge", "hop2", "hop3", "hop4", "ledger"]
        .into_iter()
        .zip(&chain.addrs)
    {
        let mut client = PaymentsClient::new(connect(addr).await);
        for (what, message, metadata, code) in &cases {
            let mut request = tonic::Request::new(message.clone());
            request.set_timeout(Duration::from_secs(5));
            let has_key = metadata.iter().any(|(k, _)| *k == IDEMPOTENCY_KEY);
            if !has_key {
                request.metadata_mut().insert(
                    IDEMPOTENCY_KEY,
                    tonic::metadata::MetadataValue::try_from(new_key()).unwrap(),
                );
            }
            for (k, v) in metadata {
                request.metadata_mut().insert(
                    *k,
                    tonic::metadata::MetadataValue::try_from(v.as_str()).unwrap(),
                );
            }
            let status = client.charge(request).await.expect_err(what);
            assert_eq!(status.code(), *code, "{target}, {what}: {status:?}");
        }
        // Bytes that are not a protobuf: the request is at fault, INVALID_ARGUMENT where it
        // is first decoded (the edge; the ledger for the relays, which forward it unread).
        let status = raw_charge(addr, vec![0xff, 0xff, 0xff, 0xff]).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{target}: {status:?}");
        assert!(
            status.message().contains("not a valid message"),
            "{target}: {status:?}"
        );
    }
    assert_eq!(row_counts(&url).await, (0, 0, 0), "nothing written");

    // An 8 KiB header nobody reads is carried and ignored; 64 multi-byte characters are fine.
    let mut request = charge(
        &"é".repeat(64),
        500,
        Some(&new_key()),
        Duration::from_secs(5),
        &[],
    );
    request.metadata_mut().insert(
        "x-padding",
        tonic::metadata::MetadataValue::try_from(big_header.as_str()).unwrap(),
    );
    chain.edge().await.charge(request).await.expect("accepted");
    assert_eq!(row_counts(&url).await, (1, 1, 1));

    // Control exists only on the admin port.
    let status = ControlClient::new(chain.channel(EDGE).await)
        .get_stats(GetStatsRequest {})
        .await
        .expect_err("no Control on the public port");
    assert_eq!(status.code(), Code::Unimplemented);
}

/// Frames no gRPC client sends, straight at every service: each answers them itself, with
/// the code tonic's servers give them, and nothing below sees them. A relay reads no
/// message, but it reads the frame around it: a bad one passed on would fail at the
/// ledger, and hop4's balancer would count that failure against a healthy ledger.
#[tokio::test]
async fn a_malformed_grpc_frame_is_refused_where_it_arrives() {
    let chain = Chain::spawn(Options::default()).await;
    let url = chain.database_url.clone().unwrap();
    let framed = |flag: u8, len: u32, payload: &[u8]| {
        let mut bytes = vec![flag];
        bytes.extend_from_slice(&len.to_be_bytes());
        bytes.extend_from_slice(payload);
        bytes
    };
    let cases: Vec<(&str, Vec<u8>, Option<&str>, &str)> = vec![
        ("no message", vec![], None, "13"),
        ("a frame header cut short", vec![0, 0, 0], None, "13"),
        ("a message cut short", framed(0, 40, b"abc"), None, "13"),
        ("a compressed message", framed(1, 3, b"abc"), None, "13"),
        ("a compression flag of 7", framed(7, 3, b"abc"), None, "13"),
        (
            "a compressed request",
            framed(0, 0, b""),
            Some("gzip"),
            "12",
        ),
        (
            "over 64 KiB by its prefix",
            framed(0, 1 << 20, b"abc"),
            None,
            "8",
        ),
    ];
    for (target, addr) in ["edge", "hop2", "hop3", "hop4", "ledger"]
        .into_iter()
        .zip(&chain.addrs)
    {
        let addr = host_port(addr);
        let connection = h2_connection(&addr).await;
        for (what, body, encoding, code) in &cases {
            let mut request =
                http::Request::post(format!("http://{addr}/retrychain.v1.Payments/Charge"))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .header(TIMEOUT_HEADER, "5S")
                    .header(IDEMPOTENCY_KEY, new_key());
            if let Some(encoding) = encoding {
                request = request.header("grpc-encoding", *encoding);
            }
            let mut sender = connection.clone().ready().await.unwrap();
            let (response, mut stream) = sender
                .send_request(request.body(()).unwrap(), false)
                .unwrap();
            stream
                .send_data(bytes::Bytes::from(body.clone()), true)
                .unwrap();
            let response = response.await.unwrap();
            let headers = response.headers();
            assert_eq!(
                headers.get("grpc-status").map(|s| s.to_str().unwrap()),
                Some(*code),
                "{target}, {what}: {headers:?}"
            );
            assert!(
                !headers.contains_key(resilience::wire::RELAYED),
                "{target}, {what}: answered below, not here: {headers:?}"
            );
        }
    }
    assert_eq!(row_counts(&url).await, (0, 0, 0), "nothing written");
    // And the chain serves well-formed calls, its balancers having seen no failure.
    chain
        .charge_new(Duration::from_secs(5), &[])
        .await
        .expect("a charge after the malformed ones");
}

/// What is sent, the message and extra metadata, and the code it must get.
type HostileCase = (
    &'static str,
    ChargeRequest,
    Vec<(&'static str, String)>,
    Code,
);

fn request(account: &str, amount: i64) -> ChargeRequest {
    ChargeRequest {
        account_id: account.to_owned(),
        amount_cents: amount,
    }
}

/// A caller that reaches hop2 directly cannot switch on every-layer retries, and resetting
/// the edge's counters does not refill its retry budget.
#[tokio::test]
async fn retry_load_cannot_be_raised_from_outside() {
    let options = Options::default().each(|s| s.allow_retry_mode_override = false);
    let chain = Chain::spawn(options).await;
    chain.fail_processor().await;

    // x-retry-mode straight at a relay: ignored, so one bottom call, not 27.
    PaymentsClient::new(chain.channel(1).await)
        .charge(charge(
            &new_account(),
            500,
            Some(&new_key()),
            Duration::from_secs(10),
            &[(RETRY_MODE, "every-layer")],
        ))
        .await
        .expect_err("the processor fails");
    assert_eq!(chain.stats(LEDGER).await.downstream_attempts, 1);

    // Drain some of the edge's budget, then ResetStats: the tokens stay where they were.
    for _ in 0..4 {
        let _ = chain.charge_new(Duration::from_secs(10), &[]).await;
    }
    let drained = chain.stats(EDGE).await.budget_tokens;
    assert!(drained < 10.0, "retries spent tokens: {drained}");
    let reset = chain
        .control(EDGE)
        .await
        .reset_stats(ResetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reset.requests_received, 0, "counters zeroed");
    assert!(
        (reset.budget_tokens - drained).abs() < 1e-9,
        "the budget was not refilled: {drained} -> {}",
        reset.budget_tokens
    );
}

/// One layer of retries even when the client retries too: the edge's give-up answer
/// carries `grpc-retry-pushback-ms: -1`, and a request marked as a client's retry gets a
/// single attempt.
#[tokio::test]
async fn the_edge_stops_clients_retrying_on_top() {
    let chain = Chain::spawn(Options::default()).await;
    chain.fail_processor().await;
    let status = chain
        .charge_new(Duration::from_secs(10), &[])
        .await
        .expect_err("fails");
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(
        status_header(&status, PUSHBACK_HEADER).as_deref(),
        Some("-1"),
        "the edge retried; the client must not"
    );
    assert_eq!(chain.stats(LEDGER).await.downstream_attempts, 3);

    chain.reset_stats().await;
    let status = chain
        .charge_new(Duration::from_secs(10), &[(PREVIOUS_ATTEMPTS_HEADER, "1")])
        .await
        .expect_err("fails");
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(
        chain.stats(LEDGER).await.downstream_attempts,
        1,
        "a client's retry gets one attempt"
    );

    // A failure the edge does not retry keeps no pushback of its own.
    chain
        .set_faults(LEDGER, failing_with(Code::FailedPrecondition))
        .await;
    let status = chain
        .charge_new(Duration::from_secs(10), &[])
        .await
        .expect_err("fails");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(status_header(&status, PUSHBACK_HEADER), None);
}

/// The edge's resident memory, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// `count` TCP connections to `addr` from the loopback address `from` (127.x.y.z: each is
/// a peer of its own to the server), sending nothing.
async fn connections_from(from: &str, addr: &str, count: usize) -> Vec<tokio::net::TcpStream> {
    let target: std::net::SocketAddr = addr.parse().unwrap();
    let mut connections = Vec::new();
    for _ in 0..count {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
        connections.push(socket.connect(target).await.unwrap());
    }
    connections
}

/// `count` silent connections to `addr`, from two loopback addresses (each under the
/// per-peer limit of 256).
async fn silent_connections(addr: &str, count: usize) -> Vec<tokio::net::TcpStream> {
    let mut connections = connections_from("127.0.0.2", addr, count / 2).await;
    connections.extend(connections_from("127.0.0.3", addr, count - count / 2).await);
    connections
}

/// A raw HTTP/2 connection to `addr` (`host:port`), for requests no gRPC client sends.
async fn h2_connection(addr: &str) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    send
}

/// A Charge whose body never ends: a gRPC message header announcing 100 bytes, then 10 of
/// them. The body's sender is returned too: dropping it would end the stream.
async fn unfinished_charge(
    connection: &h2::client::SendRequest<bytes::Bytes>,
    addr: &str,
    grpc_timeout: Option<&str>,
) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    let mut request = http::Request::post(format!("http://{addr}/retrychain.v1.Payments/Charge"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header(IDEMPOTENCY_KEY, new_key());
    if let Some(timeout) = grpc_timeout {
        request = request.header(TIMEOUT_HEADER, timeout);
    }
    let mut sender = connection.clone().ready().await.unwrap();
    let (response, mut body) = sender
        .send_request(request.body(()).unwrap(), false)
        .unwrap();
    let mut partial = vec![0u8, 0, 0, 0, 100];
    partial.extend([7u8; 10]);
    body.send_data(bytes::Bytes::from(partial), false).unwrap();
    (response, body)
}

/// The `grpc-status` of an HTTP/2 answer (a trailers-only answer's headers, else its
/// trailers), or its HTTP status when it has none.
async fn grpc_status_of(response: h2::client::ResponseFuture) -> String {
    let response = response.await.unwrap();
    if let Some(status) = response.headers().get("grpc-status") {
        return status.to_str().unwrap().to_owned();
    }
    let http_status = response.status();
    let mut body = response.into_body();
    while let Some(data) = body.data().await {
        if data.is_err() {
            break;
        }
    }
    match body.trailers().await {
        Ok(Some(trailers)) if trailers.contains_key("grpc-status") => {
            trailers["grpc-status"].to_str().unwrap().to_owned()
        }
        _ => format!("HTTP {http_status}"),
    }
}

/// What a hostile HTTP/2 client can do to the edge: too much metadata, bodies that never
/// end (with and without `grpc-timeout`), hundreds of idle connections. Each gets a gRPC
/// status, meanwhile other clients are served, and the edge's memory is printed.
// Multi-threaded: the test reads a process's memory while its load goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_abuse_gets_grpc_statuses_while_others_are_served() {
    let mut options = Options::processes();
    options.spec.edge().service.default_deadline_ms = 3000;
    let chain = Chain::spawn(options).await;
    let addr = host_port(&chain.addrs[EDGE]);
    let pid = chain.services[EDGE].pid().unwrap();
    chain
        .charge_new(Duration::from_secs(5), &[])
        .await
        .expect("a warm-up charge");
    let rss_before = rss_kib(pid);

    // 1,000 metadata entries, about 38 KiB: RESOURCE_EXHAUSTED, a gRPC status.
    let mut request = charge(
        &new_account(),
        500,
        Some(&new_key()),
        Duration::from_secs(5),
        &[],
    );
    for i in 0..1000 {
        let key = tonic::metadata::AsciiMetadataKey::from_bytes(format!("x-h{i}").as_bytes());
        request.metadata_mut().insert(
            key.unwrap(),
            tonic::metadata::MetadataValue::from_static("v"),
        );
    }
    let status = chain
        .edge()
        .await
        .charge(request)
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");

    // Past HTTP/2's own header-list limit (64 KiB), the transport answers, not gRPC: the
    // documented result (docs/contract.md) is a failure the client sees at once, never a charge.
    let mut request = charge(
        &new_account(),
        500,
        Some(&new_key()),
        Duration::from_secs(5),
        &[],
    );
    for i in 0..3000 {
        let key = tonic::metadata::AsciiMetadataKey::from_bytes(format!("x-h{i}").as_bytes());
        request.metadata_mut().insert(
            key.unwrap(),
            tonic::metadata::MetadataValue::from_static("v"),
        );
    }
    let status = chain
        .edge()
        .await
        .charge(request)
        .await
        .expect_err("refused by HTTP/2");
    println!(
        "3,000 metadata entries (~114 KiB): {:?} {}",
        status.code(),
        status.message()
    );

    // A body that never ends, with grpc-timeout 1S: DEADLINE_EXCEEDED, not CANCELLED.
    let connection = h2_connection(&addr).await;
    let sent = Instant::now();
    let (response, _body) = unfinished_charge(&connection, &addr, Some("1S")).await;
    let status = grpc_status_of(response).await;
    assert_eq!(
        status,
        "4",
        "DEADLINE_EXCEEDED (4), after {:?}",
        sent.elapsed()
    );
    println!(
        "unfinished body, grpc-timeout 1S: status {status} after {:?}",
        sent.elapsed()
    );

    // 500 connections that send nothing (from two addresses), and 200 unfinished bodies
    // without grpc-timeout on four connections: the default deadline (3 s here) counts
    // from each request's arrival.
    let silent = silent_connections(&addr, 500).await;
    let opened = Instant::now();
    // And one that sends a single byte of the preface: not enough to keep its slot.
    let mut one_byte = connections_from("127.0.0.5", &addr, 1).await.pop().unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut one_byte, b"P")
        .await
        .unwrap();
    let connections = [
        h2_connection(&addr).await,
        h2_connection(&addr).await,
        h2_connection(&addr).await,
        h2_connection(&addr).await,
    ];
    let mut open = Vec::new();
    for i in 0..200 {
        open.push(unfinished_charge(&connections[i % 4], &addr, None).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_loaded = rss_kib(pid);
    // Meanwhile, another client is served.
    chain
        .charge_new(Duration::from_secs(5), &[])
        .await
        .expect("a normal charge beside the abuse");
    let answers = futures::future::join_all(open.into_iter().map(|(response, body)| async move {
        let status = grpc_status_of(response).await;
        drop(body);
        status
    }))
    .await;
    let took = opened.elapsed();
    assert!(
        answers.iter().all(|s| s == "4"),
        "every unfinished body gets DEADLINE_EXCEEDED: {answers:?}"
    );
    println!("200 unfinished bodies without grpc-timeout: DEADLINE_EXCEEDED within {took:?}");

    // One address may hold 256 connections (the default): once they have been idle a
    // while, the 257th takes the place of the oldest one, which is closed (it sent no
    // preface, so its GOAWAY waits for one, and it is closed as idle), while everybody
    // else is still served.
    let mut one_peer = connections_from("127.0.0.4", &addr, 256).await;
    tokio::time::sleep(retrychain_node::limits::EVICTABLE_AFTER).await;
    one_peer.extend(connections_from("127.0.0.4", &addr, 1).await);
    let mut oldest = one_peer.remove(0);
    let ended = tokio::time::timeout(Duration::from_secs(4), async {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 64];
        loop {
            match oldest.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => continue, // the server's SETTINGS, sent before it was closed
            }
        }
    })
    .await;
    assert!(
        ended.is_ok(),
        "the oldest idle connection from the address is closed to make room"
    );
    chain
        .charge_new(Duration::from_secs(5), &[])
        .await
        .expect("another address is served");
    drop(one_peer);

    // A connection that never sent a byte is closed after 10 s (it reads the server's
    // SETTINGS, then the end).
    let mut silent = silent;
    let mut silent_one = silent.pop().unwrap();
    tokio::time::timeout(Duration::from_secs(15), async {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 64];
        while let Ok(n) = silent_one.read(&mut buf).await
            && n > 0
        {}
    })
    .await
    .expect("the edge closes a silent connection");
    tokio::time::timeout(Duration::from_secs(5), async {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 64];
        while let Ok(n) = one_byte.read(&mut buf).await
            && n > 0
        {}
    })
    .await
    .expect("the edge closes a connection that sent one byte of its preface");
    println!(
        "a silent connection was closed after {:?}",
        opened.elapsed()
    );
    drop(silent);
    drop(connections);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_after = rss_kib(pid);

    // The same again: memory freed by the first round is reused, not taken anew.
    let silent = silent_connections(&addr, 500).await;
    let connection = h2_connection(&addr).await;
    let mut open = Vec::new();
    for _ in 0..200 {
        open.push(unfinished_charge(&connection, &addr, None).await);
    }
    for (response, _body) in open {
        assert_eq!(grpc_status_of(response).await, "4");
    }
    drop(silent);
    drop(connection);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_again = rss_kib(pid);
    println!(
        "edge RSS: {rss_before} KiB before, {rss_loaded} KiB with 500 silent connections and \
         200 open streams, {rss_after} KiB after, {rss_again} KiB after a second round"
    );
    chain
        .charge_new(Duration::from_secs(5), &[])
        .await
        .expect("served after the abuse");
}

/// SIGTERM to the ledger under load, three times: the calls that meet its draining
/// connection (GOAWAY) or its closed port are retried or answered UNAVAILABLE, never
/// CANCELLED, the code for "the caller cancelled" that no client retries. Every key is
/// charged once after re-sending.
// Multi-threaded: the test waits for processes while the load goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_ledger_never_makes_a_caller_see_cancelled() {
    let mut chain = Chain::spawn(Options::processes()).await;
    let url = chain.database_url.clone().unwrap();
    let load = Load::start(&chain.addrs[EDGE], 16);
    for _ in 0..3 {
        chain.set_faults(LEDGER, delayed(200)).await;
        tokio::time::sleep(Duration::from_millis(800)).await;
        let status = chain.services[LEDGER]
            .terminate(retrychain_node::DRAIN_GRACE + Duration::from_secs(5))
            .await;
        assert!(
            status.is_some_and(|s| s.success()),
            "the ledger drains and exits cleanly: {status:?}"
        );
        chain.services[LEDGER].restart().await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    let sent = load.finish().await;
    println!(
        "ledger drained 3 times: {} charges, {:?}",
        sent.len(),
        codes(&sent)
    );
    assert!(
        !sent.iter().any(|s| s.code == Code::Cancelled),
        "no client saw CANCELLED: {:?}",
        codes(&sent)
    );
    resend_and_check(&chain.addrs[EDGE], &url, &sent).await;
}

/// The ledger's round-trip bound in the test chains (its default).
const ROUND_TRIP_BOUND: Duration = Duration::from_millis(1000);

/// Loads the chain (`edge`, on the database at `url`), stalls the database with `stall`
/// for 7 s, mends it with `mend`, and checks what a stalled database must not do: hold a
/// charge past the ledger's round-trip bound (plus the edge's retries, each bounded by the
/// pool's 250 ms acquire timeout) — or, for a charge caught between its phases (the
/// processor charged, the record not yet written), past the patience phase 2 has for the
/// database ([`retrychain_ledger::PHASE_TWO_PATIENCE`], its last try one acquire and one
/// round trip long), still short of the 5 s deadline —, answer anything but UNAVAILABLE,
/// take more than 2 s to serve again once mended, or charge a key twice.
async fn stall_the_database_under_load<S, M>(
    what: &str,
    edge: &str,
    url: &str,
    stall: impl FnOnce() -> S,
    mend: impl FnOnce() -> M,
) where
    S: Future<Output = ()>,
    M: Future<Output = ()>,
{
    let load = Load::start(edge, 8);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stall().await;
    let stalled = Instant::now();
    tokio::time::sleep(Duration::from_secs(7)).await;
    mend().await;
    let mended = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let sent = load.finish().await;

    let during: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.started + s.took > stalled && s.started < mended)
        .collect();
    let failed: Vec<&&Sent> = during.iter().filter(|s| s.code != Code::Ok).collect();
    assert!(!failed.is_empty(), "{what}: the stall failed some charges");
    for s in &failed {
        assert_eq!(s.code, Code::Unavailable, "{what}: {s:?}");
    }
    let longest = during.iter().map(|s| s.took).max().unwrap_or_default();
    let in_flight: Vec<Duration> = during
        .iter()
        .filter(|s| s.started < stalled)
        .map(|s| s.started + s.took - stalled)
        .collect();
    let first_success = sent
        .iter()
        .filter(|s| s.code == Code::Ok && s.started + s.took > mended)
        .map(|s| s.started + s.took - mended)
        .min()
        .expect("charges succeed once the database is back");
    println!(
        "{what}: {} charges during the stall, {} failed ({:?}); in flight when it began: {} \
         ended after at most {:?}; longest charge {longest:?}; first success {first_success:?} \
         after it ended",
        during.len(),
        failed.len(),
        codes(&sent),
        in_flight.len(),
        in_flight.iter().max().copied().unwrap_or_default(),
    );
    let allowed = retrychain_ledger::PHASE_TWO_PATIENCE
        + Duration::from_millis(250)
        + ROUND_TRIP_BOUND
        + Duration::from_millis(500);
    assert!(
        longest <= allowed,
        "{what}: a charge waited {longest:?}, past phase 2's patience and a last try ({allowed:?})"
    );
    let beyond_phases: Vec<Duration> = during
        .iter()
        .map(|s| s.took)
        .filter(|took| *took > ROUND_TRIP_BOUND + Duration::from_millis(1500))
        .collect();
    println!(
        "{what}: {} charges took longer than the round-trip bound and the edge's retries (2.5 s): \
         caught between their phases: {beyond_phases:?}",
        beyond_phases.len()
    );
    assert!(
        first_success <= Duration::from_secs(2),
        "{what}: the first success came {first_success:?} after the database was back"
    );
    resend_and_check(edge, url, &sent).await;
}

/// Sends `signal` (`STOP`, `CONT`) to every process of `cluster`'s server: the postmaster
/// and the backends of the connections open now.
async fn signal_server(cluster: &tempgres::TempCluster, signal: &'static str) {
    let pids = cluster.server_pids().unwrap();
    off_runtime(move || {
        for pid in pids {
            let _ = Command::new("kill")
                .args([format!("-{signal}"), pid.to_string()])
                .status();
        }
    })
    .await
}

/// Postgres frozen, the postmaster first and then every backend (SIGSTOP: a stalled VM or
/// a paused container), for 7 s under load. A frozen server applies none of its own
/// timeouts; the ledger's round-trip bound ends the charges it holds.
#[tokio::test]
async fn a_frozen_database_holds_no_charge_past_the_round_trip_bound() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (cluster, url, chain) = own_postgres_chain().await;
    chain.set_faults(LEDGER, delayed(20)).await;
    stall_the_database_under_load(
        "Postgres frozen 7 s",
        &chain.addrs[EDGE],
        &url,
        || signal_server(&cluster, "STOP"),
        || signal_server(&cluster, "CONT"),
    )
    .await;
}

/// One charge under `key`, what its client saw, and the status it failed with.
async fn charge_seen(
    client: &PaymentsClient<tonic::transport::Channel>,
    account: &str,
    key: String,
    deadline: Duration,
) -> (Sent, Option<tonic::Status>) {
    let started = Instant::now();
    let answer = charge_on(client, account, 1, Some(&key), deadline).await;
    let took = started.elapsed();
    let (code, message) = match &answer {
        Ok(_) => (Code::Ok, String::new()),
        Err(status) => (status.code(), status.message().to_owned()),
    };
    let sent = Sent {
        account: account.to_owned(),
        key,
        amount: 1,
        code,
        message,
        started,
        took,
    };
    (sent, answer.err())
}

/// The deadlines of the two charges let wait in [`the_line_at_the_door_against_a_stall`],
/// in ms, in the order they arrive (100 ms apart, so that the second finds the first in
/// line): the first predicted past the half of its time the edge admits to, the second
/// behind a call in line (it goes in line behind it, its connection at its fair share),
/// each within what may drain ahead of it while it waits.
const WAITERS_DEADLINES: [u64; 2] = [1100, 1600];

/// The line at the edge's door (`--door-wait-share`) against a real stall of the database
/// (`stall`, mended by `mend`) while charges wait at the edge for a place; the chain's
/// ledger reaches the database at `chain_url`, the check reads it at `url`. The ledger
/// takes 300 ms a charge and the edge's estimate is measured one charge at a time, so with
/// one charge in flight the next is predicted at about 0.6 s, past the half of its 1.1 s
/// it may take below (0.54 s), and within what may drain ahead of it (that half and half
/// of half its time: 0.82 s): it waits, for half its time. The one after it, 100 ms later
/// with 1.6 s, finds it in line and goes behind it (its connection holds its fair share),
/// predicted behind the call in flight and the line at about 0.9 s, within its 1.19 s:
/// it waits too, for half its time. The charge in flight meets the stall and, the
/// ledger's round-trip bound set past the deadline, holds its place until its deadline;
/// nothing is answered while the others wait. When their wait is over they are refused at
/// the edge — UNAVAILABLE, overloaded, saying that no call was answered — and reach no
/// inner service, rather than being let in to meet the stall with half their time gone
/// (how a wait ended before the line judged its own pace: such calls waited out their
/// deadlines in the chain). Mended, the chain serves again and every key is charged once.
async fn the_line_at_the_door_against_a_stall<S, M>(
    what: &str,
    chain_url: String,
    url: &str,
    stall: impl FnOnce() -> S,
    mend: impl FnOnce() -> M,
) where
    S: Future<Output = ()>,
    M: Future<Output = ()>,
{
    let mut options = Options::default();
    options.spec.edge().door_wait_share = 0.5;
    options.spec.edge().service.min_concurrency = 1;
    options.spec.ledger().db_round_trip_timeout_ms = 5000;
    let chain = Chain::spawn_on(options, chain_url).await;
    chain.set_faults(LEDGER, delayed(300)).await;
    let client = PaymentsClient::new(chain.channel(EDGE).await);
    let account = new_account();
    let deadline = Duration::from_secs(2);
    let mut sent = Vec::new();
    // One at a time: a window of the estimate closes after 8 answers.
    for _ in 0..10 {
        let (charge, status) = charge_seen(&client, &account, new_key(), deadline).await;
        assert!(status.is_none(), "one at a time, each fits: {status:?}");
        sent.push(charge);
    }

    stall().await;
    let first = charge_seen(&client, &account, new_key(), deadline);
    // The waiters once the first is in flight at the edge.
    let waiters = futures::future::join_all(WAITERS_DEADLINES.iter().enumerate().map(|(i, ms)| {
        let client = &client;
        let account = &account;
        async move {
            tokio::time::sleep(Duration::from_millis(200 + 100 * i as u64)).await;
            charge_seen(client, account, new_key(), Duration::from_millis(*ms)).await
        }
    }));
    // While they wait, the edge's metrics show the line.
    let line_seen = async {
        tokio::time::sleep(Duration::from_millis(450)).await;
        let metrics = scrape_metrics(&chain.admins[EDGE]).await;
        let gauge = |name: &str| {
            metrics
                .lines()
                .find(|line| line.starts_with(name))
                .and_then(|line| line.rsplit(' ').next())
                .and_then(|value| value.parse::<f64>().ok())
        };
        (
            gauge("retrychain_door_waiting{"),
            gauge("retrychain_door_line_share{"),
        )
    };
    let ((first, _), waiters, (waiting, line_share)) = tokio::join!(first, waiters, line_seen);
    assert_eq!(waiting, Some(2.0), "{what}: two calls in line at the edge");
    assert_eq!(line_share, Some(1.0), "{what}: nobody went in past them");
    mend().await;
    let thawed = Instant::now();
    println!(
        "{what}: the charge in flight: {:?} after {:?} ({})",
        first.code, first.took, first.message
    );
    let waited_longest = waiters.iter().map(|(c, _)| c.started + c.took).max();
    assert!(
        waited_longest.is_some_and(|end| first.started + first.took > end),
        "the charge in flight held its place past the waiters' wait: {:?}",
        first.took
    );
    sent.push(first);
    for ((charge, status), ms) in waiters.into_iter().zip(WAITERS_DEADLINES) {
        let waiter_deadline = Duration::from_millis(ms);
        println!(
            "{what}: a waiter: {:?} after {:?} ({})",
            charge.code, charge.took, charge.message
        );
        let status = status.expect("a waiter is refused: nothing was answered while it waited");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("no call was answered")
                && status.message().contains("waiting"),
            "refused for the stall, after its wait: {status:?}"
        );
        assert!(
            status.metadata().get(resilience::wire::RELAYED).is_none(),
            "refused at the edge, not below: {status:?}"
        );
        assert!(
            matches!(
                resilience::wire::pushback(&status),
                resilience::wire::Pushback::RetryAfter(_)
            ),
            "told when to come back: {status:?}"
        );
        // Its wait (half of its time, less the server's reserve), then the refusal: not its
        // deadline, which a call let in would have met in the frozen chain.
        assert!(
            charge.took >= waiter_deadline.mul_f64(0.4)
                && charge.took < waiter_deadline.mul_f64(0.9),
            "refused once its wait was over: {:?} of {waiter_deadline:?}",
            charge.took
        );
        sent.push(charge);
    }

    // Thawed, the chain serves again.
    loop {
        let (charge, status) = charge_seen(&client, &account, new_key(), deadline).await;
        sent.push(charge);
        if status.is_none() {
            break;
        }
        assert!(
            thawed.elapsed() < Duration::from_secs(5),
            "{what}: served again within 5 s of the mend: {status:?}"
        );
    }
    println!(
        "{what}: served again {:?} after it was mended",
        thawed.elapsed()
    );
    resend_and_check(&chain.addrs[EDGE], url, &sent).await;
}

/// [`the_line_at_the_door_against_a_stall`] with Postgres frozen (SIGSTOP).
#[tokio::test]
async fn a_frozen_database_empties_the_line_at_the_door_with_refusals_at_the_edge() {
    let _one = ONE_AT_A_TIME.lock().await;
    let cluster = own_cluster().await;
    let url = cluster.url("postgres");
    the_line_at_the_door_against_a_stall(
        "Postgres frozen",
        url.clone(),
        &url,
        || signal_server(&cluster, "STOP"),
        || signal_server(&cluster, "CONT"),
    )
    .await;
}

/// [`the_line_at_the_door_against_a_stall`] with the ledger's path to Postgres
/// black-holed (nothing arrives either way, nothing is refused).
#[tokio::test]
async fn a_black_holed_database_path_empties_the_line_at_the_door_with_refusals_at_the_edge() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (cluster, url, hole, through_hole) = BlackHole::on_own_cluster().await;
    the_line_at_the_door_against_a_stall(
        "database path black-holed",
        through_hole,
        &url,
        || async {
            hole.cut.send_replace(true);
        },
        || async {
            hole.cut.send_replace(false);
        },
    )
    .await;
    drop(cluster);
}

/// A TCP path that black-holes both ways (nothing arrives, nothing is refused, no FIN
/// gets through) between the ledger and Postgres: a proxy in this test, which either
/// forwards or holds everything until it heals.
struct BlackHole {
    /// Where the ledger connects.
    port: u16,
    /// `true` while the path is cut.
    cut: tokio::sync::watch::Sender<bool>,
}

impl BlackHole {
    /// A cluster of this test's own, its database's URL, and a black hole in front of it
    /// with the URL through the hole.
    async fn on_own_cluster() -> (tempgres::TempCluster, String, BlackHole, String) {
        let cluster = own_cluster().await;
        let url = cluster.url("postgres");
        let hole = BlackHole::start(cluster.port()).await;
        let through_hole = format!("postgres://postgres@127.0.0.1:{}/postgres", hole.port);
        (cluster, url, hole, through_hole)
    }

    async fn start(target: u16) -> BlackHole {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, cut_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let mut cut = cut_rx.clone();
                tokio::spawn(async move {
                    // A connection made while the path is cut gets no further.
                    let _ = cut.wait_for(|cut| !*cut).await;
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::spawn(Self::pipe(client_read, server_write, cut.clone()));
                    tokio::spawn(Self::pipe(server_read, client_write, cut));
                });
            }
        });
        BlackHole { port, cut }
    }

    /// Forwards `from` to `to` while the path is whole; holds everything, the end of the
    /// stream included, while it is cut.
    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut cut: tokio::sync::watch::Receiver<bool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let _ = cut.wait_for(|cut| !*cut).await;
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let _ = cut.wait_for(|cut| !*cut).await;
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = cut.wait_for(|cut| !*cut).await;
        let _ = to.shutdown().await;
    }
}

/// The ledger's path to Postgres black-holed for 7 s under load: the same promises as a
/// frozen server.
#[tokio::test]
async fn a_black_holed_database_path_holds_no_charge_past_the_round_trip_bound() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (cluster, url, hole, through_hole) = BlackHole::on_own_cluster().await;
    let chain = Chain::spawn_on(Options::default(), through_hole).await;
    chain.set_faults(LEDGER, delayed(20)).await;
    stall_the_database_under_load(
        "database path black-holed 7 s",
        &chain.addrs[EDGE],
        &url,
        || async {
            hole.cut.send_replace(true);
        },
        || async {
            hole.cut.send_replace(false);
        },
    )
    .await;
    drop(cluster);
}

/// More requests at once than `--max-in-flight` allows (alone, a fixed concurrency limit):
/// the extra ones are refused at once as overloaded — UNAVAILABLE, marked, with a pushback
/// (retryable after it) — the others are served, and nothing waits in a queue the caller
/// cannot see.
#[tokio::test]
async fn requests_over_the_in_flight_limit_are_refused_at_once() {
    let mut options = Options::default();
    options.spec.edge().service.max_in_flight = 4;
    let chain = Chain::spawn(options).await;
    chain.set_faults(LEDGER, delayed(300)).await;
    let edge = chain.edge().await;
    let results = futures::future::join_all((0..12).map(|_| {
        let edge = edge.clone();
        async move {
            let started = Instant::now();
            let result =
                charge_on(&edge, &new_account(), 100, Some(&new_key()), LOAD_DEADLINE).await;
            let result = result.map(|_| ()).map_err(|s| {
                let overloaded = s.metadata().get(resilience::wire::OVERLOADED).is_some();
                let pushback = resilience::wire::pushback(&s);
                assert!(
                    !overloaded || matches!(pushback, resilience::wire::Pushback::RetryAfter(_)),
                    "{s:?}"
                );
                (s.code(), overloaded)
            });
            (result, started.elapsed())
        }
    }))
    .await;
    let served = results.iter().filter(|(r, _)| r.is_ok()).count();
    let refused: Vec<&Duration> = results
        .iter()
        .filter(|(r, _)| *r == Err((Code::Unavailable, true)))
        .map(|(_, took)| took)
        .collect();
    assert_eq!(served + refused.len(), 12, "{results:?}");
    assert_eq!(served, 4, "{results:?}");
    let first_served = results
        .iter()
        .filter(|(r, _)| r.is_ok())
        .map(|(_, took)| *took)
        .min()
        .unwrap();
    assert!(
        refused.iter().all(|took| **took < first_served),
        "refused at once, not queued behind the served ones: {results:?}"
    );
    chain.set_faults(LEDGER, faults()).await;
    chain
        .charge_new(Duration::from_secs(5), &[])
        .await
        .expect("served again once the burst is over");
}

/// hop2's path to hop3 black-holed for 14 s under load (every packet sent to hop3's port
/// dropped: silence, not a refusal), then healed. hop2's kernel gives the connection that
/// met the black hole up after 10 s without an acknowledgement (`TCP_USER_TIMEOUT`, set on
/// every connection the balancer dials), so once the path heals the next charges go over a
/// new connection and are served within seconds. Without that bound the connection stays
/// open, retransmitting at TCP's doubling intervals — after a 14 s cut its next try comes
/// about 25 s in — and every charge until then waits out its deadline. Every key is
/// charged once when all are sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_hop_is_called_on_a_new_connection_once_the_path_heals() {
    if !retrychain_chaos::net::available() {
        missing_tool("a partition needs iptables and root: the black-holed hop is not checked");
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let (_cluster, url, chain) = own_postgres_chain().await;
    let hop3 = &chain.addrs[2];
    let port: u16 = hop3
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {hop3}"));
    let load = Load::start(&chain.addrs[EDGE], 4);
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut hole = retrychain_chaos::net::Rules::default();
    hole.disturb(&[port], retrychain_chaos::net::Disturbance::Partition)
        .expect("iptables: partition hop3");
    let cut = Instant::now();
    tokio::time::sleep(Duration::from_secs(14)).await;
    hole.heal().expect("iptables: heal");
    let healed = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let sent = load.finish().await;

    let during = sent
        .iter()
        .filter(|s| s.started >= cut + Duration::from_secs(1) && s.started + s.took < healed)
        .count();
    let resumed =
        first_success_after(&sent, healed).expect("charges are served once the path heals");
    println!(
        "hop3 black-holed 14 s: {during} charges answered during the cut, \
         the first served after the heal {resumed:?} after it"
    );
    assert!(
        resumed < Duration::from_secs(5),
        "the first charge served {resumed:?} after the path healed"
    );
    // (No INTERNAL or UNKNOWN either: checked with the invariant.)
    let cancelled: Vec<&Sent> = sent.iter().filter(|s| s.code == Code::Cancelled).collect();
    assert!(
        cancelled.is_empty(),
        "a client saw CANCELLED: {cancelled:?}"
    );
    resend_and_check(&chain.addrs[EDGE], &url, &sent).await;
}
