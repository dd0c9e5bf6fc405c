//! A throwaway PostgreSQL cluster, started from the server binaries (`initdb`, `postgres`,
//! `pg_ctl`), for the end-to-end tests and for `retrychain up` when no `DATABASE_URL` is
//! given.
//!
//! The binaries are looked for where installations put them ([`find_bindir`]): on PATH,
//! then in `pg_config --bindir`, then in the newest `/usr/lib/postgresql/<major>/bin`
//! (Debian's `postgresql` package puts them there, not on PATH).
//!
//! The tests also break the server on purpose: [`TempCluster::restart_server`],
//! [`TempCluster::stop_server`] and [`TempCluster::start_server`] keep the data directory
//! and port, as an operator's `pg_ctl` would.
//!
//! Postgres refuses to run as root, and CI runs as root; so when this process is root the
//! cluster's files are handed to an unprivileged user (`postgres` if it exists, else
//! `nobody`) and both binaries run as that user.
//!
//! Clean-up does not depend on destructors running. Beside the server runs a small guardian
//! shell that waits on a pipe from this process; when the pipe closes — on
//! [`TempCluster::stop`], on drop, or because this process died — the guardian shuts the
//! server down and removes its directory. A test binary that keeps one cluster in a static
//! therefore leaves nothing behind.
//!
//! [`HaFormation`] is the highly-available variant: two servers under pg_auto_failover, for
//! the failover tests.

mod cluster;
mod error;
pub mod ha;
mod host;

pub use cluster::{Options, ServerTls, TempCluster};
pub use error::Error;
pub use ha::HaFormation;
pub use host::{find_bindir, find_bindir_in};
