//! What happened, as the client saw it: every operation the workload made (invoked,
//! completed, with what and how it ended) and every fault the nemesis put in and took out.
//! The checker decides from this history and a read of the database alone.

use serde::{Deserialize, Serialize};

/// One operation, invoked and completed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Op {
    /// Unique in the run, in invocation order.
    pub id: u64,
    /// The worker that made it (one operation at a time each).
    pub worker: u32,
    /// What was asked.
    pub request: Request,
    /// When it was invoked and when it completed, ms from the start of the run.
    pub invoked_ms: f64,
    /// …
    pub completed_ms: f64,
    /// Its deadline, ms.
    pub deadline_ms: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// During the faults, or after them (re-sending every key until it settled).
    pub phase: Phase,
}

impl Op {
    /// How long it took, ms.
    pub fn took_ms(&self) -> f64 {
        self.completed_ms - self.invoked_ms
    }
}

/// What an operation asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Request {
    /// A Charge.
    Charge {
        /// The account.
        account: String,
        /// The idempotency key.
        key: String,
        /// The amount.
        amount_cents: i64,
        /// `x-retry-mode`, if one was sent.
        mode: Option<String>,
    },
    /// A GetAccount.
    Read {
        /// The account.
        account: String,
    },
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Outcome {
    /// A Charge answered OK.
    Charged {
        /// The charge's id.
        charge_id: String,
        /// The amount the reply says.
        amount_cents: i64,
        /// The balance the reply says.
        balance_cents: i64,
        /// `idempotent-replayed: true`.
        replayed: bool,
    },
    /// A GetAccount answered OK (or NOT_FOUND: balance 0, no charges).
    Read {
        /// The balance.
        balance_cents: i64,
        /// The charges.
        charges: i64,
    },
    /// No answer by the deadline and a grace after it: the call never ended. Allowed only
    /// while a fault silenced the edge.
    Unanswered,
    /// The connection to the edge broke before an answer: tonic's client made up an
    /// UNKNOWN or CANCELLED of its own (hyper's "operation was canceled", "transport
    /// error"). Allowed only while a fault silenced the edge (killed, stopped, frozen).
    ConnectionLost {
        /// What tonic said.
        detail: String,
    },
    /// A failure: its gRPC code (by name) and message.
    Failed {
        /// E.g. `UNAVAILABLE`.
        code: String,
        /// The status message.
        message: String,
    },
}

impl Outcome {
    /// Whether it answered OK.
    pub fn ok(&self) -> bool {
        !matches!(
            self,
            Outcome::Failed { .. } | Outcome::Unanswered | Outcome::ConnectionLost { .. }
        )
    }

    /// The failure's code name, if it failed.
    pub fn code(&self) -> &str {
        match self {
            Outcome::Failed { code, .. } => code,
            Outcome::Unanswered => "NO_ANSWER",
            Outcome::ConnectionLost { .. } => "CONNECTION_LOST",
            _ => "OK",
        }
    }
}

/// When an operation was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// While the nemesis was at work.
    Load,
    /// After everything was healed: every key re-sent until it settled.
    Settle,
}

/// One fault the nemesis put in, and when it was healed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultWindow {
    /// Its kind (`kill`, `freeze`, `partition`, …).
    pub kind: String,
    /// What it was applied to (`hop3.2`, `ledger ↔ postgres`, …).
    pub target: String,
    /// When it began and ended, ms from the start of the run.
    pub began_ms: f64,
    /// …
    pub healed_ms: f64,
    /// It left the edge unable to answer (the edge killed, frozen or stopped): calls made
    /// meanwhile may go unanswered or be answered late.
    #[serde(default)]
    pub silences_edge: bool,
}

impl FaultWindow {
    /// Whether it was in force at any time from `from_ms` to `to_ms`.
    pub fn overlaps(&self, from_ms: f64, to_ms: f64) -> bool {
        self.began_ms <= to_ms && from_ms <= self.healed_ms
    }
}

/// The run's record: the operations and the faults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    /// Every operation, in invocation order.
    pub ops: Vec<Op>,
    /// Every fault, in the order it began.
    pub faults: Vec<FaultWindow>,
    /// When the load (and the nemesis) stopped, ms from the start.
    pub load_ended_ms: f64,
}

/// The processor key the ledger uses for `key` on `account` (the ledger's own rule:
/// length-prefixed account, then the key).
pub fn processor_key(account: &str, key: &str) -> String {
    format!("{}:{account}:{key}", account.len())
}
