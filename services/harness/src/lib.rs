//! Starting and calling retrychain the way its users do: the one launcher of `up`, the
//! experiments, the benchmarks and the tests, one client named by intent, and the one way
//! to build a Charge.
//!
//! # Layout
//!
//! - [`addr`]: where services answer ([`ServiceAddr`], [`ChainAddrs`]), connecting, the
//!   health check.
//! - [`process`]: a service as a child process ([`ChildService`]): logs routed or
//!   captured, crash, signal, restart on the same ports.
//! - [`in_process`]: a service in this runtime ([`InProcessService`]), started from the
//!   same flags by `retrychain-serve`.
//! - [`chain`]: five of either, bottom-up, on their own database ([`LocalChain`],
//!   [`InProcessChain`]); `up`'s supervision; [`with_chain`].
//! - [`database`]: the database a chain starts for itself: one throwaway cluster or a
//!   pg_auto_failover formation ([`Postgres`]).
//! - [`client`]: [`ChainClient`], a chain's caller: charge, faults, counters.
//! - [`faults`]: the faults a chain is put through, by name.
//! - [`charge`]: [`charge_request`], a Charge call with its key, deadline and retry mode.
//! - [`tls`]: a chain over TLS ([`ChainTls`]): a throwaway authority, every tier's
//!   certificate, channels that speak it.

pub mod addr;
pub mod chain;
pub mod charge;
pub mod client;
pub mod database;
pub mod faults;
pub mod in_process;
pub mod process;
pub mod tls;

pub use addr::{ChainAddrs, NAMES, ServiceAddr, connect, connect_as, serving, serving_tls};
pub use chain::{ChainSpec, InProcessChain, LocalChain, with_chain};
pub use charge::charge_request;
pub use client::ChainClient;
pub use database::{OwnDatabase, Postgres};
pub use in_process::InProcessService;
pub use process::{ChildService, Launch, Logs};
pub use tls::ChainTls;
