//! The decision at the heart of a charge, without the database: what a key's row, as
//! phase 1 returned it, means for the request that asked ([`judge`]), and which processor
//! failures end a key for good ([`refused_for_good`]). Pure functions of their inputs,
//! tested by a table of every state a key can be in against every request that can find
//! it.

use resilience::Deadline;
use retrychain_domain::{AccountId, AmountCents, Caller, IdempotencyKey};
use sqlx::{Row, postgres::PgRow};
use tonic::Code;
use uuid::Uuid;

use super::error::StoreError;

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

/// One charge as the store runs it: the request's values, parsed, and its lease owner.
#[derive(Clone, Copy)]
pub(super) struct Charge<'a> {
    /// Who asks: phase 1 creates the account for it, or refuses another's.
    pub(super) caller: &'a Caller,
    pub(super) account: &'a AccountId,
    pub(super) key: &'a IdempotencyKey,
    pub(super) amount: AmountCents,
    pub(super) deadline: Deadline,
    /// This request's name on the key's lease.
    pub(super) owner: Uuid,
    /// The processor's key for it (saved on the claim; a resumed key keeps its own).
    pub(super) processor_key: &'a str,
}

/// A key's row as [`CLAIM`](super::CLAIM) returned it.
pub(super) struct KeyRow {
    /// Whether this statement inserted it.
    pub(super) inserted: bool,
    /// `started`, `finished` or `failed`.
    pub(super) state: String,
    /// The amount the key was first used with.
    pub(super) amount_cents: i64,
    /// (charge id, balance after) once finished.
    pub(super) reply: Option<(Uuid, i64)>,
    /// Who holds the lease (started keys).
    pub(super) owner: Option<Uuid>,
    /// The processor key saved with it.
    pub(super) processor_key: Option<String>,
    /// The saved error (failed keys).
    pub(super) error: Option<(i32, String)>,
}

impl KeyRow {
    pub(super) fn read(row: &PgRow) -> Result<Self, sqlx::Error> {
        let reply = match (
            row.try_get::<Option<Uuid>, _>("charge_id")?,
            row.try_get::<Option<i64>, _>("balance_cents")?,
        ) {
            (Some(charge_id), Some(balance)) => Some((charge_id, balance)),
            _ => None,
        };
        let error = match (
            row.try_get::<Option<i32>, _>("error_code")?,
            row.try_get::<Option<String>, _>("error_message")?,
        ) {
            (Some(code), message) => Some((code, message.unwrap_or_default())),
            _ => None,
        };
        Ok(Self {
            inserted: row.try_get("inserted")?,
            state: row.try_get("state")?,
            amount_cents: row.try_get("request_amount_cents")?,
            reply,
            owner: row.try_get("lease_owner")?,
            processor_key: row.try_get("processor_key")?,
            error,
        })
    }
}

/// What [`CLAIM`](super::CLAIM) came to for one request.
pub(super) enum Claim {
    /// The key is this request's: freshly claimed, or taken over (`resumed`).
    Ours {
        /// The processor key to call under.
        processor_key: String,
        /// Taken over from an owner whose lease passed.
        resumed: bool,
    },
    /// Settled with the same parameters: its outcome.
    Settled(Result<ChargeOutcome, StoreError>),
    /// Running under someone else's live lease.
    Running,
}

/// What the processor's call came to, as phase 2 needs it.
pub(super) enum Processed {
    /// It charged.
    Charged,
    /// It refused for good: the key fails with this.
    Refused(tonic::Status),
    /// It failed for now: the key is released for a retry.
    Failed(tonic::Status),
}

/// Whether a processor failure is for good: the call reached a processor that said no
/// (a retry with the same parameters would be told the same), as against a failure to
/// reach it, a busy one, or one that ran out of time.
pub(super) fn refused_for_good(status: &tonic::Status) -> bool {
    !matches!(
        status.code(),
        Code::Unavailable
            | Code::ResourceExhausted
            | Code::Aborted
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal
    )
}

/// What a key's row (as [`CLAIM`](super::CLAIM) returned it) means for `charge`.
pub(super) fn judge(charge: &Charge<'_>, row: KeyRow) -> Claim {
    let requested = charge.amount.get();
    if row.amount_cents != requested {
        return Claim::Settled(Err(StoreError::KeyReused {
            saved: row.amount_cents,
            requested,
        }));
    }
    match row.state.as_str() {
        "finished" => Claim::Settled(match row.reply {
            Some((charge_id, balance_cents)) => Ok(ChargeOutcome::Replayed(SavedReply {
                charge_id,
                account_id: charge.account.as_str().to_owned(),
                amount_cents: row.amount_cents,
                balance_cents,
            })),
            // A finished key is written with its reply in one statement, so a finished
            // row without one means the schema or the code is broken.
            None => Err(StoreError::Database(sqlx::Error::Protocol(
                "a finished idempotency key has no saved reply".into(),
            ))),
        }),
        "failed" => {
            let (code, message) = row.error.unwrap_or((Code::Unknown as i32, String::new()));
            Claim::Settled(Err(StoreError::Failed {
                code: Code::from_i32(code),
                message,
            }))
        }
        _ if row.owner == Some(charge.owner) => Claim::Ours {
            processor_key: row
                .processor_key
                .unwrap_or_else(|| charge.processor_key.to_owned()),
            resumed: !row.inserted,
        },
        _ => Claim::Running,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn only_a_processor_that_said_no_fails_a_key_for_good() {
        for code in [
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::PermissionDenied,
        ] {
            assert!(
                refused_for_good(&tonic::Status::new(code, "no")),
                "{code:?}"
            );
        }
        for code in [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
            Code::Aborted,
            Code::Cancelled,
            Code::Unknown,
            Code::Internal,
        ] {
            assert!(
                !refused_for_good(&tonic::Status::new(code, "later")),
                "{code:?}"
            );
        }
    }

    /// What a [`Claim`] says, in a form a table can hold.
    fn told(claim: Claim) -> String {
        match claim {
            Claim::Ours {
                processor_key,
                resumed,
            } => format!("ours under {processor_key}, resumed {resumed}"),
            Claim::Running => "running".to_owned(),
            Claim::Settled(Ok(ChargeOutcome::Replayed(reply))) => format!(
                "replayed {} {} {} {}",
                reply.charge_id, reply.account_id, reply.amount_cents, reply.balance_cents
            ),
            Claim::Settled(Ok(ChargeOutcome::Executed(_))) => "executed".to_owned(),
            Claim::Settled(Err(StoreError::KeyReused { saved, requested })) => {
                format!("reused: saved {saved}, requested {requested}")
            }
            Claim::Settled(Err(StoreError::Failed { code, message })) => {
                format!("failed {code:?}: {message}")
            }
            Claim::Settled(Err(StoreError::Database(_))) => "broken".to_owned(),
            Claim::Settled(Err(other)) => format!("other: {other}"),
        }
    }

    /// Every state phase 1 can return a key in, against a request with the same or other
    /// parameters. (A key on another caller's account never reaches `judge`: phase 1
    /// returns no key row for it; a started key whose lease passed comes back already
    /// taken over, under this request's owner, when the parameters match.)
    #[test]
    fn what_a_key_means_for_the_request_that_found_it() {
        let caller = Caller::anonymous();
        let account = AccountId::parse("alice").expect("valid");
        let key = IdempotencyKey::parse("k-1").expect("valid");
        let ours = Uuid::from_u128(1);
        let theirs = Uuid::from_u128(2);
        let charge_id = Uuid::from_u128(3);
        let charge = Charge {
            caller: &caller,
            account: &account,
            key: &key,
            amount: AmountCents::parse(500).expect("valid"),
            deadline: Deadline::after(Duration::from_secs(5)),
            owner: ours,
            processor_key: "pk-this-request",
        };
        let row = |inserted, state: &str, amount_cents, owner| KeyRow {
            inserted,
            state: state.to_owned(),
            amount_cents,
            reply: None,
            owner,
            processor_key: Some("pk-first".to_owned()),
            error: None,
        };
        let finished = |amount_cents, reply| KeyRow {
            reply,
            ..row(false, "finished", amount_cents, None)
        };
        let failed = |amount_cents, error| KeyRow {
            error,
            ..row(false, "failed", amount_cents, None)
        };
        let declined = Some((Code::FailedPrecondition as i32, "card declined".to_owned()));
        let cases: Vec<(&str, KeyRow, String)> = vec![
            (
                "a new key, claimed by this request",
                row(true, "started", 500, Some(ours)),
                "ours under pk-first, resumed false".to_owned(),
            ),
            (
                "a new key whose row saved no processor key: this request's",
                KeyRow {
                    processor_key: None,
                    ..row(true, "started", 500, Some(ours))
                },
                "ours under pk-this-request, resumed false".to_owned(),
            ),
            (
                "started, lease passed, same parameters: taken over, the first processor key kept",
                row(false, "started", 500, Some(ours)),
                "ours under pk-first, resumed true".to_owned(),
            ),
            (
                "started, lease held by another request",
                row(false, "started", 500, Some(theirs)),
                "running".to_owned(),
            ),
            (
                "started, lease held, other parameters",
                row(false, "started", 700, Some(theirs)),
                "reused: saved 700, requested 500".to_owned(),
            ),
            (
                "started, lease passed, other parameters (not taken over)",
                row(false, "started", 700, None),
                "reused: saved 700, requested 500".to_owned(),
            ),
            (
                "finished, same parameters: its saved reply",
                finished(500, Some((charge_id, 9_500))),
                format!("replayed {charge_id} alice 500 9500"),
            ),
            (
                "finished, other parameters",
                finished(700, Some((charge_id, 9_500))),
                "reused: saved 700, requested 500".to_owned(),
            ),
            (
                "finished without a saved reply: the schema or the code is broken",
                finished(500, None),
                "broken".to_owned(),
            ),
            (
                "failed, same parameters: its saved error",
                failed(500, declined.clone()),
                "failed FailedPrecondition: card declined".to_owned(),
            ),
            (
                "failed, other parameters",
                failed(700, declined),
                "reused: saved 700, requested 500".to_owned(),
            ),
            (
                "failed without a saved error",
                failed(500, None),
                "failed Unknown: ".to_owned(),
            ),
        ];
        for (case, row, expected) in cases {
            assert_eq!(told(judge(&charge, row)), expected, "{case}");
        }
    }
}
