//! The reusable core of retrychain: everything a retry decision needs, and nothing about
//! payments. Any tonic unary client can use it.
//!
//! # Layout
//!
//! - [`wire`]: every header name, parse and format, and the status codes' names: the only
//!   place text meets the types below.
//! - [`deadline`]: [`Deadline`], [`CallDeadline`], and the strictly-shorter deadline handed
//!   downstream.
//! - [`backoff`]: the five backoff policies of the design notes.
//! - [`budget`]: [`RetryBudget`], the token bucket that caps retries per process.
//! - [`throttle`]: [`Throttle`], what limits retries across calls: our [`RetryBudget`] or
//!   gRFC A6's [`A6Throttle`], or Google SRE's [`AdaptiveThrottle`].
//! - [`classify`]: which codes are retryable; which errors prove a call never left.
//! - [`service_config`]: [`ServiceConfig`], the gRPC service config JSON (retry policy,
//!   hedging, throttling, timeouts as data), parsed and validated once: the one policy value.
//! - [`rules`]: the decision after a failed attempt (retryable? attempts left? pushback,
//!   backoff, deadline room, throttle) and the stop reasons.
//! - [`observe`]: [`RetryObserver`], what the engine reports, for counters and logs.
//! - [`engine`]: the one retry loop, for any kind of call ([`Attempt`]).
//! - [`replay`]: a gRPC call's body buffered once and replayed per attempt.
//! - [`hedge`]: gRFC A6 hedging on the engine's parts.
//! - [`balance`]: [`Balancer`], the bottom of a hop's downstream stack: the replicas of
//!   the service below (URLs or a DNS name, followed), power of two choices over a
//!   peak-EWMA load, and a retry sent to a replica the call has not tried.
//! - [`client`]: [`RetryLayer`], the engine's face: a tower layer over any tonic client,
//!   and [`client::RetryCalls`] over an in-process service.
//! - [`admission`]: [`ConcurrencyLimit`], admission in front of a server: a call is
//!   refused at once when, at the rate the server drains its calls now, it could not be
//!   answered within its deadline; fairly between callers, retries before first attempts.
//! - [`server_deadline`]: [`DeadlineLayer`], the tower layer that gives each server
//!   request its deadline and answers DEADLINE_EXCEEDED (never CANCELLED) when it is spent.
//! - [`propagate`]: [`PropagateDeadlineLayer`], which hands every downstream call the
//!   served request's deadline, shortened.

pub mod admission;
pub mod backoff;
pub mod balance;
pub mod budget;
pub mod classify;
pub mod client;
pub mod deadline;
pub mod engine;
pub mod hedge;
pub mod observe;
pub mod propagate;
pub mod replay;
pub mod rules;
pub mod server_deadline;
pub mod service_config;
pub mod throttle;
pub mod wire;

pub use admission::{
    AdmissionLayer, AdmissionSettings, Ask, CallerKey, ConcurrencyLimit, KeyOf, Priority,
};
pub use backoff::{Backoff, BackoffKind, BackoffSchedule};
pub use balance::{BalanceSettings, Balancer, Downstream, Tried};
pub use budget::RetryBudget;
pub use classify::is_retryable;
pub use client::{AttemptRequest, CallRequest, RetryCalls, RetryLayer};
pub use deadline::{CallDeadline, Deadline, NoRoom, PerAttemptTimeout};
pub use engine::Attempt;
pub use observe::{AttemptInfo, Refusal, RetryObserver, TRACE_ONLY};
pub use propagate::PropagateDeadlineLayer;
pub use rules::StopReason;
pub use server_deadline::{DeadlineLayer, IncomingDeadline};
pub use service_config::{ConfigError, ServiceConfig};
pub use throttle::{A6Throttle, AdaptiveThrottle, Throttle};
