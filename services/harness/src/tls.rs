//! A chain over TLS, as `up --tls` and the tests run it: a throwaway authority, one
//! directory of certificates per tier (`<dir>/hop3/tls.crt`, `tls.key`, `ca.crt`, the way
//! a Kubernetes TLS secret is mounted) and one for the operator, and channels that speak
//! it.

use std::path::{Path, PathBuf};

use anyhow::Context;
use retrychain_tls::{
    CHAIN, ClientAuth, Connector, Identity, OPERATOR, Tls, TlsFiles,
    issue::{Authority, write_files},
};
use tonic::transport::{Channel, Endpoint};

/// The name (and identity, spiffe://retrychain/postgres) of the certificate a chain's own
/// Postgres serves TLS with; it also names localhost and 127.0.0.1, which the ledger's
/// `sslmode=verify-full` checks.
pub const POSTGRES: &str = "postgres";

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
        let chain = Self {
            dir: dir.to_owned(),
        };
        for name in CHAIN.iter().chain([&OPERATOR, &POSTGRES]) {
            chain.issue(&authority, name, &[&authority])?;
        }
        Ok(chain)
    }

    /// Writes a certificate for `name` (spiffe://retrychain/<name>) signed by `authority`
    /// into its directory, trusting `trusted`: how a test rotates one tier's material.
    pub fn issue(
        &self,
        authority: &Authority,
        name: &str,
        trusted: &[&Authority],
    ) -> anyhow::Result<TlsFiles> {
        let issued = authority
            .issue(&Identity::named(name))
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
        let connector = Connector::new(self.operator()?, Identity::of_service(service));
        Endpoint::from_shared(url.to_owned())
            .with_context(|| format!("URL {url:?}"))?
            .connect_with_connector(connector)
            .await
            .with_context(|| format!("connecting to {url} over TLS"))
    }
}
