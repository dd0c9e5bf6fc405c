//! A second user of the `idempotency` library, apart from the retrychain ledger: a small
//! tonic service that reserves a room for a night. Its effect is a row in its own
//! `reservations` table, written in the transaction that saves the key's reply
//! ([`idempotency::postgres::PgEffect`]); its fingerprint is the encoded request; its reply
//! is the encoded `Reservation`. A retried Reserve (the same `idempotency-key`) is made
//! once and its first reply replayed; another request under the key is refused with
//! FAILED_PRECONDITION; a room already taken is refused with ALREADY_EXISTS, saved with the
//! key and replayed to its retries.
//!
//! There is no work between the phases here (nothing outside the database), so the lease
//! only guards a request against a concurrent one with its key, and against an owner that
//! vanished after the claim. Callers are not authenticated in this example: the scope keys
//! are unique in is the guest.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use idempotency::{
    InFlight, KeyId, Phases, Policy,
    postgres::{PgEffect, PgError, PgKeys},
};
use prost::Message;
use sqlx::PgPool;
use tonic::{Code, Request, Response, Status};

/// The generated messages and service.
pub mod proto {
    #![allow(missing_docs)]
    tonic::include_proto!("reservations.v1");
}

use proto::{
    Reservation, ReserveRequest,
    reservations_server::{Reservations, ReservationsServer},
};

/// The service's own table.
pub const SCHEMA: &str = "\
CREATE TABLE IF NOT EXISTS reservations ( \
    reservation_id UUID PRIMARY KEY, \
    guest          TEXT NOT NULL, \
    room           TEXT NOT NULL, \
    night          DATE NOT NULL, \
    UNIQUE (room, night));";

/// How long a request may take when its client set no deadline.
const DEFAULT_DEADLINE: Duration = Duration::from_secs(10);

/// The Reservations service.
#[derive(Debug, Clone)]
pub struct Service {
    keys: PgKeys,
    phases: Arc<Phases>,
}

impl Service {
    /// Creates the tables (the library's and the service's own) and the service.
    pub async fn new(pool: PgPool) -> Result<Self, sqlx::Error> {
        let keys = PgKeys::new(pool.clone());
        keys.create_schema().await?;
        sqlx::raw_sql(SCHEMA).execute(&pool).await?;
        Ok(Self {
            keys,
            phases: Arc::new(Phases::new(Policy::default())),
        })
    }

    /// Serves on `listener` until the process ends.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
    ) -> Result<(), tonic::transport::Error> {
        tonic::transport::Server::builder()
            .add_service(ReservationsServer::new(self))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    }
}

/// Serves on `addr` with the database at `database_url`.
pub async fn run(addr: SocketAddr, database_url: &str) -> anyhow::Result<()> {
    // The server stops a statement or a lock wait that outlives a request's deadline
    // itself (the key store closes the connection of work it cut off).
    let options = database_url
        .parse::<sqlx::postgres::PgConnectOptions>()?
        .options([("statement_timeout", "5s"), ("lock_timeout", "4s")]);
    let pool = PgPool::connect_with(options).await?;
    let service = Service::new(pool).await?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    service.serve(listener).await?;
    Ok(())
}

#[tonic::async_trait]
impl Reservations for Service {
    async fn reserve(
        &self,
        request: Request<ReserveRequest>,
    ) -> Result<Response<Reservation>, Status> {
        let key = idempotency_key(&request)?;
        let request = request.into_inner();
        validate(&request)?;
        let fingerprint = request.encode_to_vec();
        let outcome = self
            .phases
            .run(
                &self.keys,
                idempotency::Request {
                    id: KeyId {
                        scope: &request.guest,
                        key: &key,
                    },
                    caller: "",
                    fingerprint: &fingerprint,
                    step_key: &key,
                    deadline: tokio::time::Instant::now() + DEFAULT_DEADLINE,
                    in_flight: InFlight::Wait,
                },
                |_step| {
                    let request = request.clone();
                    async move { Ok(effect(request)) }
                },
            )
            .await
            .map_err(status)?;
        let reservation = Reservation::decode(outcome.into_reply().as_slice())
            .map_err(|error| Status::internal(format!("a saved reply does not decode: {error}")))?;
        Ok(Response::new(reservation))
    }
}

/// The reservation's row, written in the transaction that saves the key's reply; the room
/// already taken that night refuses the request for good.
fn effect(request: ReserveRequest) -> PgEffect {
    PgEffect::new(move |conn| {
        let request = request.clone();
        Box::pin(async move {
            let reservation = Reservation {
                reservation_id: uuid::Uuid::new_v4().to_string(),
                guest: request.guest,
                room: request.room,
                night: request.night,
            };
            let inserted = sqlx::query(
                "INSERT INTO reservations (reservation_id, guest, room, night) \
                 VALUES ($1::uuid, $2, $3, $4::date) ON CONFLICT (room, night) DO NOTHING",
            )
            .bind(&reservation.reservation_id)
            .bind(&reservation.guest)
            .bind(&reservation.room)
            .bind(&reservation.night)
            .execute(conn)
            .await?;
            if inserted.rows_affected() == 0 {
                return Err(PgError::Refused(Status::already_exists(format!(
                    "room {} is taken on {}",
                    reservation.room, reservation.night
                ))));
            }
            Ok(reservation.encode_to_vec())
        })
    })
}

/// The request's `idempotency-key`: required, 1–128 visible ASCII characters (so that two
/// keys that look alike are alike).
fn idempotency_key<T>(request: &Request<T>) -> Result<String, Status> {
    let key = request
        .metadata()
        .get("idempotency-key")
        .ok_or_else(|| Status::invalid_argument("idempotency-key metadata is required"))?
        .to_str()
        .map_err(|_| Status::invalid_argument("idempotency-key must be visible ASCII"))?;
    if key.is_empty() || key.len() > 128 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Status::invalid_argument(
            "idempotency-key must be 1 to 128 visible ASCII characters",
        ));
    }
    Ok(key.to_owned())
}

/// Every field present and in shape: nothing is claimed for a request that cannot be made.
fn validate(request: &ReserveRequest) -> Result<(), Status> {
    let name = |field: &str, value: &str| {
        if value.is_empty() || value.len() > 64 || !value.bytes().all(|b| b.is_ascii_graphic()) {
            Err(Status::invalid_argument(format!(
                "{field} must be 1 to 64 visible ASCII characters"
            )))
        } else {
            Ok(())
        }
    };
    name("guest", &request.guest)?;
    name("room", &request.room)?;
    if !is_date(&request.night) {
        return Err(Status::invalid_argument(
            "night must be a calendar date, YYYY-MM-DD",
        ));
    }
    Ok(())
}

/// Whether `text` is a calendar date written YYYY-MM-DD (years 0001–9999).
fn is_date(text: &str) -> bool {
    let bytes = text.as_bytes();
    if bytes.len() != 10 || bytes[4] != b'-' || bytes[7] != b'-' {
        return false;
    }
    let number = |range: std::ops::Range<usize>| -> Option<u32> {
        let part = &text[range];
        part.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| part.parse().ok())
            .flatten()
    };
    let (Some(year), Some(month), Some(day)) = (number(0..4), number(5..7), number(8..10)) else {
        return false;
    };
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return false,
    };
    year >= 1 && (1..=days).contains(&day)
}

/// The status for what the phases came to.
fn status(error: idempotency::Error<Vec<u8>, PgError>) -> Status {
    use idempotency::{Error as E, Failure};
    match error {
        E::Reused { .. } => {
            Status::failed_precondition("idempotency-key was used before with a different request")
        }
        E::ScopeRefused => Status::permission_denied(error.to_string()),
        E::InFlight => Status::aborted(error.to_string()),
        E::DeadlineWhileWaiting(_) => Status::deadline_exceeded(error.to_string()),
        E::Step(status) | E::Store(PgError::Refused(status)) => status,
        E::Failed(saved) => Status::new(Code::from_i32(saved.code), saved.message),
        E::NoReply => Status::internal(error.to_string()),
        E::Store(error) if error.is_transient() => {
            Status::unavailable(format!("{error}; retry with the same idempotency-key"))
        }
        E::Store(error) => Status::internal(error.to_string()),
    }
}
