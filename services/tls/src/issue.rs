//! Throwaway authorities: a CA made on the spot and the certificates it signs, for
//! `retrychain up --tls`, docker-compose's one-shot certificate maker and the tests. Not a
//! PKI: nothing here is kept, revoked or renewed — rotation is done by writing new files
//! over the old ([`write_files`]), which is what cert-manager does too.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::{Identity, TlsFiles};

/// A certificate authority made on the spot.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").finish_non_exhaustive()
    }
}

/// Why a saved authority could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What reading it gave.
        error: io::Error,
    },
    /// One of `ca.crt` and `ca.key` is there without the other: a half-made authority is
    /// not replaced silently, since peers may already trust its certificate.
    #[error("{}: ca.crt and ca.key must both be there, or neither", .0.display())]
    Incomplete(std::path::PathBuf),
    /// `ca.key` is not the key of `ca.crt`.
    #[error("{}: ca.key is not the key of ca.crt", .0.display())]
    Mismatch(std::path::PathBuf),
    /// The files do not make an authority (not PEM, not a certificate, not a key).
    #[error("{}: {error}", dir.display())]
    Invalid {
        /// The directory.
        dir: std::path::PathBuf,
        /// What rcgen made of the files.
        error: rcgen::Error,
    },
}

/// How long an authority made here is valid: it outlives every certificate it issues.
pub const AUTHORITY_VALIDITY: std::time::Duration =
    std::time::Duration::from_secs(10 * 365 * 86_400);

/// How long a certificate issued here is valid: docker-compose's `certs` renews them on every
/// `up`, `up --tls` and the tests make new ones each run; one that stays up longer than this
/// is refused by its peers, as expired certificates should be.
pub const CERTIFICATE_VALIDITY: std::time::Duration = std::time::Duration::from_secs(90 * 86_400);

/// From an hour ago (a peer's clock a little behind still accepts it) to `span` from now.
fn valid_for(span: std::time::Duration) -> (time::OffsetDateTime, time::OffsetDateTime) {
    let now = time::OffsetDateTime::now_utc();
    (now - time::Duration::hours(1), now + span)
}

/// A certificate and its key, PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (PKCS#8).
    pub key_pem: String,
}

impl Authority {
    /// A new self-signed CA called `name` (its common name), with a fresh P-256 key.
    pub fn new(name: &str) -> Result<Self, rcgen::Error> {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        (params.not_before, params.not_after) = valid_for(AUTHORITY_VALIDITY);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate()?;
        let cert_pem = params.self_signed(&key)?.pem();
        Ok(Self {
            issuer: Issuer::new(params, key),
            cert_pem,
        })
    }

    /// The CA's certificate, PEM: what a peer trusts.
    pub fn cert_pem(&self) -> String {
        self.cert_pem.clone()
    }

    /// The CA's private key, PEM (PKCS#8): kept beside its certificate by whoever issues
    /// again later from the same authority (docker-compose's certificate maker).
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// The authority whose certificate is `cert_pem` and whose key is `key_pem` (as
    /// [`Authority::cert_pem`] and [`Authority::key_pem`] gave them, read from `dir`): what
    /// it issues chains to the certificate already trusted, so renewing the certificates of
    /// a deployment does not change what its peers trust.
    fn from_pem(dir: &Path, cert_pem: &str, key_pem: &str) -> Result<Self, LoadError> {
        let invalid = |error| LoadError::Invalid {
            dir: dir.to_owned(),
            error,
        };
        let key = KeyPair::from_pem(key_pem).map_err(invalid)?;
        // rcgen takes the pair as given: a key of another authority would sign leaves that
        // chain to nothing anyone trusts, so they must belong together.
        use rustls_pki_types::pem::PemObject;
        use x509_parser::prelude::FromDer;
        let der = rustls_pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|_| invalid(rcgen::Error::CouldNotParseCertificate))?;
        let (_, parsed) = x509_parser::certificate::X509Certificate::from_der(&der)
            .map_err(|_| invalid(rcgen::Error::CouldNotParseCertificate))?;
        if parsed.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(LoadError::Mismatch(dir.to_owned()));
        }
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key).map_err(invalid)?;
        Ok(Self {
            issuer,
            cert_pem: cert_pem.to_owned(),
        })
    }

    /// Writes the authority's certificate (`ca.crt`) and key (`ca.key`, the owner's alone)
    /// into `dir`, each by a rename, for [`Authority::load`] to issue from it again later.
    pub fn save(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)?;
        replace(&dir.join("ca.key"), self.key_pem().as_bytes(), 0o600)?;
        replace(&dir.join("ca.crt"), self.cert_pem.as_bytes(), 0o644)
    }

    /// The authority [`Authority::save`] wrote into `dir`; `Ok(None)` when `dir` holds
    /// none yet.
    pub fn load(dir: &Path) -> Result<Option<Self>, LoadError> {
        let read = |name: &str| match std::fs::read_to_string(dir.join(name)) {
            Ok(text) => Ok(Some(text)),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(LoadError::Io {
                path: dir.join(name),
                error,
            }),
        };
        match (read("ca.crt")?, read("ca.key")?) {
            (Some(cert), Some(key)) => Self::from_pem(dir, &cert, &key).map(Some),
            (None, None) => Ok(None),
            _ => Err(LoadError::Incomplete(dir.to_owned())),
        }
    }

    /// A certificate for `identity` (its one URI SAN), usable by a server and by a client,
    /// also valid for `localhost`, 127.0.0.1 and ::1 — so that grpcurl, which checks a
    /// host name, accepts the edge `up --tls` starts on this machine.
    pub fn issue(&self, identity: &Identity) -> Result<Issued, rcgen::Error> {
        self.issue_for(identity, &[])
    }

    /// [`Authority::issue`], also valid for the host names `dns_names`: a server that
    /// clients reach by name and check it (Postgres under the ledger's `verify-full`).
    pub fn issue_for(
        &self,
        identity: &Identity,
        dns_names: &[&str],
    ) -> Result<Issued, rcgen::Error> {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, identity.as_str());
        params.subject_alt_names = vec![
            SanType::URI(identity.as_str().try_into()?),
            SanType::DnsName("localhost".try_into()?),
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            SanType::IpAddress(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        ];
        for name in dns_names {
            params
                .subject_alt_names
                .push(SanType::DnsName((*name).try_into()?));
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        (params.not_before, params.not_after) = valid_for(CERTIFICATE_VALIDITY);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A certificate for the tier `name` from `authority`, its files written into `dir/name`
/// and loaded: a service's whole TLS in one call, for tests that sign, verify or connect as
/// a tier.
pub fn service(
    authority: &Authority,
    name: &str,
    dir: &Path,
    client_auth: crate::ClientAuth,
) -> Result<crate::Tls, Box<dyn std::error::Error + Send + Sync>> {
    let issued = authority.issue(&Identity::named(name))?;
    let files = write_files(&dir.join(name), &issued, &[authority])?;
    Ok(crate::Tls::load(files, client_auth)?)
}

/// Writes a service's files into `dir` (`tls.crt`, `tls.key` readable by the owner only,
/// `ca.crt` with every authority in `trusted`), each by writing a new file and renaming it
/// over the old, so a watcher never reads half a file.
pub fn write_files(dir: &Path, issued: &Issued, trusted: &[&Authority]) -> io::Result<TlsFiles> {
    std::fs::create_dir_all(dir)?;
    let files = TlsFiles::in_dir(dir);
    let ca: String = trusted.iter().map(|a| a.cert_pem()).collect();
    replace(&files.ca, ca.as_bytes(), 0o644)?;
    replace(&files.key, issued.key_pem.as_bytes(), 0o600)?;
    replace(&files.cert, issued.cert_pem.as_bytes(), 0o644)?;
    Ok(files)
}

/// Writes a secret (a signing key) to `path` whole, by a rename, readable by the owner
/// alone: a crash leaves the old file or the new one, never none.
pub fn write_secret(path: &Path, contents: &[u8]) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    replace(path, contents, 0o600)
}

/// Writes `path` whole, by a rename.
fn replace(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temporary = path.with_file_name(format!(".{name}.new"));
    // A leftover would keep its own mode: made afresh, the key is the owner's alone.
    let _ = std::fs::remove_file(&temporary);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&temporary)?;
    file.write_all(contents)?;
    file.sync_all()?;
    std::fs::rename(&temporary, path)
}

/// A throwaway token issuer, as an identity provider would be: a fresh P-256 key that
/// signs callers' bearer tokens (ES256), and its public half as a JWK for the edge's JWKS
/// file. For `up --tls` and the tests; a deployment uses its own identity provider.
pub struct TokenIssuer {
    kid: String,
    key_pem: String,
    key: jsonwebtoken::EncodingKey,
    jwk: serde_json::Value,
}

impl std::fmt::Debug for TokenIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenIssuer")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

impl TokenIssuer {
    /// A new key, named `kid` in its tokens and in the JWKS.
    pub fn new(kid: &str) -> Result<Self, rcgen::Error> {
        Self::from_pem(
            kid,
            &KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?.serialize_pem(),
        )
    }

    /// The issuer whose P-256 private key is `key_pem` (PKCS#8, as [`TokenIssuer::key_pem`]
    /// gives it), named `kid`.
    pub fn from_pem(kid: &str, key_pem: &str) -> Result<Self, rcgen::Error> {
        use base64::Engine;
        let pair = KeyPair::from_pem(key_pem)?;
        if !pair.is_compatible(&rcgen::PKCS_ECDSA_P256_SHA256) {
            return Err(rcgen::Error::KeyGenerationUnavailable);
        }
        let key = jsonwebtoken::EncodingKey::from_ec_pem(key_pem.as_bytes())
            .map_err(|_| rcgen::Error::CouldNotParseKeyPair)?;
        // An uncompressed P-256 point: 0x04, then x and y, 32 bytes each.
        let point = pair.public_key_raw();
        let coordinate =
            |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let jwk = serde_json::json!({
            "kty": "EC",
            "crv": "P-256",
            "x": coordinate(&point[1..33]),
            "y": coordinate(&point[33..65]),
            "kid": kid,
            "alg": "ES256",
            "use": "sig",
        });
        Ok(Self {
            kid: kid.to_owned(),
            key_pem: key_pem.to_owned(),
            key,
            jwk,
        })
    }

    /// The private key, PEM: what an identity provider keeps to itself.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// The key's name.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The public key, as a JWK.
    pub fn jwk(&self) -> &serde_json::Value {
        &self.jwk
    }

    /// A token for `subject`, valid for `valid_for` from now, naming `issuer` and
    /// `audience` when given.
    pub fn token(
        &self,
        subject: &str,
        issuer: Option<&str>,
        audience: Option<&str>,
        valid_for: std::time::Duration,
    ) -> String {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let mut claims = serde_json::json!({
            "sub": subject,
            "iat": now,
            "nbf": now,
            "exp": now + valid_for.as_secs(),
        });
        if let Some(issuer) = issuer {
            claims["iss"] = issuer.into();
        }
        if let Some(audience) = audience {
            claims["aud"] = audience.into();
        }
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, &claims, &self.key).expect("an ES256 key signs")
    }
}

/// Writes a JWKS file holding the public keys of `issuers` (several during a rotation), by
/// a rename, as [`write_files`] does.
pub fn write_jwks(path: &Path, issuers: &[&TokenIssuer]) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let keys: Vec<_> = issuers.iter().map(|issuer| issuer.jwk().clone()).collect();
    let text = serde_json::to_vec_pretty(&serde_json::json!({ "keys": keys }))?;
    replace(path, &text, 0o644)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_authority_loads_and_a_key_of_another_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Authority::load(dir.path()).unwrap().is_none(), "none yet");
        let authority = Authority::new("a").unwrap();
        authority.save(dir.path()).unwrap();
        let loaded = Authority::load(dir.path()).unwrap().expect("saved");
        assert_eq!(loaded.cert_pem(), authority.cert_pem());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("ca.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the key is the owner's alone");

        let other = Authority::new("b").unwrap();
        std::fs::write(dir.path().join("ca.key"), other.key_pem()).unwrap();
        assert!(matches!(
            Authority::load(dir.path()),
            Err(LoadError::Mismatch(_))
        ));
        std::fs::remove_file(dir.path().join("ca.key")).unwrap();
        assert!(matches!(
            Authority::load(dir.path()),
            Err(LoadError::Incomplete(_))
        ));
    }
}
