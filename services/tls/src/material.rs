//! A service's TLS material — its certificate chain, its key, the authorities it trusts —
//! read from files, and read again when they change, the way a Kubernetes secret or
//! cert-manager replaces them (a new file renamed over the old, or a symlink swapped).
//!
//! [`Tls`] holds what was last read well. A reload that fails (a half-written file, a key
//! that does not match its certificate, a certificate that names no identity) is logged and
//! ignored: the old material keeps serving until a good one arrives. Servers take the
//! current material for each connection they accept, clients for each connection they open,
//! so a rotation drops no call: connections already open finish on what they began with.
//!
//! The CA file may hold several authorities: during a CA rotation it holds the old and the
//! new, and both are trusted until the old is removed.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex, RwLock, Weak},
    time::{Duration, SystemTime},
};

use rustls::{
    ClientConfig, RootCertStore, ServerConfig,
    crypto::CryptoProvider,
    server::WebPkiClientVerifier,
    sign::{CertifiedKey, SingleCertAndKey},
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

use crate::{
    Identity,
    statement::{Signature, StatementError},
    verify::IdentityVerifier,
};

/// Where a service's TLS material lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The service's certificate chain, PEM, its own certificate first.
    pub cert: PathBuf,
    /// The private key of that certificate, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The authorities whose certificates this service trusts, PEM (one or several).
    pub ca: PathBuf,
}

impl TlsFiles {
    /// `tls.crt`, `tls.key` and `ca.crt` in `dir`: a Kubernetes TLS secret's keys, as
    /// cert-manager writes them, mounted as a directory.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            ca: dir.join("ca.crt"),
        }
    }
}

/// Whether a server asks its callers for a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Every caller presents a certificate from a trusted authority, or the handshake fails:
    /// a tier below the edge, whose only callers are the tier above.
    Required,
    /// A caller may present one (and is then identified by it) or none: the edge, which
    /// clients call.
    Optional,
}

/// Why TLS material could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no usable PEM.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// The material was read but does not make a configuration.
    #[error("{0}")]
    Invalid(String),
}

impl TlsError {
    fn file(path: &Path, message: impl std::fmt::Display) -> Self {
        Self::File {
            path: path.to_owned(),
            message: message.to_string(),
        }
    }
}

/// The crypto every configuration uses: ring's, TLS 1.3 only (see [`Tls`]).
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What one good read of the files gave.
#[derive(Debug)]
pub(crate) struct Loaded {
    /// Who the certificate says this service is.
    identity: Identity,
    /// Certificate chain and signing key.
    pub(crate) certified: Arc<CertifiedKey>,
    /// The certificate chain as signed statements carry it (`statement::encode_chain`).
    pub(crate) signer_chain: Arc<[u8]>,
    /// The trusted authorities.
    pub(crate) roots: Arc<RootCertStore>,
    /// The server configuration, built once per read.
    server: Arc<ServerConfig>,
    /// The admin port's: a client certificate asked for, not required (Prometheus and
    /// probes read /metrics and health with the CA alone), HTTP/1.1 beside HTTP/2.
    admin: Arc<ServerConfig>,
}

/// Each file's device, inode, change time, modification time and size: when any of them
/// changes for any of the three files, they are read again (a rename gives a new inode, a
/// rewrite a new change time, whatever the modification time was set to).
type Stamp = [Option<FileStamp>; 3];

/// How long after a read that failed the files are read again though they did not change
/// (a read can fail for a passing reason: out of file descriptors, a swap half done).
const RETRY_FAILED_READ: Duration = Duration::from_secs(10);

/// A service's TLS: the material last read well from its [`TlsFiles`], the server
/// configuration made from it, and client configurations on demand. Cheap to clone (one
/// shared state). TLS 1.3 only, with ring's algorithms; ALPN `h2` (gRPC).
#[derive(Debug, Clone)]
pub struct Tls {
    pub(crate) shared: Arc<Shared>,
}

#[derive(Debug)]
pub(crate) struct Shared {
    files: TlsFiles,
    client_auth: ClientAuth,
    current: RwLock<Arc<Loaded>>,
    /// The files' stamp at the last read, good or bad, and when a bad read is tried again.
    stamp: Mutex<(Stamp, Option<std::time::Instant>)>,
    /// How many times new material was taken into use ([`Tls::renewed`]).
    generation: tokio::sync::watch::Sender<u64>,
    /// Signers' chains verified lately (`statement`).
    pub(crate) verified_chains: crate::statement::SharedVerifiedChains,
}

/// What a [`Tls::reload`] did.
#[derive(Debug)]
pub enum Reload {
    /// The files did not change.
    Unchanged,
    /// New material is in use; the identity it names.
    Reloaded(Identity),
    /// The files changed but could not be used; the old material is still in use.
    Refused(TlsError),
}

impl Tls {
    /// Reads `files` and builds the configurations; an error names the file and what was
    /// wrong with it.
    pub fn load(files: TlsFiles, client_auth: ClientAuth) -> Result<Self, TlsError> {
        let stamp = stamp(&files);
        let loaded = load(&files, client_auth)?;
        Ok(Self {
            shared: Arc::new(Shared {
                files,
                client_auth,
                current: RwLock::new(Arc::new(loaded)),
                stamp: Mutex::new((stamp, None)),
                generation: tokio::sync::watch::Sender::new(0),
                verified_chains: Default::default(),
            }),
        })
    }

    pub(crate) fn current(&self) -> Arc<Loaded> {
        Arc::clone(
            &self
                .shared
                .current
                .read()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Who this service is, by its current certificate.
    pub fn identity(&self) -> Identity {
        self.current().identity.clone()
    }

    /// The server configuration for the next connection accepted.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.current().server)
    }

    /// The admin port's server configuration for the next connection accepted: client
    /// certificates optional (who presents one is identified by it), ALPN `h2` and
    /// `http/1.1` (a Prometheus scrape).
    pub fn admin_server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.current().admin)
    }

    /// A client configuration for the next connection to a server that must be `expected`:
    /// this service's certificate presented, the server's chain checked against the trusted
    /// authorities and its identity against `expected` (not its DNS name: replicas are
    /// reached by address, and a tier is one identity whatever its addresses).
    pub fn client_config(&self, expected: &Identity) -> Arc<ClientConfig> {
        self.client_config_presenting(expected, true)
    }

    /// [`Tls::client_config`], presenting this service's certificate or (`present`
    /// false) none: a caller that authenticates with a bearer token, or not at all.
    pub fn client_config_presenting(
        &self,
        expected: &Identity,
        present: bool,
    ) -> Arc<ClientConfig> {
        self.client_config_with(expected, present, b"h2")
    }

    /// A client configuration for an HTTP/1.1 reader of an admin port's `/metrics` (what
    /// Prometheus does): the server checked as [`Tls::client_config`] checks it, no
    /// certificate presented, ALPN `http/1.1`.
    pub fn metrics_client_config(&self, expected: &Identity) -> Arc<ClientConfig> {
        self.client_config_with(expected, false, b"http/1.1")
    }

    fn client_config_with(
        &self,
        expected: &Identity,
        present: bool,
        alpn: &[u8],
    ) -> Arc<ClientConfig> {
        let loaded = self.current();
        let provider = provider();
        let verifier = IdentityVerifier::new(
            Arc::clone(&loaded.roots),
            expected.clone(),
            Arc::clone(&provider),
        );
        let builder = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("ring supports TLS 1.3")
            .dangerous() // the verifier below checks the chain fully, and the identity
            .with_custom_certificate_verifier(Arc::new(verifier));
        let mut config = if present {
            builder.with_client_cert_resolver(Arc::new(SingleCertAndKey::from(Arc::clone(
                &loaded.certified,
            ))))
        } else {
            builder.with_no_client_auth()
        };
        config.alpn_protocols = vec![alpn.to_vec()];
        Arc::new(config)
    }

    /// Signs `statement` with this service's identity key (see [`crate::statement`]).
    /// Returns the signature and the encoded chain of the certificate that verifies it,
    /// both from the material in use now.
    pub fn sign_statement(
        &self,
        statement: &[u8],
    ) -> Result<(Signature, Arc<[u8]>), StatementError> {
        let current = self.current();
        let signature = crate::statement::sign(current.certified.key.as_ref(), statement)?;
        Ok((signature, Arc::clone(&current.signer_chain)))
    }

    /// Checks that `statement` was signed by `expected`, its chain leading to an authority
    /// this service trusts now (see [`crate::statement`]).
    pub fn verify_statement(
        &self,
        expected: &Identity,
        chain: &[u8],
        statement: &[u8],
        signature: &Signature,
    ) -> Result<(), StatementError> {
        crate::statement::verify(
            &self.current().roots,
            &self.shared.verified_chains,
            expected,
            chain,
            statement,
            signature,
        )
    }

    /// Reads the files again if they changed since the last read. A good read replaces the
    /// material for new connections; a bad one is returned and changes nothing.
    ///
    /// A read that failed is tried again every [`RETRY_FAILED_READ`] even if the files do
    /// not change, since the failure may have passed.
    pub fn reload(&self) -> Reload {
        let now = stamp(&self.shared.files);
        {
            let mut last = self.shared.stamp.lock().unwrap_or_else(|e| e.into_inner());
            let retry = last.1.is_some_and(|at| std::time::Instant::now() >= at);
            if last.0 == now && !retry {
                return Reload::Unchanged;
            }
            *last = (now, None);
        }
        match load(&self.shared.files, self.shared.client_auth) {
            Ok(loaded) => {
                let identity = loaded.identity.clone();
                *self
                    .shared
                    .current
                    .write()
                    .unwrap_or_else(|e| e.into_inner()) = Arc::new(loaded);
                self.shared
                    .generation
                    .send_modify(|generation| *generation += 1);
                Reload::Reloaded(identity)
            }
            Err(error) => {
                let mut last = self.shared.stamp.lock().unwrap_or_else(|e| e.into_inner());
                last.1 = Some(std::time::Instant::now() + RETRY_FAILED_READ);
                Reload::Refused(error)
            }
        }
    }

    /// Completes once material newer than what is in use now has been taken into use: a
    /// server closes (gracefully) a connection made before, so that no connection outlives
    /// the certificate or authority it was authenticated with by more than its calls.
    pub fn renewed(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut generation = self.shared.generation.subscribe();
        async move {
            if generation.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Checks the files every `every` for as long as any clone of this `Tls` lives, and
    /// logs what each change did.
    pub fn watch(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        watch_while_held(&self.shared, every, |shared| {
            let tls = Tls { shared };
            match tls.reload() {
                Reload::Unchanged => {}
                Reload::Reloaded(identity) => {
                    tracing::info!(%identity, cert = %tls.shared.files.cert.display(), "TLS material changed: new connections use it");
                }
                Reload::Refused(error) => {
                    tracing::warn!(%error, "TLS material changed but cannot be used; keeping the material in use");
                }
            }
        })
    }
}

/// The three files' stamps ([`file_stamp`]).
fn stamp(files: &TlsFiles) -> Stamp {
    [&files.cert, &files.key, &files.ca].map(|path| file_stamp(path))
}

/// A file's device and inode, change time, modification time and size, following symlinks
/// (as a swapped Kubernetes `..data` link is followed): a change of any of them is a new
/// file to read.
pub(crate) type FileStamp = (u64, u64, i64, i64, SystemTime, u64);

/// `path`'s [`FileStamp`]; `None` when it cannot be read.
pub(crate) fn file_stamp(path: &std::path::Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some((
        meta.dev(),
        meta.ino(),
        meta.ctime(),
        meta.ctime_nsec(),
        meta.modified().ok()?,
        meta.len(),
    ))
}

/// Runs `check` on `shared` every `every` for as long as something else holds it (the
/// task keeps only a weak reference): how material read from files is watched.
pub(crate) fn watch_while_held<S: Send + Sync + 'static>(
    shared: &Arc<S>,
    every: Duration,
    check: impl Fn(Arc<S>) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let weak: Weak<S> = Arc::downgrade(shared);
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(shared) = weak.upgrade() else { return };
            check(shared);
        }
    })
}

fn load(files: &TlsFiles, client_auth: ClientAuth) -> Result<Loaded, TlsError> {
    let provider = provider();
    let chain = certificates(&files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|error| TlsError::file(&files.key, format!("no private key: {error}")))?;
    let certified = CertifiedKey::from_der(chain, key, &provider).map_err(|error| {
        TlsError::file(
            &files.key,
            format!("not the key of {} ({error})", files.cert.display()),
        )
    })?;
    let identity = Identity::of_certificate(&certified.cert[0]).ok_or_else(|| {
        TlsError::file(
            &files.cert,
            "the certificate names no identity (one URI SAN such as spiffe://retrychain/hop3)",
        )
    })?;
    if let Some(problem) = crate::identity::outside_validity(&certified.cert[0]) {
        return Err(TlsError::file(&files.cert, problem));
    }
    let mut roots = RootCertStore::empty();
    for ca in certificates(&files.ca)? {
        roots
            .add(ca)
            .map_err(|error| TlsError::file(&files.ca, format!("not a CA certificate: {error}")))?;
    }
    let roots = Arc::new(roots);
    let certified = Arc::new(certified);
    let server = server_config(&provider, &roots, &certified, client_auth, &[b"h2"])?;
    let admin = server_config(
        &provider,
        &roots,
        &certified,
        ClientAuth::Optional,
        &[b"h2", b"http/1.1"],
    )?;
    let signer_chain = crate::statement::encode_chain(&certified.cert).into();
    Ok(Loaded {
        identity,
        certified,
        signer_chain,
        roots,
        server,
        admin,
    })
}

/// A server configuration: TLS 1.3, `certified` presented, clients' certificates checked
/// against `roots` (required or not), `alpn` offered.
fn server_config(
    provider: &Arc<CryptoProvider>,
    roots: &Arc<RootCertStore>,
    certified: &Arc<CertifiedKey>,
    client_auth: ClientAuth,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(roots), Arc::clone(provider));
    let verifier = match client_auth {
        ClientAuth::Required => verifier,
        ClientAuth::Optional => verifier.allow_unauthenticated(),
    }
    .build()
    .map_err(|error| TlsError::Invalid(format!("client verifier: {error:?}")))?;
    let mut server = ServerConfig::builder_with_provider(Arc::clone(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("ring supports TLS 1.3")
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(Arc::new(SingleCertAndKey::from(Arc::clone(certified))));
    server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(server))
}

/// Every certificate in a PEM file; at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(|error| TlsError::file(path, error))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| TlsError::file(path, error))?;
    if certificates.is_empty() {
        return Err(TlsError::file(path, "no certificate in it"));
    }
    Ok(certificates)
}
