//! The end-to-end tests, one binary, a module per behaviour (as zero2prod's `tests/api/`):
//! real services over TCP, real Postgres, real processes where a crash, a signal, a log or
//! the environment is the point, grpcurl and grpcio where users meet the chain. What they
//! share is in [`support`]: a database per test and the harness's chains with the tests'
//! defaults.
//!
//! `cargo test --test e2e` runs them all; `-- chain::` one module; `-- deployment::` the
//! tests written against a running deployment (`scripts/test`, `scripts/compose-test`).

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod support;

mod chain;
mod chaos;
mod compose;
mod connections;
mod crash;
mod demo;
mod failover;
mod faults;
mod grpcio;
mod grpcurl;
mod ledger;
mod load;
mod logs;
mod metrics;
mod newcomer;
mod otel;
mod overload;
mod phases;
mod pool;
mod replicas;
mod service_config;
mod sim;
mod storm;
mod tls;
