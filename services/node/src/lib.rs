//! What every retrychain service shares to serve, whatever its role. The values its
//! requests carry (the key, the account, the amount, the caller, the retry mode, the trace
//! context) are `retrychain-domain`'s.
//!
//! # Layout
//!
//! - [`stats`]: [`Counters`], which are also the retry loops' observer.
//! - [`metrics`]: the same counters (and a few gauges) as Prometheus metrics on the admin
//!   port's `/metrics`.
//! - [`faults`]: [`FaultSwitch`], the fault knobs on a service's downstream call.
//! - [`node`]: [`Node`], what one service's parts share: name, counters, faults, policy.
//! - [`control`]: the `Control` gRPC service over a [`Node`].
//! - [`limits`]: what a port facing untrusted clients bounds below gRPC: connections,
//!   silent connections, metadata size.
//! - [`statement`]: the edge's signed statement of each call's caller, checked by the
//!   ledger.
//! - [`rpc`]: [`RpcScope`], the first and last thing every Payments handler does.
//! - [`server`]: [`serve`], the one server stack all five services run, on a public and
//!   an admin port.
//! - [`h2`]: the public port's HTTP/2 server: hyper with tonic's services inside, without
//!   tonic's per-request timeout layer (the deadline is kept once, by the node's own).
//! - [`telemetry`]: log set-up.
//! - [`log_writer`]: where log lines go: stdout, in batches, from a thread of their own.

pub mod admin_tls;
pub mod authz;
pub mod callers;
pub mod control;
pub mod faults;
pub mod h2;
pub mod limits;
pub mod log_writer;
pub mod metrics;
pub mod node;
pub mod rpc;
pub mod server;
pub mod statement;
pub mod stats;
pub mod telemetry;

pub use faults::FaultSwitch;
pub use node::{Node, NodeConfig, Statements};
pub use rpc::RpcScope;
pub use server::{
    DRAIN_GRACE, Listeners, PaymentsService, READY_PREFIX, ReadyAddrs, ServeError, decoding,
    default_admin_addr, serve, shutdown_signal,
};
pub use stats::Counters;
