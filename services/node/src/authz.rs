//! Who may call a service over TLS: the caller's identity, learned from its certificate
//! at the handshake ([`PeerIdentity`], put on every request of the connection), checked
//! before any work ([`AuthorizeLayer`]) against the identities the service accepts
//! ([`Accept`]). A tier below the edge accepts only the tier above it (hop3 only hop2), so
//! a process that reaches hop3 cannot skip the edge's validation, budget and limits.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use futures::future::{Either, Ready, ready};
use retrychain_tls::Identity;
use tonic::Status;

/// The caller's identity on a TLS connection (`None`: it presented no certificate, which
/// only the edge allows); absent on a plaintext connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity(pub Option<Identity>);

/// A service's TLS on its public port: its material (re-read when the files change) and
/// who may call its Payments.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// Certificate, key and trusted authorities.
    pub tls: retrychain_tls::Tls,
    /// Who may call.
    pub accept: Accept,
}

/// The callers a service's Payments accepts over TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Accept {
    /// Any caller, with or without a certificate: the edge, unless told otherwise.
    Anyone,
    /// Only these identities; a caller without a certificate is UNAUTHENTICATED, one with
    /// another identity PERMISSION_DENIED.
    Only(Vec<Identity>),
}

impl Accept {
    /// Whether a request from `peer` may go on; the refusal otherwise.
    pub fn check(&self, peer: Option<&PeerIdentity>) -> Result<(), Status> {
        let Self::Only(accepted) = self else {
            return Ok(());
        };
        match peer {
            // `Only` is set on TLS listeners alone, whose every request carries the peer's
            // identity: a request without one came some other way, and is refused.
            None | Some(PeerIdentity(None)) => Err(Status::unauthenticated(format!(
                "a client certificate naming one identity is required: this service accepts {}",
                list(accepted)
            ))),
            Some(PeerIdentity(Some(identity))) if accepted.contains(identity) => Ok(()),
            Some(PeerIdentity(Some(identity))) => Err(Status::permission_denied(format!(
                "{identity} may not call this service: it accepts {}",
                list(accepted)
            ))),
        }
    }
}

fn list(identities: &[Identity]) -> String {
    identities
        .iter()
        .map(Identity::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `request` calls a method of `service` (its path is `/<service>/<method>`).
pub(crate) fn calls_service<B>(request: &http::Request<B>, service: &str) -> bool {
    request
        .uri()
        .path()
        .strip_prefix('/')
        .and_then(|path| path.split_once('/'))
        .is_some_and(|(called, _)| called == service)
}

/// Refuses, before any other layer sees it, a call to `service` from a caller that
/// [`Accept`] does not let through (other services — health, reflection — pass).
#[derive(Debug, Clone)]
pub struct AuthorizeLayer {
    accept: Arc<Accept>,
    service: &'static str,
}

impl AuthorizeLayer {
    /// Guards `service`'s methods (a gRPC service name, `retrychain.v1.Payments`).
    pub fn new(accept: Arc<Accept>, service: &'static str) -> Self {
        Self { accept, service }
    }
}

impl<S> tower::Layer<S> for AuthorizeLayer {
    type Service = Authorize<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Authorize {
            inner,
            accept: Arc::clone(&self.accept),
            service: self.service,
        }
    }
}

/// See [`AuthorizeLayer`].
#[derive(Debug, Clone)]
pub struct Authorize<S> {
    inner: S,
    accept: Arc<Accept>,
    service: &'static str,
}

impl<S, B> tower::Service<http::Request<B>> for Authorize<S>
where
    S: tower::Service<http::Request<B>>,
    S::Error: From<Status>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if calls_service(&request, self.service)
            && let Err(status) = self
                .accept
                .check(request.extensions().get::<PeerIdentity>())
        {
            tracing::info!(code = ?status.code(), reason = status.message(), path = request.uri().path(), "call refused before any work");
            return Either::Right(ready(Err(status.into())));
        }
        Either::Left(self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_accepted_identities_pass() {
        let accept = Accept::Only(vec![Identity::named("hop2")]);
        let hop2 = PeerIdentity(Some(Identity::named("hop2")));
        let edge = PeerIdentity(Some(Identity::named("edge")));
        let nobody = PeerIdentity(None);
        assert!(accept.check(Some(&hop2)).is_ok());
        let denied = accept.check(Some(&edge)).unwrap_err();
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert!(
            denied
                .message()
                .contains("spiffe://retrychain/edge may not call")
        );
        let anonymous = accept.check(Some(&nobody)).unwrap_err();
        assert_eq!(anonymous.code(), tonic::Code::Unauthenticated);
        assert!(Accept::Anyone.check(Some(&nobody)).is_ok());
    }
}
