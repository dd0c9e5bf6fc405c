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
//! A hop is a tonic client with layers: the handler validates, builds the downstream call
//! and relays the answer; the [`Downstream`] stack does the rest — every call gets a
//! strictly shorter deadline than the one received, the same idempotency key, the same
//! trace id, and the retry policy of the request's [`Plan`].

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use resilience::{
    Backoff, ForwardHeadersLayer, PropagateDeadlineLayer, RetryLayer, ServiceConfig, Throttle,
    classify::{PUSHBACK_HEADER, RETRYABLE},
    client::RetryService,
    propagate::{ForwardHeaders, PropagateDeadline},
    service_config::{CallPolicy, HedgingPolicy, RetryPolicyConfig},
};
use retrychain_node::{
    AccountId, AmountCents, IdempotencyKey, Node, RetryMode, RpcScope,
    faults::{FaultLayer, Faulty},
    metadata::{self, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, RETRY_MODE, TRACE_ID, TRACEPARENT},
    telemetry::{InjectTrace, InjectTraceLayer},
};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest, payments_client::PaymentsClient,
    payments_server::Payments,
};
use tonic::{
    Request, Response, Status,
    metadata::{MetadataMap, MetadataValue},
    transport::Channel,
};
use tower::{Layer, ServiceBuilder, ServiceExt, util::Either};

/// A hop's downstream client stack, outermost first — where every retry decision of the
/// chain is made:
///
/// 1. [`ForwardHeaders`]: the `idempotency-key` (and, where honoured, `x-retry-mode`) of
///    the request being served go on every call, unless the handler set them.
/// 2. [`PropagateDeadline`]: the call's `grpc-timeout` is the served request's time left
///    less the margin; with too little left, no call is made (DEADLINE_EXCEEDED).
/// 3. [`ByPlan`]: the [`RetryLayer`] of the request's [`Plan`] retries the call, sending
///    each attempt the time left and counting it in the node's Stats.
/// 4. [`InjectTrace`]: while exporting traces, each attempt is its server's parent.
/// 5. [`FaultLayer`], only in a service started with `--fault-injection`.
/// 6. The channel: one HTTP/2 connection shared by all calls.
pub type Downstream = ForwardHeaders<PropagateDeadline<ByPlan<RetryService<InjectTrace<Faults>>>>>;

/// The fault layer, when the service has one.
pub type Faults = Either<Faulty<Channel>, Channel>;

/// Which retry policy a downstream call goes out under. The handler puts it in the call's
/// extensions; [`ByPlan`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Retries without a budget (`every-layer`).
    EveryLayer,
    /// Budgeted retries at the edge; one attempt at a relay (`edge-only`).
    EdgeOnly,
    /// One attempt: the edge's answer to a caller that retries on its own.
    Single,
}

/// Sends each call through the retry service of its [`Plan`] (one attempt when it names
/// none). The three share the layers below them, and so the connection.
#[derive(Debug, Clone)]
pub struct ByPlan<S> {
    /// For [`Plan::EveryLayer`].
    every_layer: S,
    /// For [`Plan::EdgeOnly`].
    edge_only: S,
    /// For [`Plan::Single`].
    single: S,
}

impl<S, B> tower::Service<http::Request<B>> for ByPlan<S>
where
    S: tower::Service<http::Request<B>> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tower::util::Oneshot<S, http::Request<B>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is the chosen service's, awaited in `call` (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let service = match request.extensions().get::<Plan>() {
            Some(Plan::EveryLayer) => &self.every_layer,
            Some(Plan::EdgeOnly) => &self.edge_only,
            Some(Plan::Single) | None => &self.single,
        };
        service.clone().oneshot(request)
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
    /// A service config's `hedgingPolicy`: the edge hedges instead of retrying in
    /// `edge-only` mode (safe because every copy carries the same idempotency key).
    pub hedging: Option<HedgingPolicy>,
}

/// Builds the [`Downstream`] stack over `channel`.
fn downstream(
    node: &Arc<Node>,
    role: Role,
    retry: &HopRetryConfig,
    channel: Channel,
) -> Downstream {
    let faults = if node.fault_injection {
        Either::Left(FaultLayer::new(Arc::clone(node)).layer(channel))
    } else {
        Either::Right(channel)
    };
    let below = InjectTraceLayer.layer(faults);
    let observer: Arc<dyn resilience::RetryObserver> = Arc::clone(node) as _;
    let retrying = |policy: CallPolicy, throttle: Option<&Arc<dyn Throttle>>| {
        let mut layer = RetryLayer::new(ServiceConfig::every_method(policy))
            .min_attempt(retry.min_attempt)
            .annotate_failures(&node.name)
            .observer(observer.clone());
        if let Some(throttle) = throttle {
            layer = layer.throttle(Arc::clone(throttle));
        }
        // The edge is the one retrying layer: a client that retries on top of it is told
        // not to (gRFC A6: a negative pushback means "do not retry").
        if role == Role::Edge {
            layer = layer.refuse_caller_retries();
        }
        layer.layer(below.clone())
    };
    let retries = |max_attempts: u32| {
        CallPolicy::Retry(RetryPolicyConfig::new(
            max_attempts,
            retry.backoff,
            retry
                .retryable
                .clone()
                .unwrap_or_else(|| RETRYABLE.to_vec()),
        ))
    };
    let plans = ByPlan {
        every_layer: retrying(retries(retry.max_attempts), None),
        edge_only: match (role, &retry.hedging) {
            (Role::Edge, Some(hedging)) => {
                retrying(CallPolicy::Hedging(hedging.clone()), retry.budget.as_ref())
            }
            (Role::Edge, None) => retrying(retries(retry.max_attempts), retry.budget.as_ref()),
            (Role::Relay, _) => retrying(retries(1), None),
        },
        single: retrying(retries(1), None),
    };
    ServiceBuilder::new()
        .layer(ForwardHeadersLayer)
        .layer(PropagateDeadlineLayer::new(retry.margin, retry.min_attempt).observer(observer))
        .service(plans)
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
    /// The downstream service, under the [`Downstream`] stack.
    downstream: PaymentsClient<Downstream>,
}

impl Hop {
    /// A hop in `role` forwarding to `channel`.
    pub fn new(node: Arc<Node>, role: Role, retry: HopRetryConfig, channel: Channel) -> Self {
        Self {
            role,
            mode: retry.mode,
            downstream: PaymentsClient::new(downstream(&node, role, &retry, channel)),
            node,
        }
    }

    /// The downstream call for `message`: the request's [`Plan`], and what the edge adds
    /// that the incoming request lacks (the key it made; edge-only for a retrying caller).
    /// Everything else the caller sent travels by the stack's propagation layers.
    fn outgoing<T, U>(
        &self,
        request: &Request<T>,
        scope: &RpcScope,
        key_required: bool,
        message: U,
    ) -> Result<Request<U>, Status> {
        let incoming = request.metadata();
        let mut outgoing = Request::new(message);
        let key = match (metadata::idempotency_key(incoming)?, self.role) {
            (Some(key), _) => Some(key),
            (None, Role::Edge) if key_required => {
                let key = IdempotencyKey::generate();
                if let Ok(value) = MetadataValue::try_from(key.as_str()) {
                    outgoing.metadata_mut().insert(IDEMPOTENCY_KEY, value);
                }
                Some(key)
            }
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
        let caller_retries = self.role == Role::Edge && scope.caller_previous_attempts > 0;
        // A service without the override neither reads the header nor passes it on.
        let mode = match self.node.requested_retry_mode(incoming)? {
            // A caller retrying on its own gets one attempt from the edge, and no retries
            // below it either: an honoured every-layer would make each of its retries 81
            // bottom calls.
            Some(_) if caller_retries => {
                outgoing.metadata_mut().insert(
                    RETRY_MODE,
                    MetadataValue::from_static(RetryMode::EdgeOnly.as_str()),
                );
                RetryMode::EdgeOnly
            }
            Some(mode) => mode,
            None => self.mode,
        };
        let plan = match mode {
            _ if caller_retries => Plan::Single,
            RetryMode::EveryLayer => Plan::EveryLayer,
            RetryMode::EdgeOnly => Plan::EdgeOnly,
        };
        outgoing.extensions_mut().insert(plan);
        // This hop's trace context; while exporting, each attempt's span replaces it.
        if let Ok(traceparent) = MetadataValue::try_from(scope.trace.traceparent()) {
            outgoing.metadata_mut().insert(TRACEPARENT, traceparent);
        }
        Ok(outgoing)
    }
}

/// Relays the downstream's answer: its reply, or its failure, with the metadata that
/// travels back up the chain. A pushback is for whoever retries next, whichever layer that
/// is — the edge's own "do not retry" included.
fn relay<T>(answer: Result<Response<T>, Status>) -> Result<Response<T>, Status> {
    match answer {
        Ok(response) => {
            let (downstream_metadata, reply, _) = response.into_parts();
            let mut response = Response::new(reply);
            copy_relayed(&downstream_metadata, response.metadata_mut());
            Ok(response)
        }
        Err(status) => {
            let mut metadata = MetadataMap::new();
            copy_relayed(status.metadata(), &mut metadata);
            if let Some(value) = status.metadata().get(PUSHBACK_HEADER) {
                metadata.insert(PUSHBACK_HEADER, value.clone());
            }
            Err(Status::with_metadata(
                status.code(),
                status.message().to_owned(),
                metadata,
            ))
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
                let outgoing = self.outgoing(&request, &scope, true, request.get_ref().clone())?;
                // Bad input fails here, not five hops down (and is never retried).
                AccountId::parse(&outgoing.get_ref().account_id)?;
                AmountCents::parse(outgoing.get_ref().amount_cents)?;
                relay(self.downstream.clone().charge(outgoing).await)
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
                let outgoing = self.outgoing(&request, &scope, false, request.get_ref().clone())?;
                AccountId::parse(&outgoing.get_ref().account_id)?;
                relay(self.downstream.clone().get_account(outgoing).await)
            })
            .await
    }
}
