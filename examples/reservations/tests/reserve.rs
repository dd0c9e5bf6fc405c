//! The Reservations example over the wire, against a real Postgres: the idempotency
//! library's promises as a user of another service sees them.

use std::time::Duration;

use prost::Message;
use reservations::{
    Service,
    proto::{Reservation, ReserveRequest, reservations_client::ReservationsClient},
};
use sqlx::PgPool;
use tempgres::TempCluster;
use tonic::{Code, transport::Channel};

/// A throwaway Postgres, the service on a free port, a client of it and a pool to look.
async fn start() -> (TempCluster, PgPool, ReservationsClient<Channel>) {
    let cluster = tokio::task::spawn_blocking(TempCluster::start)
        .await
        .expect("joined")
        .expect("a throwaway postgres (PostgreSQL's server binaries on PATH)");
    let pool = PgPool::connect(&cluster.url("postgres"))
        .await
        .expect("connected");
    let service = Service::new(pool.clone()).await.expect("schema created");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bound");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(service.serve(listener));
    let client = ReservationsClient::connect(format!("http://{addr}"))
        .await
        .expect("connected to the service");
    (cluster, pool, client)
}

fn request(guest: &str, room: &str, night: &str) -> ReserveRequest {
    ReserveRequest {
        guest: guest.to_owned(),
        room: room.to_owned(),
        night: night.to_owned(),
    }
}

async fn reserve(
    client: &ReservationsClient<Channel>,
    key: &str,
    body: ReserveRequest,
) -> Result<Reservation, tonic::Status> {
    let mut request = tonic::Request::new(body);
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("ascii"));
    request.set_timeout(Duration::from_secs(10));
    client
        .clone()
        .reserve(request)
        .await
        .map(tonic::Response::into_inner)
}

async fn reservations(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM reservations")
        .fetch_one(pool)
        .await
        .expect("counted")
}

#[tokio::test]
async fn a_retried_reservation_is_made_once() {
    let (_cluster, pool, client) = start().await;
    let body = request("ada", "101", "2027-02-14");
    let first = reserve(&client, "k-1", body.clone())
        .await
        .expect("reserved");
    // Retries, one after another and eight at once (a client that lost its answers).
    let again = reserve(&client, "k-1", body.clone())
        .await
        .expect("replayed");
    let together: Vec<_> =
        futures::future::join_all((0..8).map(|_| reserve(&client, "k-1", body.clone()))).await;
    assert_eq!(again, first);
    for retry in together {
        assert_eq!(retry.expect("replayed"), first);
    }
    assert_eq!(reservations(&pool).await, 1, "one reservation for one key");
    let replays: i64 = sqlx::query_scalar(
        "SELECT replays FROM idempotency_records WHERE scope = 'ada' AND key = 'k-1'",
    )
    .fetch_one(&pool)
    .await
    .expect("the key's record");
    assert_eq!(replays, 9, "every retry was answered from the saved reply");
}

#[tokio::test]
async fn another_request_under_the_key_is_refused_and_changes_nothing() {
    let (_cluster, pool, client) = start().await;
    let first = reserve(&client, "k-1", request("ada", "101", "2027-02-14"))
        .await
        .expect("reserved");
    let other = reserve(&client, "k-1", request("ada", "102", "2027-02-14"))
        .await
        .expect_err("another room under the same key");
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    assert_eq!(reservations(&pool).await, 1);
    // The key still answers its own request, and room 102 is still free.
    let again = reserve(&client, "k-1", request("ada", "101", "2027-02-14"))
        .await
        .expect("replayed");
    assert_eq!(again, first);
    reserve(&client, "k-2", request("ada", "102", "2027-02-14"))
        .await
        .expect("room 102 was never reserved");
    // Keys are unique per guest: another guest's k-1 is another key.
    reserve(&client, "k-1", request("grace", "103", "2027-02-14"))
        .await
        .expect("another guest's key");
    assert_eq!(reservations(&pool).await, 3);
}

#[tokio::test]
async fn a_taken_room_is_refused_for_good_and_the_refusal_replayed() {
    let (_cluster, pool, client) = start().await;
    reserve(&client, "k-1", request("ada", "101", "2027-02-14"))
        .await
        .expect("reserved");
    let taken = reserve(&client, "k-9", request("grace", "101", "2027-02-14"))
        .await
        .expect_err("the room is taken");
    assert_eq!(taken.code(), Code::AlreadyExists, "{taken:?}");
    // Ada cancels by hand; Grace's retry is still told what her first request was told.
    sqlx::query("DELETE FROM reservations")
        .execute(&pool)
        .await
        .expect("deleted");
    let retried = reserve(&client, "k-9", request("grace", "101", "2027-02-14"))
        .await
        .expect_err("the saved refusal");
    assert_eq!(retried.code(), Code::AlreadyExists);
    assert_eq!(retried.message(), taken.message());
    assert_eq!(reservations(&pool).await, 0, "the replay made nothing");
}

#[tokio::test]
async fn a_key_its_owner_left_started_is_resumed_once() {
    let (_cluster, pool, client) = start().await;
    let body = request("ada", "101", "2027-02-14");
    // An owner that claimed the key and vanished (a crash between the phases): its lease
    // passed a second ago.
    sqlx::query(
        "INSERT INTO idempotency_records \
             (scope, key, caller, fingerprint, state, lease_owner, lease_expires_at, step_key) \
         VALUES ('ada', 'k-1', '', $1, 'started', gen_random_uuid(), \
                 now() - interval '1 second', 'k-1')",
    )
    .bind(body.encode_to_vec())
    .execute(&pool)
    .await
    .expect("a key left started");
    let first = reserve(&client, "k-1", body.clone())
        .await
        .expect("resumed");
    let again = reserve(&client, "k-1", body).await.expect("replayed");
    assert_eq!(again, first);
    assert_eq!(reservations(&pool).await, 1);
    let (state, takeovers): (String, i32) = sqlx::query_as(
        "SELECT state, takeovers FROM idempotency_records WHERE scope = 'ada' AND key = 'k-1'",
    )
    .fetch_one(&pool)
    .await
    .expect("the key's record");
    assert_eq!((state.as_str(), takeovers), ("finished", 1));
}

#[tokio::test]
async fn bad_input_is_refused_before_any_key_is_claimed() {
    let (_cluster, pool, client) = start().await;
    for (key, body) in [
        ("k-1", request("ada", "101", "2027-02-30")),
        ("k-1", request("ada", "101", "14/02/2027")),
        ("k-1", request("", "101", "2027-02-14")),
        ("k-1", request("ada", "１０１", "2027-02-14")),
        ("", request("ada", "101", "2027-02-14")),
        ("k 1", request("ada", "101", "2027-02-14")),
    ] {
        let refused = reserve(&client, key, body.clone())
            .await
            .expect_err("bad input");
        assert_eq!(refused.code(), Code::InvalidArgument, "{key:?} {body:?}");
    }
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
        .fetch_one(&pool)
        .await
        .expect("counted");
    assert_eq!((records, reservations(&pool).await), (0, 0));
}
