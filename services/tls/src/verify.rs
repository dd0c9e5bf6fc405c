//! The client's check of a server: its chain to a trusted authority (webpki, as rustls's
//! own verifier does it), then its identity — the URI SAN of the tier the client means to
//! call — instead of a DNS name, since a tier's replicas are reached by address.

use std::sync::Arc;

use rustls::{
    CertificateError, DigitallySignedStruct, Error, RootCertStore, SignatureScheme,
    client::{
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
        verify_server_cert_signed_by_trust_anchor,
    },
    crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature},
    server::ParsedCertificate,
};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use crate::Identity;

/// Accepts a server whose chain leads to one of `roots` and whose certificate names
/// `expected`.
#[derive(Debug)]
pub struct IdentityVerifier {
    roots: Arc<RootCertStore>,
    expected: Identity,
    provider: Arc<CryptoProvider>,
}

impl IdentityVerifier {
    /// A verifier for servers that must be `expected`.
    pub fn new(
        roots: Arc<RootCertStore>,
        expected: Identity,
        provider: Arc<CryptoProvider>,
    ) -> Self {
        Self {
            roots,
            expected,
            provider,
        }
    }
}

impl ServerCertVerifier for IdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let certificate = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(
            &certificate,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        match Identity::of_certificate(end_entity) {
            Some(identity) if identity == self.expected => Ok(ServerCertVerified::assertion()),
            found => Err(Error::InvalidCertificate(CertificateError::Other(
                rustls::OtherError(Arc::new(WrongIdentity {
                    expected: self.expected.clone(),
                    found,
                })),
            ))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A server that is not the tier the client meant to call. Its `Debug` is its message:
/// rustls shows a custom certificate error with `{:?}`, and this is what a user reads.
struct WrongIdentity {
    expected: Identity,
    found: Option<Identity>,
}

impl std::fmt::Display for WrongIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.found {
            Some(found) => write!(f, "the server is {found}, not {}", self.expected),
            None => write!(
                f,
                "the server's certificate names no identity; expected {}",
                self.expected
            ),
        }
    }
}

impl std::fmt::Debug for WrongIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for WrongIdentity {}
