//! Who is calling the edge, and how much of it each caller may hold.
//!
//! The edge learns a call's caller ([`Caller`]) before any other work:
//!
//! 1. a bearer token (`authorization: Bearer <JWT>`), checked against the JWKS the edge was
//!    given (`retrychain_tls::tokens`): the caller is `jwt:<subject>`. A token wins over a
//!    certificate: per-call credentials are the more specific (a gateway's connection may
//!    carry many callers' tokens);
//! 2. else the client certificate of the TLS connection: the caller is its identity
//!    (`spiffe://…`);
//! 3. else nobody: the anonymous caller where the edge lets callers in without
//!    credentials (plaintext, `up`'s default), UNAUTHENTICATED where it does not (TLS, or
//!    a JWKS given: [`Callers::require`]).
//!
//! Bad credentials are UNAUTHENTICATED, never a fall-back to anonymous. The caller goes
//! down the chain in `x-caller` (any value a client sent is dropped first, and the token
//! itself goes no further than the edge); the ledger scopes accounts, and so keys, by it.
//!
//! **Per-caller limits.** An identified caller may hold at most
//! [`CallersSettings::max_in_flight`] calls at the edge at once; past that its next call is
//! RESOURCE_EXHAUSTED at once, with a pushback: a fixed bound beside admission's fair
//! shares (`resilience::admission`, keyed by [`fair_key`]), which follow what the chain
//! can answer in time. The anonymous caller has no fixed bound; its share goes by its
//! connection.

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use futures::future::{Either, Ready, ready};
use http::HeaderValue;
use resilience::wire::{self, AUTHORIZATION, CALLER};
use retrychain_tls::Tokens;
use tonic::Status;

use retrychain_domain::Caller;

use crate::{
    authz::{PeerIdentity, calls_service},
    statement::{CALLER_SIGNER, CALLER_STATEMENT},
};

/// How the edge tells callers apart.
#[derive(Debug, Clone)]
pub struct CallersSettings {
    /// Bearer tokens accepted, checked against these keys; `None`: a token is refused.
    pub tokens: Option<Tokens>,
    /// Whether a call without credentials is UNAUTHENTICATED (else it is the anonymous
    /// caller's).
    pub require: bool,
    /// The most calls one identified caller holds at the edge at once.
    pub max_in_flight: usize,
}

/// The pushback a caller over its limit is given, in ms: about how long a call takes.
const OVER_LIMIT_PUSHBACK_MS: i64 = 100;

/// The edge's callers: who they are, and how many calls each holds.
#[derive(Debug)]
pub struct Callers {
    settings: CallersSettings,
    in_flight: Mutex<HashMap<Caller, usize>>,
}

impl Callers {
    /// With these settings.
    pub fn new(settings: CallersSettings) -> Self {
        Self {
            settings,
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a call without credentials is refused.
    pub fn require(&self) -> bool {
        self.settings.require
    }

    /// The caller of a call with these `headers` on a connection whose client presented
    /// `peer` (see the module docs for the order).
    pub fn identify(
        &self,
        headers: &http::HeaderMap,
        peer: Option<&PeerIdentity>,
    ) -> Result<Caller, Status> {
        let mut values = headers.get_all(AUTHORIZATION).iter();
        if let Some(value) = values.next() {
            if values.next().is_some() {
                return Err(Status::unauthenticated(
                    "authorization was sent more than once",
                ));
            }
            return self.bearer(value);
        }
        if let Some(PeerIdentity(Some(identity))) = peer {
            return Caller::parse(identity.as_str())
                .map_err(|error| Status::unauthenticated(error.to_string()));
        }
        if self.settings.require {
            return Err(Status::unauthenticated(
                "credentials are required: a client certificate, or authorization: Bearer <JWT>",
            ));
        }
        Ok(Caller::anonymous())
    }

    fn bearer(&self, value: &HeaderValue) -> Result<Caller, Status> {
        let text = value
            .to_str()
            .map_err(|_| Status::unauthenticated("authorization is not visible ASCII"))?;
        let token = match text.split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token.trim(),
            _ => {
                return Err(Status::unauthenticated(
                    "authorization must be `Bearer <JWT>`",
                ));
            }
        };
        let Some(tokens) = &self.settings.tokens else {
            return Err(Status::unauthenticated(
                "this edge accepts no bearer tokens (it was given no JWKS)",
            ));
        };
        let subject = tokens
            .verify(token)
            .map_err(|error| Status::unauthenticated(error.to_string()))?;
        Caller::parse(&format!("jwt:{subject}"))
            .map_err(|error| Status::unauthenticated(format!("the token's subject: {error}")))
    }

    /// A place for one more call of `caller`, or RESOURCE_EXHAUSTED if it holds its limit.
    pub fn admit(self: &Arc<Self>, caller: &Caller) -> Result<Option<CallerTurn>, Status> {
        if caller.is_anonymous() {
            return Ok(None);
        }
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        let held = in_flight.entry(caller.clone()).or_insert(0);
        if *held >= self.settings.max_in_flight {
            let mut status = Status::resource_exhausted(format!(
                "{caller} holds {held} calls at the edge, its limit: wait for some to finish"
            ));
            wire::set_pushback(&mut status, OVER_LIMIT_PUSHBACK_MS);
            return Err(status);
        }
        *held += 1;
        Ok(Some(CallerTurn {
            callers: Arc::clone(self),
            caller: caller.clone(),
        }))
    }

    /// How many calls `caller` holds now.
    pub fn in_flight(&self, caller: &Caller) -> usize {
        let in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        in_flight.get(caller).copied().unwrap_or(0)
    }
}

/// One call's place under its caller's limit, given back when dropped.
#[derive(Debug)]
pub struct CallerTurn {
    callers: Arc<Callers>,
    caller: Caller,
}

impl Drop for CallerTurn {
    fn drop(&mut self) {
        let mut in_flight = self
            .callers
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(held) = in_flight.get_mut(&self.caller) {
            *held -= 1;
            if *held == 0 {
                in_flight.remove(&self.caller);
            }
        }
    }
}

/// Identifies the caller of every call to `service` (see the module docs), refuses one
/// without acceptable credentials or over its limit, and writes `x-caller` for the chain.
/// Without [`Callers`] (below the edge) it lets every request through untouched.
#[derive(Debug, Clone)]
pub struct CallersLayer {
    callers: Option<Arc<Callers>>,
    service: &'static str,
}

impl CallersLayer {
    /// Guards `service`'s methods (a gRPC service name, `retrychain.v1.Payments`).
    pub fn new(callers: Option<Arc<Callers>>, service: &'static str) -> Self {
        Self { callers, service }
    }
}

impl<S> tower::Layer<S> for CallersLayer {
    type Service = Identify<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Identify {
            inner,
            callers: self.callers.clone(),
            service: self.service,
        }
    }
}

/// See [`CallersLayer`].
#[derive(Debug, Clone)]
pub struct Identify<S> {
    inner: S,
    callers: Option<Arc<Callers>>,
    service: &'static str,
}

impl<S, B> tower::Service<http::Request<B>> for Identify<S>
where
    S: tower::Service<http::Request<B>>,
    S::Error: From<Status>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<Held<S::Future>, Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let Some(callers) = &self.callers else {
            return Either::Left(Held {
                inner: self.inner.call(request),
                _turn: None,
            });
        };
        let headers = request.headers_mut();
        // Whatever a client says about who it is goes no further than here: its own
        // `x-caller`, and any statement of a caller (the edge signs its own, below).
        headers.remove(CALLER);
        headers.remove(CALLER_STATEMENT);
        headers.remove(CALLER_SIGNER);
        if !calls_service(&request, self.service) {
            request.headers_mut().remove(AUTHORIZATION);
            return Either::Left(Held {
                inner: self.inner.call(request),
                _turn: None,
            });
        }
        let identified = callers
            .identify(
                request.headers(),
                request.extensions().get::<PeerIdentity>(),
            )
            .and_then(|caller| Ok((callers.admit(&caller)?, caller)));
        let (turn, caller) = match identified {
            Ok(admitted) => admitted,
            Err(status) => {
                tracing::info!(code = ?status.code(), reason = status.message(), path = request.uri().path(), "call refused before any work");
                return Either::Right(ready(Err(status.into())));
            }
        };
        let headers = request.headers_mut();
        // The credentials stay at the edge; the chain below is told only who called.
        headers.remove(AUTHORIZATION);
        if !caller.is_anonymous()
            && let Ok(mut value) = HeaderValue::from_str(caller.as_str())
        {
            value.set_sensitive(true);
            headers.insert(CALLER, value);
        }
        request.extensions_mut().insert(caller);
        Either::Left(Held {
            inner: self.inner.call(request),
            _turn: turn,
        })
    }
}

pin_project_lite::pin_project! {
    /// A call's future holding its caller's place until it completes (or is dropped).
    #[derive(Debug)]
    pub struct Held<F> {
        #[pin]
        inner: F,
        _turn: Option<CallerTurn>,
    }
}

impl<F: Future> Future for Held<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.project().inner.poll(cx)
    }
}

/// The key a caller's fair share of admission goes by at the edge
/// (`resilience::admission`), read before anything is verified, so that a refusal costs
/// nothing more: the caller's bearer token as sent (a forged one gets its own share, and
/// is refused UNAUTHENTICATED microseconds later), else its client certificate's identity,
/// else — a plaintext caller without credentials — its connection: a client with k
/// connections holds k shares (at most `--max-connections-per-peer` of them).
pub fn fair_key(
    headers: &http::HeaderMap,
    extensions: &http::Extensions,
) -> Option<resilience::CallerKey> {
    if let Some(token) = headers.get(AUTHORIZATION) {
        return Some(resilience::CallerKey::of(token.as_bytes()));
    }
    if let Some(PeerIdentity(Some(identity))) = extensions.get::<PeerIdentity>() {
        return Some(resilience::CallerKey::of(identity.as_str()));
    }
    extensions
        .get::<crate::h2::ConnectionId>()
        .map(|connection| resilience::CallerKey::of(connection.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn callers(require: bool, max_in_flight: usize) -> Arc<Callers> {
        Arc::new(Callers::new(CallersSettings {
            tokens: None,
            require,
            max_in_flight,
        }))
    }

    #[test]
    fn a_certificate_names_the_caller_and_nothing_is_anonymous_when_required() {
        let headers = http::HeaderMap::new();
        let peer = PeerIdentity(Some(retrychain_tls::Identity::named("alice")));
        let open = callers(false, 1);
        assert_eq!(
            open.identify(&headers, Some(&peer)).unwrap().as_str(),
            "spiffe://retrychain/alice"
        );
        assert!(open.identify(&headers, None).unwrap().is_anonymous());
        let closed = callers(true, 1);
        let refused = closed
            .identify(&headers, Some(&PeerIdentity(None)))
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    }

    #[test]
    fn a_token_without_a_jwks_or_a_scheme_is_refused_not_ignored() {
        let open = callers(false, 1);
        for value in ["Bearer abc.def.ghi", "Basic dXNlcjpwYXNz", "abc"] {
            let mut headers = http::HeaderMap::new();
            headers.insert(AUTHORIZATION, HeaderValue::from_static(value));
            let refused = open.identify(&headers, None).unwrap_err();
            assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{value}");
        }
    }

    #[test]
    fn one_caller_over_its_limit_is_refused_and_the_others_are_not() {
        let callers = callers(false, 2);
        let alice = Caller::parse("jwt:alice").unwrap();
        let bob = Caller::parse("jwt:bob").unwrap();
        let first = callers.admit(&alice).unwrap();
        let _second = callers.admit(&alice).unwrap();
        let refused = callers.admit(&alice).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            wire::pushback(&refused),
            wire::Pushback::RetryAfter(std::time::Duration::from_millis(100))
        );
        assert!(callers.admit(&bob).unwrap().is_some());
        drop(first);
        assert_eq!(callers.in_flight(&alice), 1);
        assert!(callers.admit(&alice).is_ok());
        // The anonymous caller is not counted.
        assert!(callers.admit(&Caller::anonymous()).unwrap().is_none());
    }
}
