//! Postgres failover, for real: a pg_auto_failover formation (a monitor, a primary and a
//! synchronous standby; [`tempgres::HaFormation`]) under the ledger, its `DATABASE_URL` the
//! multi-host URL the formation prints. Under load, the standby is killed, then the
//! primary, each restarted to rejoin; then a planned switchover. After each: every charge
//! a client saw acknowledged is on the new primary, once; none was answered OK while the
//! primary wrote alone; no client saw INTERNAL or UNKNOWN; charges succeed again (the time
//! to the first success is printed). At the end every key is re-sent and each is charged
//! exactly once.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::{load::*, support::*};
use tempgres::{HaFormation, ha::NodeState};
use tonic::Code;

/// How long the formation may take to settle after a fault (the monitor notices a dead
/// node within about 2 s; a rejoining node replays and catches up).
const SETTLE: Duration = Duration::from_secs(90);

/// The formation, shared with the blocking calls that drive it (`pg_autoctl`, signals).
#[derive(Clone)]
struct Formation(Arc<Mutex<HaFormation>>);

impl Formation {
    async fn start() -> Formation {
        let formation = off_runtime(HaFormation::start)
            .await
            .unwrap_or_else(|e| panic!("a pg_auto_failover formation: {e}"));
        Formation(Arc::new(Mutex::new(formation)))
    }

    /// Runs `op` on the formation off the runtime (it blocks: processes, polling).
    async fn with<T: Send + 'static>(
        &self,
        op: impl FnOnce(&mut HaFormation) -> Result<T, tempgres::Error> + Send + 'static,
    ) -> T {
        let formation = Arc::clone(&self.0);
        off_runtime(move || op(&mut formation.lock().unwrap()))
            .await
            .unwrap_or_else(|e| panic!("the formation: {e}"))
    }

    async fn uri(&self) -> String {
        self.with(|f| Ok(f.uri())).await
    }

    /// The node reporting primary now, and the URL to look at it directly.
    async fn primary(&self) -> (usize, String) {
        self.with(|f| {
            let i = f.primary()?.expect("a primary");
            Ok((i, f.node_url(i)))
        })
        .await
    }

    /// Waits until the monitor sees `ready`.
    async fn settle(
        &self,
        ready: impl Fn(&[NodeState]) -> bool + Send + 'static,
    ) -> Vec<NodeState> {
        self.with(move |f| f.wait_until(SETTLE, ready)).await
    }
}

/// A primary and a synchronous standby, both healthy.
fn replicating(nodes: &[NodeState]) -> bool {
    nodes
        .iter()
        .any(|n| n.reported == "primary" && n.assigned == "primary")
        && nodes
            .iter()
            .any(|n| n.reported == "secondary" && n.assigned == "secondary")
}

/// A primary writing alone, its standby gone.
fn primary_alone(nodes: &[NodeState]) -> bool {
    nodes.iter().any(|n| n.reported == "wait_primary")
}

/// Node `i` is the primary (alone or not), as it reports and as the monitor assigned.
fn primary_is(i: usize) -> impl Fn(&[NodeState]) -> bool + Send + 'static {
    let name = format!("node{}", i + 1);
    move |nodes| {
        nodes.iter().any(|n| {
            n.name == name
                && n.reported == n.assigned
                && matches!(n.reported.as_str(), "primary" | "wait_primary")
        })
    }
}

/// Puts the chain under load, applies `fault`, waits for the formation to reach `after`,
/// keeps the load on 2 s longer, and checks what the clients saw against the primary.
async fn under_load(
    chain: &Chain,
    formation: &Formation,
    what: &str,
    fault: impl FnOnce(&mut HaFormation) -> Result<(), tempgres::Error> + Send + 'static,
    after: impl Fn(&[NodeState]) -> bool + Send + 'static,
) -> Vec<Sent> {
    let load = Load::start(&chain.addrs[EDGE], 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let faulted = Instant::now();
    formation.with(fault).await;
    // Calls started once the fault is done: a call that completed in the moment before the
    // fault took hold says nothing about the recovery.
    let fault_done = Instant::now();
    let state = formation.settle(after).await;
    let settled = faulted.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = load.finish().await;

    let after_fault: Vec<&Sent> = sent.iter().filter(|s| s.started > fault_done).collect();
    let first_success = after_fault
        .iter()
        .filter(|s| s.code == Code::Ok)
        .map(|s| s.started + s.took - faulted)
        .min();
    println!(
        "{what}: the formation settled in {settled:.1?} ({state:?}); {} charges {:?}; \
         first success {first_success:.1?} after the fault",
        sent.len(),
        codes(&sent),
    );
    if first_success.is_none() && !chain.services.is_empty() {
        println!("the ledger's log:\n{}", chain.log(LEDGER));
    }
    assert!(
        first_success.is_some(),
        "{what}: no charge succeeded after the fault: {:?}; the last failures said: {:#?}",
        codes(&sent),
        sent.iter()
            .rev()
            .filter(|s| s.code != Code::Ok)
            .take(3)
            .map(|s| &s.message)
            .collect::<Vec<_>>()
    );
    assert!(
        !sent
            .iter()
            .any(|s| matches!(s.code, Code::Internal | Code::Unknown)),
        "{what}: a client saw INTERNAL or UNKNOWN: {:?}",
        codes(&sent)
    );
    // Whatever failed, it was never because the ledger tried a standby or a demoted
    // primary: those it refuses before writing (`after_connect`) or finds read-only.
    let refused: Vec<&str> = sent
        .iter()
        .filter(|s| met_a_standby(&s.message))
        .map(|s| s.message.as_str())
        .take(3)
        .collect();
    println!("{what}: failures that met a standby or a read-only server: {refused:?}");
    let (_, primary_url) = formation.primary().await;
    assert_acknowledged_kept(&primary_url, &sent).await;
    sent
}

#[tokio::test]
async fn postgres_failover_and_switchover_lose_no_acknowledged_charge_and_charge_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let formation = Formation::start().await;
    let chain = Chain::spawn_on(Options::processes(), formation.uri().await).await;
    let mut sent = Vec::new();
    // Three faults in turn, each under load and checked (`under_load`).

    // The standby dies: the primary writes alone — and the ledger answers no charge until a
    // standby has it again (`--standby-copy`, on for a multi-host URL). Then it returns.
    let (primary, _) = formation.primary().await;
    let standby = 1 - primary;
    let alone = Alone::default();
    let outage = under_load(
        &chain,
        &formation,
        "standby killed, then back",
        alone.while_(
            primary_alone,
            move |f| f.kill_node(standby),
            move |f| f.restart_node(standby),
        ),
        replicating,
    )
    .await;
    alone.no_success_within(&outage, "the standby was down");
    sent.extend(outage);

    // The primary dies: the monitor promotes the standby, which writes alone until the old
    // primary returns (rewound) as its standby; the ledger follows the new primary and
    // answers nothing while it writes alone.
    let (old_primary, _) = formation.primary().await;
    let alone = Alone::default();
    let failover = under_load(
        &chain,
        &formation,
        "primary killed, then back as the standby",
        alone.while_(
            primary_is(1 - old_primary),
            move |f| f.kill_node(old_primary),
            move |f| f.restart_node(old_primary),
        ),
        replicating,
    )
    .await;
    alone.no_success_within(&failover, "the new primary was writing alone");
    let (new_primary, new_primary_url) = formation.primary().await;
    assert_ne!(new_primary, old_primary, "the standby was promoted");
    // No call met the returning old primary (a refused connection or a read-only write
    // would say so), and the ledger holds no session there.
    let met_old: Vec<&str> = failover
        .iter()
        .filter(|s| met_a_standby(&s.message))
        .map(|s| s.message.as_str())
        .collect();
    assert!(
        met_old.is_empty(),
        "calls met the old primary or a standby: {met_old:?}"
    );
    sent.extend(failover);
    let old_primary_url = formation.with(move |f| Ok(f.node_url(old_primary))).await;
    assert_eq!(
        ledger_sessions(&old_primary_url).await,
        0,
        "no ledger session on the old primary"
    );
    assert!(
        ledger_sessions(&new_primary_url).await > 0,
        "the ledger's pool is on the new primary"
    );

    // A planned switchover moves the primary back; the ledger follows again, and charges
    // are answered once the other node streams from it (settled: both).
    let back = primary_is(old_primary);
    sent.extend(
        under_load(
            &chain,
            &formation,
            "switchover",
            |f| f.switchover(),
            move |nodes| back(nodes) && replicating(nodes),
        )
        .await,
    );
    let (after_switchover, primary_url) = formation.primary().await;
    assert_eq!(
        after_switchover, old_primary,
        "the switchover moved the primary back"
    );

    resend_and_check(&chain.addrs[EDGE], &primary_url, &sent).await;
    drop(chain);
}

/// Waits (up to [`SETTLE`]) until the writable host of the multi-host `uri` has a standby
/// streaming from it: until then the ledger answers no charge (`--standby-copy`).
async fn a_standby_streams_from(uri: &str) {
    let start = Instant::now();
    loop {
        let host = writable_host(uri).await;
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&host)
            .await
            .unwrap();
        let streaming: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if streaming > 0 {
            return;
        }
        assert!(
            start.elapsed() < SETTLE,
            "no standby streams from {host} after {SETTLE:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Whether a failure says the ledger met a standby or a read-only (demoted) server — which
/// it refuses before writing: a connection that landed there, or a write refused.
fn met_a_standby(message: &str) -> bool {
    message.contains("is a standby") || message.contains("read-only")
}

/// When a primary wrote alone during a fault: from the moment the monitor saw it alone
/// until its standby was being brought back.
#[derive(Clone, Default)]
struct Alone(Arc<Mutex<Option<(Instant, Instant)>>>);

impl Alone {
    /// A fault for [`under_load`]: `break_it`, a wait until `alone` holds (the primary
    /// writing without a standby), 3 s of load in that state, then `mend`; the window is
    /// kept for [`Alone::no_success_within`].
    fn while_(
        &self,
        alone: impl Fn(&[NodeState]) -> bool + Send + 'static,
        break_it: impl FnOnce(&mut HaFormation) -> Result<(), tempgres::Error> + Send + 'static,
        mend: impl FnOnce(&mut HaFormation) -> Result<(), tempgres::Error> + Send + 'static,
    ) -> impl FnOnce(&mut HaFormation) -> Result<(), tempgres::Error> + Send + 'static {
        let window = Arc::clone(&self.0);
        move |f| {
            break_it(f)?;
            f.wait_until(SETTLE, alone)?;
            let from = Instant::now();
            std::thread::sleep(Duration::from_secs(3));
            *window.lock().unwrap() = Some((from, Instant::now()));
            mend(f)
        }
    }

    /// No call that started once the primary was alone and ended before its standby was
    /// being brought back succeeded: every success is on two servers. Some were tried.
    fn no_success_within(&self, sent: &[Sent], what: &str) {
        let (from, until) = self.0.lock().unwrap().expect("the fault ran");
        let within: Vec<&Sent> = sent
            .iter()
            .filter(|s| s.started > from && s.started + s.took < until)
            .collect();
        let mut codes = std::collections::BTreeMap::<String, usize>::new();
        for s in &within {
            *codes.entry(format!("{:?}", s.code)).or_default() += 1;
        }
        println!("while {what}: {} charges {codes:?}", within.len());
        assert!(!within.is_empty(), "no charge was tried while {what}");
        let answered: Vec<&&Sent> = within.iter().filter(|s| s.code == Code::Ok).collect();
        assert!(
            answered.is_empty(),
            "while {what}, {} charges were answered OK: a success a failover could take back",
            answered.len()
        );
    }
}

/// The URL of whichever host of the multi-host `uri` accepts writes now.
async fn writable_host(uri: &str) -> String {
    let (scheme_user, rest) = uri.split_once('@').unwrap();
    let (hosts, path) = rest.split_once('/').unwrap();
    let database = path.split('?').next().unwrap();
    for host in hosts.split(',') {
        let url = format!("{scheme_user}@{host}/{database}");
        let Ok(mut conn) = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await else {
            continue;
        };
        let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        if !standby {
            return url;
        }
    }
    panic!("no host of {uri} accepts writes");
}

#[tokio::test]
async fn up_with_postgres_ha_rides_through_the_failover_it_tells_you_to_run() {
    use std::process::Command;

    let _one = ONE_AT_A_TIME.lock().await;
    let base = free_base_port();
    let (mut up, lines) = start_up(
        &["--postgres", "ha", "--base-port", &base.to_string()],
        |up| {
            up.env_remove("DATABASE_URL");
        },
    );
    let (mut uri, mut fail_over) = (None, None);
    let start = Instant::now();
    loop {
        let line = lines
            .recv_timeout(Duration::from_secs(180).saturating_sub(start.elapsed()))
            .expect("retrychain up --postgres ha never said it was up");
        if let Some(url) = line.trim().strip_prefix("postgres://") {
            uri = Some(format!("postgres://{url}"));
        }
        if let Some(command) = line.strip_prefix("fail over:") {
            fail_over = Some(command.trim().to_owned());
        }
        if line.starts_with("retrychain is up") {
            break;
        }
    }
    let uri = uri.expect("up prints the formation's URI");
    let fail_over = fail_over.expect("up prints how to fail over");
    // Nothing `up` started listens beyond the loopback: not the services, not the
    // formation's nodes, not its monitor (pg_autoctl's own default is every address).
    let open = listeners_beyond_loopback(up.0.id());
    assert!(open.is_empty(), "listening beyond the loopback: {open:#?}");
    let formation_dir = std::path::PathBuf::from(
        fail_over
            .rsplit_once("--pgdata ")
            .map(|(_, monitor)| monitor.trim_matches('\''))
            .expect("the command names the monitor's directory"),
    )
    .parent()
    .unwrap()
    .to_owned();
    assert!(formation_dir.exists(), "{formation_dir:?}");
    assert!(uri.contains(','), "a multi-host URI: {uri}");
    let before = writable_host(&uri).await;

    let edge = format!("http://127.0.0.1:{base}");
    let load = Load::start(&edge, 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let failed_over = off_runtime(move || {
        Command::new("sh")
            .args(["-c", &fail_over])
            .output()
            .unwrap()
    })
    .await;
    assert!(
        failed_over.status.success(),
        "the printed fail-over command: {}",
        String::from_utf8_lossy(&failed_over.stderr)
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = load.finish().await;
    let after = writable_host(&uri).await;
    assert_ne!(before, after, "the primary moved");
    println!(
        "up --postgres ha, failed over by hand: {} charges {:?}",
        sent.len(),
        codes(&sent)
    );
    assert_acknowledged_kept(&after, &sent).await;
    // Charges are answered again once the old primary streams from the new one.
    a_standby_streams_from(&uri).await;
    resend_and_check(&edge, &after, &sent).await;

    let _ = Command::new("kill")
        .args(["-TERM", &up.0.id().to_string()])
        .status();
    let status = up.0.wait().unwrap();
    assert!(status.success(), "up stops cleanly on SIGTERM: {status}");
    assert!(
        !formation_dir.exists(),
        "up removes the formation when it stops: {formation_dir:?}"
    );
}

/// How many sessions the ledger holds on the server at `url` (its connections carry the
/// application name `retrychain-ledger`); a connection being closed may take a moment to go.
async fn ledger_sessions(url: &str) -> i64 {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url)
        .await
        .unwrap();
    let mut sessions = 0;
    for _ in 0..20 {
        sessions = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'retrychain-ledger'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if sessions == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sessions
}

/// Whether the charge under `key` is on the server at `url`.
async fn has_charge(url: &str, key: &str) -> bool {
    has_row(url, "charges", "idempotency_key", key).await
}

/// Whether `table` at `url` has a row whose `column` is `value`.
async fn has_row(url: &str, table: &str, column: &str, value: &str) -> bool {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url)
        .await
        .unwrap();
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE {column} = $1"
    )))
    .bind(value)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    n > 0
}

/// Freezes (SIGSTOP) or thaws (SIGCONT) the standby's WAL receiver: the standby stays up
/// and healthy in the monitor's eyes, but stops confirming WAL, so the primary's commits
/// wait for it (synchronous replication) — the state an isolated primary is in.
async fn signal_wal_receiver(standby_url: &str, signal: &str) {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(standby_url)
        .await
        .unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pid FROM pg_stat_wal_receiver")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

/// Ends (`pg_terminate_backend`) every session of the primary at `url` that waits for the
/// synchronous standby, once there is one: what an operator clearing stuck sessions, a
/// pooler's query timeout or a fast shutdown does. Postgres then keeps the commit it was
/// waiting to confirm — committed here, visible here, not on the standby.
async fn end_sessions_waiting_for_the_standby(url: &str) -> i64 {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url)
        .await
        .unwrap();
    let start = Instant::now();
    loop {
        let ended: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if ended > 0 || start.elapsed() > Duration::from_secs(5) {
            return ended;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_success_is_answered_only_once_the_standby_has_the_charge() {
    let _one = ONE_AT_A_TIME.lock().await;
    let formation = Formation::start().await;
    let chain = Chain::spawn_on(Options::default(), formation.uri().await).await;
    let (primary, primary_url) = formation.primary().await;
    let standby_url = formation.with(move |f| Ok(f.node_url(1 - primary))).await;
    let account = new_account();
    chain
        .charge(&account, 100, Some(&new_key()), Duration::from_secs(5), &[])
        .await
        .unwrap();

    // A charge claims its key and calls the processor; then, before its phase 2 (the
    // ledger holds 1.5 s there), the standby stops confirming WAL. Phase 2 commits on the
    // primary and waits for the standby; its session is ended there, which leaves the
    // charge committed on the primary alone.
    chain
        .set_faults(
            LEDGER,
            retrychain_proto::v1::Faults {
                finish_delay_ms: 1500,
                ..Default::default()
            },
        )
        .await;
    let key = new_key();
    let first = {
        let client = chain.client.clone();
        let request = charge(&account, 250, Some(&key), Duration::from_secs(3), &[]);
        tokio::spawn(async move { client.charge(request).await })
    };
    // The processor's record on the standby: its commit was confirmed, the processor has
    // answered, and the ledger holds before phase 2.
    let processor_key = format!("{}:{account}:{key}", account.len());
    let start = Instant::now();
    while !has_row(
        &standby_url,
        "processor_charges",
        "processor_key",
        &processor_key,
    )
    .await
    {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the processor was called"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    signal_wal_receiver(&standby_url, "STOP").await;
    // Every session that waits for the standby is ended (its lease renewal's among them)
    // until phase 2's commit, ended too, is there on the primary.
    let start = Instant::now();
    while !has_charge(&primary_url, &key).await {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "phase 2 never waited for the standby"
        );
        end_sessions_waiting_for_the_standby(&primary_url).await;
    }
    // The edge's own retries of that charge, and a client's retry after it, find the key
    // committed on the primary. A success now would be about a charge the standby lacks,
    // lost if the primary died next.
    let first = first.await.unwrap();
    chain.set_faults(LEDGER, Default::default()).await;
    let again = chain
        .charge(&account, 250, Some(&key), Duration::from_secs(3), &[])
        .await;
    let on_primary = has_charge(&primary_url, &key).await;
    let on_standby = has_charge(&standby_url, &key).await;
    signal_wal_receiver(&standby_url, "CONT").await;
    let seen = [&first, &again].map(|r| r.as_ref().map(|_| Code::Ok).unwrap_or_else(|s| s.code()));
    println!(
        "standby not confirming: the client saw {seen:?}; on the primary: {on_primary}, on the standby: {on_standby}"
    );
    assert!(
        on_primary,
        "the ended session's commit stayed on the primary"
    );
    assert!(!on_standby, "the standby did not have it while frozen");
    for code in seen {
        assert!(
            matches!(code, Code::Unavailable | Code::DeadlineExceeded),
            "while the standby lacks the charge the client must not see {code:?}"
        );
    }

    // Thawed: the retry with the same key replays the charge, now on both.
    let replayed = chain
        .charge(&account, 250, Some(&key), Duration::from_secs(5), &[])
        .await
        .unwrap();
    assert_eq!(
        header(&replayed, IDEMPOTENT_REPLAYED).as_deref(),
        Some("true")
    );
    // Flushed on the standby before the replay's commit returned; applied a moment later.
    let start = Instant::now();
    while !has_charge(&standby_url, &key).await {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the standby applies the charge"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(chain.account(&account).await, Some((350, 2)));
}
