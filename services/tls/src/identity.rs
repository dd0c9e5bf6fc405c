//! Workload identities: who is at the other end of a connection, as its certificate names
//! it — a SPIFFE-style URI SAN, `spiffe://retrychain/<tier>`, the way Linkerd and Istio
//! name workloads. A tier's replicas share its identity (`hop3` and `hop3.2` are both
//! `spiffe://retrychain/hop3`): a caller trusts a tier, not one process of it.

use std::fmt;

use rustls_pki_types::CertificateDer;

/// The trust domain every identity of the chain lives in.
pub const TRUST_DOMAIN: &str = "retrychain";

/// The chain's tiers, top to bottom: who calls whom when nothing says otherwise.
pub const CHAIN: [&str; 5] = ["edge", "hop2", "hop3", "hop4", "ledger"];

/// The identity of whoever operates the chain: the one the admin port's Control accepts
/// over TLS, and the one `up --tls` gives grpcurl.
pub const OPERATOR: &str = "operator";

/// A SPIFFE-style identity, `spiffe://<trust domain>/<path>`: compared whole, byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity(String);

/// Why a string is not an identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not an identity such as spiffe://retrychain/hop3 (spiffe://, a trust domain, a path)"
)]
pub struct BadIdentity(pub String);

impl Identity {
    /// `spiffe://retrychain/<name>`: a tier's or a caller's identity in the chain's domain.
    pub fn named(name: &str) -> Self {
        Self(format!("spiffe://{TRUST_DOMAIN}/{name}"))
    }

    /// The identity of the tier a service named `service` belongs to: the name up to its
    /// replica suffix (`hop3.2` is a replica of `hop3`).
    pub fn of_service(service: &str) -> Self {
        Self::named(tier(service))
    }

    /// Reads `spiffe://domain/path`. Only what a SPIFFE ID may hold: a lower-case trust
    /// domain of letters, digits, `-`, `.` and `_`, and a non-empty path of segments of
    /// letters, digits, `-`, `.` and `_` (no `.` or `..` segment, no query or fragment) —
    /// so that two identities that look alike are equal strings.
    pub fn parse(text: &str) -> Result<Self, BadIdentity> {
        let bad = || BadIdentity(text.to_owned());
        let rest = text.strip_prefix("spiffe://").ok_or_else(bad)?;
        let (domain, path) = rest.split_once('/').ok_or_else(bad)?;
        let domain_ok = !domain.is_empty()
            && domain.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.' | b'_')
            });
        let segment_ok = |segment: &str| {
            !segment.is_empty()
                && segment != "."
                && segment != ".."
                && segment
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        };
        if !domain_ok || !path.split('/').all(segment_ok) {
            return Err(bad());
        }
        Ok(Self(text.to_owned()))
    }

    /// The identity a certificate (DER) names: its one URI SAN, when that is a valid
    /// identity. None when it has no URI SAN, or more than one (of any kind: an X.509 SVID
    /// has exactly one), which would make "who is this" ambiguous.
    pub fn of_certificate(certificate: &CertificateDer<'_>) -> Option<Self> {
        use x509_parser::{extensions::GeneralName, prelude::FromDer};
        let (_, parsed) = x509_parser::certificate::X509Certificate::from_der(certificate).ok()?;
        let names = parsed.subject_alternative_name().ok()??;
        let mut uris = names
            .value
            .general_names
            .iter()
            .filter_map(|name| match name {
                GeneralName::URI(uri) => Some(*uri),
                _ => None,
            });
        let only = uris.next()?;
        if uris.next().is_some() {
            return None;
        }
        Self::parse(only).ok()
    }

    /// The identity as written in a certificate.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Identity {
    type Err = BadIdentity;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

/// Why a certificate (DER) cannot be used now: expired, not valid yet, or unreadable;
/// `None` when it is within its validity period.
pub(crate) fn outside_validity(certificate: &CertificateDer<'_>) -> Option<String> {
    use x509_parser::prelude::FromDer;
    let Ok((_, parsed)) = x509_parser::certificate::X509Certificate::from_der(certificate) else {
        return Some("the certificate cannot be parsed".to_owned());
    };
    let validity = parsed.validity();
    (!validity.is_valid()).then(|| {
        format!(
            "the certificate is not valid now (valid from {} to {})",
            validity.not_before, validity.not_after
        )
    })
}

/// The tier of a service name: `hop3.2` → `hop3`.
pub fn tier(service: &str) -> &str {
    service.split_once('.').map_or(service, |(tier, _)| tier)
}

/// The identity of the tier that calls `service` in the standard chain (hop2's caller is
/// the edge); `None` for the edge, whose callers are clients, and for a name outside the
/// chain.
pub fn caller_of(service: &str) -> Option<Identity> {
    let at = CHAIN.iter().position(|t| *t == tier(service))?;
    at.checked_sub(1).map(|above| Identity::named(CHAIN[above]))
}

/// The identity of the tier `service` calls in the standard chain (the edge calls hop2);
/// `None` for the ledger and for a name outside the chain.
pub fn callee_of(service: &str) -> Option<Identity> {
    let at = CHAIN.iter().position(|t| *t == tier(service))?;
    CHAIN.get(at + 1).map(|below| Identity::named(below))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_spiffe_ids_of_one_spelling() {
        assert_eq!(
            Identity::parse("spiffe://retrychain/hop3")
                .unwrap()
                .as_str(),
            "spiffe://retrychain/hop3"
        );
        for bad in [
            "hop3",
            "https://retrychain/hop3",
            "spiffe://retrychain",
            "spiffe://retrychain/",
            "spiffe://Retrychain/hop3",
            "spiffe://retrychain/hop3/",
            "spiffe://retrychain//hop3",
            "spiffe://retrychain/./hop3",
            "spiffe://retrychain/hop3?x=1",
            "spiffe://retrychain/hop3#f",
            "spiffe://retrychain/h\u{43e}p3", // a Cyrillic o
            "spiffe://retrychain/hop3\u{200b}",
        ] {
            assert!(Identity::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_chain_names_each_tiers_caller_and_callee() {
        assert_eq!(caller_of("edge"), None);
        assert_eq!(caller_of("hop2"), Some(Identity::named("edge")));
        assert_eq!(caller_of("hop4.3"), Some(Identity::named("hop3")));
        assert_eq!(caller_of("ledger.2"), Some(Identity::named("hop4")));
        assert_eq!(callee_of("edge"), Some(Identity::named("hop2")));
        assert_eq!(callee_of("hop4"), Some(Identity::named("ledger")));
        assert_eq!(callee_of("ledger"), None);
        assert_eq!(caller_of("billing"), None);
        assert_eq!(Identity::of_service("hop3.2"), Identity::named("hop3"));
    }
}
