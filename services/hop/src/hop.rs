//! [`Hop`], what the edge and the relays share: the [`Downstream`] stack, the metadata a
//! downstream call carries ([`Hop::outgoing`]), what of the answer travels back up
//! ([`relay`]); and the edge's handlers, which decode each message. A relay's face is
//! [`forward`].

pub(crate) mod forward;

use std::{
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use resilience::{
    Balancer, PropagateDeadlineLayer, RetryLayer, ServiceConfig,
    client::RetryService,
    propagate::PropagateDeadline,
    wire::{self, names},
};
use retrychain_domain::{
    AccountId, AmountCents, Caller, IdempotencyKey, RetryMode,
    metadata::{self, IDEMPOTENCY_KEY, RETRY_MODE},
};
use retrychain_node::{
    Node, RpcScope,
    faults::{FaultLayer, Faulty},
    statement::{Call, STATEMENT_HEADERS},
    telemetry::{InjectTrace, InjectTraceLayer},
};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest, payments_client::PaymentsClient,
    payments_server::Payments,
};
use tonic::{
    Request, Response, Status,
    metadata::{MetadataKey, MetadataMap, MetadataValue},
};
use tower::{Layer, ServiceBuilder, ServiceExt, util::Either};

/// A hop's downstream client stack, outermost first — where every retry decision of the
/// chain is made:
///
/// 1. [`PropagateDeadline`]: the call's deadline is the served request's, less the margin;
///    with too little left, no call is made (DEADLINE_EXCEEDED).
/// 2. [`ByPlan`]: the retry engine ([`RetryLayer`]) of the request's [`Plan`] retries the
///    call, writing each attempt's time left, and counts it in the node's Stats.
/// 3. [`InjectTrace`]: each attempt's trace context (the attempt's span while exporting
///    traces, else this hop's).
/// 4. [`FaultLayer`], only in a service started with `--fault-injection`.
/// 5. [`Balancer`]: the replicas below (`--downstream`: URLs or a DNS name), each attempt
///    sent to the cheaper of two — to one the call has not tried, when there is one — over
///    one HTTP/2 connection per replica.
///
/// The idempotency key and the retry mode are written once, by the handler, on the call it
/// makes (`Hop::outgoing`).
pub type Downstream = PropagateDeadline<ByPlan<RetryService<InjectTrace<Faults>>>>;

/// The fault layer, when the service has one.
pub type Faults = Either<Faulty<Balancer>, Balancer>;

/// Which retry policy a downstream call goes out under. The handler puts it in the call's
/// extensions; [`ByPlan`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// The service config's policies, without a throttle (`every-layer`).
    EveryLayer,
    /// At the edge, the service config's policies under the edge's throttle; at a relay, one
    /// attempt (`edge-only`).
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

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        // Taken out: nothing below reads it, and every attempt copies what is left.
        let service = match request.extensions_mut().remove::<Plan>() {
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

/// How a hop's downstream calls are timed. The retry policy itself is the node's
/// ([`Node::policy`]), its throttle the node's budget ([`Node::budget`]).
#[derive(Debug, Clone, Copy)]
pub struct HopSettings {
    /// The mode used when no honoured `x-retry-mode` says otherwise.
    pub mode: RetryMode,
    /// Taken off the remaining time for each downstream deadline.
    pub margin: Duration,
    /// The shortest downstream attempt worth starting.
    pub min_attempt: Duration,
    /// The per-attempt timeout of an edge-only or single call (Envoy's `per_try_timeout`):
    /// a replica that stops answering costs a call this much, not its deadline.
    pub per_try: Option<Duration>,
    /// The per-attempt timeout of an every-layer call: only one the operator set. The
    /// balancer's default (a replicated downstream's 1 s) is sized for one call through the
    /// chain; an every-layer attempt holds every retry below it (81 bottom calls at the
    /// edge), and cutting it would hide the very amplification the mode shows.
    pub every_layer_per_try: Option<Duration>,
}

/// Builds the [`Downstream`] stack over `replicas`.
fn downstream(
    node: &Arc<Node>,
    role: Role,
    settings: &HopSettings,
    replicas: Balancer,
) -> Downstream {
    let faults = if node.fault_injection {
        Either::Left(FaultLayer::new(Arc::clone(&node.faults), &node.name).layer(replicas))
    } else {
        Either::Right(replicas)
    };
    let below = InjectTraceLayer.layer(faults);
    let observer: Arc<dyn resilience::RetryObserver> = Arc::clone(node) as _;
    // Every plan's engine: the node's observer and name, the least attempt worth making,
    // and unary calls (a call that never reached downstream is sent again).
    let engine = |policy: Arc<ServiceConfig>, per_try: Option<Duration>| {
        let layer = RetryLayer::new(policy)
            .unary()
            .per_try_timeout(per_try)
            .no_throttle()
            .min_attempt(settings.min_attempt)
            .annotate_failures(&node.name)
            .observer(observer.clone());
        // The edge is the one retrying layer: a client that retries on top of it is told
        // not to (gRFC A6: a negative pushback means "do not retry").
        match role {
            Role::Edge => layer.refuse_caller_retries(),
            Role::Relay => layer,
        }
    };
    let one_attempt = Arc::new(ServiceConfig::default());
    let per_try = settings.per_try;
    let every_layer = engine(Arc::clone(&node.policy), settings.every_layer_per_try);
    let edge_only = match (role, &node.budget) {
        (Role::Edge, Some(throttle)) => {
            engine(Arc::clone(&node.policy), per_try).throttle(Arc::clone(throttle))
        }
        (Role::Edge, None) => engine(Arc::clone(&node.policy), per_try),
        (Role::Relay, _) => engine(Arc::clone(&one_attempt), per_try),
    };
    let plans = ByPlan {
        every_layer: every_layer.layer(below.clone()),
        edge_only: edge_only.layer(below.clone()),
        single: engine(one_attempt, per_try).layer(below),
    };
    ServiceBuilder::new()
        .layer(
            PropagateDeadlineLayer::new(settings.margin, settings.min_attempt).observer(observer),
        )
        .service(plans)
}

/// Forwards `Payments` to the next service.
#[derive(Debug, Clone)]
pub struct Hop {
    /// Counters, faults, name and policy.
    node: Arc<Node>,
    /// Edge or relay.
    role: Role,
    /// The configured mode.
    mode: RetryMode,
    /// The downstream service, under the [`Downstream`] stack: the edge's calls.
    downstream: PaymentsClient<Downstream>,
    /// The same stack, called with each request's body as it came: a relay's calls
    /// ([`Forwarding`]).
    below: Downstream,
}

impl Hop {
    /// A hop in `role` forwarding to the replicas of `replicas`.
    pub fn new(node: Arc<Node>, role: Role, settings: HopSettings, replicas: Balancer) -> Self {
        let downstream = downstream(&node, role, &settings, replicas);
        Self {
            role,
            mode: settings.mode,
            below: downstream.clone(),
            downstream: PaymentsClient::new(downstream),
            node,
        }
    }

    /// At the edge (its handlers call it there alone: a relay passes on the edge's
    /// statement in [`Hop::outgoing`] and copies nothing for it), the signed statement
    /// that the call's authenticated caller (the `callers` layer put it in `extensions`)
    /// makes `call`, written into `outgoing`.
    fn state_caller<U>(
        &self,
        extensions: &http::Extensions,
        scope: &RpcScope,
        call: Call<'_>,
        outgoing: &mut Request<U>,
    ) -> Result<(), Status> {
        let anonymous = Caller::anonymous();
        let caller = extensions.get::<Caller>().unwrap_or(&anonymous);
        let key = outgoing
            .metadata()
            .get(IDEMPOTENCY_KEY)
            .and_then(|key| key.to_str().ok())
            .map(str::to_owned);
        let call = Call {
            key: key.as_deref(),
            ..call
        };
        self.node
            .state_caller(caller, &call, scope.timeout, outgoing.metadata_mut())
    }

    /// The downstream call for `message`, and everything it carries that the wire must
    /// say — written here, once: the idempotency key (the caller's, or at the edge one it
    /// makes), the caller's identity (`x-caller`), the retry mode where honoured (edge-only for a caller that retries on its
    /// own), the request's [`Plan`], and this hop's trace context (written per attempt by
    /// the stack).
    fn outgoing<U>(
        &self,
        incoming: &MetadataMap,
        scope: &RpcScope,
        key_required: bool,
        message: U,
    ) -> Result<Request<U>, Status> {
        let mut outgoing = Request::new(message);
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
            // The caller's value as it came (a shared buffer, no copy), else the one made here.
            let value = match incoming.as_ref().get(&names::IDEMPOTENCY_KEY) {
                Some(value) => Some(value.clone()),
                None => http::HeaderValue::try_from(key.as_str()).ok(),
            };
            if let Some(mut value) = value {
                value.set_sensitive(true); // new on every call: not for the HPACK table
                outgoing
                    .metadata_mut()
                    .as_mut()
                    .insert(names::IDEMPOTENCY_KEY, value);
            }
        }
        // Who called, as the edge authenticated it (the edge's `callers` layer wrote it and
        // dropped any a client sent): the ledger scopes accounts by it.
        if let Some(caller) = incoming.as_ref().get(&names::CALLER) {
            outgoing
                .metadata_mut()
                .as_mut()
                .insert(names::CALLER, caller.clone());
        }
        // And the edge's signed statement of it, for the ledger to check (a relay can
        // neither make one nor change one; the edge signs its own in `state_caller`).
        if self.role == Role::Relay {
            for name in STATEMENT_HEADERS {
                if let Some(value) = incoming.as_ref().get(&name) {
                    outgoing.metadata_mut().as_mut().insert(name, value.clone());
                }
            }
        }
        let caller_retries = self.role == Role::Edge && scope.caller_previous_attempts > 0;
        // A service without the override neither reads the header nor passes it on.
        let requested = self.node.requested_retry_mode(incoming)?;
        let mode = match requested {
            // A caller retrying on its own gets one attempt from the edge, and no retries
            // below it either: an honoured every-layer would make each of its retries 81
            // bottom calls.
            Some(_) if caller_retries => Some(RetryMode::EdgeOnly),
            requested => requested,
        };
        if let Some(mode) = mode {
            outgoing.metadata_mut().insert(
                MetadataKey::from_static(RETRY_MODE),
                MetadataValue::from_static(mode.as_str()),
            );
        }
        let plan = match mode.unwrap_or(self.mode) {
            _ if caller_retries => Plan::Single,
            RetryMode::EveryLayer => Plan::EveryLayer,
            RetryMode::EdgeOnly => Plan::EdgeOnly,
        };
        outgoing.extensions_mut().insert(plan);
        if let Some(traceparent) = scope.trace.traceparent_header(scope.exported()) {
            outgoing.extensions_mut().insert(traceparent);
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
            Ok(Response::from_parts(
                relayed(downstream_metadata),
                reply,
                Default::default(),
            ))
        }
        Err(mut status) => {
            let pushback = status.metadata().get(wire::PUSHBACK).cloned();
            let overloaded = status.metadata().get(wire::OVERLOADED).is_some();
            let mut metadata = relayed(std::mem::take(status.metadata_mut()));
            // Whatever failed, it was the call below, not this service: the balancer
            // above must not eject this replica for it.
            wire::mark_relayed(&mut metadata);
            // An overload below is a signal for every concurrency limit on the way up:
            // each lowers its own, so the excess is refused where it enters.
            if overloaded {
                wire::mark_overloaded(&mut metadata);
            }
            if let Some(value) = pushback {
                metadata.insert(MetadataKey::from_static(wire::PUSHBACK), value);
            }
            Err(Status::with_metadata(
                status.code(),
                status.message().to_owned(),
                metadata,
            ))
        }
    }
}

/// Of the downstream's response metadata, what travels back up the chain unchanged;
/// everything else (transport headers, the downstream's own bookkeeping) stays behind.
/// The map is emptied and refilled, keeping its allocation.
fn relayed(downstream: MetadataMap) -> MetadataMap {
    const RELAYED: [http::HeaderName; 3] = [
        names::IDEMPOTENT_REPLAYED,
        names::IDEMPOTENCY_KEY,
        names::TRACE_ID,
    ];
    let mut headers = downstream.into_headers();
    let kept = RELAYED.map(|name| headers.remove(&name));
    headers.clear();
    for (name, value) in RELAYED.into_iter().zip(kept) {
        if let Some(value) = value {
            headers.insert(name, value);
        }
    }
    MetadataMap::from_headers(headers)
}

/// The edge's handlers (a relay is served by [`Forwarding`](forward::Forwarding)): the message is decoded, so bad
/// input is refused here, before any service below works on it, and the caller's
/// statement can name the account and the amount.
#[tonic::async_trait]
impl Payments for Hop {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let scope = RpcScope::begin(&self.node, "Charge", &request);
        let (incoming, extensions, message) = request.into_parts();
        scope
            .run(async {
                let mut outgoing = self.outgoing(&incoming, &scope, true, message)?;
                // Bad input fails here, not five hops down (and is never retried).
                AccountId::parse(&outgoing.get_ref().account_id)?;
                AmountCents::parse(outgoing.get_ref().amount_cents)?;
                if self.role == Role::Edge {
                    let (account, amount) = {
                        let message = outgoing.get_ref();
                        (message.account_id.clone(), message.amount_cents)
                    };
                    let call = Call {
                        method: "Charge",
                        key: None,
                        account: &account,
                        amount: Some(amount),
                    };
                    self.state_caller(&extensions, &scope, call, &mut outgoing)?;
                }
                relay(self.downstream.clone().charge(outgoing).await)
            })
            .await
    }

    async fn get_account(
        &self,
        request: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        let scope = RpcScope::begin(&self.node, "GetAccount", &request);
        let (incoming, extensions, message) = request.into_parts();
        scope
            .run(async {
                let mut outgoing = self.outgoing(&incoming, &scope, false, message)?;
                AccountId::parse(&outgoing.get_ref().account_id)?;
                if self.role == Role::Edge {
                    let account = outgoing.get_ref().account_id.clone();
                    let call = Call {
                        method: "GetAccount",
                        key: None,
                        account: &account,
                        amount: None,
                    };
                    self.state_caller(&extensions, &scope, call, &mut outgoing)?;
                }
                relay(self.downstream.clone().get_account(outgoing).await)
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use retrychain_domain::metadata::{IDEMPOTENT_REPLAYED, TRACE_ID};

    #[test]
    fn only_what_travels_up_is_relayed() {
        let mut below = MetadataMap::new();
        for (key, value) in [
            (IDEMPOTENT_REPLAYED, "true"),
            (IDEMPOTENCY_KEY, "k-1"),
            (TRACE_ID, "4bf92f3577b34da6a3ce929d0e0e4736"),
            ("content-type", "application/grpc"),
            ("x-internal", "secret"),
        ] {
            below.insert(key, value.parse().expect("ascii"));
        }
        let up = relayed(below);
        assert_eq!(up.len(), 3);
        assert_eq!(
            up.get(IDEMPOTENT_REPLAYED).map(|v| v.to_str().ok()),
            Some(Some("true"))
        );
        assert_eq!(
            up.get(IDEMPOTENCY_KEY).map(|v| v.to_str().ok()),
            Some(Some("k-1"))
        );
        assert!(up.get(TRACE_ID).is_some());
        assert!(up.get("x-internal").is_none());
        assert!(relayed(MetadataMap::new()).is_empty());
    }
}
