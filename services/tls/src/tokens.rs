//! Bearer tokens: a caller's JWT (`authorization: Bearer …`), checked against the public
//! keys of a JWKS file that is read again when it changes.
//!
//! Only asymmetric keys (EC P-256/P-384, RSA, Ed25519): the edge holds no secret that
//! could mint a token. A token must name its key (`kid`) unless the set holds one key, must
//! be signed with that key's own algorithm (a token cannot choose a weaker one, nor `none`),
//! and must carry `sub` and `exp`; `nbf`, and the issuer and audience when configured, are
//! checked too. The caller is the token's subject.
//!
//! Rotation works as for certificates ([`crate::Tls::watch`]): an identity provider
//! publishes the new key beside the old, starts signing with it, and drops the old one once
//! the old tokens have expired; a JWKS file that cannot be used is logged and ignored, and
//! the keys in use stay.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, RwLock},
    time::{Duration, Instant},
};

use crate::material::{FileStamp, file_stamp, watch_while_held};
use jsonwebtoken::{
    Algorithm, DecodingKey, Validation,
    jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm},
};

/// What a token must satisfy besides its signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRules {
    /// The JWKS file (`{"keys": [...]}`), public keys only.
    pub jwks: PathBuf,
    /// The `iss` a token must carry; unset, any.
    pub issuer: Option<String>,
    /// The `aud` a token must carry (one of); unset, a token with an `aud` is refused (it
    /// was meant for someone else).
    pub audience: Option<String>,
}

/// Why a token or a JWKS file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The JWKS file cannot be used.
    #[error("JWKS {path}: {reason}")]
    Jwks {
        /// The file.
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// The token is not one this service accepts.
    #[error("bearer token refused: {0}")]
    Refused(String),
}

impl TokenError {
    fn jwks(path: &Path, reason: impl Into<String>) -> Self {
        Self::Jwks {
            path: path.display().to_string(),
            reason: reason.into(),
        }
    }

    fn refused(reason: impl Into<String>) -> Self {
        Self::Refused(reason.into())
    }
}

/// The verifier: the rules and the keys in use. Cheap to clone (one shared state).
#[derive(Clone)]
pub struct Tokens {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("rules", &self.shared.rules)
            .field("keys", &self.current().count())
            .finish()
    }
}

struct Shared {
    rules: TokenRules,
    keys: RwLock<Arc<Keys>>,
    /// The file's stamp at the last read, and when a failed read is tried again.
    stamp: Mutex<(Option<FileStamp>, Option<Instant>)>,
}

/// One key of the set, ready to verify with.
struct Key {
    key: DecodingKey,
    algorithm: Algorithm,
}

/// The usable keys of a JWKS file.
struct Keys {
    named: HashMap<String, Key>,
    unnamed: Vec<Key>,
}

impl Keys {
    fn count(&self) -> usize {
        self.named.len() + self.unnamed.len()
    }
}

/// What a [`Tokens::reload`] did.
#[derive(Debug)]
pub enum TokenReload {
    /// The file did not change.
    Unchanged,
    /// New keys are in use; how many.
    Reloaded(usize),
    /// The file changed but could not be used; the old keys are still in use.
    Refused(TokenError),
}

/// How long after a failed read the file is read again even if it did not change.
const RETRY_FAILED_READ: Duration = Duration::from_secs(10);

/// The claims read from a token (the rest are checked by [`Validation`] or ignored).
#[derive(serde::Deserialize)]
struct Claims {
    sub: String,
    /// Read only to refuse a token meant for someone else when no audience is configured.
    aud: Option<serde_json::Value>,
}

impl Tokens {
    /// Reads the JWKS file; an error says what was wrong with it.
    pub fn load(rules: TokenRules) -> Result<Self, TokenError> {
        let stamp = file_stamp(&rules.jwks);
        let keys = read_keys(&rules.jwks)?;
        Ok(Self {
            shared: Arc::new(Shared {
                rules,
                keys: RwLock::new(Arc::new(keys)),
                stamp: Mutex::new((stamp, None)),
            }),
        })
    }

    fn current(&self) -> Arc<Keys> {
        Arc::clone(&self.shared.keys.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The token's subject, if the token is signed by a key of the set with that key's
    /// algorithm, is within its validity, and names the configured issuer and audience.
    pub fn verify(&self, token: &str) -> Result<String, TokenError> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|error| TokenError::refused(format!("not a JWT ({error})")))?;
        let keys = self.current();
        let key = match &header.kid {
            Some(kid) => keys.named.get(kid).ok_or_else(|| {
                TokenError::refused(format!("no key {kid:?} in the JWKS (expired or unknown)"))
            })?,
            None if keys.count() == 1 => keys
                .named
                .values()
                .chain(keys.unnamed.iter())
                .next()
                .expect("one key"),
            None => {
                return Err(TokenError::refused(
                    "the token names no key (kid) and the JWKS holds several",
                ));
            }
        };
        if header.alg != key.algorithm {
            return Err(TokenError::refused(format!(
                "signed with {:?}, but its key is for {:?}",
                header.alg, key.algorithm
            )));
        }
        let rules = &self.shared.rules;
        let mut validation = Validation::new(key.algorithm);
        validation.set_required_spec_claims(&["exp", "sub"]);
        validation.validate_nbf = true;
        validation.leeway = 30;
        if let Some(issuer) = &rules.issuer {
            validation.set_issuer(&[issuer]);
        }
        match &rules.audience {
            Some(audience) => validation.set_audience(&[audience]),
            None => validation.validate_aud = false,
        }
        let data = jsonwebtoken::decode::<Claims>(token, &key.key, &validation)
            .map_err(|error| TokenError::refused(error.to_string()))?;
        if rules.audience.is_none() && data.claims.aud.is_some() {
            return Err(TokenError::refused(
                "InvalidAudience: the token names an audience, and this service expects none",
            ));
        }
        let subject = data.claims.sub;
        if subject.is_empty() {
            return Err(TokenError::refused("its subject (sub) is empty"));
        }
        Ok(subject)
    }

    /// Reads the file again if it changed since the last read (or a failed read is due to
    /// be tried again). A good read replaces the keys; a bad one changes nothing.
    pub fn reload(&self) -> TokenReload {
        let now = file_stamp(&self.shared.rules.jwks);
        {
            let mut last = self.shared.stamp.lock().unwrap_or_else(|e| e.into_inner());
            let retry = last.1.is_some_and(|at| Instant::now() >= at);
            if last.0 == now && !retry {
                return TokenReload::Unchanged;
            }
            *last = (now, None);
        }
        match read_keys(&self.shared.rules.jwks) {
            Ok(keys) => {
                let count = keys.count();
                *self.shared.keys.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(keys);
                TokenReload::Reloaded(count)
            }
            Err(error) => {
                let mut last = self.shared.stamp.lock().unwrap_or_else(|e| e.into_inner());
                last.1 = Some(Instant::now() + RETRY_FAILED_READ);
                TokenReload::Refused(error)
            }
        }
    }

    /// Checks the file every `every` for as long as any clone lives, and logs each change.
    pub fn watch(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        watch_while_held(&self.shared, every, |shared| {
            let tokens = Tokens { shared };
            match tokens.reload() {
                TokenReload::Unchanged => {}
                TokenReload::Reloaded(keys) => {
                    tracing::info!(keys, jwks = %tokens.shared.rules.jwks.display(), "JWKS changed: tokens are checked against its keys");
                }
                TokenReload::Refused(error) => {
                    tracing::warn!(%error, "JWKS changed but cannot be used; keeping the keys in use");
                }
            }
        })
    }
}

fn read_keys(path: &Path) -> Result<Keys, TokenError> {
    let text = std::fs::read(path).map_err(|error| TokenError::jwks(path, error.to_string()))?;
    let set: JwkSet = serde_json::from_slice(&text)
        .map_err(|error| TokenError::jwks(path, format!("not a JWK set ({error})")))?;
    let mut keys = Keys {
        named: HashMap::new(),
        unnamed: Vec::new(),
    };
    for (i, jwk) in set.keys.iter().enumerate() {
        let name = jwk.common.key_id.clone().unwrap_or_else(|| format!("#{i}"));
        let algorithm = algorithm_of(jwk)
            .map_err(|reason| TokenError::jwks(path, format!("key {name}: {reason}")))?;
        let key = DecodingKey::from_jwk(jwk)
            .map_err(|error| TokenError::jwks(path, format!("key {name}: {error}")))?;
        let key = Key { key, algorithm };
        match &jwk.common.key_id {
            Some(kid) => {
                if keys.named.insert(kid.clone(), key).is_some() {
                    return Err(TokenError::jwks(path, format!("two keys named {kid:?}")));
                }
            }
            None => keys.unnamed.push(key),
        }
    }
    if keys.count() == 0 {
        return Err(TokenError::jwks(path, "holds no key"));
    }
    Ok(keys)
}

/// The one algorithm a key verifies: its `alg`, else the usual one for its curve or type.
/// Symmetric keys are refused: a verifier holding one could mint tokens.
fn algorithm_of(jwk: &Jwk) -> Result<Algorithm, String> {
    let from_type = match &jwk.algorithm {
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => Algorithm::ES256,
            EllipticCurve::P384 => Algorithm::ES384,
            ref other => return Err(format!("curve {other:?} is not supported")),
        },
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::OctetKeyPair(_) => Algorithm::EdDSA,
        AlgorithmParameters::OctetKey(_) => {
            return Err("a symmetric (oct) key: only public keys belong in a JWKS".into());
        }
    };
    let Some(named) = jwk.common.key_algorithm else {
        return Ok(from_type);
    };
    let algorithm = match named {
        KeyAlgorithm::ES256 => Algorithm::ES256,
        KeyAlgorithm::ES384 => Algorithm::ES384,
        KeyAlgorithm::RS256 => Algorithm::RS256,
        KeyAlgorithm::RS384 => Algorithm::RS384,
        KeyAlgorithm::RS512 => Algorithm::RS512,
        KeyAlgorithm::PS256 => Algorithm::PS256,
        KeyAlgorithm::PS384 => Algorithm::PS384,
        KeyAlgorithm::PS512 => Algorithm::PS512,
        KeyAlgorithm::EdDSA => Algorithm::EdDSA,
        other => return Err(format!("algorithm {other:?} is not for signatures")),
    };
    let family_matches = matches!(
        (&jwk.algorithm, algorithm),
        (
            AlgorithmParameters::EllipticCurve(_),
            Algorithm::ES256 | Algorithm::ES384
        ) | (
            AlgorithmParameters::RSA(_),
            Algorithm::RS256
                | Algorithm::RS384
                | Algorithm::RS512
                | Algorithm::PS256
                | Algorithm::PS384
                | Algorithm::PS512
        ) | (AlgorithmParameters::OctetKeyPair(_), Algorithm::EdDSA)
    );
    if !family_matches || (algorithm != from_type && from_type != Algorithm::RS256) {
        return Err(format!("alg {named:?} does not fit the key's type"));
    }
    Ok(algorithm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::issue::{TokenIssuer, write_jwks};

    fn rules(dir: &Path) -> TokenRules {
        TokenRules {
            jwks: dir.join("jwks.json"),
            issuer: Some("https://id.example".into()),
            audience: None,
        }
    }

    #[test]
    fn a_token_from_a_published_key_names_its_subject_and_every_other_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ours = TokenIssuer::new("k1").unwrap();
        write_jwks(&dir.path().join("jwks.json"), &[&ours]).unwrap();
        let tokens = Tokens::load(rules(dir.path())).unwrap();
        let hour = Duration::from_secs(3600);
        let good = ours.token("alice", Some("https://id.example"), None, hour);
        assert_eq!(tokens.verify(&good).unwrap(), "alice");

        let refused = |token: &str, says: &str| {
            let error = tokens.verify(token).unwrap_err().to_string();
            assert!(error.contains(says), "{error} (wanted {says:?})");
        };
        // Another issuer's key, even under our kid.
        let forger = TokenIssuer::new("k1").unwrap();
        refused(
            &forger.token("alice", Some("https://id.example"), None, hour),
            "InvalidSignature",
        );
        // The wrong issuer; an audience nobody asked for; not a JWT at all.
        refused(
            &ours.token("alice", Some("https://other.example"), None, hour),
            "InvalidIssuer",
        );
        refused(
            &ours.token("alice", Some("https://id.example"), Some("elsewhere"), hour),
            "InvalidAudience",
        );
        refused("a.b.c", "not a JWT");
        // `alg: none`, with our kid: refused whatever the claims say.
        let unsigned = format!(
            "{}.{}.",
            base64_url(br#"{"alg":"none","kid":"k1"}"#),
            base64_url(br#"{"sub":"alice","exp":99999999999}"#)
        );
        assert!(tokens.verify(&unsigned).is_err());
        // HS256 under our kid (the public key as an HMAC secret, the classic confusion).
        let hs = jsonwebtoken::encode(
            &jsonwebtoken::Header {
                kid: Some("k1".into()),
                ..jsonwebtoken::Header::new(Algorithm::HS256)
            },
            &serde_json::json!({"sub": "alice", "exp": 99999999999u64}),
            &jsonwebtoken::EncodingKey::from_secret(ours.jwk().to_string().as_bytes()),
        )
        .unwrap();
        refused(&hs, "signed with HS256");

        // Our key and kid, but outside its validity or without a claim it must carry.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let signed = |claims: serde_json::Value| {
            jsonwebtoken::encode(
                &jsonwebtoken::Header {
                    kid: Some("k1".into()),
                    ..jsonwebtoken::Header::new(Algorithm::ES256)
                },
                &claims,
                &jsonwebtoken::EncodingKey::from_ec_pem(ours.key_pem().as_bytes()).unwrap(),
            )
            .unwrap()
        };
        let iss = "https://id.example";
        refused(
            &signed(serde_json::json!({"sub": "alice", "iss": iss, "exp": now - 120})),
            "ExpiredSignature",
        );
        refused(
            &signed(
                serde_json::json!({"sub": "alice", "iss": iss, "exp": now + 600, "nbf": now + 300}),
            ),
            "ImmatureSignature",
        );
        refused(
            &signed(serde_json::json!({"sub": "alice", "iss": iss})),
            "exp",
        );
        refused(
            &signed(serde_json::json!({"iss": iss, "exp": now + 600})),
            "sub",
        );
        refused(
            &signed(serde_json::json!({"sub": "", "iss": iss, "exp": now + 600})),
            "subject (sub) is empty",
        );
        // Within the 30 s leeway an expiry is still honoured.
        assert_eq!(
            tokens
                .verify(&signed(
                    serde_json::json!({"sub": "alice", "iss": iss, "exp": now - 5})
                ))
                .unwrap(),
            "alice"
        );
    }

    #[test]
    fn a_new_key_is_taken_and_a_broken_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jwks.json");
        let (old, new) = (
            TokenIssuer::new("old").unwrap(),
            TokenIssuer::new("new").unwrap(),
        );
        write_jwks(&path, &[&old]).unwrap();
        let tokens = Tokens::load(rules(dir.path())).unwrap();
        let hour = Duration::from_secs(3600);
        let issuer = Some("https://id.example");
        assert!(tokens.verify(&new.token("a", issuer, None, hour)).is_err());
        write_jwks(&path, &[&old, &new]).unwrap();
        assert!(matches!(tokens.reload(), TokenReload::Reloaded(2)));
        assert!(tokens.verify(&new.token("a", issuer, None, hour)).is_ok());
        std::fs::write(
            &path,
            b"{\"keys\": [{\"kty\": \"oct\", \"k\": \"c2VjcmV0\"}]}",
        )
        .unwrap();
        assert!(matches!(tokens.reload(), TokenReload::Refused(_)));
        assert!(tokens.verify(&old.token("a", issuer, None, hour)).is_ok());
    }

    fn base64_url(bytes: &[u8]) -> String {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }
}
