//! Why a throwaway cluster or formation could not be started.

use std::time::Duration;

/// Why the cluster could not be started.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No directory holds the server binaries.
    #[error(
        "the PostgreSQL server binaries (initdb, postgres, pg_ctl) were not found: looked on PATH, in `pg_config --bindir` and in /usr/lib/postgresql/*/bin. Install the server package (Debian: apt-get install postgresql), or set DATABASE_URL to a server of your own, or run the chain with docker-compose up"
    )]
    NotFound,
    /// A binary could not be run.
    #[error("could not run {program}: {source}")]
    Spawn {
        /// The binary.
        program: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// initdb ran and failed.
    #[error("initdb failed: {0}")]
    Initdb(String),
    /// The server did not become ready.
    #[error("postgres did not start within {timeout:?}; its log says:\n{log}")]
    NotReady {
        /// How long we waited.
        timeout: Duration,
        /// The server's log.
        log: String,
    },
    /// `pg_ctl` failed to stop or start the server.
    #[error("pg_ctl {action} failed: {output}")]
    PgCtl {
        /// stop, start or restart.
        action: &'static str,
        /// What it printed.
        output: String,
    },
    /// `pg_autoctl` is not on PATH (only [`ha::HaFormation`] needs it).
    #[error(
        "pg_autoctl was not found on PATH: install pg_auto_failover (Debian: apt-get install postgresql-15-auto-failover)"
    )]
    NoAutoFailover,
    /// Preparing the directory failed.
    #[error("preparing the cluster directory: {0}")]
    Io(#[from] std::io::Error),
}
