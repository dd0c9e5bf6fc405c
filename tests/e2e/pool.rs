//! The ledger's connection pool on a real Postgres: a use its caller cuts off (the future
//! dropped mid-statement, as a lease renewal is when its processor call answers) costs no
//! connection and leaves no transaction open, and one that cannot be brought back in time
//! is replaced.

use std::time::Duration;

use retrychain_ledger::{
    database::{Database, DatabaseOptions},
    pool::{Checkout, Pool, Queue},
};
use sqlx::{Connection, PgConnection};

use crate::support::database;

/// A pool of one connection on a fresh database, with `round_trip` as its bound on a
/// recovery (and the server's statement timeout three quarters of it).
async fn one_connection(round_trip: Duration) -> (Database, String) {
    let url = database().await;
    let db = Database::open(
        &url,
        DatabaseOptions {
            application_name: "retrychain-pool-test",
            pool_size: 1,
            connect_timeout: Duration::from_secs(5),
            round_trip_timeout: round_trip,
        },
    )
    .await
    .unwrap();
    (db, url)
}

/// The pool's connection, waiting up to 10 s.
async fn take(pool: &Pool) -> Checkout {
    pool.acquire(
        tokio::time::Instant::now() + Duration::from_secs(10),
        Duration::from_secs(10),
        Queue::Back,
    )
    .await
    .unwrap()
}

/// The server process behind the pool's connection, the use settled clean.
async fn backend(pool: &Pool) -> i32 {
    let mut conn = take(pool).await;
    let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn.get())
        .await
        .unwrap();
    conn.settle(true);
    pid
}

/// Runs `sql` (one simple query, any number of statements) on the pool's connection and
/// drops the use 100 ms in, before it is answered and without settling it.
async fn cut_off(pool: &Pool, sql: &'static str) {
    let mut conn = take(pool).await;
    let cut = tokio::time::timeout(
        Duration::from_millis(100),
        sqlx::raw_sql(sql).execute(conn.get()),
    )
    .await;
    assert!(cut.is_err(), "{sql} was answered before the cut");
}

#[tokio::test]
async fn a_statement_cut_off_by_its_caller_gives_its_connection_back() {
    let (db, _url) = one_connection(Duration::from_secs(5)).await;
    let before = backend(&db.pool).await;
    for sql in [
        "SELECT pg_sleep(0.5)",
        // The cut statement is answered with an error after the cut: read past.
        "SELECT pg_sleep(0.5); SELECT 1/0",
    ] {
        cut_off(&db.pool, sql).await;
        assert_eq!(
            backend(&db.pool).await,
            before,
            "after cutting off {sql:?}, the same session serves the next use"
        );
        assert_eq!(db.pool.status().open, 1);
    }
}

/// The next use of the pool's connection, on session `pid`, runs outside any
/// transaction: the row `id` it writes is committed at once, seen by `observer`, and no
/// row of the cut transactions is.
async fn next_use_commits(pool: &Pool, observer: &mut PgConnection, pid: i32, id: i32) {
    let mut conn = take(pool).await;
    let now: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn.get())
        .await
        .unwrap();
    assert_eq!(now, pid, "the session was recovered, not replaced");
    sqlx::query("INSERT INTO cut VALUES ($1)")
        .bind(id)
        .execute(conn.get())
        .await
        .unwrap();
    let seen: Vec<i32> = sqlx::query_scalar("SELECT id FROM cut ORDER BY id")
        .fetch_all(&mut *observer)
        .await
        .unwrap();
    assert_eq!(
        seen,
        [id],
        "the cut transaction rolled back, the next use committed"
    );
    let state: String = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(&mut *observer)
        .await
        .unwrap();
    assert_eq!(state, "idle");
    conn.settle(true);
    sqlx::query("DELETE FROM cut")
        .execute(observer)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_transaction_cut_off_by_its_caller_is_rolled_back_and_none_is_left_open() {
    let (db, url) = one_connection(Duration::from_secs(5)).await;
    let mut observer = PgConnection::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE cut (id int)")
        .execute(&mut observer)
        .await
        .unwrap();
    let pid = backend(&db.pool).await;

    // A BEGIN sqlx knows nothing of (as a cancelled `begin()` leaves one), cut off.
    cut_off(
        &db.pool,
        "BEGIN; INSERT INTO cut VALUES (-1); SELECT pg_sleep(0.5)",
    )
    .await;
    next_use_commits(&db.pool, &mut observer, pid, 1).await;

    // One sqlx knows of, its guard dropped with the cut.
    {
        let mut conn = take(&db.pool).await;
        let mut tx = conn.get().begin().await.unwrap();
        sqlx::query("INSERT INTO cut VALUES (-2)")
            .execute(&mut *tx)
            .await
            .unwrap();
        let cut = tokio::time::timeout(
            Duration::from_millis(100),
            sqlx::query("SELECT pg_sleep(0.5)").execute(&mut *tx),
        )
        .await;
        assert!(cut.is_err());
    }
    next_use_commits(&db.pool, &mut observer, pid, 2).await;
}

#[tokio::test]
async fn a_use_cut_off_by_its_caller_leaves_no_setting_or_lock_behind() {
    let (db, url) = one_connection(Duration::from_secs(5)).await;
    let mut observer = PgConnection::connect(&url).await.unwrap();
    let pid = backend(&db.pool).await;
    cut_off(
        &db.pool,
        "SET lock_timeout = 1234; SELECT pg_advisory_lock(42); SELECT pg_sleep(0.5)",
    )
    .await;
    let mut conn = take(&db.pool).await;
    let (now, lock_timeout): (i32, String) =
        sqlx::query_as("SELECT pg_backend_pid(), current_setting('lock_timeout')")
            .fetch_one(conn.get())
            .await
            .unwrap();
    conn.settle(true);
    assert_eq!(now, pid, "the session was recovered, not replaced");
    // What the ledger opens its sessions with: 3/4 of 4/5 of the round-trip bound.
    assert_eq!(lock_timeout, "3s", "the setting it was opened with");
    let free: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(42)")
        .fetch_one(&mut observer)
        .await
        .unwrap();
    assert!(free, "the cut use's advisory lock was released");
}

#[tokio::test]
async fn a_cut_off_statement_that_outlasts_the_recovery_bound_is_replaced() {
    let (db, _url) = one_connection(Duration::from_millis(400)).await;
    let before = backend(&db.pool).await;
    // Past the server's own statement timeout too.
    cut_off(&db.pool, "SET statement_timeout = 0; SELECT pg_sleep(30)").await;
    let started = std::time::Instant::now();
    let after = backend(&db.pool).await;
    assert_ne!(after, before, "a new session, not the stuck one");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "served by a new connection, not after the statement: {:?}",
        started.elapsed()
    );
    assert_eq!(db.pool.status().open, 1);
}
