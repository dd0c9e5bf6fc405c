//! The edge's signed statement of who made a call, checked by the ledger: a tier between
//! them relays it and can neither make one nor change one, so a stolen relay key no longer
//! charges as any caller (docs/security.md, "The caller, signed").
//!
//! The edge signs, with its identity key ([`retrychain_tls::statement`]), a statement that
//! binds the caller to **this call**: the method, the idempotency key, the account, the
//! amount, and an expiry (the call's own deadline). It travels in two metadata entries that
//! every hop passes on unchanged:
//!
//! | key | what |
//! |---|---|
//! | [`CALLER_STATEMENT`] | the statement and its signature |
//! | [`CALLER_SIGNER`] | the certificate chain that verifies it (the same on every call of one edge, so HPACK sends it once per connection) |
//!
//! The ledger checks that the chain leads to an authority it trusts and names the edge,
//! that the signature is the edge's over this statement, that the statement has not
//! expired, and that it describes the call the ledger is serving. A statement copied from
//! another call names another key, account or amount and is refused; one replayed for the
//! very call it was made for asks for what that call already asked, so a Charge gets the
//! saved reply and charges nothing again.
//!
//! Why a statement made by the edge and not the caller's own token relayed and checked
//! again at the ledger: callers authenticated by a certificate have no token to relay, a
//! token says nothing of the call it travels with (a stolen one is good for any call until
//! its `exp`), and the ledger would need the identity provider's keys as well as the
//! edge's decision about them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use retrychain_tls::{Identity, Signature, Tls};
use tonic::{
    Status,
    metadata::{BinaryMetadataValue, MetadataKey, MetadataMap},
};

use retrychain_domain::{Caller, metadata::CALLER};

/// The edge's statement of a call's caller, and its signature (binary metadata).
pub const CALLER_STATEMENT: &str = "x-caller-statement-bin";
/// The certificate chain that verifies [`CALLER_STATEMENT`] (binary metadata).
pub const CALLER_SIGNER: &str = "x-caller-signer-bin";
/// [`CALLER_STATEMENT`] and [`CALLER_SIGNER`] as header names made at compile time, for a
/// relay that passes both on with every call (see `resilience::wire::names`).
pub const STATEMENT_HEADERS: [http::HeaderName; 2] = [
    http::HeaderName::from_static(CALLER_STATEMENT),
    http::HeaderName::from_static(CALLER_SIGNER),
];

/// How far past its expiry a statement is still taken: the edge's and the ledger's clocks
/// may disagree by this much.
pub const CLOCK_LEEWAY: Duration = Duration::from_secs(10);

/// The first byte of a statement: its layout's version.
const VERSION: u8 = 1;

/// What a statement is about: one call, as the edge sends it and the ledger serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call<'a> {
    /// The Payments method (`Charge`, `GetAccount`).
    pub method: &'a str,
    /// The call's idempotency key, where it has one.
    pub key: Option<&'a str>,
    /// The account it is about.
    pub account: &'a str,
    /// The amount, for a Charge.
    pub amount: Option<i64>,
}

/// What the edge states: who made which call, valid until when.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Statement {
    /// The caller as the edge authenticated it (empty: the anonymous caller).
    caller: String,
    method: String,
    /// Empty when the call has no key (keys are 1 to 255 characters).
    key: String,
    account: String,
    amount: Option<i64>,
    /// Milliseconds since the Unix epoch.
    expires_unix_ms: u64,
}

impl Statement {
    fn about(caller: &Caller, call: &Call<'_>, expires: SystemTime) -> Self {
        Self {
            caller: caller.as_str().to_owned(),
            method: call.method.to_owned(),
            key: call.key.unwrap_or_default().to_owned(),
            account: call.account.to_owned(),
            amount: call.amount,
            expires_unix_ms: unix_ms(expires),
        }
    }

    fn is_about(&self, call: &Call<'_>) -> bool {
        self.method == call.method
            && self.key == call.key.unwrap_or_default()
            && self.account == call.account
            && self.amount == call.amount
    }

    /// `VERSION`, the expiry (8 bytes), then each text as a 2-byte length and its bytes,
    /// then the amount (a byte: present or not; 8 bytes). Every integer big-endian.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            32 + self.caller.len() + self.method.len() + self.key.len() + self.account.len(),
        );
        out.push(VERSION);
        out.extend_from_slice(&self.expires_unix_ms.to_be_bytes());
        for text in [&self.caller, &self.method, &self.key, &self.account] {
            // Every field is bounded far below 64 KiB (callers and keys 255 bytes, accounts
            // 64 characters) by the parsing that came before.
            let length = u16::try_from(text.len()).unwrap_or(u16::MAX);
            out.extend_from_slice(&length.to_be_bytes());
            out.extend_from_slice(&text.as_bytes()[..usize::from(length)]);
        }
        match self.amount {
            Some(amount) => {
                out.push(1);
                out.extend_from_slice(&amount.to_be_bytes());
            }
            None => out.push(0),
        }
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
        if version != VERSION {
            return None;
        }
        let (expires, mut rest) = rest.split_first_chunk::<8>()?;
        let mut texts = Vec::with_capacity(4);
        for _ in 0..4 {
            let (length, after) = rest.split_first_chunk::<2>()?;
            let length = usize::from(u16::from_be_bytes(*length));
            let text = after.get(..length)?;
            texts.push(String::from_utf8(text.to_vec()).ok()?);
            rest = &after[length..];
        }
        let amount = match rest {
            [0] => None,
            [1, amount @ ..] => Some(i64::from_be_bytes(amount.try_into().ok()?)),
            _ => return None,
        };
        let [caller, method, key, account] = <[String; 4]>::try_from(texts).ok()?;
        Some(Self {
            caller,
            method,
            key,
            account,
            amount,
            expires_unix_ms: u64::from_be_bytes(*expires),
        })
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |since| {
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
    })
}

/// Signs the statement that `caller` makes `call`, valid until `expires`, with `tls`'s
/// identity key, and writes it and the chain that verifies it into `metadata`.
pub fn sign(
    tls: &Tls,
    caller: &Caller,
    call: &Call<'_>,
    expires: SystemTime,
    metadata: &mut MetadataMap,
) -> Result<(), Status> {
    let statement = Statement::about(caller, call, expires).encode();
    let (signature, chain) = tls.sign_statement(&statement).map_err(|error| {
        tracing::error!(%error, "cannot sign the caller statement");
        Status::internal("the edge cannot sign the caller statement")
    })?;
    // The statement (its length first), the scheme, the signature.
    let mut value = Vec::with_capacity(statement.len() + signature.bytes.len() + 4);
    value.extend_from_slice(&(statement.len() as u16).to_be_bytes());
    value.extend_from_slice(&statement);
    value.extend_from_slice(&signature.scheme.to_be_bytes());
    value.extend_from_slice(&signature.bytes);
    let mut value = BinaryMetadataValue::from_bytes(&value);
    value.set_sensitive(true); // new on every call: not for the HPACK table
    metadata.insert_bin(MetadataKey::from_static(CALLER_STATEMENT), value);
    metadata.insert_bin(
        MetadataKey::from_static(CALLER_SIGNER),
        BinaryMetadataValue::from_bytes(&chain),
    );
    Ok(())
}

/// The caller of `call`, from the statement in `metadata` that `signer` signed (checked
/// against the authorities `tls` trusts now). No statement, or one that does not verify or
/// has expired: UNAUTHENTICATED. One made for another call, or an `x-caller` that says
/// otherwise: PERMISSION_DENIED. Nothing is done either way.
pub fn verify(
    tls: &Tls,
    signer: &Identity,
    metadata: &MetadataMap,
    call: &Call<'_>,
    now: SystemTime,
) -> Result<Caller, Status> {
    let unauthenticated = |why: &str| {
        Status::unauthenticated(format!(
            "{why}: below the edge, a call's caller is taken only from a statement {signer} signed ({CALLER_STATEMENT}, {CALLER_SIGNER})"
        ))
    };
    let value = |key: &str| {
        let mut values = metadata.get_all_bin(key).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => value
                .to_bytes()
                .map_err(|_| unauthenticated(&format!("{key} is not base64"))),
            (None, _) => Err(unauthenticated(&format!("the call carries no {key}"))),
            (Some(_), Some(_)) => Err(unauthenticated(&format!("{key} was sent more than once"))),
        }
    };
    let signed = value(CALLER_STATEMENT)?;
    let chain = value(CALLER_SIGNER)?;
    let malformed = || unauthenticated(&format!("{CALLER_STATEMENT} is malformed"));
    let (length, rest) = signed.split_first_chunk::<2>().ok_or_else(malformed)?;
    let length = usize::from(u16::from_be_bytes(*length));
    let statement = rest.get(..length).ok_or_else(malformed)?;
    let (scheme, signature) = rest[length..]
        .split_first_chunk::<2>()
        .ok_or_else(malformed)?;
    let signature = Signature {
        scheme: u16::from_be_bytes(*scheme),
        bytes: signature.to_vec(),
    };
    tls.verify_statement(signer, &chain, statement, &signature)
        .map_err(|error| unauthenticated(&format!("the caller statement: {error}")))?;
    let statement = Statement::decode(statement).ok_or_else(malformed)?;
    let expired_ms = unix_ms(now).saturating_sub(statement.expires_unix_ms);
    if expired_ms > CLOCK_LEEWAY.as_millis() as u64 {
        return Err(unauthenticated(&format!(
            "the caller statement expired {expired_ms} ms ago"
        )));
    }
    if !statement.is_about(call) {
        return Err(Status::permission_denied(
            "the caller statement was made for another call (its method, key, account or amount differ)",
        ));
    }
    let caller = if statement.caller.is_empty() {
        Caller::anonymous()
    } else {
        Caller::parse(&statement.caller).map_err(|_| malformed())?
    };
    let named = retrychain_domain::metadata::caller(metadata)?;
    if metadata.get(CALLER).is_some() && named != caller {
        return Err(Status::permission_denied(format!(
            "x-caller names {named}, the edge's signed statement {caller}"
        )));
    }
    Ok(caller)
}

#[cfg(test)]
mod tests {
    use super::*;
    use retrychain_tls::{ClientAuth, issue::Authority};

    fn service(authority: &Authority, name: &str, dir: &std::path::Path) -> Tls {
        retrychain_tls::issue::service(authority, name, dir, ClientAuth::Required).unwrap()
    }

    const CHARGE: Call<'static> = Call {
        method: "Charge",
        key: Some("order-1"),
        account: "alice-main",
        amount: Some(500),
    };

    #[test]
    fn a_statement_round_trips_and_a_truncated_one_does_not() {
        let alice = Caller::parse("jwt:alice").unwrap();
        let statement = Statement::about(&alice, &CHARGE, UNIX_EPOCH + Duration::from_secs(9));
        let encoded = statement.encode();
        assert_eq!(Statement::decode(&encoded), Some(statement));
        for cut in 0..encoded.len() {
            assert_eq!(Statement::decode(&encoded[..cut]), None, "cut at {cut}");
        }
        let mut longer = encoded.clone();
        longer.push(0);
        assert_eq!(Statement::decode(&longer), None);
    }

    #[test]
    fn the_ledger_takes_the_caller_only_from_the_edges_statement_of_this_call() {
        let dir = tempfile::tempdir().unwrap();
        let authority = Authority::new("test").unwrap();
        let edge = service(&authority, "edge", dir.path());
        let hop2 = service(&authority, "hop2", dir.path());
        let ledger = service(&authority, "ledger", dir.path());
        let signer = Identity::named("edge");
        let now = SystemTime::now();
        let alice = Caller::parse("jwt:alice").unwrap();

        let mut signed = MetadataMap::new();
        sign(
            &edge,
            &alice,
            &CHARGE,
            now + Duration::from_secs(5),
            &mut signed,
        )
        .unwrap();
        assert_eq!(
            verify(&ledger, &signer, &signed, &CHARGE, now).unwrap(),
            alice
        );
        // With the edge's x-caller beside it, as the chain sends it.
        let mut named = signed.clone();
        named.insert(CALLER, "jwt:alice".parse().unwrap());
        assert_eq!(
            verify(&ledger, &signer, &named, &CHARGE, now).unwrap(),
            alice
        );

        // Copied onto another call: another amount, account, key or method.
        for other in [
            Call {
                amount: Some(501),
                ..CHARGE
            },
            Call {
                account: "mallory",
                ..CHARGE
            },
            Call {
                key: Some("order-2"),
                ..CHARGE
            },
            Call {
                method: "GetAccount",
                key: None,
                amount: None,
                ..CHARGE
            },
        ] {
            let refused = verify(&ledger, &signer, &signed, &other, now).unwrap_err();
            assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{other:?}");
        }
        // x-caller changed beside a good statement.
        let mut renamed = signed.clone();
        renamed.insert(CALLER, "jwt:mallory".parse().unwrap());
        let refused = verify(&ledger, &signer, &renamed, &CHARGE, now).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);

        // Expired (past the leeway), missing, made by hop2, or changed in one byte.
        let later = now + Duration::from_secs(5) + CLOCK_LEEWAY + Duration::from_secs(1);
        let refused = verify(&ledger, &signer, &signed, &CHARGE, later).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        let refused = verify(&ledger, &signer, &MetadataMap::new(), &CHARGE, now).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        let mut forged = MetadataMap::new();
        sign(
            &hop2,
            &alice,
            &CHARGE,
            now + Duration::from_secs(5),
            &mut forged,
        )
        .unwrap();
        let refused = verify(&ledger, &signer, &forged, &CHARGE, now).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        assert!(
            refused.message().contains("spiffe://retrychain/hop2"),
            "{}",
            refused.message()
        );
        let bytes = signed
            .get_bin(CALLER_STATEMENT)
            .unwrap()
            .to_bytes()
            .unwrap();
        let mut changed = bytes.to_vec();
        let caller_at = 2 + 1 + 8 + 2; // the statement's length, version, expiry, length
        changed[caller_at + 4] ^= 0x01; // "jwt:alice" → "jwt:`lice"
        let mut tampered = signed.clone();
        tampered.insert_bin(CALLER_STATEMENT, BinaryMetadataValue::from_bytes(&changed));
        let refused = verify(&ledger, &signer, &tampered, &CHARGE, now).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    }
}
