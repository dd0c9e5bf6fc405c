//! A chain over TLS, as `up --tls` and the tests run it: a throwaway authority, one
//! directory of certificates per tier (`<dir>/hop3/tls.crt`, `tls.key`, `ca.crt`, the way
//! a Kubernetes TLS secret is mounted) and one for the operator, a token issuer whose
//! JWKS the edge checks callers' bearer tokens against, and channels that speak it.

use std::path::{Path, PathBuf};

use anyhow::Context;
use retrychain_tls::{
    CHAIN, ClientAuth, Connector, Identity, OPERATOR, Tls, TlsFiles,
    issue::{Authority, TokenIssuer, write_files, write_jwks, write_secret},
};
use tonic::transport::{Channel, Endpoint};

/// The name (and identity, spiffe://retrychain/postgres) of the certificate a chain's own
/// Postgres serves TLS with; it also names localhost and 127.0.0.1, which the ledger's
/// `sslmode=verify-full` checks.
pub const POSTGRES: &str = "postgres";

/// The directory of the callers' token material: the issuer's key, the edge's JWKS and a
/// token for each sample caller.
const CALLERS: &str = "callers";

/// The file in [`CALLERS`] holding the token issuer's key id and private key.
const ISSUER: &str = "issuer.key";

/// The directory where [`ChainTls::renew`] keeps the authority's certificate and key.
const AUTHORITY: &str = "ca";

/// How long the sample callers' tokens last.
const TOKENS_FOR: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// The certificates of a chain: `<dir>/<tier>/` for each of the five tiers,
/// `<dir>/operator/` for whoever runs it (grpcurl, the tests, `up`'s health checks) and
/// `<dir>/postgres/` for the database the chain starts for itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainTls {
    /// The directory holding one directory per identity.
    pub dir: PathBuf,
}

impl ChainTls {
    /// Makes a new authority and a certificate for every tier and the operator in `dir`
    /// (created if needed; files already there are replaced).
    pub fn create(dir: &Path) -> anyhow::Result<Self> {
        let authority = Authority::new("retrychain throwaway CA").context("making a CA")?;
        let issuer = TokenIssuer::new("callers-1").context("making a token issuer")?;
        Self::fill(dir, &authority, &issuer, false)
    }

    /// Issues fresh certificates for every tier, the operator and Postgres in `dir` from
    /// the authority kept in `<dir>/ca/` (made there the first time), and fresh tokens for
    /// the sample callers from the issuer kept in `<dir>/callers/` (likewise): what
    /// docker-compose's one-shot `certs` service does on every `up`. The certificates are
    /// renewed; what the peers trust, and the JWKS, stay the same.
    pub fn renew(dir: &Path) -> anyhow::Result<Self> {
        let kept = dir.join(AUTHORITY);
        let authority = match Authority::load(&kept).context("the kept authority")? {
            Some(authority) => authority,
            None => {
                let authority =
                    Authority::new("retrychain deployment CA").context("making a CA")?;
                authority
                    .save(&kept)
                    .with_context(|| format!("writing {}", kept.display()))?;
                authority
            }
        };
        let chain = Self {
            dir: dir.to_owned(),
        };
        let kept = chain.dir.join(CALLERS).join(ISSUER).exists();
        let issuer = match kept {
            true => chain.token_issuer().context("the kept token issuer")?,
            false => TokenIssuer::new("callers-1").context("making a token issuer")?,
        };
        Self::fill(dir, &authority, &issuer, kept)
    }

    /// Writes a certificate from `authority` for every tier, the operator and Postgres,
    /// `issuer`'s JWKS — and its key, unless it was `kept` there already (a key rewritten
    /// on every renewal could be lost to a crash) — and a token for each sample caller
    /// (alice and bob, for a day) into `dir`.
    fn fill(
        dir: &Path,
        authority: &Authority,
        issuer: &TokenIssuer,
        kept: bool,
    ) -> anyhow::Result<Self> {
        let chain = Self {
            dir: dir.to_owned(),
        };
        for name in CHAIN.iter().chain([&OPERATOR, &POSTGRES]) {
            chain.issue(authority, name, &[authority])?;
        }
        match kept {
            true => write_jwks(&chain.jwks(), &[issuer]).context("writing the JWKS")?,
            false => chain.use_token_issuer(issuer)?,
        }
        for caller in ["alice", "bob"] {
            let path = chain.token_file(caller);
            // A bearer token is a credential: its owner's alone.
            write_secret(&path, chain.token(caller, TOKENS_FOR)?.as_bytes())
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(chain)
    }

    /// The JWKS file the edge checks callers' bearer tokens against.
    pub fn jwks(&self) -> PathBuf {
        self.dir.join(CALLERS).join("jwks.json")
    }

    /// A file holding a bearer token for `caller` (`alice` or `bob`), as `up --tls`
    /// prints it.
    pub fn token_file(&self, caller: &str) -> PathBuf {
        self.dir.join(CALLERS).join(format!("{caller}.jwt"))
    }

    /// Makes `issuer` the one that signs [`ChainTls::token`]s from now on and writes a JWKS
    /// holding its key alone — how a test rotates the callers' signing key (publish the new
    /// key beside the old with [`retrychain_tls::issue::write_jwks`] first, to keep old
    /// tokens valid).
    pub fn use_token_issuer(&self, issuer: &TokenIssuer) -> anyhow::Result<()> {
        let dir = self.dir.join(CALLERS);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let key = dir.join(ISSUER);
        write_secret(
            &key,
            format!("{}\n{}", issuer.kid(), issuer.key_pem()).as_bytes(),
        )
        .with_context(|| format!("writing {}", key.display()))?;
        write_jwks(&self.jwks(), &[issuer]).context("writing the JWKS")
    }

    /// The issuer in use (see [`ChainTls::use_token_issuer`]).
    pub fn token_issuer(&self) -> anyhow::Result<TokenIssuer> {
        let path = self.dir.join(CALLERS).join(ISSUER);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let (kid, pem) = text
            .split_once('\n')
            .context("an issuer file: kid, then the key")?;
        TokenIssuer::from_pem(kid, pem).context("the issuer's key")
    }

    /// A bearer token for `caller` (its subject; the edge names the caller `jwt:<caller>`)
    /// valid for `valid_for`.
    pub fn token(&self, caller: &str, valid_for: std::time::Duration) -> anyhow::Result<String> {
        Ok(self.token_issuer()?.token(caller, None, None, valid_for))
    }

    /// Writes a certificate for `name` (spiffe://retrychain/<name>, also valid for the host
    /// name `name`, as a docker-compose service is reached) signed by `authority` into its
    /// directory, trusting `trusted`: how a test rotates one tier's material.
    pub fn issue(
        &self,
        authority: &Authority,
        name: &str,
        trusted: &[&Authority],
    ) -> anyhow::Result<TlsFiles> {
        let issued = authority
            .issue_for(&Identity::named(name), &[name])
            .with_context(|| format!("issuing a certificate for {name}"))?;
        write_files(&self.dir.join(name), &issued, trusted)
            .with_context(|| format!("writing {}", self.dir.join(name).display()))
    }

    /// The directory of `name`'s files (a tier or `operator`).
    pub fn files_of(&self, name: &str) -> TlsFiles {
        TlsFiles::in_dir(&self.dir.join(name))
    }

    /// The operator's TLS, as a client presents it, read again when its files change (from
    /// within a runtime) so that its trust follows a rotation as the services' does.
    pub fn operator(&self) -> anyhow::Result<Tls> {
        let tls = Tls::load(self.files_of(OPERATOR), ClientAuth::Optional)
            .context("the operator's TLS")?;
        if tokio::runtime::Handle::try_current().is_ok() {
            tls.watch(std::time::Duration::from_secs(1));
        }
        Ok(tls)
    }

    /// A channel to `url` over TLS as the operator, to a server that must be the tier of
    /// `service` (`hop3.2` is hop3).
    pub async fn connect(&self, url: &str, service: &str) -> anyhow::Result<Channel> {
        self.connect_with(
            url,
            Connector::new(self.operator()?, Identity::of_service(service)),
        )
        .await
    }

    /// A channel to the edge at `url` over TLS that presents no certificate: a caller that
    /// trusts the CA and authenticates with a bearer token, or not at all.
    pub async fn connect_without_certificate(&self, url: &str) -> anyhow::Result<Channel> {
        let connector = Connector::new(self.operator()?, Identity::named("edge"));
        self.connect_with(url, connector.without_certificate())
            .await
    }

    async fn connect_with(&self, url: &str, connector: Connector) -> anyhow::Result<Channel> {
        Endpoint::from_shared(url.to_owned())
            .with_context(|| format!("URL {url:?}"))?
            .connect_with_connector(connector)
            .await
            .with_context(|| format!("connecting to {url} over TLS"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `retrychain certs` relies on: a second run renews every certificate and token
    /// but keeps the authority, the token issuer and the JWKS, so that nothing a peer
    /// trusts changes; the signing keys and tokens are their owner's alone.
    #[test]
    fn renewing_keeps_the_authority_and_the_issuer() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let read = |path: PathBuf| std::fs::read_to_string(path).unwrap();
        let first = ChainTls::renew(dir.path()).unwrap();
        let before = (
            read(dir.path().join("ca/ca.crt")),
            read(first.jwks()),
            read(dir.path().join("callers").join(ISSUER)),
            read(first.files_of("hop3").cert),
        );
        let second = ChainTls::renew(dir.path()).unwrap();
        assert_eq!(
            read(dir.path().join("ca/ca.crt")),
            before.0,
            "the same authority"
        );
        assert_eq!(read(second.jwks()), before.1, "the same JWKS");
        assert_eq!(read(dir.path().join("callers").join(ISSUER)), before.2);
        assert_ne!(read(second.files_of("hop3").cert), before.3, "renewed");
        assert_eq!(read(second.files_of("hop3").ca), before.0);
        for secret in [
            dir.path().join("ca/ca.key"),
            dir.path().join("callers").join(ISSUER),
            second.token_file("alice"),
            second.files_of("hop3").key,
        ] {
            let mode = std::fs::metadata(&secret).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{}", secret.display());
        }
    }
}
