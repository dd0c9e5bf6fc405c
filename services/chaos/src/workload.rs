//! The workload: clients that charge and read through the edge and record every operation
//! ([`Workload`]), extra clients for an overload burst ([`Burst`]), and the settling after
//! the faults ([`Workload::settle`]).
//!
//! Each client makes one call at a time: a new charge (a fresh key on one of the run's
//! accounts), a charge re-sent with the key and parameters of an earlier one (sometimes
//! one still in flight), or a read. Some charges ask for `x-retry-mode: every-layer`. A
//! client that got a failure waits a little before its next call, as any client would.
//! Every account and key carries the run's id, so a run against a shared database reads
//! back only its own rows.

use std::{
    collections::HashSet,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use rand::{RngExt, SeedableRng, rngs::SmallRng};
use resilience::wire::{IDEMPOTENT_REPLAYED, code_name};
use retrychain_domain::RetryMode;
use retrychain_harness::charge_request;
use retrychain_proto::v1::{GetAccountRequest, payments_client::PaymentsClient};
use tokio::{task::JoinHandle, time::Instant};
use tonic::{Code, transport::Channel};

use crate::history::{Op, Outcome, Phase, Request};

/// What the workload does.
#[derive(Debug, Clone, Copy)]
pub struct Mix {
    /// Clients, each one call at a time.
    pub clients: usize,
    /// Accounts the charges spread over.
    pub accounts: usize,
    /// Each call's deadline.
    pub deadline: Duration,
    /// The share of calls that re-send an earlier charge.
    pub resend: f64,
    /// The share of calls that read an account.
    pub reads: f64,
    /// The share of charges sent with `x-retry-mode: every-layer`.
    pub every_layer: f64,
}

/// How long past its deadline a client waits for an answer before it gives up on it. tonic's
/// client gives up at the deadline itself (see [`failed`]); this bound only guards against
/// a call that never ends.
const GRACE: Duration = Duration::from_secs(2);

/// Clients re-sending the unsettled keys after the faults.
const SETTLERS: usize = 32;

/// How long a client waits after a failure before its next call.
const AFTER_FAILURE: Duration = Duration::from_millis(50);

/// A charge as first sent: its key's parameters for good.
#[derive(Debug, Clone)]
struct Sent {
    account: String,
    key: String,
    amount_cents: i64,
}

#[derive(Debug)]
struct Inner {
    edge: PaymentsClient<Channel>,
    run: String,
    mix: Mix,
    seed: u64,
    start: Instant,
    ops: Mutex<Vec<Op>>,
    sent: Mutex<Vec<Sent>>,
    next_op: AtomicU64,
    next_key: AtomicU64,
    next_client: AtomicU64,
}

/// The run's clients and their record; cheap to clone.
#[derive(Debug, Clone)]
pub struct Workload {
    inner: Arc<Inner>,
}

/// Clients running until stopped.
#[derive(Debug)]
pub struct Clients {
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Clients {
    /// Stops them after the calls they are making, and waits for those.
    pub async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// The extra clients of an overload burst.
pub type Burst = Clients;

impl Workload {
    /// A workload on `edge` for the run named `run` (its accounts and keys start with it),
    /// timed from `start`.
    pub fn new(edge: Channel, run: &str, mix: Mix, seed: u64, start: Instant) -> Self {
        Self {
            inner: Arc::new(Inner {
                edge: PaymentsClient::new(edge),
                run: run.to_owned(),
                mix,
                seed,
                start,
                ops: Mutex::default(),
                sent: Mutex::default(),
                next_op: AtomicU64::new(0),
                next_key: AtomicU64::new(0),
                next_client: AtomicU64::new(0),
            }),
        }
    }

    /// Starts the run's clients.
    pub fn start(&self) -> Clients {
        self.clients(self.inner.mix.clients, false)
    }

    /// Starts `n` extra clients that send new charges only, as fast as they are answered.
    pub fn burst(&self, n: usize) -> Burst {
        self.clients(n, true)
    }

    fn clients(&self, n: usize, burst: bool) -> Clients {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..n)
            .map(|_| {
                let client = self.inner.next_client.fetch_add(1, Ordering::Relaxed) as u32;
                let workload = self.clone();
                let stop = Arc::clone(&stop);
                tokio::spawn(async move { workload.client(client, burst, &stop).await })
            })
            .collect();
        Clients { stop, tasks }
    }

    async fn client(&self, client: u32, burst: bool, stop: &AtomicBool) {
        let mix = self.inner.mix;
        let mut rng = SmallRng::seed_from_u64(self.inner.seed ^ u64::from(client) << 32);
        while !stop.load(Ordering::Relaxed) {
            let roll: f64 = rng.random();
            let request = if burst || roll >= mix.resend + mix.reads {
                self.fresh_charge(&mut rng)
            } else if roll < mix.resend {
                match self.earlier_charge(&mut rng) {
                    Some(request) => request,
                    None => self.fresh_charge(&mut rng),
                }
            } else {
                Request::Read {
                    account: self.account(&mut rng),
                }
            };
            let ok = self.call(client, request, Phase::Load).await;
            if !ok {
                tokio::time::sleep(AFTER_FAILURE).await;
            }
        }
    }

    fn account(&self, rng: &mut SmallRng) -> String {
        let i = rng.random_range(0..self.inner.mix.accounts.max(1));
        format!("{}-a{i}", self.inner.run)
    }

    fn fresh_charge(&self, rng: &mut SmallRng) -> Request {
        let n = self.inner.next_key.fetch_add(1, Ordering::Relaxed);
        let sent = Sent {
            account: self.account(rng),
            key: format!("{}-k{n}", self.inner.run),
            amount_cents: rng.random_range(1..=10_000),
        };
        let every_layer = rng.random_bool(self.inner.mix.every_layer.clamp(0.0, 1.0));
        let request = charge(&sent, every_layer);
        // Recorded before it is sent, so another client may re-send it while it runs.
        lock(&self.inner.sent).push(sent);
        request
    }

    fn earlier_charge(&self, rng: &mut SmallRng) -> Option<Request> {
        let sent = lock(&self.inner.sent);
        if sent.is_empty() {
            return None;
        }
        let every_layer = rng.random_bool(self.inner.mix.every_layer.clamp(0.0, 1.0));
        Some(charge(&sent[rng.random_range(0..sent.len())], every_layer))
    }

    fn ms(&self) -> f64 {
        self.inner.start.elapsed().as_secs_f64() * 1000.0
    }

    /// Makes `request` and records it; whether it was answered OK.
    async fn call(&self, client: u32, request: Request, phase: Phase) -> bool {
        let id = self.inner.next_op.fetch_add(1, Ordering::Relaxed);
        let deadline = self.inner.mix.deadline;
        let mut edge = self.inner.edge.clone();
        let invoked_ms = self.ms();
        let invoked = Instant::now();
        let outcome = match &request {
            Request::Charge {
                account,
                key,
                amount_cents,
                mode,
            } => {
                let mode = mode.as_deref().and_then(|m| m.parse::<RetryMode>().ok());
                let call = charge_request(account, *amount_cents, Some(key), deadline, mode);
                match tokio::time::timeout(deadline + GRACE, edge.charge(call)).await {
                    Err(_) => Outcome::Unanswered,
                    Ok(Err(status)) => failed(&status, invoked.elapsed() >= deadline),
                    Ok(Ok(reply)) => {
                        let replayed = reply
                            .metadata()
                            .get(IDEMPOTENT_REPLAYED)
                            .is_some_and(|v| v == "true");
                        let reply = reply.into_inner();
                        Outcome::Charged {
                            charge_id: reply.charge_id,
                            amount_cents: reply.amount_cents,
                            balance_cents: reply.balance_cents,
                            replayed,
                        }
                    }
                }
            }
            Request::Read { account } => {
                let mut call = tonic::Request::new(GetAccountRequest {
                    account_id: account.clone(),
                });
                call.set_timeout(deadline);
                match tokio::time::timeout(deadline + GRACE, edge.get_account(call)).await {
                    Err(_) => Outcome::Unanswered,
                    Ok(Err(status)) if status.code() == Code::NotFound => Outcome::Read {
                        balance_cents: 0,
                        charges: 0,
                    },
                    Ok(Err(status)) => failed(&status, invoked.elapsed() >= deadline),
                    Ok(Ok(reply)) => Outcome::Read {
                        balance_cents: reply.get_ref().balance_cents,
                        charges: reply.get_ref().charges,
                    },
                }
            }
        };
        let ok = outcome.ok();
        let op = Op {
            id,
            worker: client,
            request,
            invoked_ms,
            completed_ms: self.ms(),
            deadline_ms: deadline.as_millis() as u64,
            outcome,
            phase,
        };
        lock(&self.inner.ops).push(op);
        ok
    }

    /// After the faults: re-sends every key never answered OK, with its parameters, until
    /// it is — giving up only once no key at all has settled for `patience` (so a long
    /// run's many keys are not cut short by a clock, and a chain that stopped answering
    /// is); the keys still unsettled then.
    pub async fn settle(&self, patience: Duration) -> usize {
        let settled: HashSet<(String, String)> = lock(&self.inner.ops)
            .iter()
            .filter(|op| op.outcome.ok())
            .filter_map(|op| match &op.request {
                Request::Charge { account, key, .. } => Some((account.clone(), key.clone())),
                Request::Read { .. } => None,
            })
            .collect();
        let open: Vec<Sent> = lock(&self.inner.sent)
            .iter()
            .filter(|s| !settled.contains(&(s.account.clone(), s.key.clone())))
            .cloned()
            .collect();
        let queue = Arc::new(Mutex::new(open));
        let progress = Arc::new(Mutex::new(Instant::now()));
        let left = Arc::new(AtomicU64::new(0));
        let tasks: Vec<JoinHandle<()>> = (0..SETTLERS)
            .map(|_| {
                let client = self.inner.next_client.fetch_add(1, Ordering::Relaxed) as u32;
                let workload = self.clone();
                let (queue, progress, left) =
                    (Arc::clone(&queue), Arc::clone(&progress), Arc::clone(&left));
                tokio::spawn(async move {
                    loop {
                        let Some(sent) = lock(&queue).pop() else {
                            return;
                        };
                        loop {
                            if workload
                                .call(client, charge(&sent, false), Phase::Settle)
                                .await
                            {
                                *lock(&progress) = Instant::now();
                                break;
                            }
                            if lock(&progress).elapsed() >= patience {
                                left.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(250)).await;
                        }
                    }
                })
            })
            .collect();
        for task in tasks {
            let _ = task.await;
        }
        left.load(Ordering::Relaxed) as usize
    }

    /// The accounts of the run.
    pub fn accounts(&self) -> Vec<String> {
        (0..self.inner.mix.accounts.max(1))
            .map(|i| format!("{}-a{i}", self.inner.run))
            .collect()
    }

    /// Every operation so far, in the order they were made.
    pub fn ops(&self) -> Vec<Op> {
        let mut ops = lock(&self.inner.ops).clone();
        ops.sort_by_key(|op| op.id);
        ops
    }
}

fn charge(sent: &Sent, every_layer: bool) -> Request {
    Request::Charge {
        account: sent.account.clone(),
        key: sent.key.clone(),
        amount_cents: sent.amount_cents,
        mode: every_layer.then(|| RetryMode::EveryLayer.as_str().to_owned()),
    }
}

/// A failure, as recorded. Two kinds of status are made up by tonic's own client rather
/// than answered by the edge, and are recorded as what they mean: CANCELLED "Timeout
/// expired" at the deadline is the client giving up when its deadline passed
/// (DEADLINE_EXCEEDED, as gRPC's own clients report it); an UNKNOWN or CANCELLED with an
/// error of the client's own beneath it (hyper's "operation was canceled", "transport
/// error") is the connection to the edge breaking before an answer.
fn failed(status: &tonic::Status, at_deadline: bool) -> Outcome {
    if status.code() == Code::Cancelled && at_deadline && status.message() == "Timeout expired" {
        return Outcome::Failed {
            code: code_name(Code::DeadlineExceeded).to_owned(),
            message: "no answer by the deadline: the client gave up (tonic reports CANCELLED \"Timeout expired\")".to_owned(),
        };
    }
    if matches!(
        status.code(),
        Code::Unknown | Code::Cancelled | Code::Internal
    ) && std::error::Error::source(status).is_some()
    {
        return Outcome::ConnectionLost {
            detail: format!("{}: {}", code_name(status.code()), status.message()),
        };
    }
    Outcome::Failed {
        code: code_name(status.code()).to_owned(),
        message: status.message().to_owned(),
    }
}

/// A lock that a panicking client cannot poison for the others.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
