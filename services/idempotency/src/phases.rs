//! The protocol: phase 1 (claim the key), the work done with no transaction open while
//! the lease is renewed, phase 2 (the effect and the reply together, or the error), and
//! what a request does when it finds its key running or settled. Also the completer's
//! step, which resumes keys nobody came back for.

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::time::Instant;
use uuid::Uuid;

use crate::{
    decide::{Outcome, Refusal, SavedError, Verdict, judge, refused_for_good},
    key_locks::KeyLocks,
    persistence::{Claim, Failure, KeyId, Persistence, TakeOver},
};

/// The timings of the protocol.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// A key's lease: how long its owner holds it without renewing. Renewed every third of
    /// it while the work runs, so a crashed or frozen owner's key is free to resume within
    /// about this long, whatever the request's deadline.
    pub lease: Duration,
    /// How long after its lease passed the completer takes over a key whose owner vanished
    /// (the client's own retry usually comes sooner, and resumes it itself).
    pub abandoned_after: Duration,
    /// How long after a transient failure the completer takes over a released key nobody
    /// retried, the first time; doubled for each take-over after.
    pub released_after: Duration,
    /// How long phase 2 is tried again, after the work was done, while the persistence
    /// fails transiently (a restart, a failover): recorded now rather than resumed later.
    pub phase_two_patience: Duration,
    /// The bound on each write after the work (a failure saved, a release, a renewal):
    /// the persistence's own, never the caller's deadline — what the work did is to be
    /// recorded even when the caller has stopped waiting.
    pub write_within: Duration,
    /// The first pause between two looks at a key another process runs; doubled each time
    /// up to `poll_max`.
    pub poll_min: Duration,
    /// The longest pause between two looks.
    pub poll_max: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(2),
            abandoned_after: Duration::from_secs(2),
            released_after: Duration::from_secs(60),
            phase_two_patience: Duration::from_secs(3),
            write_within: Duration::from_secs(5),
            poll_min: Duration::from_millis(5),
            poll_max: Duration::from_millis(50),
        }
    }
}

/// What a same-key request does while the first one is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    /// Wait for the first to finish, then replay its outcome (or resume it, if its lease
    /// passes).
    Wait,
    /// Refuse at once ([`Error::InFlight`], Stripe-style); a settled key still replays.
    Reject,
}

/// One idempotent call, as a service asks for it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a, F> {
    /// Which key.
    pub id: KeyId<'a>,
    /// Who asks (see [`Claim::caller`]).
    pub caller: &'a str,
    /// What binds the key to this request.
    pub fingerprint: &'a F,
    /// The key the work calls its downstream under, if this request claims the key.
    pub step_key: &'a str,
    /// When the caller stops waiting.
    pub deadline: Instant,
    /// What to do while another request with the key runs.
    pub in_flight: InFlight,
}

/// The work between the phases, as it is handed to the service: the step key to call a
/// downstream under (the one saved with the claim, so a resumed key repeats the first
/// request's call), and the fingerprint of the request that claimed it.
#[derive(Debug, Clone)]
pub struct Step<F> {
    /// The saved step key.
    pub step_key: String,
    /// The claiming request's fingerprint.
    pub fingerprint: F,
}

/// Why an idempotent call did not come to an outcome.
#[derive(Debug, thiserror::Error)]
pub enum Error<F, E> {
    /// The key was first used with another request.
    #[error("idempotency key was reused with a different request")]
    Reused {
        /// The first request's fingerprint.
        saved: F,
        /// This request's.
        requested: F,
    },
    /// The scope belongs to another caller.
    #[error("the idempotency key's scope belongs to another caller")]
    ScopeRefused,
    /// [`InFlight::Reject`]: a request with this key is still running.
    #[error("a request with this idempotency key is still in flight; retry after it finishes")]
    InFlight,
    /// The deadline ran out waiting for a same-key request.
    #[error("the deadline ran out while {0}")]
    DeadlineWhileWaiting(&'static str),
    /// The work failed this time: for good (the key now fails with this status, replayed
    /// to every retry), or for now (the key is released; a retry resumes it).
    #[error("{}", .0.message())]
    Step(tonic::Status),
    /// The key failed for good earlier: its saved error.
    #[error("{}", .0.message)]
    Failed(SavedError),
    /// A finished key without a saved reply: the persistence is broken.
    #[error("a finished idempotency key has no saved reply")]
    NoReply,
    /// The persistence failed.
    #[error(transparent)]
    Store(E),
}

/// The phases, shared by every request of a process: same-key requests of this process
/// wait in memory first ([`KeyLocks`]), and the protocol's counts.
#[derive(Debug, Default)]
pub struct Phases {
    policy: Policy,
    locks: Arc<KeyLocks>,
    counts: Counts,
}

/// What the phases count, since start.
#[derive(Debug, Default)]
struct Counts {
    key_waits: AtomicU64,
    resumed: AtomicU64,
    stale_owner: AtomicU64,
}

/// A phase-2 result: settled with an outcome, or the key taken over meanwhile.
type Settled<R, F, E> = Option<Result<Outcome<R>, Error<F, E>>>;

impl Phases {
    /// Phases with `policy`.
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            ..Self::default()
        }
    }

    /// The timings.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Requests that waited for another with their key, since start.
    pub fn key_waits(&self) -> u64 {
        self.counts.key_waits.load(Ordering::Relaxed)
    }

    /// Keys taken over and resumed, and phase 2s refused to a stale owner, since start.
    pub fn takeovers(&self) -> (u64, u64) {
        (
            self.counts.resumed.load(Ordering::Relaxed),
            self.counts.stale_owner.load(Ordering::Relaxed),
        )
    }

    /// Keys with a request running or waiting in this process.
    pub fn keys_in_flight(&self) -> usize {
        self.locks.len()
    }

    /// Runs `request` once per key: claims the key, does `work` with no transaction open
    /// while renewing the lease, and records its effect with the reply; or replays the
    /// key's saved outcome; or waits for the request that runs it.
    pub async fn run<P, W, Fut>(
        &self,
        store: &P,
        request: Request<'_, P::Fingerprint>,
        work: W,
    ) -> Result<Outcome<P::Reply>, Error<P::Fingerprint, P::Error>>
    where
        P: Persistence,
        W: Fn(Step<P::Fingerprint>) -> Fut,
        Fut: Future<Output = Result<P::Effect, tonic::Status>>,
    {
        let Request {
            id,
            caller,
            fingerprint,
            step_key,
            deadline,
            in_flight,
        } = request;
        // Same-key requests of this process: one at a time, the others waiting in memory
        // (or, rejecting, only a look at the key).
        let _turn = match self.locks.try_lock(id.scope, id.key) {
            Some(turn) => Some(turn),
            None if in_flight == InFlight::Reject => None,
            None => {
                self.counts.key_waits.fetch_add(1, Ordering::Relaxed);
                let turn = tokio::time::timeout_at(deadline, self.locks.lock(id.scope, id.key))
                    .await
                    .map_err(|_| Error::DeadlineWhileWaiting(WAITING_FOR_KEY))?;
                Some(turn)
            }
        };
        let owner = Uuid::new_v4();
        let mut pause = self.policy.poll_min;
        loop {
            let claim = Claim {
                id,
                caller,
                fingerprint,
                owner,
                lease: self.policy.lease,
                step_key,
                deadline,
            };
            let record = store
                .claim(claim)
                .await
                .map_err(Error::Store)?
                .ok_or(Error::ScopeRefused)?;
            match judge(fingerprint, owner, step_key, record) {
                Verdict::Replay(reply) => return Ok(Outcome::Replayed(reply)),
                Verdict::Refused(refusal) => return Err(refused(refusal)),
                Verdict::Ours { step_key, resumed } => {
                    if resumed {
                        self.counts.resumed.fetch_add(1, Ordering::Relaxed);
                        tracing::info!("resuming a key whose owner's lease passed");
                    }
                    let step = Step {
                        step_key,
                        fingerprint: fingerprint.clone(),
                    };
                    let Some(done) = self.holding_lease(store, id, owner, work(step)).await else {
                        // Taken over while the work ran: its new owner settles it.
                        self.stale::<()>();
                        continue;
                    };
                    match self.settle(store, id, owner, done).await {
                        Some(outcome) => return outcome,
                        // Taken over meanwhile: its new owner settles it; wait for that.
                        None => continue,
                    }
                }
                Verdict::Running if in_flight == InFlight::Reject => {
                    return Err(Error::InFlight);
                }
                Verdict::Running => {
                    if pause == self.policy.poll_min {
                        self.counts.key_waits.fetch_add(1, Ordering::Relaxed);
                    }
                    self.wait_while_running(store, id, deadline, &mut pause)
                        .await?;
                }
            }
        }
    }

    /// The completer's step: takes over up to `batch` keys nobody came back for (see
    /// [`TakeOver`]) and redoes each one's work under its saved step key, then records it
    /// as a request would. Returns how many were taken over.
    pub async fn complete_abandoned<P, W, Fut>(
        &self,
        store: &P,
        batch: i64,
        work: W,
    ) -> Result<usize, P::Error>
    where
        P: Persistence,
        W: Fn(Step<P::Fingerprint>) -> Fut,
        Fut: Future<Output = Result<P::Effect, tonic::Status>>,
    {
        let owner = Uuid::new_v4();
        let take = TakeOver {
            owner,
            lease: self.policy.lease,
            abandoned_after: self.policy.abandoned_after,
            released_after: self.policy.released_after,
            batch,
        };
        let taken = store
            .take_over(take, Instant::now() + self.policy.write_within)
            .await?;
        let count = taken.len();
        for abandoned in taken {
            let id = KeyId {
                scope: &abandoned.scope,
                key: &abandoned.key,
            };
            self.counts.resumed.fetch_add(1, Ordering::Relaxed);
            let step = Step {
                step_key: abandoned.step_key.clone().unwrap_or_default(),
                fingerprint: abandoned.fingerprint.clone(),
            };
            let outcome = match self.holding_lease(store, id, owner, work(step)).await {
                Some(done) => self.settle(store, id, owner, done).await,
                None => self.stale(),
            };
            tracing::info!(
                scope = id.scope,
                key = id.key,
                outcome = match &outcome {
                    Some(Ok(_)) => "finished".to_owned(),
                    Some(Err(error)) => format!("not finished: {error}"),
                    None => "taken over by another process".to_owned(),
                },
                "completer resumed an abandoned key"
            );
        }
        Ok(count)
    }

    /// `work`, while `owner` renews its lease on the key every third of it; `None` if a
    /// renewal found the key taken over (the work is then dropped: its downstream
    /// deduplicates by the step key, and the new owner calls it again).
    async fn holding_lease<P: Persistence, T>(
        &self,
        store: &P,
        id: KeyId<'_>,
        owner: Uuid,
        work: impl Future<Output = T>,
    ) -> Option<T> {
        let lease = self.policy.lease;
        let renewing = async {
            loop {
                tokio::time::sleep(lease / 3).await;
                // Renewed, or the persistence did not answer: go on (phase 2's guard still
                // refuses a stale owner). Taken: stop the work.
                if let Ok(false) = store
                    .renew(id, owner, lease, Instant::now() + lease / 3)
                    .await
                {
                    return;
                }
            }
        };
        tokio::select! {
            done = work => Some(done),
            () = renewing => None,
        }
    }

    /// Waits, writing nothing, until the key another process runs is settled or its lease
    /// passes (then the caller claims again), or the deadline.
    async fn wait_while_running<P: Persistence>(
        &self,
        store: &P,
        id: KeyId<'_>,
        deadline: Instant,
        pause: &mut Duration,
    ) -> Result<(), Error<P::Fingerprint, P::Error>> {
        loop {
            if deadline.saturating_duration_since(Instant::now()) <= *pause {
                return Err(Error::DeadlineWhileWaiting(WAITING_FOR_KEY));
            }
            tokio::time::sleep(*pause).await;
            *pause = (*pause * 2).min(self.policy.poll_max);
            if store
                .look(id, deadline)
                .await
                .map_err(Error::Store)?
                .changed()
            {
                return Ok(());
            }
        }
    }

    /// Phase 2 for what the work came to: finished, failed, or released. `None` when the
    /// key was taken over meanwhile (nothing written; its new owner settles it).
    async fn settle<P: Persistence>(
        &self,
        store: &P,
        id: KeyId<'_>,
        owner: Uuid,
        done: Result<P::Effect, tonic::Status>,
    ) -> Settled<P::Reply, P::Fingerprint, P::Error> {
        let within = || Instant::now() + self.policy.write_within;
        let effect = match done {
            Ok(effect) => effect,
            Err(status) if refused_for_good(&status) => {
                return match store.fail(id, owner, &status, within()).await {
                    Ok(true) => Some(Err(Error::Step(status))),
                    Ok(false) => self.stale(),
                    Err(error) => Some(Err(Error::Store(error))),
                };
            }
            Err(status) => {
                // Best effort: if the release is lost, the lease passes by itself.
                let _ = store.release(id, owner, within()).await;
                return Some(Err(Error::Step(status)));
            }
        };
        let patience = Instant::now() + self.policy.phase_two_patience;
        let finished = loop {
            match store.finish(id, owner, &effect, patience).await {
                // The persistence did not answer: it may be restarting or failing over;
                // tried again, briefly spaced, while patience lasts (a try whose commit
                // was lost finds the key finished: `None`, handled as taken over, and the
                // next claim replays it).
                Err(error)
                    if error.is_transient()
                        && patience.saturating_duration_since(Instant::now())
                            > Duration::from_millis(100) =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => break other,
            }
        };
        match finished {
            Ok(Some(reply)) => Some(Ok(Outcome::Executed(reply))),
            Ok(None) => self.stale(),
            Err(error) => match error.fails_key() {
                // The request itself cannot be recorded: the key fails with that, for good.
                Some(status) => match store.fail(id, owner, &status, within()).await {
                    Ok(true) => Some(Err(Error::Store(error))),
                    Ok(false) => self.stale(),
                    Err(other) => Some(Err(Error::Store(other))),
                },
                None => Some(Err(Error::Store(error))),
            },
        }
    }

    /// The key is someone else's now (phase 2 refused, or a renewal found it taken): this
    /// request writes nothing more, and waits for the new owner's outcome.
    fn stale<T>(&self) -> Option<T> {
        self.counts.stale_owner.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "the key was taken over while this request held it (its lease passed): it writes nothing more; the new owner settles it"
        );
        None
    }
}

/// What a request waits for when the deadline ends its wait.
const WAITING_FOR_KEY: &str = "waiting for a request with the same key to finish";

/// The error a refusing record comes to.
fn refused<F, E>(refusal: Refusal<F>) -> Error<F, E> {
    match refusal {
        Refusal::Reused { saved, requested } => Error::Reused { saved, requested },
        Refusal::Failed(saved) => Error::Failed(saved),
        Refusal::NoReply => Error::NoReply,
    }
}
