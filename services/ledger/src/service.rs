//! The ledger's `Payments` service: validation, the processor under the retry mode's
//! policy, the key store's phases, the completer of abandoned charges, and the one place
//! store errors become statuses.

use std::{sync::Arc, time::Duration};

use resilience::{AttemptRequest, CallRequest, Deadline, RetryCalls, RetryLayer, ServiceConfig};
use retrychain_domain::{
    AccountId, AmountCents, Caller, IdempotencyKey, RetryMode,
    metadata::{self, IDEMPOTENT_REPLAYED},
};
use retrychain_node::{Node, RpcScope, faults::lost_reply, statement::Call, stats::Counters};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest, payments_server::Payments,
};
use tonic::{
    Request, Response, Status,
    metadata::{MetadataKey, MetadataValue},
};
use tower::{ServiceExt, util::BoxCloneSyncService};
use tracing::Instrument;

use crate::{
    processor::{Processor, ProcessorKey, ProcessorRecord},
    store::{
        ChargeOutcome, InFlight, KeyStore, KeyedCharge, ProcessorCharge, SavedReply, StoreError,
    },
};

/// The method whose policy the processor's calls follow: they are Charge's bottom calls.
const CHARGE: &str = "/retrychain.v1.Payments/Charge";

/// The processor as a tower service, one attempt per call: what the retry engine drives.
type ProcessorService = BoxCloneSyncService<AttemptRequest<ProcessorCharge>, (), Status>;

/// The bottom of the chain.
#[derive(Debug, Clone)]
pub struct Ledger {
    /// Counters, faults, name and policy.
    node: Arc<Node>,
    /// Postgres.
    store: KeyStore,
    /// The mode when no `x-retry-mode` came down the chain.
    mode: RetryMode,
    /// Processor calls for `every-layer`: the node's policy for Charge, counted by the same
    /// engine (and observer) as every hop's downstream calls.
    every_layer: RetryCalls<ProcessorService>,
    /// One processor attempt, for `edge-only`.
    single: RetryCalls<ProcessorService>,
    /// Taken off the time left for the processor's calls, so they end while the
    /// transaction can still commit.
    margin: Duration,
    /// Same-key behaviour while the first request runs.
    in_flight: InFlight,
}

impl Ledger {
    /// A ledger over `store`. Its processor calls retry (in `every-layer` mode) as the
    /// node's policy says for Charge, with attempts no shorter than `min_attempt` and each
    /// ending `margin` before the charge must answer.
    pub fn new(
        node: Arc<Node>,
        store: KeyStore,
        processor_record: ProcessorRecord,
        mode: RetryMode,
        margin: Duration,
        min_attempt: Duration,
        in_flight: InFlight,
    ) -> Self {
        let processor = Arc::new(Processor::new(Arc::clone(&node), processor_record));
        let service: ProcessorService = BoxCloneSyncService::new(tower::service_fn(
            move |call: AttemptRequest<ProcessorCharge>| {
                let processor = Arc::clone(&processor);
                async move { processor.charge(call.attempt, &call.request).await }
            },
        ));
        let engine = |policy: Arc<ServiceConfig>| {
            RetryLayer::new(policy)
                .no_throttle()
                .min_attempt(min_attempt)
                .annotate_failures(&node.name)
                .observer(Arc::clone(&node) as _)
                .calls(CHARGE, service.clone())
        };
        Self {
            every_layer: engine(Arc::clone(&node.policy)),
            single: engine(Arc::new(ServiceConfig::default())),
            store,
            mode,
            margin,
            in_flight,
            node,
        }
    }

    /// The key store, for the retention task.
    pub fn store(&self) -> &KeyStore {
        &self.store
    }

    /// One charge: the key store's phases with the processor call(s) between them, under
    /// the mode's retry policy, and its counters. Processor attempts end at `answer_by`,
    /// less the margin, which leaves phase 2 its time before this service must answer.
    async fn charge_once(
        &self,
        caller: Caller,
        account: AccountId,
        key: IdempotencyKey,
        amount: AmountCents,
        mode: RetryMode,
        answer_by: Deadline,
    ) -> Result<(SavedReply, bool), Status> {
        let processor: &RetryCalls<ProcessorService> = match mode {
            RetryMode::EveryLayer => &self.every_layer,
            RetryMode::EdgeOnly => &self.single,
        };
        let processor_key = ProcessorKey::new(&account, &key);
        let deadline = Some(answer_by.earlier_by(self.margin).instant());
        let faults = &self.node.faults;
        let outcome = self
            .store
            .charge(
                KeyedCharge {
                    caller: &caller,
                    account: &account,
                    key: &key,
                    amount,
                    deadline: answer_by,
                    in_flight: self.in_flight,
                    processor_key: processor_key.as_str(),
                },
                |call| {
                    let called = processor.clone().oneshot(CallRequest {
                        request: call,
                        deadline,
                    });
                    async move {
                        called.await?;
                        // A test's window between the processor's answer and phase 2.
                        let hold = faults.current().finish_delay_ms;
                        if hold > 0 {
                            tokio::time::sleep(Duration::from_millis(u64::from(hold))).await;
                        }
                        Ok(())
                    }
                },
            )
            .await?;
        // The outcome goes on the request's one log line (its span's fields), not a line
        // of its own: `charge_id` and `balance_cents` there, `replayed=true` on a replay.
        let span = tracing::Span::current();
        let (saved, replayed) = match outcome {
            ChargeOutcome::Executed(saved) => {
                Counters::bump(&self.node.counters.executions);
                (saved, false)
            }
            ChargeOutcome::Replayed(saved) => {
                Counters::bump(&self.node.counters.replays);
                span.record("replayed", true);
                (saved, true)
            }
        };
        span.record("charge_id", tracing::field::display(&saved.charge_id));
        span.record("balance_cents", saved.balance_cents);
        Ok((saved, replayed))
    }

    fn mode_of<T>(&self, request: &Request<T>) -> Result<RetryMode, Status> {
        Ok(self
            .node
            .requested_retry_mode(request.metadata())?
            .unwrap_or(self.mode))
    }
}

fn reply(saved: SavedReply) -> ChargeReply {
    ChargeReply {
        charge_id: saved.charge_id.to_string(),
        account_id: saved.account_id,
        amount_cents: saved.amount_cents,
        balance_cents: saved.balance_cents,
    }
}

/// The one mapping from store failures to the wire.
impl From<StoreError> for Status {
    fn from(error: StoreError) -> Self {
        let message = error.to_string();
        match error {
            StoreError::KeyReused { .. } => Status::failed_precondition(message),
            StoreError::NotOwner => Status::permission_denied(message),
            StoreError::InFlight => Status::aborted(message),
            StoreError::DeadlineWhileWaiting(_) => Status::deadline_exceeded(message),
            StoreError::BalanceOverflow => Status::out_of_range(message),
            // The payment processor below failed, not this replica: marked relayed, so
            // that a processor outage ejects no ledger from a hop's rotation. (A replica
            // that cannot reach the database is not marked: that may be its own fault,
            // and the ejection limit bounds what a shared database's outage costs.)
            StoreError::Processor(mut status) => {
                resilience::wire::mark_relayed(status.metadata_mut());
                status
            }
            // A processor refusal saved with the key, replayed as a saved reply would be.
            StoreError::Failed { code, message } => {
                let mut status = Status::new(code, message);
                resilience::wire::mark_relayed(status.metadata_mut());
                status.metadata_mut().insert(
                    MetadataKey::from_static(IDEMPOTENT_REPLAYED),
                    MetadataValue::from_static("true"),
                );
                status
            }
            // Every connection busy: an overload, refused as the admission layer refuses
            // (marked, so no balancer ejects this replica for it, and every limit above
            // takes it as backpressure), with a short pushback: connections come free
            // every few milliseconds.
            StoreError::Busy(_) => {
                let mut status = Status::unavailable(message);
                resilience::wire::mark_overloaded(status.metadata_mut());
                resilience::wire::set_pushback(&mut status, 1);
                status
            }
            StoreError::Unavailable(_) | StoreError::Lost(_) | StoreError::NotCopied(_) => {
                tracing::warn!(%message, "database unavailable");
                Status::unavailable(message)
            }
            StoreError::Conflict(_) => Status::aborted(message),
            StoreError::Database(error) => {
                tracing::error!(%error, "database failure");
                Status::internal("database error; the charge was not committed")
            }
        }
    }
}

#[tonic::async_trait]
impl Payments for Ledger {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let scope = RpcScope::begin(&self.node, "Charge", &request);
        scope
            .run(async {
                let key = metadata::idempotency_key(request.metadata())?.ok_or_else(|| {
                    Status::invalid_argument(
                        "idempotency-key is required: a charge without one cannot be retried safely",
                    )
                })?;
                scope.record_key(&key);
                scope.echo_key(&key);
                let mode = self.mode_of(&request)?;
                let account = AccountId::parse(&request.get_ref().account_id)?;
                let amount = AmountCents::parse(request.get_ref().amount_cents)?;
                // Who asks: the edge's signed statement of this very call, where the
                // chain has one (`node::statement`).
                let caller = self.node.caller_of(
                    request.metadata(),
                    &Call {
                        method: "Charge",
                        key: Some(key.as_str()),
                        account: account.as_str(),
                        amount: Some(amount.get()),
                    },
                )?;

                // The transaction runs in its own task: if this handler is dropped (its
                // deadline passed, the client went away), the transaction still ends
                // properly — committed and counted, or rolled back — instead of being cut
                // off between two statements. The charge's future (3.5 KB) is boxed where
                // it starts, so that spawning moves a pointer, not the whole future (each
                // move a copy: callgrind counted 3.3k instructions of copying a charge).
                let ledger = self.clone();
                let answer_by = scope.answer_by;
                let transaction = async move {
                    Box::pin(ledger.charge_once(caller, account, key, amount, mode, answer_by))
                        .await
                };
                let (saved, replayed) = tokio::spawn(transaction.instrument(scope.span.clone()))
                    .await
                    .map_err(|e| Status::internal(format!("the charge task failed: {e}")))??;

                if self.node.faults.drop_reply() {
                    return Err(lost_reply(&self.node.name));
                }
                let mut response = Response::new(reply(saved));
                if replayed {
                    response
                        .metadata_mut()
                        .insert(
                            MetadataKey::from_static(IDEMPOTENT_REPLAYED),
                            MetadataValue::from_static("true"),
                        );
                }
                Ok(response)
            })
            .await
    }

    async fn get_account(
        &self,
        request: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        let scope = RpcScope::begin(&self.node, "GetAccount", &request);
        scope
            .run(async {
                let account = AccountId::parse(&request.get_ref().account_id)?;
                let caller = self.node.caller_of(
                    request.metadata(),
                    &Call {
                        method: "GetAccount",
                        key: None,
                        account: account.as_str(),
                        amount: None,
                    },
                )?;
                // A plain read: if the scope's deadline guard drops it, nothing is half-done.
                let found = self
                    .store
                    .account(&caller, &account, scope.answer_by)
                    .await?;
                let (balance_cents, charges) = found.ok_or_else(|| {
                    Status::not_found(format!("account {account} has never been charged"))
                })?;
                Ok(Response::new(Account {
                    account_id: account.as_str().to_owned(),
                    balance_cents,
                    charges,
                }))
            })
            .await
    }
}

/// Resumes abandoned charges (keys left started, their lease passed a while ago, nobody
/// back for them) every second until the process ends; see `store::KeyStore::complete_abandoned`.
pub async fn run_completer(ledger: Ledger) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let processor = ledger.single.clone();
    loop {
        ticker.tick().await;
        let completed = ledger
            .store
            .complete_abandoned(16, |call| {
                processor.clone().oneshot(CallRequest {
                    request: call,
                    deadline: Some(tokio::time::Instant::now() + crate::store::COMPLETER_CALL),
                })
            })
            .await;
        match completed {
            Ok(0) => {}
            Ok(taken) => tracing::info!(taken, "completer took over abandoned charges"),
            Err(error) => {
                tracing::warn!(%error, "completer could not look for abandoned charges; will try again")
            }
        }
    }
}

/// Deletes expired keys, and the processor's records of the same age, every `every` until
/// the process ends. A key's retention starts when it was claimed; after it, the same key
/// is a new request.
pub async fn run_retention(
    store: KeyStore,
    processor_record: ProcessorRecord,
    retention: std::time::Duration,
    every: std::time::Duration,
) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match store.purge_keys_older_than(retention, 1000).await {
            Ok(0) => {}
            Ok(purged) => tracing::info!(purged, ?retention, "purged expired idempotency keys"),
            Err(error) => tracing::warn!(%error, "retention purge failed; will try again"),
        }
        match processor_record.purge_older_than(retention, 1000).await {
            Ok(0) => {}
            Ok(purged) => tracing::info!(purged, ?retention, "purged expired processor records"),
            Err(error) => {
                tracing::warn!(%error, "processor records' purge failed; will try again")
            }
        }
    }
}
