//! Callers told apart, and how many calls each holds: the fair shares of a limit.

use std::{
    hash::{Hash, Hasher},
    sync::atomic::{AtomicU32, AtomicUsize, Ordering},
};

use crate::wire;

/// Which class a call is admitted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// A caller's first attempt.
    First,
    /// A retry or a hedge (`grpc-previous-rpc-attempts` ≥ 1): refused first.
    Retry,
}

impl Priority {
    /// The class of a request by its headers.
    pub fn of(headers: &http::HeaderMap) -> Self {
        if wire::previous_attempts(headers) > 0 {
            Priority::Retry
        } else {
            Priority::First
        }
    }
}

/// A caller, as admission tells callers apart (a hash of its credentials or connection;
/// see [`AdmissionLayer::keyed_by`](super::AdmissionLayer::keyed_by)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallerKey(pub u64);

impl CallerKey {
    /// The key of anything hashable (a token's bytes, an identity, a connection's number).
    pub fn of(value: impl Hash) -> Self {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        value.hash(&mut hasher);
        Self(hasher.finish())
    }
}

/// How many counters [`Holdings`] keeps.
pub(super) const HOLDING_SLOTS: usize = 4096;

/// Calls in flight per caller, without a lock: every admitted call and every answer
/// counts here, and a lock taken that often was where refusals waited (a holder
/// preempted on a busy core held up the refusals behind it: at 1,500 calls in flight the
/// edge's refusals took 5 ms at p99 instead of 0.1). A caller's key picks one of
/// [`HOLDING_SLOTS`] counters; two callers whose keys pick the same one share it, and its
/// share (one chance in 4,096 for two callers; more, as with any hash, for thousands).
#[derive(Debug)]
pub(super) struct Holdings {
    /// Calls held, per slot.
    slots: Box<[AtomicU32]>,
    /// Slots holding at least one call: the callers competing now.
    active: AtomicUsize,
}

impl Holdings {
    pub(super) fn new() -> Self {
        Self {
            slots: (0..HOLDING_SLOTS).map(|_| AtomicU32::new(0)).collect(),
            active: AtomicUsize::new(0),
        }
    }

    pub(super) fn slot(&self, caller: CallerKey) -> &AtomicU32 {
        &self.slots[(caller.0 % HOLDING_SLOTS as u64) as usize]
    }

    pub(super) fn held(&self, caller: CallerKey) -> u32 {
        self.slot(caller).load(Ordering::Acquire)
    }

    /// One more call of `caller`.
    pub(super) fn take(&self, caller: CallerKey) {
        if self.slot(caller).fetch_add(1, Ordering::AcqRel) == 0 {
            self.active.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// One more call of `caller` if it holds fewer than its share of `fit` (divided among
    /// the callers holding calls, itself included); whether it was taken. Checked and
    /// counted in one compare-and-swap: two calls of one caller at once cannot both take
    /// its last place.
    pub(super) fn take_if_under_share(&self, caller: CallerKey, fit: usize) -> bool {
        let slot = self.slot(caller);
        let mut held = slot.load(Ordering::Acquire);
        loop {
            let active = self.active.load(Ordering::Acquire) + usize::from(held == 0);
            if held as usize >= (fit / active.max(1)).max(1) {
                return false;
            }
            match slot.compare_exchange_weak(held, held + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    if held == 0 {
                        self.active.fetch_add(1, Ordering::AcqRel);
                    }
                    return true;
                }
                Err(now) => held = now,
            }
        }
    }

    /// One call of `caller` answered.
    pub(super) fn give_back(&self, caller: CallerKey) {
        if self.slot(caller).fetch_sub(1, Ordering::AcqRel) == 1 {
            self.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
