//! Admission: refuse at the door, at once, only what cannot be served within its deadline,
//! fairly between callers, retries before first attempts.
//!
//! # Why
//!
//! A server that admits everything up to a fixed, generous number queues the excess of an
//! overload inside itself, where each queued call holds memory and everything below it,
//! and fails only when its deadline runs out; retries of those failures arrive on top.
//! That is the metastable failure this project is about. But a limit that follows latency
//! (Netflix's Gradient2, which this module used before, and Envoy's adaptive concurrency
//! filter) refuses as soon as calls queue at all, and queueing is not by itself overload:
//! measured on this chain, with 256 charges in flight and 5 s deadlines it served 47% where
//! admitting everything served 100% at a third more charges a second, every one well within
//! its deadline. What makes a call worth refusing is that it cannot be answered in time.
//!
//! # The decision
//!
//! Each call is predicted its time here from how fast this server drains its calls now, and
//! admitted when the prediction fits the time it has (CoDel's question — how long has the
//! queue made calls wait? — asked before the call joins it, as DAGOR and Breakwater do):
//!
//! ```text
//! every window (≥ 10 ms and ≥ 8 answers):
//!   per_call ← Σ latency / Σ calls in flight when each was admitted, over the calls
//!              served and dropped (over all if most failed: a figure of failures);
//!              if higher (at once), else an EWMA toward it (seconds each call in flight
//!              adds: 1 / drain rate), at once too if the last figure was of failures
//! a call arriving with n − 1 in flight:
//!   predicted = n × per_call
//!   budget    = min(its timeout − the server's reserve, the latency objective) × headroom
//!   admit when predicted ≤ budget (a retry or hedge: ≤ budget × retry_share),
//!   always while n ≤ min_limit, never past max_limit (the memory bound)
//! ```
//!
//! `per_call` is Little's law read off the calls themselves: a saturated server that drains
//! X calls a second answers a call admitted behind n others after about n / X; one that is
//! not saturated answers in its base latency whatever n is, and the estimate says so (its
//! ratio is base / n̄). Nothing has to be tuned to the machine or the load, and a deadline
//! that leaves room is never a reason to refuse.
//!
//! **At the door.** The edge admits with `headroom` 0.5, the services behind it with 1.0:
//! the edge's prediction includes every service below it (its latency is theirs plus its
//! own), so what it admits fits their deadlines too, with room left for a stall after
//! admission (a ledger session killed, a starved core), and a service below refuses only
//! what the edge misjudged. A refusal from below that the edge relays is a **drop**: a
//! sample as slow as the call's whole budget (it did not fit), which raises `per_call` so
//! that the edge refuses the next such call itself.
//!
//! **Waiting at the door.** A first attempt that does not fit now is not refused if it
//! would go in within [`AdmissionSettings::wait_share`] of its time (the edge's
//! `--door-wait-share`: 0 by default, so refused at once; a quarter, say, when switched on):
//! it waits at the door, where it holds nothing below and costs no CPU, in a line served
//! first come first served — only the first is woken as a place comes free, and it keeps
//! its place while it does not fit. Having waited `w`, it is judged by the time it has
//! left, so that waiting never eats the room kept below; so at arrival it may be behind at
//! most what drains in `budget + (1 − headroom) × wait`, and a call behind more is refused
//! at once. The line ahead of it is counted with the callers that pass it: it moves at
//! the share of freed places the line has been getting (callers under their fair share go
//! in past it). A call let wait is served if the chain still drains: once its wait is over
//! it goes in if, at the pace calls were served (not failed below) while it waited, it would be answered
//! within half the time it has left. The estimate cannot tell a stall below (a database
//! session ended, a frozen service) from a quiet moment — it moves only with answers, and
//! a stall is answers that do not come — but the line's own pace can, so a stall refuses
//! the line after its wait instead of forcing it in past its deadline. Otherwise a
//! refusal comes at once. Queueing is not overload, and a
//! refusal is not free: a client that sends again the moment it is refused (one that does
//! not wait out the pushback) turned each such refusal into a loop of refusals on the
//! cores the charges needed.
//!
//! **Fairly.** At the edge each call carries a caller key (the caller's credentials, or
//! without any its connection: see `AdmissionLayer::keyed_by`). While the server is full
//! (a call's prediction does not fit), a caller holding fewer calls than its share —
//! `budget / per_call` calls (what fits) divided among the callers holding calls now — is
//! still admitted, past the line at the door, and a caller at or over its share waits in
//! line or is refused as above: a caller using less than its share is never refused
//! because another uses more, and shares follow the server's capacity, not a fixed number.
//! A caller's calls in line count among what it holds, or a caller with calls in line
//! would go past them with each call it sends as one of its calls is answered. Past 90% of `max_limit`, only callers under their share
//! are admitted, so the memory bound is not reached by one caller either.
//!
//! **Retries and hedges** (an attempt carrying `grpc-previous-rpc-attempts` ≥ 1) are
//! admitted only while their prediction fits [`AdmissionSettings::retry_share`] of their
//! budget (75%), and never under the fair-share exception: under overload they go first.
//!
//! # The refusal
//!
//! UNAVAILABLE at once (the message says overloaded; an A6 client retries UNAVAILABLE), with
//! `grpc-retry-pushback-ms` set to how much longer than its budget the call was predicted
//! to take (at least 1 ms): when about that much of the backlog will have drained. The
//! answer is marked [`wire::OVERLOADED`](crate::wire::OVERLOADED) so that a balancer above takes it as load, not a
//! fault. It comes before the call is authorised, its caller's token verified, its
//! metadata checked or its message decoded: a refusal costs the server microseconds.
//!
//! "At once" needs care with the request's body. Answered while the request's stream is
//! still open (its message not yet read), and with the body dropped, HTTP/2 (the `h2`
//! crate) resets the stream — a reset the server makes, which it counts against the
//! connection's allowance for protocol errors (the defence against "rapid reset" floods).
//! Under a sustained overload that allowance runs out and the whole connection is closed
//! (ENHANCE_YOUR_CALM), failing every call on it. So a refusal reads the body to its end
//! first, in a task of its own, for at most [`DRAIN_WITHIN`], while the refusal goes out at
//! once.
//!
//! # What is a sample
//!
//! The time from admission to the answer's headers, with the calls in flight when it was
//! admitted, for every answer but CANCELLED (the caller left; the time says nothing about
//! the server), a refusal before any work (bad arguments, credentials, method) and an
//! error of the layers below (no answer). It is one of three kinds ([`Outcome`]):
//!
//! - **served**: its time is the drain's;
//! - **dropped** (refused below for overload): twice its whole budget (see
//!   [`Admitted::dropped`]);
//! - **failed** below (unavailable, out of time, internal): its time may be the drain's (a
//!   call that queued until its deadline) or mostly what failing took — a refused
//!   connection, the backoff between retries below — which does not grow with the calls
//!   in flight. A window's failures count only when they are most of it (a stall or a
//!   slowdown, which admission must learn of, or an outage): a figure of failures. The
//!   first window of mostly calls served replaces it at once, and once no call is in
//!   flight it goes back to the last figure that was not, taken as measured at no more
//!   than `min_limit` calls in flight, so trusted to twice that ([`Drain::idle`]).
//!   Before, an every-layer outage left the edge's estimate at about 0.44 s a call in
//!   flight for as long as the EWMA took to forget it: the edge refused 453–998 of the
//!   next 5 s's charges at 32 in flight, which the chain then served in milliseconds.

mod drain;
mod fairness;
mod layer;
mod limit;
mod settings;
#[cfg(test)]
mod tests;

pub use drain::{Drain, Outcome};
pub use fairness::{CallerKey, Priority};
pub use layer::{Admission, AdmissionLayer, DRAIN_WITHIN, KeyOf};
pub use limit::{Admitted, Ask, ConcurrencyLimit, DROP_PENALTY, Entry, GROWTH};
pub use settings::{AdmissionSettings, InvalidAdmission};
