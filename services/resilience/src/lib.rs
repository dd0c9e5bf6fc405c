//! The reusable core of retrychain: everything a retry decision needs, and nothing about
//! payments. Any tonic unary client can use it.
//!
//! # Layout
//!
//! - [`deadline`]: `grpc-timeout` parsing and formatting, [`Deadline`], and the
//!   strictly-shorter deadline handed downstream.
//! - [`backoff`]: the five backoff policies of the design notes.
//! - [`budget`]: [`RetryBudget`], the token bucket that caps retries per process.
//! - [`classify`]: which status codes are retryable; `grpc-retry-pushback-ms`.
//! - [`throttle`]: [`Throttle`], what limits retries across calls: our [`RetryBudget`] or
//!   gRFC A6's [`A6Throttle`].
//! - [`rules`]: the decision after a failed attempt (retryable? attempts left? pushback,
//!   backoff, deadline room, throttle), shared by both retry loops.
//! - [`observe`]: [`RetryObserver`], what both loops report, for counters and logs.
//! - [`retry`]: [`Retry`], the executor that runs attempts of any async call under a
//!   [`RetryPolicy`] (the ledger's processor, the simulations).
//! - [`client`]: [`RetryLayer`], gRFC A6 retries as a tower layer over any tonic client
//!   (a `Channel`), configured by a service config.
//! - [`service_config`]: [`ServiceConfig`], the gRPC service config JSON (retry policy,
//!   throttling, timeouts as data), parsed and validated.
//! - [`layer`]: [`DeadlineLayer`], the tower layer that gives each server request its
//!   deadline and answers DEADLINE_EXCEEDED (never CANCELLED) when it is spent.
//! - [`propagate`]: the client layers that hand every downstream call the served
//!   request's deadline, shortened, and its chosen headers.

pub mod backoff;
pub mod budget;
pub mod classify;
pub mod client;
pub mod deadline;
pub mod layer;
pub mod observe;
pub mod propagate;
pub mod retry;
pub mod rules;
pub mod service_config;
pub mod throttle;

pub use backoff::{Backoff, BackoffKind, BackoffSchedule};
pub use budget::RetryBudget;
pub use classify::{Pushback, is_retryable, pushback, set_pushback};
pub use client::RetryLayer;
pub use deadline::{Deadline, NoRoom, format_grpc_timeout, parse_grpc_timeout};
pub use layer::{DeadlineLayer, IncomingDeadline};
pub use observe::{AttemptInfo, Refusal, RetryObserver};
pub use propagate::{CarryHeadersLayer, ForwardHeadersLayer, PropagateDeadlineLayer};
pub use retry::{Attempt, Retry, RetryPolicy};
pub use rules::StopReason;
pub use service_config::{ConfigError, ServiceConfig};
pub use throttle::{A6Throttle, Throttle};
