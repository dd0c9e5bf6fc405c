//! The design notes' experiments, each a command of the `retrychain` binary that returns a
//! typed report (printed as a table, or as JSON by serde with `--json`).
//!
//! # Layout
//!
//! - [`demo`]: the scenarios measured on running services (243 against 3, the lost reply,
//!   the outage, jitter, clients that retry too).
//! - [`storm`]: load against a chain: success, amplification, throughput, latency.
//! - [`metastable`]: load at 0.8× capacity, a trigger, and whether goodput comes back
//!   once it is gone, per retry mode (the demo's scenario g).
//! - [`chart`]: a storm's per-second samples as an SVG chart.
//! - [`sim`]: the simulations, on the resilience crate's own backoff and budget code.
//!
//! Chains are started with `retrychain-harness`, the one launcher.

pub mod chart;
pub mod demo;
pub mod metastable;
pub mod sim;
pub mod storm;
