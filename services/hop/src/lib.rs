//! The edge and the relays: the four services that forward `Payments` calls downstream.
//!
//! Both roles are one type, [`Hop`]; they differ only where the contract says:
//!
//! | | edge | relay (hop2, hop3, hop4) |
//! |---|---|---|
//! | no `idempotency-key` | generates a UUID, returns it | INVALID_ARGUMENT |
//! | `x-retry-mode` | honoured and passed on only with `--allow-retry-mode-override` | the same |
//! | `edge-only` mode | retries, under the retry budget | tries once |
//! | `every-layer` mode | retries, no budget | retries, no budget |
//! | the caller is retrying (its previous attempts ≥ 1, gRFC A6) | tries once | as its mode says |
//! | gave up after retrying, or a retry was refused | answers with a pushback of -1 | passes on the pushback from below |
//!
//! The last two rows make "retry at one layer" hold when the client retries too: a gRFC A6
//! client (grpc-go, grpc-java, gRPC core) obeys a negative pushback by not retrying, and one
//! that retries anyway gets a single attempt per retry instead of another round.
//!
//! A hop is a tonic client with layers: the handler builds the downstream call and relays
//! the answer; the [`Downstream`] stack does the rest — every call gets a
//! strictly shorter deadline than the one received, the same idempotency key, the same
//! trace id, and the retry policy of the request's [`Plan`].
//!
//! The edge decodes each message ([`Payments`](retrychain_proto::v1::payments_server::Payments)): it refuses bad input before anything
//! below works on it, and signs a statement of the call's caller, account and amount. A
//! relay ([`Forwarding`]) forwards the message in the frames it came in, without gRPC's codec:
//! it acts on metadata alone, and the ledger decodes the message again before it acts on
//! it.

mod hop;

pub use hop::{ByPlan, Downstream, Faults, Hop, HopSettings, Plan, Role, forward::Forwarding};
