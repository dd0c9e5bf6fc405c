//! Statements one service signs and another checks, whatever relays carry them between:
//! how the edge tells the ledger who called, so that no tier in between can make or change
//! that statement (docs/security.md, "Callers").
//!
//! **The signing key is the service's own identity key** — the one its certificate
//! certifies, issued and rotated like every other (`certs`, `up --tls`, docker-compose,
//! cert-manager). Only the holder of an identity's key can sign as that identity, so a
//! check needs nothing but the authorities the checker already trusts: the signer's
//! certificate chain travels with the statement, is verified like a client certificate
//! (chain to a trusted authority, validity, client-auth usage) and must name the identity
//! the checker expects. Rotation needs nothing either: a new certificate signs from the
//! moment it is read, and travels with what it signs.
//!
//! **One key, two uses, no confusion.** What is signed is [`CONTEXT`] followed by the
//! statement. A TLS 1.3 handshake signature covers 64 spaces and a context string of TLS's
//! own before its transcript hash, so a signature of one kind never verifies as the other.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use rustls::{RootCertStore, SignatureScheme};
use rustls_pki_types::{CertificateDer, UnixTime};

use crate::{Identity, Tls, material::provider};

/// What every signed statement starts with, before the statement itself: names the purpose,
/// so a signature made for anything else — a TLS handshake, another protocol — is never one.
pub const CONTEXT: &[u8] = b"retrychain signed statement v1\0";

/// The schemes a statement may be signed with, the first one the key supports chosen:
/// TLS 1.3's, as the identity keys are TLS keys (ECDSA P-256 as `certs` and the Kubernetes
/// manifests make them; P-384, Ed25519 and RSA-PSS for keys made elsewhere).
const SCHEMES: [SignatureScheme; 4] = [
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA256,
];

/// How long a signer's chain, once verified, is taken without verifying it again (unless
/// the trusted authorities change first): a chain check costs a signature verification per
/// certificate, and one signer signs every call.
const CHAIN_CHECKED_FOR: Duration = Duration::from_secs(60);

/// The most signer chains remembered as verified; the cache is emptied when full. Only
/// chains that verified are remembered, so it holds the signer's few certificates (its
/// current one, the one before a rotation).
const CHAINS_REMEMBERED: usize = 64;

/// A statement's signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    /// The TLS `SignatureScheme` code it was made with.
    pub scheme: u16,
    /// The signature itself.
    pub bytes: Vec<u8>,
}

/// Why a statement was not accepted (or could not be made).
#[derive(Debug, thiserror::Error)]
pub enum StatementError {
    /// The signer's chain is not a list of certificates as [`encode_chain`] writes it.
    #[error("the signer's certificate chain is malformed")]
    MalformedChain,
    /// The signer's certificate does not lead to a trusted authority, or is not valid now.
    #[error("the signer's certificate is not trusted: {0}")]
    Untrusted(String),
    /// A trusted certificate, but not of the identity that was expected to sign.
    #[error("signed by {}, not by {expected}", found.as_ref().map_or("a certificate that names no identity".to_owned(), ToString::to_string))]
    WrongSigner {
        /// Who signed (`None`: the certificate names no identity).
        found: Option<Identity>,
        /// Who was expected to.
        expected: Identity,
    },
    /// A scheme not among [`SCHEMES`], or not the key's.
    #[error("unsupported signature scheme {0:#06x}")]
    Scheme(u16),
    /// The signature does not match the statement.
    #[error("the signature does not match the statement")]
    BadSignature,
    /// This service's key signs with none of [`SCHEMES`].
    #[error("this service's key cannot sign statements: {0}")]
    CannotSign(String),
}

/// The certificates a checker needs, as one byte string: each certificate's DER preceded
/// by its length (4 bytes, big-endian), the signer's own first.
pub fn encode_chain(chain: &[CertificateDer<'_>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(chain.iter().map(|c| c.len() + 4).sum());
    for certificate in chain {
        out.extend_from_slice(&(certificate.len() as u32).to_be_bytes());
        out.extend_from_slice(certificate);
    }
    out
}

/// The inverse of [`encode_chain`]; at least one certificate.
fn decode_chain(mut bytes: &[u8]) -> Result<Vec<CertificateDer<'_>>, StatementError> {
    let mut chain = Vec::new();
    while !bytes.is_empty() {
        let (length, rest) = bytes
            .split_first_chunk::<4>()
            .ok_or(StatementError::MalformedChain)?;
        let length = u32::from_be_bytes(*length) as usize;
        if rest.len() < length || length == 0 {
            return Err(StatementError::MalformedChain);
        }
        let (certificate, rest) = rest.split_at(length);
        chain.push(CertificateDer::from(certificate));
        bytes = rest;
    }
    if chain.is_empty() {
        return Err(StatementError::MalformedChain);
    }
    Ok(chain)
}

/// Signer chains verified lately, for the authorities in use when they were.
#[derive(Debug, Default)]
pub(crate) struct VerifiedChains {
    /// The authorities the entries were verified against: when the trusted set is another
    /// one, every entry is forgotten.
    roots: Option<Arc<RootCertStore>>,
    /// The signer's encoded chain, and when it was verified.
    at: HashMap<Vec<u8>, Instant>,
}

impl Tls {
    /// Signs `statement` (after [`CONTEXT`]) with this service's identity key. Returns the
    /// signature and the encoded chain of the certificate that verifies it, both from the
    /// material in use now.
    pub fn sign_statement(
        &self,
        statement: &[u8],
    ) -> Result<(Signature, Arc<[u8]>), StatementError> {
        let current = self.current();
        let signer = current
            .certified
            .key
            .choose_scheme(&SCHEMES)
            .ok_or_else(|| StatementError::CannotSign(format!("{:?}", current.certified.key)))?;
        let mut message = Vec::with_capacity(CONTEXT.len() + statement.len());
        message.extend_from_slice(CONTEXT);
        message.extend_from_slice(statement);
        let bytes = signer
            .sign(&message)
            .map_err(|error| StatementError::CannotSign(error.to_string()))?;
        let signature = Signature {
            scheme: u16::from(signer.scheme()),
            bytes,
        };
        Ok((signature, Arc::clone(&current.signer_chain)))
    }

    /// Checks that `statement` was signed by `expected`: `chain` (as [`encode_chain`] makes
    /// it) leads to an authority this service trusts now, is valid now for client
    /// authentication, names `expected`, and its key made `signature` over [`CONTEXT`] and
    /// `statement`.
    pub fn verify_statement(
        &self,
        expected: &Identity,
        chain: &[u8],
        statement: &[u8],
        signature: &Signature,
    ) -> Result<(), StatementError> {
        let certificates = decode_chain(chain)?;
        let end_entity = webpki::EndEntityCert::try_from(&certificates[0])
            .map_err(|error| StatementError::Untrusted(error.to_string()))?;
        self.verify_signer(expected, chain, &certificates, &end_entity)?;
        let provider = provider();
        let scheme = SignatureScheme::from(signature.scheme);
        if !SCHEMES.contains(&scheme) {
            return Err(StatementError::Scheme(signature.scheme));
        }
        let algorithms = provider
            .signature_verification_algorithms
            .mapping
            .iter()
            .find(|(s, _)| *s == scheme)
            .map(|(_, algorithms)| *algorithms)
            .ok_or(StatementError::Scheme(signature.scheme))?;
        let mut message = Vec::with_capacity(CONTEXT.len() + statement.len());
        message.extend_from_slice(CONTEXT);
        message.extend_from_slice(statement);
        // TLS 1.3 takes the first algorithm of a scheme (the one whose curve is the
        // scheme's); so does this.
        let algorithm = algorithms
            .first()
            .ok_or(StatementError::Scheme(signature.scheme))?;
        end_entity
            .verify_signature(*algorithm, &message, &signature.bytes)
            .map_err(|_| StatementError::BadSignature)
    }

    /// The chain check of [`Tls::verify_statement`], remembered for
    /// [`CHAIN_CHECKED_FOR`] while the trusted authorities stay the same.
    fn verify_signer(
        &self,
        expected: &Identity,
        encoded: &[u8],
        certificates: &[CertificateDer<'_>],
        end_entity: &webpki::EndEntityCert<'_>,
    ) -> Result<(), StatementError> {
        let roots = Arc::clone(&self.current().roots);
        match Identity::of_certificate(&certificates[0]) {
            Some(found) if &found == expected => {}
            found => {
                return Err(StatementError::WrongSigner {
                    found,
                    expected: expected.clone(),
                });
            }
        }
        {
            let verified = self.verified_chains();
            if verified
                .roots
                .as_ref()
                .is_some_and(|r| Arc::ptr_eq(r, &roots))
                && verified
                    .at
                    .get(encoded)
                    .is_some_and(|at| at.elapsed() < CHAIN_CHECKED_FOR)
            {
                return Ok(());
            }
        }
        end_entity
            .verify_for_usage(
                provider().signature_verification_algorithms.all,
                &roots.roots,
                &certificates[1..],
                UnixTime::now(),
                webpki::KeyUsage::client_auth(),
                None,
                None,
            )
            .map_err(|error| StatementError::Untrusted(error.to_string()))?;
        let mut verified = self.verified_chains();
        if !verified
            .roots
            .as_ref()
            .is_some_and(|r| Arc::ptr_eq(r, &roots))
            || verified.at.len() >= CHAINS_REMEMBERED
        {
            verified.at.clear();
            verified.roots = Some(roots);
        }
        verified.at.insert(encoded.to_vec(), Instant::now());
        Ok(())
    }

    fn verified_chains(&self) -> std::sync::MutexGuard<'_, VerifiedChains> {
        self.shared
            .verified_chains
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// [`VerifiedChains`] as every clone of one [`Tls`] shares it.
pub(crate) type SharedVerifiedChains = Mutex<VerifiedChains>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClientAuth, issue::Authority};

    fn service(authority: &Authority, name: &str, dir: &std::path::Path) -> Tls {
        crate::issue::service(authority, name, dir, ClientAuth::Required).unwrap()
    }

    #[test]
    fn a_statement_verifies_only_as_signed_by_whom_and_over_what() {
        let dir = tempfile::tempdir().unwrap();
        let authority = Authority::new("test").unwrap();
        let edge = service(&authority, "edge", dir.path());
        let hop2 = service(&authority, "hop2", dir.path());
        let ledger = service(&authority, "ledger", dir.path());
        let edge_id = Identity::named("edge");

        let (signature, chain) = edge.sign_statement(b"alice charges 5").unwrap();
        ledger
            .verify_statement(&edge_id, &chain, b"alice charges 5", &signature)
            .unwrap();
        // Twice: the second check takes the remembered chain, and still checks the
        // signature.
        ledger
            .verify_statement(&edge_id, &chain, b"alice charges 5", &signature)
            .unwrap();
        assert!(matches!(
            ledger.verify_statement(&edge_id, &chain, b"alice charges 6", &signature),
            Err(StatementError::BadSignature)
        ));

        // hop2's key makes a good signature, of hop2: not the edge's word.
        let (forged, hop2_chain) = hop2.sign_statement(b"alice charges 5").unwrap();
        assert!(matches!(
            ledger.verify_statement(&edge_id, &hop2_chain, b"alice charges 5", &forged),
            Err(StatementError::WrongSigner { .. })
        ));
        // hop2's signature presented with the edge's certificate.
        assert!(matches!(
            ledger.verify_statement(&edge_id, &chain, b"alice charges 5", &forged),
            Err(StatementError::BadSignature)
        ));

        // An edge certificate from another authority is not trusted.
        let other = Authority::new("other").unwrap();
        let impostor = service(&other, "edge", &dir.path().join("other"));
        let (signature, chain) = impostor.sign_statement(b"alice charges 5").unwrap();
        assert!(matches!(
            ledger.verify_statement(&edge_id, &chain, b"alice charges 5", &signature),
            Err(StatementError::Untrusted(_))
        ));

        // A chain that is not one, and a scheme outside the list.
        assert!(matches!(
            ledger.verify_statement(&edge_id, &[0, 0, 0, 9, 1], b"x", &signature),
            Err(StatementError::MalformedChain)
        ));
        let rsa_pkcs1 = Signature {
            scheme: u16::from(SignatureScheme::RSA_PKCS1_SHA256),
            bytes: vec![0; 64],
        };
        let (_, chain) = edge.sign_statement(b"x").unwrap();
        assert!(matches!(
            ledger.verify_statement(&edge_id, &chain, b"x", &rsa_pkcs1),
            Err(StatementError::Scheme(_))
        ));
    }

    #[test]
    fn a_statement_is_not_a_tls_handshake_signature() {
        // The signed bytes start with the statement's context, never TLS 1.3's 64 spaces.
        assert!(!CONTEXT.starts_with(b" "));
        assert!(CONTEXT.ends_with(b"\0"));
    }
}
