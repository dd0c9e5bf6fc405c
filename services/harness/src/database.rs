//! The database a chain starts for itself when it is given none: one throwaway cluster, or
//! a pg_auto_failover formation to fail over ([`Postgres`]); removed when the chain stops.

use anyhow::Context;

/// Which Postgres a chain starts when no database URL is given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Postgres {
    /// One throwaway cluster ([`tempgres::TempCluster`]).
    #[default]
    Single,
    /// A pg_auto_failover formation: a monitor, a primary and a synchronous standby
    /// ([`tempgres::HaFormation`]); the ledger gets its multi-host URL and follows the
    /// primary through a failover.
    Ha,
}

/// The database a chain started, held until the chain stops.
#[derive(Debug)]
pub enum OwnDatabase {
    /// One cluster.
    Single(tempgres::TempCluster),
    /// A formation.
    Ha(tempgres::HaFormation),
}

impl OwnDatabase {
    /// Starts the `kind` of database (it blocks: run it off the runtime). With `tls`, every
    /// server speaks TLS with the certificate `tls` holds for `postgres`, and the URL asks
    /// for `sslmode=verify-full` against the chain's authority: one cluster accepts TCP
    /// only over TLS; a formation's own connections (node to monitor, standby to primary)
    /// check the same certificate.
    pub fn start(kind: Postgres, tls: Option<&crate::ChainTls>) -> anyhow::Result<Self> {
        let tls = tls.map(|tls| {
            let own = tls.files_of(crate::tls::POSTGRES);
            tempgres::ServerTls {
                cert: own.cert,
                key: own.key,
                ca: own.ca,
            }
        });
        Ok(match kind {
            Postgres::Single => Self::Single(
                tempgres::TempCluster::start_with(&tempgres::Options {
                    tls,
                    ..tempgres::Options::default()
                })
                .context("starting a throwaway Postgres (or set DATABASE_URL)")?,
            ),
            Postgres::Ha => Self::Ha(
                tempgres::HaFormation::start_with(tls.as_ref())
                    .context("starting a pg_auto_failover formation (or set DATABASE_URL)")?,
            ),
        })
    }

    /// The URL the ledger connects with (several hosts for a formation).
    pub fn url(&self) -> String {
        match self {
            Self::Single(cluster) => cluster.url("postgres"),
            Self::Ha(formation) => formation.uri(),
        }
    }

    /// What a user of `up` needs to know about it: where it is, and for a formation how to
    /// watch it and fail it over.
    pub fn describe(&self) -> String {
        match self {
            Self::Single(cluster) => format!(
                "throwaway cluster on 127.0.0.1:{} (removed on exit){}",
                cluster.port(),
                if cluster.url("postgres").contains("sslmode=verify-full") {
                    "; TLS only, the ledger checking its certificate and name (verify-full)"
                } else {
                    ""
                }
            ),
            Self::Ha(formation) => format!(
                "pg_auto_failover formation (removed on exit){}, the ledger on\n  {}\n\
                 watch it:     {}\n\
                 fail over:    {}\n\
                 switch over:  {}",
                if formation.uri().contains("sslmode=verify-full") {
                    " over TLS (every server's certificate and name checked: verify-full)"
                } else {
                    ""
                },
                formation.uri(),
                formation.command_line(&["show", "state", "--watch"]),
                formation.command_line(&["perform", "failover"]),
                formation.command_line(&["perform", "switchover"]),
            ),
        }
    }

    /// Stops it and removes its files (it blocks: run it off the runtime).
    pub fn stop(self) {
        match self {
            Self::Single(cluster) => cluster.stop(),
            Self::Ha(formation) => drop(formation),
        }
    }
}
