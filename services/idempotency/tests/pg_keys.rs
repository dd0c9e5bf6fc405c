//! `PgKeys` and `Phases` against a real Postgres: the completer, a refusal saved, a
//! transient failure resumed, a key kept from another caller.

use std::{
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use idempotency::{
    Error, InFlight, KeyId, Outcome, Phases, Policy, Request,
    postgres::{PgEffect, PgKeys},
};
use sqlx::PgPool;
use tempgres::TempCluster;
use tonic::{Code, Status};

async fn keys() -> (TempCluster, PgPool, PgKeys) {
    let cluster = tokio::task::spawn_blocking(TempCluster::start)
        .await
        .expect("joined")
        .expect("a throwaway postgres (PostgreSQL's server binaries on PATH)");
    let pool = PgPool::connect(&cluster.url("postgres"))
        .await
        .expect("connected");
    let keys = PgKeys::new(pool.clone());
    keys.create_schema().await.expect("schema");
    keys.create_schema()
        .await
        .expect("the schema twice changes nothing");
    (cluster, pool, keys)
}

fn request<'a>(key: &'a str, caller: &'a str, fingerprint: &'a Vec<u8>) -> Request<'a, Vec<u8>> {
    Request {
        id: KeyId { scope: "s", key },
        caller,
        fingerprint,
        step_key: key,
        deadline: tokio::time::Instant::now() + Duration::from_secs(5),
        in_flight: InFlight::Wait,
    }
}

async fn state(pool: &PgPool, key: &str) -> (String, Option<uuid::Uuid>) {
    sqlx::query_as("SELECT state, lease_owner FROM idempotency_records WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .expect("the key's record")
}

#[tokio::test]
async fn the_completer_finishes_an_abandoned_key_once_and_leaves_a_released_one() {
    let (_cluster, pool, keys) = keys().await;
    let fingerprint = b"request-1".to_vec();
    // One owner vanished holding its key (its lease passed 3 s ago); another released its
    // key after a transient failure it told its caller of (the caller may retry).
    for (key, owner) in [("abandoned", "gen_random_uuid()"), ("released", "NULL")] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotency_records \
                 (scope, key, caller, fingerprint, state, lease_owner, lease_expires_at, step_key) \
             VALUES ('s', '{key}', 'c', $1, 'started', {owner}, now() - interval '3 seconds', \
                     'step-{key}')"
        )))
        .bind(&fingerprint)
        .execute(&pool)
        .await
        .expect("a started key");
    }
    let phases = Phases::new(Policy::default());
    let calls = AtomicU32::new(0);
    let work = |step: idempotency::Step<Vec<u8>>| {
        calls.fetch_add(1, Ordering::SeqCst);
        assert_eq!(step.step_key, "step-abandoned", "the saved step key");
        assert_eq!(step.fingerprint, b"request-1");
        async { Ok(PgEffect::reply(b"done".to_vec())) }
    };
    assert_eq!(phases.complete_abandoned(&keys, 16, work).await.unwrap(), 1);
    assert_eq!(phases.complete_abandoned(&keys, 16, work).await.unwrap(), 0);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the work was redone once");
    assert_eq!(
        state(&pool, "abandoned").await,
        ("finished".to_owned(), None)
    );
    assert_eq!(
        state(&pool, "released").await.0,
        "started",
        "not due for a minute"
    );
    // The caller's retry is answered from the saved reply.
    let replay = phases
        .run(&keys, request("abandoned", "c", &fingerprint), |_| async {
            Err::<PgEffect, _>(Status::internal("the work must not run again"))
        })
        .await
        .expect("replayed");
    assert_eq!(replay, Outcome::Replayed(b"done".to_vec()));
}

#[tokio::test]
async fn a_refusal_for_good_is_saved_and_a_failure_for_now_is_resumed() {
    let (_cluster, pool, keys) = keys().await;
    let phases = Phases::new(Policy::default());
    let fingerprint = b"request-1".to_vec();
    let calls = AtomicU32::new(0);

    let refused = phases
        .run(&keys, request("no", "c", &fingerprint), |_| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<PgEffect, _>(Status::failed_precondition("card declined")) }
        })
        .await;
    assert!(
        matches!(&refused, Err(Error::Step(status)) if status.code() == Code::FailedPrecondition),
        "{refused:?}"
    );
    let again = phases
        .run(&keys, request("no", "c", &fingerprint), |_| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok(PgEffect::reply(Vec::new())) }
        })
        .await;
    assert!(
        matches!(&again, Err(Error::Failed(saved)) if saved.message == "card declined"
            && saved.code == Code::FailedPrecondition as i32),
        "{again:?}"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "a saved refusal runs nothing"
    );

    let later = phases
        .run(&keys, request("later", "c", &fingerprint), |_| async {
            Err::<PgEffect, _>(Status::unavailable("downstream down"))
        })
        .await;
    assert!(matches!(&later, Err(Error::Step(status)) if status.code() == Code::Unavailable));
    assert_eq!(
        state(&pool, "later").await,
        ("started".to_owned(), None),
        "released: no owner, the retry resumes at once"
    );
    let resumed = phases
        .run(
            &keys,
            request("later", "c", &fingerprint),
            |step| async move {
                assert_eq!(step.step_key, "later");
                Ok(PgEffect::reply(b"made".to_vec()))
            },
        )
        .await
        .expect("resumed");
    assert_eq!(resumed, Outcome::Executed(b"made".to_vec()));
    assert_eq!(
        phases.takeovers().0,
        1,
        "the retry took the released key over"
    );
}

#[tokio::test]
async fn a_key_is_its_callers_and_bound_to_its_request() {
    let (_cluster, _pool, keys) = keys().await;
    let phases = Phases::new(Policy::default());
    let fingerprint = b"request-1".to_vec();
    let made = |_| async { Ok(PgEffect::reply(b"secret".to_vec())) };
    phases
        .run(&keys, request("k", "alice", &fingerprint), made)
        .await
        .expect("made");
    let other_caller = phases
        .run(&keys, request("k", "mallory", &fingerprint), made)
        .await;
    assert!(
        matches!(other_caller, Err(Error::ScopeRefused)),
        "another caller is neither replayed the reply nor runs the work: {other_caller:?}"
    );
    let other_request = b"request-2".to_vec();
    let reused = phases
        .run(&keys, request("k", "alice", &other_request), made)
        .await;
    assert!(
        matches!(&reused, Err(Error::Reused { saved, requested })
            if saved == b"request-1" && requested == b"request-2"),
        "{reused:?}"
    );
}
