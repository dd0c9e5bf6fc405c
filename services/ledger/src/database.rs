//! One way to reach the ledger's database: the primary found (and followed across a
//! failover) from `DATABASE_URL`, a pool of connections on it, each session set up the
//! same way. The key store opens one; the simulated processor, which stands for another
//! system, opens its own.

use std::{sync::Arc, time::Duration};

use anyhow::Context;
use tracing::instrument::WithSubscriber;

use crate::{
    pool::{Pool, PoolOptions},
    primary::{Hosts, Primary},
};

/// How to reach the database.
#[derive(Debug, Clone, Copy)]
pub struct DatabaseOptions {
    /// The name the sessions carry in `pg_stat_activity` (unless the URL names one), so an
    /// operator and the tests can tell whose they are.
    pub application_name: &'static str,
    /// Connections at most.
    pub pool_size: usize,
    /// Longest one opening of a connection may take.
    pub connect_timeout: Duration,
    /// The client's bound on one round trip; the server's own statement and lock timeouts
    /// are set a little under it.
    pub round_trip_timeout: Duration,
}

/// The primary, followed for as long as this lives, and a pool on it.
#[derive(Debug, Clone)]
pub struct Database {
    /// The connections.
    pub pool: Pool,
    /// Which host accepts writes; told when a failure suggests it moved.
    pub primary: Arc<Primary>,
    /// The tasks that follow the primary and close idle connections, stopped with the
    /// last clone.
    _tasks: Arc<[AbortOnDrop; 2]>,
}

/// Aborts a task when dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Database {
    /// Finds the primary of `database_url` (one host, or several in libpq's multi-host
    /// form: see [`crate::primary`]), waiting up to a minute for a database that is still
    /// starting, and opens a pool on it.
    pub async fn open(database_url: &str, options: DatabaseOptions) -> anyhow::Result<Self> {
        // The server gives up on a statement a little before the ledger gives up on the
        // connection (a live but slow server cancels its own work first), and on a lock
        // wait a little before that (told apart from a slow statement in the logs).
        let statement_ms = (options.round_trip_timeout.as_millis() * 3 / 4).max(1);
        let lock_ms = (statement_ms * 4 / 5).max(1);
        let (statement_ms, lock_ms) = (statement_ms.to_string(), lock_ms.to_string());
        let hosts = Hosts::parse(database_url)
            .context("parsing the database URL")?
            .map(|host| {
                let host = match host.get_application_name() {
                    Some(_) => host,
                    None => host.application_name(options.application_name),
                };
                host.options([
                    // Custom plans: a generic plan cached while a table was empty (say
                    // after a retention purge) can pick a sequential scan and keep it.
                    ("plan_cache_mode", "force_custom_plan"),
                    // The server notices a client host that vanished (no FIN, no RST) within
                    // about 25 s and ends its session, releasing its locks: by keepalives
                    // while the session is idle, and by `tcp_user_timeout` while it has
                    // sent what the host never acknowledged (keepalives wait for that to be
                    // acknowledged, and TCP retransmits it for some fifteen minutes).
                    ("tcp_keepalives_idle", "10"),
                    ("tcp_keepalives_interval", "5"),
                    ("tcp_keepalives_count", "3"),
                    ("tcp_user_timeout", "25000"),
                    ("statement_timeout", statement_ms.as_str()),
                    ("lock_timeout", lock_ms.as_str()),
                    // Every charge statement commits on its own; only the purges and the
                    // migrations open transactions, and none may be left open for long.
                    ("idle_in_transaction_session_timeout", "60s"),
                ])
            });
        let primary = Primary::find(hosts, options.round_trip_timeout, Duration::from_secs(60))
            .await
            .context("finding the database's primary")?;
        let pool = Pool::new(
            Arc::clone(&primary),
            PoolOptions {
                max_size: options.pool_size,
                connect_timeout: options.connect_timeout,
                ping_timeout: options.round_trip_timeout,
            },
        );
        let watcher = AbortOnDrop(tokio::spawn(Arc::clone(&primary).watch()).abort_handle());
        let reaper = AbortOnDrop(
            tokio::spawn({
                let pool = pool.clone();
                let bound = options.round_trip_timeout;
                async move {
                    loop {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        pool.reap_idle(bound);
                    }
                }
            })
            .abort_handle(),
        );
        Ok(Self {
            pool,
            primary,
            _tasks: Arc::new([watcher, reaper]),
        })
    }
}

/// Why a purge stopped.
#[derive(Debug, thiserror::Error)]
pub enum PurgeError {
    /// What Postgres said.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A batch took longer than its bound (the connection's state is in doubt).
    #[error("Postgres did not finish a purge batch within {0:?}")]
    TooSlow(Duration),
}

/// Runs `delete` — a `DELETE` of at most `$2` rows older than `$1` seconds — until a batch
/// deletes fewer than `batch` rows; returns how many went. Each batch is a transaction of
/// its own, bounded by `bound` on this clock and a little under it on the server's, so no
/// statement holds many locks or runs on after it is cut off. After an error the
/// connection's state is in doubt: close it.
pub async fn purge_in_batches(
    conn: &mut sqlx::PgConnection,
    delete: &'static str,
    retention: Duration,
    batch: i64,
    bound: Duration,
) -> Result<u64, PurgeError> {
    use sqlx::Connection;
    let server_ms = bound.as_millis() * 9 / 10;
    let mut purged = 0;
    loop {
        let one_batch = async {
            let mut tx = conn
                .begin_with(sqlx::AssertSqlSafe(format!(
                    "BEGIN; SET LOCAL statement_timeout = {server_ms}"
                )))
                .await?;
            let deleted = sqlx::query(delete)
                .bind(retention.as_secs_f64())
                .bind(batch)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            Ok::<_, sqlx::Error>(deleted)
        };
        let deleted = tokio::time::timeout(bound, one_batch)
            .await
            .map_err(|_| PurgeError::TooSlow(bound))??;
        purged += deleted;
        if deleted < batch as u64 {
            return Ok(purged);
        }
    }
}

/// A statement that takes this long or longer is logged as slow (sqlx's own threshold),
/// or half its round-trip bound if that is shorter (see [`statement`]).
pub const SLOW_STATEMENT: Duration = Duration::from_secs(1);

/// Runs one statement (`what` names it in the log) bounded by the caller at `bound`,
/// without sqlx's own logging unless the log filter lets anything at DEBUG or finer
/// through (sqlx's statement log is at DEBUG: `RUST_LOG=sqlx=debug`, among others), and
/// warns when it took [`SLOW_STATEMENT`] or half of `bound`,
/// whichever is shorter: a statement that is cut off at the bound is an error, logged as
/// such, and one that took half of it is the warning before (the default bound, 1 s, is
/// sqlx's threshold itself, and the server's own statement timeout is three quarters of it).
///
/// Why: sqlx runs every statement inside the span that is current when it starts (its
/// streams are `in_current_span`), so the request's span is entered and left again around
/// each poll of each statement, for events the default filter drops (sqlx logs each
/// statement at DEBUG). Callgrind counted that at about 10k instructions a charge, 6% of
/// the ledger's. Here the statement is polled with no subscriber, so there is no current
/// span to enter. What sqlx would have logged at the default filter is its warning for a
/// slow statement, given here instead, inside the request's span, and a server's NOTICE,
/// which none of the ledger's statements raises (`RUST_LOG=sqlx=debug` brings both back;
/// enabling only `sqlx::postgres::notice` does not).
///
/// Why the most verbose level any filter allows decides, not `tracing::enabled!` for sqlx's
/// target: where that target's interest is not fixed (an `EnvFilter` with span
/// directives), `enabled!` asks the per-layer filters, and a filter that says no leaves its
/// answer on the thread for the next event or span, which is then dropped
/// (tokio-rs/tracing#2519). Reading the level asks nothing.
///
/// The cost that callgrind does not see: while a statement is polled, tracing-core counts
/// a scoped dispatcher in a process-wide atomic, and every thread's lookup of its dispatcher
/// takes the thread-local path meanwhile. It holds only for sqlx's methods that build their
/// stream when first polled (`execute`, `fetch_one`, `fetch_optional`, `fetch_all`); a
/// stream from `fetch` or `fetch_many` is built when called, inside the request's span.
pub async fn statement<F: Future>(what: &'static str, bound: Duration, work: F) -> F::Output {
    let started = tokio::time::Instant::now();
    let done = if tracing::level_filters::LevelFilter::current()
        >= tracing::level_filters::LevelFilter::DEBUG
    {
        work.await
    } else {
        work.with_subscriber(tracing::Dispatch::none()).await
    };
    let took = started.elapsed();
    if took >= SLOW_STATEMENT.min(bound / 2) {
        tracing::warn!(
            statement = what,
            elapsed_ms = took.as_millis() as u64,
            "slow statement"
        );
    }
    done
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing::{Event, Subscriber, span};
    use tracing_subscriber::{
        Layer, filter::Targets, layer::Context, layer::SubscriberExt, registry::LookupSpan,
    };

    use super::*;

    /// An event's message and the span it was logged in, as the log line would show.
    type Line = (String, Option<&'static str>);

    /// The events logged.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<Line>>>);

    impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Lines {
        fn on_event(&self, event: &Event<'_>, cx: Context<'_, S>) {
            struct Message(String);
            impl tracing::field::Visit for Message {
                fn record_debug(
                    &mut self,
                    field: &tracing::field::Field,
                    value: &dyn std::fmt::Debug,
                ) {
                    if field.name() == "message" {
                        self.0 = format!("{value:?}");
                    }
                }
            }
            let mut message = Message(String::new());
            event.record(&mut message);
            let span = cx.event_span(event).map(|span| span.name());
            self.0.lock().unwrap().push((message.0, span));
        }
    }

    /// A round-trip bound long enough that [`SLOW_STATEMENT`] is the threshold.
    const BOUND: Duration = Duration::from_secs(10);

    /// Runs `statement` (bounded at `bound`) inside a request's span under a subscriber
    /// whose log filter is `filter` (per layer, as the services' is), with the clock
    /// paused; returns the name of the span current inside the statement, and the lines
    /// logged.
    fn run(filter: &str, bound: Duration, takes: Duration) -> (Option<&'static str>, Vec<Line>) {
        // One at a time: the most verbose level any live subscriber allows is the
        // process's, and the tests' subscribers differ.
        static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let lines = Lines::default();
        let subscriber = tracing_subscriber::registry().with(
            lines
                .clone()
                .with_filter(filter.parse::<Targets>().unwrap()),
        );
        let _default = tracing::subscriber::set_default(subscriber);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let request = tracing::info_span!("rpc");
        let inside = runtime.block_on(tracing::Instrument::instrument(
            statement("claiming the key", bound, async {
                tokio::time::sleep(takes).await;
                span::Span::current().metadata().map(|m| m.name())
            }),
            request,
        ));
        let logged = lines.0.lock().unwrap().clone();
        (inside, logged)
    }

    #[test]
    fn a_statement_runs_outside_the_requests_span_unless_sqlx_is_logged() {
        let (inside, logged) = run("info", BOUND, Duration::from_millis(5));
        assert_eq!(inside, None, "no span for sqlx to enter around each poll");
        assert!(logged.is_empty(), "{logged:?}");

        let (inside, _) = run("info,sqlx=debug", BOUND, Duration::from_millis(5));
        assert_eq!(
            inside,
            Some("rpc"),
            "sqlx's statement log keeps the request's span"
        );
    }

    #[test]
    fn a_slow_statement_is_logged_in_the_requests_span() {
        let (_, logged) = run("info", BOUND, SLOW_STATEMENT);
        assert_eq!(logged, [("slow statement".to_owned(), Some("rpc"))]);

        let (_, logged) = run("info", BOUND, SLOW_STATEMENT - Duration::from_millis(1));
        assert!(logged.is_empty(), "{logged:?}");

        // Under a short bound, half of it is slow.
        let short = Duration::from_millis(400);
        let (_, logged) = run("info", short, short / 2);
        assert_eq!(logged, [("slow statement".to_owned(), Some("rpc"))]);
        let (_, logged) = run("info", short, short / 2 - Duration::from_millis(1));
        assert!(logged.is_empty(), "{logged:?}");
    }
}
