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

use crate::Identity;

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

/// Signs `statement` (after [`CONTEXT`]) with `key`.
pub(crate) fn sign(
    key: &dyn rustls::sign::SigningKey,
    statement: &[u8],
) -> Result<Signature, StatementError> {
    let signer = key
        .choose_scheme(&SCHEMES)
        .ok_or_else(|| StatementError::CannotSign(format!("{key:?}")))?;
    let bytes = signer
        .sign(&with_context(statement))
        .map_err(|error| StatementError::CannotSign(error.to_string()))?;
    Ok(Signature {
        scheme: u16::from(signer.scheme()),
        bytes,
    })
}

/// [`CONTEXT`], then `statement`: what is signed.
fn with_context(statement: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(CONTEXT.len() + statement.len());
    message.extend_from_slice(CONTEXT);
    message.extend_from_slice(statement);
    message
}

/// Checks that `statement` was signed by `expected`: `chain` (as [`encode_chain`] makes
/// it) leads to one of `roots`, is valid now for client authentication, names `expected`,
/// and its key made `signature` over [`CONTEXT`] and `statement`. Verified chains are
/// remembered in `verified`.
pub(crate) fn verify(
    roots: &Arc<RootCertStore>,
    verified: &SharedVerifiedChains,
    expected: &Identity,
    chain: &[u8],
    statement: &[u8],
    signature: &Signature,
) -> Result<(), StatementError> {
    let certificates = decode_chain(chain)?;
    let end_entity = webpki::EndEntityCert::try_from(&certificates[0])
        .map_err(|error| StatementError::Untrusted(error.to_string()))?;
    verify_signer(roots, verified, expected, chain, &certificates, &end_entity)?;
    let scheme = SignatureScheme::from(signature.scheme);
    if !SCHEMES.contains(&scheme) {
        return Err(StatementError::Scheme(signature.scheme));
    }
    // TLS 1.3 takes the first algorithm of a scheme (the one whose curve is the
    // scheme's); so does this.
    let algorithm = algorithms()
        .mapping
        .iter()
        .find(|(s, _)| *s == scheme)
        .and_then(|(_, algorithms)| algorithms.first())
        .ok_or(StatementError::Scheme(signature.scheme))?;
    end_entity
        .verify_signature(*algorithm, &with_context(statement), &signature.bytes)
        .map_err(|_| StatementError::BadSignature)
}

/// ring's signature algorithms, as the TLS configurations use them.
fn algorithms() -> rustls::crypto::WebPkiSupportedAlgorithms {
    rustls::crypto::ring::default_provider().signature_verification_algorithms
}

/// The chain check of [`verify`], remembered for [`CHAIN_CHECKED_FOR`] while the trusted
/// authorities stay the same.
fn verify_signer(
    roots: &Arc<RootCertStore>,
    verified: &SharedVerifiedChains,
    expected: &Identity,
    encoded: &[u8],
    certificates: &[CertificateDer<'_>],
    end_entity: &webpki::EndEntityCert<'_>,
) -> Result<(), StatementError> {
    match Identity::of_certificate(&certificates[0]) {
        Some(found) if &found == expected => {}
        found => {
            return Err(StatementError::WrongSigner {
                found,
                expected: expected.clone(),
            });
        }
    }
    let lock = || verified.lock().unwrap_or_else(|e| e.into_inner());
    {
        let verified = lock();
        if verified
            .roots
            .as_ref()
            .is_some_and(|r| Arc::ptr_eq(r, roots))
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
            algorithms().all,
            &roots.roots,
            &certificates[1..],
            UnixTime::now(),
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .map_err(|error| StatementError::Untrusted(error.to_string()))?;
    let mut verified = lock();
    if !verified
        .roots
        .as_ref()
        .is_some_and(|r| Arc::ptr_eq(r, roots))
        || verified.at.len() >= CHAINS_REMEMBERED
    {
        verified.at.clear();
        verified.roots = Some(Arc::clone(roots));
    }
    verified.at.insert(encoded.to_vec(), Instant::now());
    Ok(())
}

/// [`VerifiedChains`] as every clone of one `Tls` shares it.
pub(crate) type SharedVerifiedChains = Mutex<VerifiedChains>;
