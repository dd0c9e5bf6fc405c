//! TLS for the chain, and who is on the other end of each connection.
//!
//! - **TLS 1.3 only** (rustls, ring's algorithms), ALPN `h2`: every gRPC listener and every
//!   downstream call of a service started with TLS material ([`TlsFiles`]).
//! - **Identities**: each tier's certificate names it with one URI SAN,
//!   `spiffe://retrychain/<tier>` ([`Identity`]); replicas of a tier share it. A client
//!   checks the server's chain to a trusted authority and that it is the tier it meant to
//!   call ([`verify`]); a server learns the caller's identity from its certificate
//!   ([`accept`]) and decides what it may do (the node's authorization layer).
//! - **Rotation without a restart** ([`Tls::watch`]): the files are read again when they
//!   change; new connections use the new material, open ones finish on the old; a bad
//!   file is logged and ignored.
//! - **Signed statements** ([`statement`]): one service signs with its identity key,
//!   another checks the signer's chain and identity — the edge naming a call's caller to the
//!   ledger through relays that cannot change it.
//! - **Callers' bearer tokens** ([`tokens`]): JWTs checked against a JWKS file that is
//!   read again when it changes.
//! - **Throwaway authorities and token issuers** ([`issue`]) for `up --tls` and the tests.

mod connect;
mod identity;
pub mod issue;
mod material;
pub mod statement;
pub mod tokens;
pub mod verify;

pub use connect::{Connector, accept, accept_with};
pub use identity::{
    BadIdentity, CHAIN, Identity, OPERATOR, TRUST_DOMAIN, callee_of, caller_of, tier,
};
pub use material::{ClientAuth, Reload, Tls, TlsError, TlsFiles};
pub use statement::{Signature, StatementError};
pub use tokens::{TokenError, TokenReload, TokenRules, Tokens};
