//! The edge and the relays: the four services that forward `Payments` calls downstream.
//!
//! Both roles are one type, [`Hop`]; they differ only where the contract says:
//!
//! | | edge | relay (hop2, hop3, hop4) |
//! |---|---|---|
//! | no `idempotency-key` | generates a UUID, returns it | INVALID_ARGUMENT |
//! | `x-retry-mode` | honoured and passed on only with `--allow-retry-mode-override` | the same |
//! | `edge-only` mode | retries, under the retry budget | tries once |
//! | `every-layer` mode | retries, no budget | retries, no budget |
//! | the caller is retrying (`grpc-previous-rpc-attempts` ≥ 1) | tries once | as its mode says |
//! | gave up after retrying, or a retry was refused | answers with `grpc-retry-pushback-ms: -1` | passes on the pushback from below |
//!
//! The last two rows make "retry at one layer" hold when the client retries too: a gRFC A6
//! client (grpc-go, grpc-java, gRPC core) obeys a negative pushback by not retrying, and one
//! that retries anyway gets a single attempt per retry instead of another round.
//!
//! Every call gets a strictly shorter deadline than the one received (the retry executor
//! computes it per attempt), the same idempotency key, and the same trace id.

use std::sync::Arc;

use resilience::{Backoff, Retry, RetryError, RetryPolicy, Throttle};
use retrychain_node::{
    AccountId, AmountCents, IdempotencyKey, Node, RetryMode, RpcScope, TraceContext,
    faults::{FaultLayer, Faulty},
    metadata::{self, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, RETRY_MODE, TRACE_ID, TRACEPARENT},
};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest, payments_client::PaymentsClient,
    payments_server::Payments,
};
use tonic::{
    Request, Response, Status,
    metadata::{Ascii, MetadataMap, MetadataValue},
    transport::Channel,
};
use tower::{Layer, util::Either};

/// The client stack under a hop's downstream calls, outermost first: fault injection
/// ([`FaultLayer`], only in a service started with `--fault-injection`), then the channel.
/// The retry executor sits above it, driving one call through the stack per attempt.
pub type Downstream = Either<Faulty<Channel>, Channel>;

fn downstream_stack(node: &Arc<Node>, channel: Channel) -> Downstream {
    if node.fault_injection {
        Either::Left(FaultLayer::new(Arc::clone(node)).layer(channel))
    } else {
        Either::Right(channel)
    }
}

/// Which place in the chain a hop holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The service clients call.
    Edge,
    /// hop2, hop3 or hop4.
    Relay,
}

/// How a hop retries.
#[derive(Debug, Clone)]
pub struct HopRetryConfig {
    /// The mode used when no honoured `x-retry-mode` says otherwise.
    pub mode: RetryMode,
    /// Attempts per call in the modes where this hop retries.
    pub max_attempts: u32,
    /// Waits between attempts.
    pub backoff: Backoff,
    /// The edge's retry throttle in `edge-only` mode (the budget, or a service config's
    /// `retryThrottling`); `None` with `--no-budget`.
    pub budget: Option<Arc<dyn Throttle>>,
    /// The codes worth a retry; `None`: the contract's set.
    pub retryable: Option<Vec<tonic::Code>>,
    /// Taken off the remaining time for each downstream deadline.
    pub margin: std::time::Duration,
    /// The shortest downstream attempt worth starting.
    pub min_attempt: std::time::Duration,
}

/// Forwards `Payments` to the next service.
#[derive(Debug, Clone)]
pub struct Hop {
    /// Counters, faults and name.
    node: Arc<Node>,
    /// Edge or relay.
    role: Role,
    /// The configured mode.
    mode: RetryMode,
    /// The downstream service; one HTTP/2 connection shared by all calls.
    downstream: PaymentsClient<Downstream>,
    /// The executor for `every-layer`: retries without a budget.
    every_layer: Arc<Retry>,
    /// The executor for `edge-only`: budgeted retries at the edge, one attempt elsewhere.
    edge_only: Arc<Retry>,
    /// One attempt: the edge's answer to a caller that retries on its own.
    single: Arc<Retry>,
}

/// What a hop passes on with each downstream call, encoded once per request and cloned
/// (cheaply: the values are shared bytes) into each attempt.
struct Forward {
    /// The idempotency key (absent only on GetAccount).
    key: Option<MetadataValue<Ascii>>,
    /// The mode for this request.
    mode: RetryMode,
    /// Whether to send `x-retry-mode` on.
    pass_mode: bool,
    /// This hop's `traceparent` for its downstream.
    traceparent: Option<MetadataValue<Ascii>>,
}

impl Forward {
    fn new(
        key: Option<&IdempotencyKey>,
        mode: RetryMode,
        pass_mode: bool,
        trace: &TraceContext,
    ) -> Self {
        Self {
            key: key.and_then(|key| MetadataValue::try_from(key.as_str()).ok()),
            mode,
            pass_mode,
            traceparent: MetadataValue::try_from(trace.traceparent()).ok(),
        }
    }

    fn request<T>(&self, message: T, attempt: &resilience::Attempt) -> Request<T> {
        let mut request = Request::new(message);
        let metadata = request.metadata_mut();
        if let Some(key) = &self.key {
            metadata.insert(IDEMPOTENCY_KEY, key.clone());
        }
        if self.pass_mode {
            metadata.insert(RETRY_MODE, MetadataValue::from_static(self.mode.as_str()));
        }
        // Exporting traces, the parent of the downstream's span is this attempt's span;
        // otherwise this hop's own trace context.
        if !retrychain_node::telemetry::inject_current(metadata)
            && let Some(traceparent) = &self.traceparent
        {
            metadata.insert(TRACEPARENT, traceparent.clone());
        }
        attempt.apply(&mut request);
        request
    }
}

impl Hop {
    /// A hop in `role` forwarding to `downstream`.
    pub fn new(node: Arc<Node>, role: Role, retry: HopRetryConfig, downstream: Channel) -> Self {
        let every_layer = RetryPolicy {
            max_attempts: retry.max_attempts,
            backoff: retry.backoff,
            budget: None,
            retryable: retry.retryable.clone(),
            margin: retry.margin,
            min_attempt: retry.min_attempt,
        };
        let single = RetryPolicy::single_attempt(retry.backoff, retry.margin, retry.min_attempt);
        let edge_only = match role {
            Role::Edge => RetryPolicy {
                budget: retry.budget.clone(),
                ..every_layer.clone()
            },
            Role::Relay => single.clone(),
        };
        Self {
            role,
            mode: retry.mode,
            downstream: PaymentsClient::new(downstream_stack(&node, downstream)),
            every_layer: Arc::new(Retry::new(every_layer).with_label(&node.name)),
            edge_only: Arc::new(Retry::new(edge_only).with_label(&node.name)),
            single: Arc::new(Retry::new(single).with_label(&node.name)),
            node,
        }
    }

    /// Reads key and retry mode from the incoming call, per role.
    fn forward<T>(
        &self,
        request: &Request<T>,
        scope: &RpcScope,
        key_required: bool,
    ) -> Result<Forward, Status> {
        let incoming = request.metadata();
        let key = match (metadata::idempotency_key(incoming)?, self.role) {
            (Some(key), _) => Some(key),
            (None, Role::Edge) if key_required => Some(IdempotencyKey::generate()),
            (None, Role::Relay) if key_required => {
                return Err(Status::invalid_argument(
                    "idempotency-key is required (the edge adds one when a client sends none)",
                ));
            }
            (None, _) => None,
        };
        if let Some(key) = &key {
            scope.record_key(key);
            if self.role == Role::Edge {
                scope.echo_key(key);
            }
        }
        // A service without the override neither reads the header nor passes it on.
        let (mode, pass_mode) = match self.node.requested_retry_mode(incoming)? {
            // A caller retrying on its own gets one attempt from the edge, and no retries
            // below it either: an honoured every-layer would make each of its retries 81
            // bottom calls.
            Some(_) if self.role == Role::Edge && scope.caller_previous_attempts > 0 => {
                (RetryMode::EdgeOnly, true)
            }
            Some(mode) => (mode, true),
            None => (self.mode, false),
        };
        Ok(Forward::new(key.as_ref(), mode, pass_mode, &scope.trace))
    }

    fn executor(&self, mode: RetryMode, scope: &RpcScope) -> &Retry {
        if self.role == Role::Edge && scope.caller_previous_attempts > 0 {
            return &self.single;
        }
        match mode {
            RetryMode::EveryLayer => &self.every_layer,
            RetryMode::EdgeOnly => &self.edge_only,
        }
    }

    /// Whether this hop's failure answer tells its caller not to retry: at the edge, when
    /// the edge was the retrying layer for this call (it retried, or a retry was refused).
    /// An edge configured never to retry (`--max-attempts 1`) leaves retrying to its caller.
    fn refuse_caller_retries(&self, error: &RetryError) -> bool {
        self.role == Role::Edge && error.retries_were_spent()
    }

    /// Sends a call downstream under the request's retry mode and relays the answer.
    async fn relay<Req, Rep, F, Fut>(
        &self,
        scope: &RpcScope,
        forward: &Forward,
        message: Req,
        call: F,
    ) -> Result<Response<Rep>, Status>
    where
        Req: Clone,
        F: Fn(PaymentsClient<Downstream>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Rep>, Status>>,
    {
        let result = self
            .executor(forward.mode, scope)
            .run_detailed(scope.deadline, &self.node.counters, |attempt| {
                let request = forward.request(message.clone(), &attempt);
                call(self.downstream.clone(), request)
            })
            .await;
        match result {
            Ok(response) => {
                let (downstream_metadata, reply, _) = response.into_parts();
                let mut response = Response::new(reply);
                copy_relayed(&downstream_metadata, response.metadata_mut());
                Ok(response)
            }
            Err(error) => {
                let refuse = self.refuse_caller_retries(&error);
                let status = error.status;
                let mut metadata = MetadataMap::new();
                copy_relayed(status.metadata(), &mut metadata);
                let pushback = resilience::classify::PUSHBACK_HEADER;
                if refuse {
                    // The edge was the one retrying layer; a client on top must not be
                    // another (gRFC A6: a negative pushback means "do not retry").
                    metadata.insert(pushback, MetadataValue::from(-1));
                } else if let Some(value) = status.metadata().get(pushback) {
                    // A pushback is for whoever retries next, whichever layer that is.
                    metadata.insert(pushback, value.clone());
                }
                Err(Status::with_metadata(
                    status.code(),
                    status.message().to_owned(),
                    metadata,
                ))
            }
        }
    }
}

/// Copies the response metadata that travels back up the chain unchanged; everything else
/// (transport headers, the downstream's own bookkeeping) stays behind.
fn copy_relayed(from: &MetadataMap, to: &mut MetadataMap) {
    for key in [IDEMPOTENT_REPLAYED, IDEMPOTENCY_KEY, TRACE_ID] {
        if let Some(value) = from.get(key) {
            to.insert(key, value.clone());
        }
    }
}

#[tonic::async_trait]
impl Payments for Hop {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let scope = RpcScope::begin(&self.node, "Charge", &request);
        scope
            .run(async {
                let forward = self.forward(&request, &scope, true)?;
                let message = request.into_inner();
                // Bad input fails here, not five hops down (and is never retried).
                AccountId::parse(&message.account_id)?;
                AmountCents::parse(message.amount_cents)?;
                self.relay(
                    &scope,
                    &forward,
                    message,
                    |mut client, request| async move { client.charge(request).await },
                )
                .await
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
                let forward = self.forward(&request, &scope, false)?;
                let message = request.into_inner();
                AccountId::parse(&message.account_id)?;
                self.relay(
                    &scope,
                    &forward,
                    message,
                    |mut client, request| async move { client.get_account(request).await },
                )
                .await
            })
            .await
    }
}
