//! The request values a payment service must never get wrong, parsed once at the edge of
//! each handler: a value of these types is valid by construction.

use std::fmt;

use tonic::Status;

/// Why a request value was refused; always INVALID_ARGUMENT on the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidInput {
    /// The idempotency key is missing or malformed.
    #[error("idempotency-key {0}")]
    Key(&'static str),
    /// The account id is empty, too long, or holds a control character.
    #[error("account_id {0}")]
    Account(&'static str),
    /// The amount is outside 1..=1_000_000_000_000 cents.
    #[error("amount_cents must be between 1 and {max}, got {got}", max = AmountCents::MAX)]
    Amount {
        /// What the request carried.
        got: i64,
    },
}

impl From<InvalidInput> for Status {
    fn from(error: InvalidInput) -> Self {
        Status::invalid_argument(error.to_string())
    }
}

/// The client's name for one logical operation, reused on every retry of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Longest key accepted, as in Stripe's API.
    pub const MAX_LEN: usize = 255;

    /// 1 to 255 visible ASCII characters (0x21..=0x7E): no spaces or control characters,
    /// so a key can be logged and copied from a log without ambiguity.
    pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
        if raw.is_empty() {
            return Err(InvalidInput::Key("must not be empty"));
        }
        if raw.len() > Self::MAX_LEN {
            return Err(InvalidInput::Key("must be at most 255 characters"));
        }
        if !raw.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidInput::Key(
                "must be visible ASCII characters only (no spaces or control characters)",
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    /// A fresh random key (a UUID), for a client that sent none.
    pub fn generate() -> Self {
        Self(uuid::Uuid::new_v4().to_string())
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An account's identifier.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AccountId(String);

impl AccountId {
    /// Longest id accepted, in characters.
    pub const MAX_CHARS: usize = 64;

    /// 1 to 64 characters (Unicode scalar values, not bytes), none of them a control
    /// character (Unicode category Cc: U+0000..=U+001F and U+007F..=U+009F).
    ///
    /// An account id is shown in logs, statements and support tools, so it must be printable
    /// text; and Postgres refuses NUL in `TEXT` outright, which would otherwise surface as a
    /// database error instead of a clear INVALID_ARGUMENT.
    pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
        if raw.is_empty() {
            return Err(InvalidInput::Account("must not be empty"));
        }
        if raw.chars().count() > Self::MAX_CHARS {
            return Err(InvalidInput::Account("must be at most 64 characters"));
        }
        if raw.chars().any(char::is_control) {
            return Err(InvalidInput::Account(
                "must not contain control characters (NUL, tab, newline, BEL, DEL, …)",
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A positive amount of money in cents, at most ten billion units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct AmountCents(i64);

impl AmountCents {
    /// Largest amount one charge may carry.
    pub const MAX: i64 = 1_000_000_000_000;

    /// 1 ..= [`AmountCents::MAX`].
    pub fn parse(raw: i64) -> Result<Self, InvalidInput> {
        if (1..=Self::MAX).contains(&raw) {
            Ok(Self(raw))
        } else {
            Err(InvalidInput::Amount { got: raw })
        }
    }

    /// The amount in cents.
    pub fn get(&self) -> i64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert!(IdempotencyKey::parse("order-17/attempt~A").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        for bad in ["", " ", "has space", "tab\t", "naïve", "\u{7f}"] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?}");
        }
        assert!(IdempotencyKey::parse(&"k".repeat(256)).is_err());
        let generated = IdempotencyKey::generate();
        assert!(IdempotencyKey::parse(generated.as_str()).is_ok());
        assert_ne!(generated, IdempotencyKey::generate());
    }

    #[test]
    fn accounts() {
        assert!(AccountId::parse("acct-1").is_ok());
        assert!(
            AccountId::parse(&"é".repeat(64)).is_ok(),
            "counts characters"
        );
        assert!(AccountId::parse("").is_err());
        assert!(AccountId::parse(&"a".repeat(65)).is_err());
        assert!(AccountId::parse(&"é".repeat(65)).is_err());
        for bad in [
            "a\u{0}b",
            "bell\u{7}",
            "tab\t",
            "line\n",
            "del\u{7f}",
            "c1\u{85}",
        ] {
            assert!(AccountId::parse(bad).is_err(), "{bad:?}");
        }
        assert!(
            AccountId::parse("Zoë Smith-Ångström 名前").is_ok(),
            "printable Unicode"
        );
    }

    #[test]
    fn amounts() {
        assert!(AmountCents::parse(1).is_ok());
        assert!(AmountCents::parse(AmountCents::MAX).is_ok());
        for bad in [0, -1, AmountCents::MAX + 1, i64::MIN, i64::MAX] {
            assert!(AmountCents::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn invalid_input_is_invalid_argument() {
        let status: Status = AmountCents::parse(0).expect_err("zero").into();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains("amount_cents"));
    }
}
