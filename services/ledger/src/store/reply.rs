//! What a charge comes to: the reply the ledger answers with, and what phase 2 saves on
//! the key to rebuild it for a replay. A leaf: the protocol's outcome in the ledger's terms.

use uuid::Uuid;

/// A committed charge's reply, as saved on its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedReply {
    /// The charge's id.
    pub charge_id: Uuid,
    /// The account charged.
    pub account_id: String,
    /// The amount charged.
    pub amount_cents: i64,
    /// The balance right after the charge.
    pub balance_cents: i64,
}

/// What a charge request came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// This request finished the charge (a fresh key, or one it resumed).
    Executed(SavedReply),
    /// The key was settled with the same parameters: its saved reply, nothing charged.
    Replayed(SavedReply),
}

/// What phase 2 saves on a key: the charge's id and the balance right after it (the
/// account and the amount are the key's scope and fingerprint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// The charge's id.
    pub charge_id: Uuid,
    /// The balance after it.
    pub balance_cents: i64,
}
