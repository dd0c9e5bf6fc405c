//! Starting and calling retrychain the way its users do: the one launcher of `up`, the
//! experiments and the benchmarks, and the one way to build a Charge.
//!
//! # Layout
//!
//! - [`launch`]: services and whole chains as child processes of the `retrychain` binary,
//!   waiting until they serve, and `up`'s supervision.
//! - [`charge`]: [`charge_request`], a Charge call with its key, deadline and retry mode.

pub mod charge;
pub mod launch;

pub use charge::charge_request;
pub use launch::{
    ChainOptions, ChildService, LocalChain, Logs, ServiceAddr, connect, serving, with_chain,
};
