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
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};

use crate::{Identity, TlsFiles};

/// A certificate authority made on the spot.
pub struct Authority {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").finish_non_exhaustive()
    }
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
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        Ok(Self { issuer })
    }

    /// The CA's certificate, PEM: what a peer trusts.
    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for `identity` (its one URI SAN), usable by a server and by a client,
    /// also valid for `localhost`, 127.0.0.1 and ::1 — so that grpcurl, which checks a
    /// host name, accepts the edge `up --tls` starts on this machine.
    pub fn issue(&self, identity: &Identity) -> Result<Issued, rcgen::Error> {
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
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
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
