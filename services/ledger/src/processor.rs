//! The payment processor, simulated in process. Its calls are the "bottom calls" whose
//! count shows how retries multiply; it obeys the ledger's faults.

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};

use resilience::Attempt;
use retrychain_node::{IdempotencyKey, Node, faults::failure};
use tonic::{Code, Status};

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
    pub async fn charge(&self, attempt: Attempt, key: &IdempotencyKey) -> Result<(), Status> {
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
