//! One way to start a retrychain service: from the flags of `edge`, `relay` or `ledger`,
//! as a process of its own (the binary) or in the caller's runtime (the harness's
//! in-process chains, the demo's extra edges) — the same parsing, the same building.
//!
//! # Layout
//!
//! - [`args`]: the flags (clap, every flag also an environment variable).
//! - [`start()`]: bind, build, then [`Started::serve`] until the shutdown future completes;
//!   [`run`] is that for a process, with its logging, on the [`runtime()`] its flags ask for.

pub mod args;
mod start;

pub use args::{ServiceCli, ServiceCommand};
pub use start::{Serving, Started, run, runtime, start};
