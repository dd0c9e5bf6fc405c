//! The key store's connections: a pool of `PgConnection`s, opened to the primary, checked
//! only when something suggests they are broken, and refilled by the pool's own tasks.
//!
//! # Why a pool of our own
//!
//! sqlx's pool pings every connection given back to it (a fifth round trip per charge);
//! deadpool opens a missing connection inside the waiting caller's future, so a caller
//! that gives up (its acquire timeout, its deadline) cancels the opening with it. Under
//! overload every caller gives up early, so a pool that lost a connection never gets it
//! back: it drains to zero and stays there while Postgres is healthy (a metastable
//! failure the overload trial found, goodput 0 until the load stopped). Here the work that
//! makes a connection usable belongs to the pool, not to a caller:
//!
//! - **Opening** is a task of the pool's, bounded by its own connect timeout
//!   ([`PoolOptions::connect_timeout`]), never by a caller's wait. Its connection goes to
//!   the first caller still waiting, or to the idle stack if none is. A pool below its
//!   size with callers waiting always has openings under way, retried (briefly spaced)
//!   while callers wait and the failure is one that may pass (a restart, a failover).
//! - **Verifying** a connection that may be broken (one last seen working before a
//!   connection was lost: a restart breaks them all) is a ping, also a task of the pool's,
//!   bounded by the round-trip timeout, once per connection per loss — not a ping per use
//!   for a while, which under load keeps itself going.
//! - **Waiting** is the caller's: FIFO (a charge under way in a queue of its own, served
//!   before charges waiting to start: [`Queue::Front`]), bounded by its own clock — and, while connections are being given
//!   back, by nothing else: a queue that moves is load the caller's deadline can absorb
//!   (refusing it early refused charges that would have been served in time). Only a wait
//!   during which no connection came back for the caller's patience ends early: the
//!   database stalled, or every connection is stuck. A wait that ended because every
//!   connection was busy is load, and is said so ([`AcquireError::Busy`]); it raises no
//!   suspicion, pings nothing, retires nothing.
//!
//! # What shrinks the pool, and why none of it feeds itself
//!
//! | path | when | refilled by |
//! |---|---|---|
//! | a use that ended in doubt ([`Checkout::settle`] not clean) | a lost connection, the round-trip bound, an error mid-protocol | an opening, at once if anyone waits |
//! | a failed recovery | a use cut off (its caller's future dropped mid-statement) whose connection did not come back clean within the ping timeout | the same |
//! | a failed verification | the ping after a loss failed or went unanswered | the same |
//! | retirement | opened before the primary last moved; past its lifetime (jittered, so a pool opened at once does not retire at once) | the same |
//! | idle reaping ([`Pool::reap_idle`]) | not taken for [`IDLE_TIMEOUT`]: never under load | the next wait |
//!
//! A use cut off by its caller (a future dropped mid-statement: the renewal of a lease
//! that stops when its processor call answers, a read whose client left) is not a fault:
//! the connection is **recovered** by a task of the pool's — what the server still had to
//! say is read, and any transaction the cut left open is ended, in one round trip — and goes
//! back into circulation. Closing it instead cost a new session (a server process, its
//! authentication, the primary check) per cut, and under load, where cuts are frequent, a
//! pool a third below its size between openings.
//!
//! Suspicion is raised only by a connection that was really lost (an I/O error, the server
//! ending the session) or could not be opened — never by a wait, a timeout under load, or
//! a failed verification — and it costs at most one ping per pooled connection.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use sqlx::{Connection, PgConnection};
use tokio::{sync::oneshot, time::Instant};

use crate::primary::Primary;

/// A connection older than about this is closed rather than reused (sqlx's default
/// lifetime): server-side memory a long session accumulates goes back, and connections
/// spread again over whatever a DNS name resolves to now. Each connection's own lifetime
/// is drawn within ±10% of it, so a pool opened in one burst is not reopened in one.
pub const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// A connection not taken from the pool for this long is closed (sqlx's default idle
/// timeout): a burst's connections do not stay open on the server for good.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// The first pause between two failed openings while callers wait; doubled each time up to
/// [`OPEN_PAUSE_MAX`].
const OPEN_PAUSE_MIN: Duration = Duration::from_millis(5);

/// The longest pause between two failed openings.
const OPEN_PAUSE_MAX: Duration = Duration::from_millis(100);

/// How the pool sizes and bounds its work.
#[derive(Debug, Clone, Copy)]
pub struct PoolOptions {
    /// Connections at most, opened and opening.
    pub max_size: usize,
    /// The longest one opening may take (TCP, TLS, authentication, the primary check).
    pub connect_timeout: Duration,
    /// The longest a verifying ping may take.
    pub ping_timeout: Duration,
}

/// One pooled connection.
#[derive(Debug)]
struct Pooled {
    /// The connection.
    conn: PgConnection,
    /// When its opening began: a connection whose opening began before the primary moved
    /// may have been opened to the old one, however late it finished.
    opening_began: std::time::Instant,
    /// When it is retired ([`MAX_LIFETIME`], jittered).
    retire_at: Instant,
    /// When it last finished a use cleanly, or was opened or verified: a connection lost
    /// after that makes it suspect.
    last_ok: Instant,
}

/// Why no connection could be had.
#[derive(Debug, thiserror::Error)]
pub enum AcquireError {
    /// Every connection was busy until the caller stopped waiting: load, not a fault.
    #[error("every database connection is busy, and none came back within the acquire timeout")]
    Busy,
    /// Openings were failing (the server down, restarting, or a standby now) while the
    /// caller waited; the last failure.
    #[error("no connection to Postgres could be opened: {0}")]
    CannotOpen(sqlx::Error),
    /// Opening failed in a way that will not pass by itself (bad credentials, a missing
    /// database): said at once.
    #[error("Postgres refused a connection: {0}")]
    Refused(sqlx::Error),
}

/// Where a caller joins the queue of callers waiting for a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queue {
    /// Behind everyone waiting: a new charge, a read.
    Back,
    /// Ahead of them: a charge whose processor has answered, recording the outcome (its
    /// key is held meanwhile; a charge waiting to start has held nothing yet).
    Front,
}

/// What a waiting caller is handed.
type Handoff = Result<InTransit, Arc<sqlx::Error>>;

/// A connection on its way to a waiting caller. The caller may give up after it was sent
/// and before it looked (its future dropped with the connection in the channel): then the
/// connection comes back to the pool as it drops, instead of vanishing from the count.
#[derive(Debug)]
struct InTransit {
    /// The connection; taken by the caller that receives it.
    pooled: Option<Pooled>,
    /// Where it goes back if nobody takes it.
    shared: Arc<Shared>,
}

impl InTransit {
    fn take(mut self) -> Pooled {
        self.pooled.take().expect("taken once")
    }
}

impl Drop for InTransit {
    fn drop(&mut self) {
        if let Some(pooled) = self.pooled.take() {
            self.shared.hand_over(pooled);
        }
    }
}

/// The pool's state, under one lock held only for bookkeeping (never across I/O).
#[derive(Debug)]
struct State {
    /// Connections not in use, the most recently used last (taken from the end).
    idle: Vec<Pooled>,
    /// Connections that exist: idle, in use, or being verified.
    open: usize,
    /// Openings under way.
    opening: usize,
    /// Verifications and recoveries under way (counted in `open` too): connections
    /// that will be handed over once they answer.
    verifying: usize,
    /// Callers waiting, oldest first; a dropped receiver is a caller that gave up.
    waiters: VecDeque<oneshot::Sender<Handoff>>,
    /// Callers waiting at the front ([`Queue::Front`]), oldest first: served before
    /// `waiters`.
    first_waiters: VecDeque<oneshot::Sender<Handoff>>,
    /// Connections given back so far (to a waiter or idle): whether the queue moves.
    handovers: u64,
    /// How long a use holds a connection, on average (an exponential average, in
    /// seconds): with the pool's size, the pace at which the queue moves.
    mean_hold: f64,
    /// When a connection was last lost (or could not be opened): a connection whose
    /// `last_ok` is older is verified before use.
    lost_at: Option<Instant>,
    /// The last failed opening and when it failed, until one succeeds.
    last_open_error: Option<(Instant, Arc<sqlx::Error>)>,
}

impl State {
    /// Callers still waiting (dropping those that gave up).
    fn live_waiters(&mut self) -> usize {
        self.waiters.retain(|w| !w.is_closed());
        self.first_waiters.retain(|w| !w.is_closed());
        self.waiters.len() + self.first_waiters.len()
    }
}

/// What opening and verifying need; shared with the pool's tasks.
#[derive(Debug)]
struct Shared {
    /// The bookkeeping.
    state: Mutex<State>,
    /// Which host to open connections to.
    primary: Arc<Primary>,
    /// Size and bounds.
    options: PoolOptions,
}

/// The key store's pool; see the module docs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Pool {
    /// State and settings, shared with the pool's own tasks.
    shared: Arc<Shared>,
}

/// The pool's size now, for `/metrics` and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStatus {
    /// Connections that exist (idle, in use, being verified).
    pub open: usize,
    /// Of those, not in use.
    pub idle: usize,
    /// Openings under way.
    pub opening: usize,
    /// Callers waiting for a connection.
    pub waiting: usize,
}

impl Pool {
    /// An empty pool opening connections to `primary`'s current host.
    pub fn new(primary: Arc<Primary>, options: PoolOptions) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    idle: Vec::with_capacity(options.max_size),
                    open: 0,
                    opening: 0,
                    verifying: 0,
                    waiters: VecDeque::new(),
                    first_waiters: VecDeque::new(),
                    handovers: 0,
                    mean_hold: 0.0,
                    lost_at: None,
                    last_open_error: None,
                }),
                primary,
                options,
            }),
        }
    }

    /// A connection, waiting until `by` at the latest, and no longer than `patience`
    /// while no connection is given back to anyone (see the module docs); queued at the
    /// back or, for a charge's second phase, at the front. Giving up (the caller's future
    /// dropped, or the wait over) cancels only the wait: an opening or verification this
    /// wait started goes on, and its connection goes to the next caller or the idle stack.
    pub async fn acquire(
        &self,
        by: Instant,
        patience: Duration,
        queue: Queue,
    ) -> Result<Checkout, AcquireError> {
        let began = Instant::now();
        let mut handovers;
        let receiver = {
            let mut state = self.shared.lock();
            loop {
                let Some(pooled) = state.idle.pop() else {
                    break;
                };
                match self.shared.judge(&state, &pooled) {
                    Judgement::Ready => return Ok(Checkout::new(pooled, self.clone())),
                    Judgement::Retire => {
                        state.open -= 1;
                        close_quietly(pooled);
                    }
                    Judgement::Verify => {
                        state.verifying += 1;
                        spawn(Arc::clone(&self.shared).verify(pooled));
                    }
                }
            }
            // A wait the queue's pace says would outlast `by` is not begun: load, said now
            // rather than at `by` (the edge learns from it sooner, and nothing below it
            // holds the call meanwhile).
            let ahead = match queue {
                Queue::Back => state.first_waiters.len() + state.waiters.len(),
                Queue::Front => state.first_waiters.len(),
            };
            let pace = state.mean_hold / self.shared.options.max_size.max(1) as f64;
            if state.open >= self.shared.options.max_size
                && began + Duration::from_secs_f64(pace * (ahead + 1) as f64) > by
            {
                return Err(AcquireError::Busy);
            }
            let (sender, receiver) = oneshot::channel();
            match queue {
                Queue::Back => state.waiters.push_back(sender),
                Queue::Front => state.first_waiters.push_back(sender),
            }
            handovers = state.handovers;
            self.shared.open_for_waiters(&mut state);
            receiver
        };
        let mut receiver = receiver;
        let waited = loop {
            let slice = by.min(Instant::now() + patience);
            match tokio::time::timeout_at(slice, &mut receiver).await {
                Ok(handed) => break Ok(handed),
                Err(_) if slice >= by => break Err(()),
                Err(_) => {
                    // Patience spent: wait on only while the queue moves.
                    let state = self.shared.lock();
                    if state.handovers == handovers {
                        break Err(());
                    }
                    handovers = state.handovers;
                }
            }
        };
        match waited {
            Ok(Ok(Ok(pooled))) => Ok(Checkout::new(pooled.take(), self.clone())),
            Ok(Ok(Err(refused))) => Err(AcquireError::Refused(unshare(&refused))),
            // The sender is only dropped with the pool.
            Ok(Err(_)) => Err(AcquireError::Busy),
            Err(()) => {
                // Openings failing while this caller waited: the database's fault;
                // otherwise every connection was busy.
                let state = self.shared.lock();
                Err(match &state.last_open_error {
                    Some((at, error)) if *at >= began => AcquireError::CannotOpen(unshare(error)),
                    _ => AcquireError::Busy,
                })
            }
        }
    }

    /// A connection was lost (an I/O error, the server ended the session): a restart may
    /// have broken every idle one, so each connection last seen working before now is
    /// verified once before its next use.
    pub fn connection_lost(&self) {
        self.shared.lock().lost_at = Some(Instant::now());
    }

    /// The pool's size now.
    pub fn status(&self) -> PoolStatus {
        let mut state = self.shared.lock();
        PoolStatus {
            open: state.open,
            idle: state.idle.len(),
            opening: state.opening,
            waiting: state.live_waiters(),
        }
    }

    /// Closes, politely and within `bound` each, the idle connections not used for
    /// [`IDLE_TIMEOUT`]; called now and then by the store's maintenance task.
    pub fn reap_idle(&self, bound: Duration) {
        let now = Instant::now();
        let stale: Vec<Pooled> = {
            let mut state = self.shared.lock();
            let (stale, kept) = std::mem::take(&mut state.idle)
                .into_iter()
                .partition(|p| now.duration_since(p.last_ok) >= IDLE_TIMEOUT);
            state.idle = kept;
            state.open -= stale.len();
            stale
        };
        for pooled in stale {
            spawn(async move {
                let _ = tokio::time::timeout(bound, pooled.conn.close()).await;
            });
        }
    }

    /// A use held a connection for `held`: folded into the pace of the queue.
    fn held(&self, held: Duration) {
        let mut state = self.shared.lock();
        let held = held.as_secs_f64();
        state.mean_hold = if state.mean_hold == 0.0 {
            held
        } else {
            state.mean_hold * 0.95 + held * 0.05
        };
    }

    /// Takes `pooled` back after a clean use: to the first caller waiting, or idle.
    fn release(&self, mut pooled: Pooled) {
        pooled.last_ok = Instant::now();
        self.shared.hand_over(pooled);
    }

    /// Recovers, in a task of the pool's, a connection whose use was cut off; without a
    /// runtime left (the process stopping), closes it.
    fn recover(&self, pooled: Pooled) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            close_quietly(pooled);
            return self.discard();
        };
        self.shared.lock().verifying += 1;
        runtime.spawn(Arc::clone(&self.shared).recover(pooled));
    }

    /// Forgets a connection whose state is in doubt (its socket closes as it drops, and
    /// the server rolls back whatever it had open), and opens another if callers wait.
    fn discard(&self) {
        let mut state = self.shared.lock();
        state.open -= 1;
        self.shared.open_for_waiters(&mut state);
    }
}

/// What to do with an idle connection about to be handed out.
enum Judgement {
    /// Use it.
    Ready,
    /// Close it: opened before the primary moved, or past its lifetime.
    Retire,
    /// Ping it first: last seen working before a connection was lost.
    Verify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn judge(&self, state: &State, pooled: &Pooled) -> Judgement {
        if self.retired(pooled) {
            Judgement::Retire
        } else if state.lost_at.is_some_and(|lost| pooled.last_ok <= lost) {
            Judgement::Verify
        } else {
            Judgement::Ready
        }
    }

    /// Whether `pooled` is done with: opened before the primary moved, or past its
    /// lifetime.
    fn retired(&self, pooled: &Pooled) -> bool {
        self.primary
            .opened_before_move(pooled.opening_began.elapsed())
            || Instant::now() >= pooled.retire_at
    }

    /// Starts openings for callers that no opening or verification under way will serve,
    /// within the pool's size.
    fn open_for_waiters(self: &Arc<Self>, state: &mut State) {
        let waiting = state.live_waiters();
        while state.opening + state.verifying < waiting
            && state.open + state.opening < self.options.max_size
        {
            state.opening += 1;
            spawn(Arc::clone(self).open());
        }
    }

    /// Gives `pooled` to the first caller still waiting, or puts it idle.
    fn hand_over(self: &Arc<Self>, pooled: Pooled) {
        let mut state = self.lock();
        state.handovers += 1;
        let mut pooled = pooled;
        while let Some(waiter) = state
            .first_waiters
            .pop_front()
            .or_else(|| state.waiters.pop_front())
        {
            let in_transit = InTransit {
                pooled: Some(pooled),
                shared: Arc::clone(self),
            };
            match waiter.send(Ok(in_transit)) {
                Ok(()) => return,
                // That caller gave up: the next one.
                Err(back) => match back {
                    Ok(back) => pooled = back.take(),
                    Err(_) => unreachable!("a connection was sent"),
                },
            }
        }
        state.idle.push(pooled);
    }

    /// One opening, retried while callers wait and the failure may pass; see the module
    /// docs.
    async fn open(self: Arc<Self>) {
        let mut pause = OPEN_PAUSE_MIN;
        loop {
            let opened = tokio::time::timeout(self.options.connect_timeout, self.connect())
                .await
                .unwrap_or_else(|_| {
                    Err(sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "opening a connection took longer than {:?}",
                            self.options.connect_timeout
                        ),
                    )))
                });
            match opened {
                Ok(pooled) => {
                    {
                        let mut state = self.lock();
                        state.opening -= 1;
                        state.open += 1;
                        state.last_open_error = None;
                    }
                    self.hand_over(pooled);
                    return;
                }
                Err(error) => {
                    // The server may have restarted (idle connections broken) or moved.
                    self.primary.suspect();
                    let transient = opening_may_succeed_later(&error);
                    let error = Arc::new(error);
                    let mut state = self.lock();
                    state.lost_at = Some(Instant::now());
                    state.last_open_error = Some((Instant::now(), Arc::clone(&error)));
                    if !transient {
                        state.opening -= 1;
                        let state = &mut *state;
                        for waiter in state.first_waiters.drain(..).chain(state.waiters.drain(..)) {
                            let _ = waiter.send(Err(Arc::clone(&error)));
                        }
                        return;
                    }
                    // Tried again only while someone waits that this opening is for.
                    if state.live_waiters() <= state.opening - 1 + state.verifying {
                        state.opening -= 1;
                        return;
                    }
                }
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(OPEN_PAUSE_MAX);
        }
    }

    /// A new connection to the primary as it is named now; see [`Primary::check`].
    async fn connect(&self) -> Result<Pooled, sqlx::Error> {
        let opening_began = std::time::Instant::now();
        let mut conn = PgConnection::connect_with(&self.primary.options()).await?;
        self.primary.check(&mut conn).await?;
        // Begun with the old primary's options and finished after the move: perhaps to a
        // primary that has not yet stepped down.
        if self.primary.opened_before_move(opening_began.elapsed()) {
            return Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "opened while the primary moved, perhaps to the old one",
            )));
        }
        let lifetime = MAX_LIFETIME.mul_f64(rand::random_range(0.9..1.1));
        let now = Instant::now();
        Ok(Pooled {
            conn,
            opening_began,
            retire_at: now + lifetime,
            last_ok: now,
        })
    }

    /// Pings a suspect connection: back into circulation if it answers within the ping
    /// timeout, else closed (and replaced if callers wait).
    async fn verify(self: Arc<Self>, mut pooled: Pooled) {
        let answered = tokio::time::timeout(self.options.ping_timeout, pooled.conn.ping()).await;
        self.checked(pooled, matches!(answered, Ok(Ok(()))));
    }

    /// Recovers a connection whose use was cut off ([`RESET_SESSION`], within the
    /// ping timeout): back into circulation if it answers clean, else closed (and
    /// replaced if callers wait).
    async fn recover(self: Arc<Self>, mut pooled: Pooled) {
        let conn = &mut pooled.conn;
        let answered = tokio::time::timeout(self.options.ping_timeout, async {
            // sqlx reports an error the cut use's own statements were answered with as
            // it reads it, before sending anything: read on. The query failing each time
            // (a session in a failed transaction) is not passed.
            for _ in 0..RECOVERY_READS {
                match sqlx::raw_sql(RESET_SESSION).execute(&mut *conn).await {
                    Ok(_) => return Ok(true),
                    Err(sqlx::Error::Database(_)) => continue,
                    Err(lost) => return Err(lost),
                }
            }
            Ok(false)
        })
        .await;
        let clean = match answered {
            Ok(Ok(clean)) => clean && !pooled.conn.is_in_transaction() && !self.retired(&pooled),
            // Lost (the server restarted, the socket broke): the others may be too.
            Ok(Err(_)) => {
                self.lock().lost_at = Some(Instant::now());
                self.primary.suspect();
                false
            }
            // No answer within the bound: a primary that moved or froze, or a statement
            // that runs on.
            Err(_) => {
                self.primary.suspect();
                false
            }
        };
        self.checked(pooled, clean);
    }

    /// The end of a verification or recovery: `pooled` goes to a waiter or idle if it
    /// answered `clean`, and is closed otherwise.
    fn checked(self: &Arc<Self>, mut pooled: Pooled, clean: bool) {
        let mut state = self.lock();
        state.verifying -= 1;
        if clean {
            drop(state);
            pooled.last_ok = Instant::now();
            self.hand_over(pooled);
        } else {
            state.open -= 1;
            self.open_for_waiters(&mut state);
            drop(state);
            close_quietly(pooled);
        }
    }
}

/// Runs `task` on the runtime, if there still is one (a checkout dropped while the
/// process stops has nobody left to open for).
fn spawn(task: impl Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}

/// What brings a cut-off connection back to the state of a fresh one, as one simple
/// query: before it is sent, sqlx finishes writing what the cut use had begun to and reads
/// every answer still owed; then the session is inside no transaction whatever the cut
/// left — a BEGIN answered after its caller left included, which sqlx does not know of
/// (the BEGIN then only warns, and the ROLLBACK ends the older transaction) — its settings
/// are those it was opened with (a cut migration changes `statement_timeout`), and it holds
/// no advisory lock (the migrator takes one). Not `DISCARD ALL`: that would drop the
/// prepared statements sqlx keeps. A session in a failed transaction answers with an
/// error, and is closed.
const RESET_SESSION: &str = "BEGIN; ROLLBACK; RESET ALL; SELECT pg_advisory_unlock_all()";

/// How many errors a recovery reads past: the cut use's statements may each have been
/// answered with one (a pipelined statement and the rollback sqlx queued behind it).
const RECOVERY_READS: usize = 4;

/// Drops a connection without a round trip: its socket closes now.
fn close_quietly(pooled: Pooled) {
    drop(pooled);
}

/// A copy of a shared error good enough to report (its text, and its kind where the
/// classification needs it).
fn unshare(error: &sqlx::Error) -> sqlx::Error {
    match error {
        sqlx::Error::Io(io) => sqlx::Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        other => sqlx::Error::Protocol(other.to_string()),
    }
}

/// Whether opening a connection that failed with `error` may work if tried again shortly:
/// the server unreachable, restarting, refusing connections for now or out of them, or a
/// standby (the primary is moving). Bad credentials or a missing database are answered at
/// once.
pub fn opening_may_succeed_later(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08") || code.starts_with("53") || code.starts_with("57P")
        }),
        _ => false,
    }
}

/// A connection taken from the pool for one use. Dropped, it goes back as the use ended:
/// settled clean, as it is; settled in doubt (an error that leaves the protocol's state
/// unknown), closed; never settled — the caller's future dropped mid-use, which no error
/// reports — recovered by the pool first (see the module docs: a cancelled BEGIN leaves the
/// session inside a transaction that sqlx does not know about).
pub struct Checkout {
    /// The pooled connection; taken only by `drop`.
    pooled: Option<Pooled>,
    /// When it was handed out: how long a use holds a connection paces the queue.
    since: Instant,
    /// Where it goes back.
    pool: Pool,
    /// How the use ended, as far as it is known.
    ending: Ending,
}

/// How a use of a connection ended, as its [`Checkout`] knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Not settled: the use is under way, or was cut off by its caller.
    CutOff,
    /// Settled with an answer and no transaction open: reusable as it is.
    Clean,
    /// Settled after a failure that leaves the connection's state unknown (no answer, a
    /// lost connection), or with a transaction open: closed, never reused.
    InDoubt,
}

impl Checkout {
    fn new(pooled: Pooled, pool: Pool) -> Self {
        Self {
            pooled: Some(pooled),
            since: Instant::now(),
            pool,
            ending: Ending::CutOff,
        }
    }

    /// The connection.
    pub fn get(&mut self) -> &mut PgConnection {
        &mut self.pooled.as_mut().expect("taken only when dropped").conn
    }

    /// Marks the use as over: when dropped, the connection goes back to the pool if
    /// `clean` and no transaction is left open on it, and is closed otherwise.
    pub fn settle(&mut self, clean: bool) {
        self.ending = if clean && !self.get().is_in_transaction() {
            Ending::Clean
        } else {
            Ending::InDoubt
        };
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        let Some(pooled) = self.pooled.take() else {
            return;
        };
        self.pool.held(self.since.elapsed());
        match self.ending {
            // Back with no I/O.
            Ending::Clean => self.pool.release(pooled),
            // Brought to a known state by the pool, off the caller's path.
            Ending::CutOff => self.pool.recover(pooled),
            // The socket closes now, with no round trip to a server that may not answer,
            // and the server rolls back what was open.
            Ending::InDoubt => {
                close_quietly(pooled);
                self.pool.discard();
            }
        }
    }
}
