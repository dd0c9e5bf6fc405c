//! The payment processor, simulated in process, behaving as a provider does. Its calls are
//! the "bottom calls" whose count shows how retries multiply; it obeys the ledger's faults.
//!
//! Like a real provider's idempotency (Stripe's, Adyen's), it remembers every processor
//! key with the parameters it was first called with, in a record of its own that outlives
//! a crash of the ledger ([`record`]: the `processor_charges` table, a provider's database
//! kept in the ledger's for want of a second system, reached through connections of its
//! own, never through the key store):
//!
//! - a repeat with the same parameters is answered as the first call was — it charges
//!   nothing again (the ledger resumes a charge this way after a crash or a timeout);
//! - a repeat with other parameters is refused, FAILED_PRECONDITION, and counted
//!   (`processor_conflicts` on the ledger's Control stats): the ledger binds a key to its
//!   parameters from the first attempt, so it must never happen.
//!
//! The faults, in the order a call meets them: `fail_rate` (the call fails before it
//! reaches the processor: nothing recorded), `processor_capacity` (busy: RESOURCE_EXHAUSTED,
//! nothing recorded), `delay_ms` (the processor's time), the record (the charge happens),
//! `processor_lost_answer_rate` (charged, but the answer is lost: UNAVAILABLE).

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};

use rand::RngExt;
use resilience::{Attempt, Deadline};
use retrychain_domain::{AccountId, IdempotencyKey};
use retrychain_node::{Node, faults::failure, stats::Counters};
use tonic::{Code, Status};

use crate::store::ProcessorCharge;

pub mod record;

pub use record::{ProcessorRecord, RecordOptions};

/// The idempotency key the processor receives: the client's key scoped to its account.
///
/// Our keys are scoped per account (two customers may both send `order-1`), but a real
/// processor keys idempotency per merchant: sent bare, the second customer's `order-1`
/// would get the first one's result. The account goes in front, length-prefixed so that no
/// two (account, key) pairs give the same text: `5:alice:order-1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessorKey(String);

impl ProcessorKey {
    /// The processor key of `key` on `account`.
    pub fn new(account: &AccountId, key: &IdempotencyKey) -> Self {
        let account = account.as_str();
        Self(format!("{}:{account}:{key}", account.len()))
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ProcessorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A processor that charges unless the faults say otherwise; see the module docs.
#[derive(Debug)]
pub struct Processor {
    /// The ledger's node: its faults steer this processor, its counters count conflicts.
    node: Arc<Node>,
    /// Where the processor keeps its record.
    record: ProcessorRecord,
    /// Calls running now, against `processor_capacity`.
    in_flight: AtomicU32,
}

/// Releases a processor slot however the call ends, cancellation included.
struct Slot<'a>(&'a AtomicU32);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Processor {
    /// A processor steered by `node`'s faults, keeping its record through `record`.
    pub fn new(node: Arc<Node>, record: ProcessorRecord) -> Self {
        Self {
            node,
            record,
            in_flight: AtomicU32::new(0),
        }
    }

    /// One processor call: may fail before reaching the processor (`fail_rate`), may find
    /// it busy (`processor_capacity`), takes `delay_ms`, charges (or answers a repeat of a
    /// key as before), may lose its answer. The retry executor bounds it by the attempt's
    /// timeout.
    pub async fn charge(&self, attempt: Attempt, call: &ProcessorCharge) -> Result<(), Status> {
        let name = &self.node.name;
        if let Some(status) = self.node.faults.injected_failure(name) {
            return Err(status);
        }
        let faults = self.node.faults.current();
        let _slot = Slot(&self.in_flight);
        let running = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        if faults.processor_capacity > 0 && running > faults.processor_capacity {
            return Err(failure(
                Code::ResourceExhausted,
                format!(
                    "payment processor busy: it serves {} call(s) at a time",
                    faults.processor_capacity
                ),
                &faults,
            ));
        }
        let delay = std::time::Duration::from_millis(u64::from(faults.delay_ms));
        if !delay.is_zero() {
            tracing::debug!(
                attempt = attempt.number,
                key = %call.key,
                delay_ms = faults.delay_ms,
                "processor working"
            );
            tokio::time::sleep(delay).await;
        }
        let deadline = attempt.deadline.map_or_else(
            || Deadline::after(std::time::Duration::from_secs(5)),
            Deadline::at,
        );
        let first_amount = self.record.record(call, deadline).await?;
        if first_amount != call.amount_cents {
            Counters::bump(&self.node.counters.processor_conflicts);
            return Err(Status::failed_precondition(format!(
                "payment processor: key {} was first used with amount_cents={first_amount}, this call has amount_cents={}; refused",
                call.key, call.amount_cents
            )));
        }
        let lost = faults.processor_lost_answer_rate;
        if lost > 0.0 && rand::rng().random_bool(lost.min(1.0)) {
            return Err(Status::unavailable(
                "payment processor: the call's answer was lost (it charged); retry with the same key",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processor_keys_are_scoped_to_the_account_and_unambiguous() {
        let key = IdempotencyKey::parse("order-1").expect("key");
        let alice = AccountId::parse("alice").expect("account");
        let bob = AccountId::parse("bob").expect("account");
        assert_eq!(ProcessorKey::new(&alice, &key).as_str(), "5:alice:order-1");
        assert_ne!(
            ProcessorKey::new(&alice, &key),
            ProcessorKey::new(&bob, &key)
        );
        // "a:b" + "c" and "a" + "b:c" must differ.
        let left = ProcessorKey::new(
            &AccountId::parse("a:b").expect("account"),
            &IdempotencyKey::parse("c").expect("key"),
        );
        let right = ProcessorKey::new(
            &AccountId::parse("a").expect("account"),
            &IdempotencyKey::parse("b:c").expect("key"),
        );
        assert_ne!(left, right);
    }
}
