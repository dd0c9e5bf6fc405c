//! The payment processor, simulated in process. Its calls are the "bottom calls" whose
//! count shows how retries multiply; it obeys the ledger's faults.

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};

use resilience::Attempt;
use retrychain_node::{AccountId, IdempotencyKey, Node, faults::failure};
use tonic::{Code, Status};

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

/// A processor that succeeds unless the faults say otherwise.
#[derive(Debug)]
pub struct Processor {
    /// The ledger's node: its faults steer this processor.
    node: Arc<Node>,
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
    /// A processor steered by `node`'s faults.
    pub fn new(node: Arc<Node>) -> Self {
        Self {
            node,
            in_flight: AtomicU32::new(0),
        }
    }

    /// One processor call for the charge under `key`: may fail (`fail_rate`), may be busy
    /// (`processor_capacity`), takes `delay_ms`. The retry executor bounds it by the
    /// attempt's timeout. The key goes with the call, as it would to a real processor: if
    /// the ledger's transaction rolls back after the processor succeeded, the retry's
    /// processor call carries the same key and a real processor would not charge again.
    pub async fn charge(&self, attempt: Attempt, key: &ProcessorKey) -> Result<(), Status> {
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
                %key,
                delay_ms = faults.delay_ms,
                "processor working"
            );
            tokio::time::sleep(delay).await;
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
