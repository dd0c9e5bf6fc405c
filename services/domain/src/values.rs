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
    /// The account id is empty, too long, or not written in its one spelling
    /// ([`AccountId::parse`]).
    #[error("account_id {0}")]
    Account(String),
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

/// Who asks: the identity the edge authenticated for a call — a client certificate's
/// (`spiffe://…`), or `jwt:` and a bearer token's subject — or nobody (the anonymous
/// caller, on an edge that lets callers in without credentials). An account belongs to
/// the caller that created it, so keys, which are scoped by account, are scoped by caller
/// too: another caller's Charge or GetAccount on it is PERMISSION_DENIED, never a replay of
/// someone else's saved reply.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Caller(String);

impl Caller {
    /// Longest identity accepted, in bytes.
    pub const MAX_LEN: usize = 255;

    /// 1 to 255 visible ASCII characters (0x21..=0x7E), as a key: an identity is logged and
    /// stored, and two that look alike must be the same.
    pub fn parse(raw: &str) -> Result<Self, InvalidCaller> {
        if raw.is_empty() || raw.len() > Self::MAX_LEN {
            return Err(InvalidCaller("must be 1 to 255 characters"));
        }
        if !raw.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidCaller(
                "must be visible ASCII characters only (no spaces or control characters)",
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    /// The caller of an edge that lets callers in without credentials (plaintext, `up`'s
    /// default): every such call is the same caller.
    pub fn anonymous() -> Self {
        Self(String::new())
    }

    /// Whether this is [`Caller::anonymous`].
    pub fn is_anonymous(&self) -> bool {
        self.0.is_empty()
    }

    /// The identity as stored (empty for the anonymous caller).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_anonymous() {
            f.write_str("(anonymous)")
        } else {
            f.write_str(&self.0)
        }
    }
}

/// Why a caller identity was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("caller identity {0}")]
pub struct InvalidCaller(pub &'static str);

/// An account's identifier.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AccountId(String);

impl AccountId {
    /// Longest id accepted, in characters.
    pub const MAX_CHARS: usize = 64;

    /// 1 to 64 characters (Unicode scalar values, not bytes) in the id's one spelling.
    ///
    /// An account id names money. Two ids that look the same on a screen, in a log or in a
    /// support tool must be the same account, or one customer can be made to pay into, or
    /// be mistaken for, another (`alice` and `ali\u{200B}ce`). So an id is refused
    /// (INVALID_ARGUMENT, nothing written) unless it is written the one way its characters
    /// allow, rather than normalised: a normalised id would be stored under a spelling the
    /// caller never sent, and the caller's own records would disagree with ours. Refused:
    ///
    /// - control characters (Cc: NUL, tab, newline, DEL, C1) — Postgres refuses NUL in
    ///   `TEXT` outright, and the rest corrupt logs;
    /// - format characters (Cf: zero-width space and joiners, bidi controls such as the
    ///   right-to-left override, BOM, word joiner, soft hyphen) — invisible;
    /// - unassigned code points and noncharacters (Cn), and private-use ones (Co) — no agreed
    ///   glyph, so no agreed meaning;
    /// - any space but one ASCII space between two other characters (no-break, ideographic
    ///   and other spaces, line and paragraph separators, leading, trailing or doubled
    ///   spaces);
    /// - outside ASCII, any character that Unicode's security profile for identifiers
    ///   (UTS #39, Identifier_Status) does not allow: invisible fillers and variation
    ///   selectors, compatibility forms that look like another character (fullwidth `ａ`,
    ///   ligatures, superscripts), obsolete scripts, symbols;
    /// - text not in Unicode Normalization Form C (`café` with a combining accent, which
    ///   looks exactly like the precomposed `café`);
    /// - outside ASCII, anything but letters, marks and decimal digits, and letters that are
    ///   look-alikes of ASCII punctuation (`‐` U+2010, `’` U+2019, `ʼ` U+02BC beside `-`
    ///   and `'`);
    /// - letters from scripts that do not go together (UTS #39 "highly restrictive": one
    ///   script, or Latin with Han and the Japanese kana, or with Han and Bopomofo, or with
    ///   Han and Hangul), so a Cyrillic `а` cannot stand in for the Latin `a` in `alice`;
    /// - digits of two numbering systems (`1००` beside `100`; UTS #39 §5.3);
    /// - a dot above on i, j or a dotless ı (`alı̇ce`, `ali̇ce` beside `alice`), the same
    ///   nonspacing mark twice in a row, or more than four in a row (UTS #39 §5.4).
    ///
    /// - ids written wholly in a non-Latin script whose every letter looks like a Latin
    ///   ASCII one (UTS #39 §4, whole-script confusables: Cyrillic `асе` beside `ace`, Greek
    ///   `ΑΒΕ` beside `ABE`): refused, not folded, so that one account has one spelling
    ///   and a Cyrillic or Greek id is never silently charged as its Latin look-alike. An
    ///   id with at least one letter that has no Latin look-alike (`привет`, `Ωμέγα`) is
    ///   its own account.
    ///
    /// Zero-width joiners are refused with the other format characters, so the Persian
    /// and Indic spellings that use one must be written without it.
    pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
        let refuse = |why: String| Err(InvalidInput::Account(why));
        if raw.is_empty() {
            return refuse("must not be empty".into());
        }
        if raw.chars().count() > Self::MAX_CHARS {
            return refuse(format!("must be at most {} characters", Self::MAX_CHARS));
        }
        // ASCII letters, digits, punctuation and the space are the common case, and each
        // is a spelling of its own.
        let odd = raw.chars().filter(|c| !(c.is_ascii_graphic() || *c == ' '));
        if let Some(why) = odd.map(refused_character).find_map(|why| why) {
            return refuse(why);
        }
        if raw.starts_with(' ') || raw.ends_with(' ') || raw.contains("  ") {
            return refuse(
                "must not begin or end with a space, or hold two spaces in a row".into(),
            );
        }
        // ASCII has no marks, is in NFC, has one digit system and one script.
        if !raw.is_ascii() {
            let why = confusable_marks(raw)
                .or_else(|| mixed_digits(raw))
                .or_else(|| not_nfc(raw))
                .or_else(|| mixed_scripts(raw))
                .or_else(|| whole_script_look_alike(raw));
            if let Some(why) = why {
                return refuse(why);
            }
        }
        Ok(Self(raw.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Why the character `c` (not ASCII graphic, not the space) cannot be in an account id, if
/// it cannot; see [`AccountId::parse`].
fn refused_character(c: char) -> Option<String> {
    use unicode_properties::{GeneralCategory, GeneralCategoryGroup, UnicodeGeneralCategory};
    use unicode_security::GeneralSecurityProfile;

    let point = format!("U+{:04X}", u32::from(c));
    let why = match c.general_category() {
        GeneralCategory::Control => {
            "must not contain control characters (NUL, tab, newline, BEL, DEL, …)"
        }
        GeneralCategory::Format => {
            "must not contain invisible format characters (zero-width characters, bidi controls, BOM, word joiner, soft hyphen)"
        }
        GeneralCategory::Unassigned => "must not contain unassigned code points or noncharacters",
        GeneralCategory::PrivateUse => "must not contain private-use code points",
        GeneralCategory::SpaceSeparator
        | GeneralCategory::LineSeparator
        | GeneralCategory::ParagraphSeparator => "may separate words only with the ASCII space",
        _ if !c.identifier_allowed() => {
            "must not contain characters Unicode's identifier profile (UTS #39) excludes: invisible ones, look-alike compatibility forms, obsolete scripts, symbols"
        }
        // Outside ASCII only letters, marks and digits: a `‐` (U+2010) or `’` beside the
        // ASCII `-` and `'` is a second spelling.
        category
            if !matches!(
                c.general_category_group(),
                GeneralCategoryGroup::Letter | GeneralCategoryGroup::Mark
            ) && category != GeneralCategory::DecimalNumber
                || looks_like_ascii_punctuation(c) =>
        {
            "outside ASCII, may hold only letters, marks and digits (punctuation has its ASCII spelling)"
        }
        _ => return None,
    };
    Some(format!("{why}: it holds {point}"))
}

/// Why `raw` is not in Unicode Normalization Form C, if it is not.
fn not_nfc(raw: &str) -> Option<String> {
    use unicode_normalization::{IsNormalized, is_nfc_quick};
    let nfc = match is_nfc_quick(raw.chars()) {
        IsNormalized::Yes => true,
        IsNormalized::No => false,
        IsNormalized::Maybe => unicode_normalization::is_nfc(raw),
    };
    (!nfc).then(|| {
        "must be in Unicode Normalization Form C (a combining accent written apart from its letter, say); send the composed form".into()
    })
}

/// Why the letters of `raw` mix scripts that do not go together (UTS #39 "highly
/// restrictive"), if they do. Scripts are judged on the letters: ASCII digits, spaces and
/// punctuation belong to every script, but UTS #39's detection would refuse them as
/// non-identifier characters.
fn mixed_scripts(raw: &str) -> Option<String> {
    use unicode_security::{RestrictionLevel, RestrictionLevelDetection};
    let letters: String = raw
        .chars()
        .filter(|c| !c.is_ascii() || c.is_ascii_alphanumeric())
        .collect();
    (!letters
        .as_str()
        .check_restriction_level(RestrictionLevel::HighlyRestrictive))
    .then(|| {
        "must not mix letters of different scripts (a Cyrillic а among Latin letters, say)".into()
    })
}

/// Why `raw`, written in one script other than Latin, is refused as a whole-script
/// look-alike of an ASCII spelling (UTS #39 §4), if it is: every letter's confusable
/// skeleton is an ASCII letter.
fn whole_script_look_alike(raw: &str) -> Option<String> {
    use unicode_script::{Script, UnicodeScript};
    let letters: String = raw.chars().filter(|c| c.is_alphabetic()).collect();
    let script = letters
        .chars()
        .map(|c| c.script())
        .find(|s| !matches!(s, Script::Common | Script::Inherited))?;
    if script == Script::Latin {
        return None;
    }
    // Every letter's skeleton ASCII letters, marks included: Cyrillic `в` is confusable
    // with the small capital `ʙ`, which is Latin but no one's spelling of an ASCII id
    // (`Москва` stays its own), and Greek `ή` with `ń`, not `n`.
    let mut buf = [0u8; 4];
    let ascii_look_alike = letters.chars().all(|c| {
        let skeleton: String = unicode_security::skeleton(c.encode_utf8(&mut buf)).collect();
        !skeleton.is_empty() && skeleton.chars().all(|p| p.is_ascii_alphabetic())
    });
    let skeleton: String = unicode_security::skeleton(&letters).collect();
    ascii_look_alike.then(|| {
        format!(
            "is written in {} letters that all look like Latin ones ({letters:?} looks like {skeleton:?}: a whole-script confusable, UTS #39); one account has one spelling, so write it in Latin",
            script.full_name()
        )
    })
}

/// Whether `c` (outside ASCII) is confusable with an ASCII punctuation character or space
/// (UTS #39 confusables: `ʼ` U+02BC → `'`).
fn looks_like_ascii_punctuation(c: char) -> bool {
    let mut buf = [0u8; 4];
    let skeleton: String = unicode_security::skeleton(c.encode_utf8(&mut buf)).collect();
    !skeleton.is_empty()
        && skeleton
            .chars()
            .all(|p| p.is_ascii() && !p.is_ascii_alphanumeric())
}

/// UTS #39 §5.4's invisible-mark checks, on the decomposed text: a combining dot above (U+0307) after a letter
/// that has or hides a dot (i, j, ı, ȷ), the same nonspacing mark twice in a row, or more
/// than four nonspacing marks in a row. `None` when there is none.
fn confusable_marks(raw: &str) -> Option<String> {
    use unicode_normalization::UnicodeNormalization;
    use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};
    let mut previous: Option<char> = None;
    let mut marks_in_a_row = 0;
    // Decomposed, as §5.4 says: `é` followed by U+0301 is an `e` with the acute twice.
    for c in raw.chars().nfd() {
        if c.general_category() == GeneralCategory::NonspacingMark {
            marks_in_a_row += 1;
            if c == '\u{0307}' && matches!(previous, Some('i' | 'j' | 'ı' | 'ȷ')) {
                return Some(
                    "must not put a dot above (U+0307) on i, j or a dotless ı: it looks like the plain letter"
                        .into(),
                );
            }
            if previous == Some(c) {
                return Some(format!(
                    "must not repeat the mark U+{:04X}: twice looks like once",
                    u32::from(c)
                ));
            }
            if marks_in_a_row > 4 {
                return Some("must not stack more than four marks on one letter".into());
            }
        } else {
            marks_in_a_row = 0;
        }
        previous = Some(c);
    }
    None
}

/// UTS #39 §5.3: the decimal digits of one id come from one numbering system (each system
/// is ten consecutive code points). `None` when they do.
fn mixed_digits(raw: &str) -> Option<String> {
    use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};
    let mut ascii = false;
    let mut others: Option<(u32, u32)> = None;
    for c in raw.chars() {
        if c.is_ascii_digit() {
            ascii = true;
        } else if c.general_category() == GeneralCategory::DecimalNumber {
            let point = u32::from(c);
            let (low, high) = others.unwrap_or((point, point));
            others = Some((low.min(point), high.max(point)));
        }
    }
    let mixed = match others {
        Some((low, high)) => ascii || high - low > 9,
        None => false,
    };
    mixed.then(|| "must not mix digits of two numbering systems (`1००` beside `100`)".into())
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

    /// Every pair here looks like one account on a screen; the second of each is refused.
    #[test]
    fn look_alike_account_ids_are_refused() {
        for (plain, look_alike) in [
            ("alice", "ali\u{200B}ce"),        // zero-width space
            ("alice", "\u{FEFF}alice"),        // BOM
            ("alice", "\u{202E}ecila"),        // right-to-left override
            ("bob", "bob\u{2060}"),            // word joiner
            ("bob", "b\u{200D}ob"),            // zero-width joiner
            ("bob", "bo\u{00AD}b"),            // soft hyphen
            ("alice", "\u{061C}alice"),        // Arabic letter mark
            ("café", "cafe\u{0301}"),          // NFD
            ("Å", "A\u{030A}"),                // NFD
            ("alice", "аlice"),                // Cyrillic а
            ("paypal", "pаypal"),              // Cyrillic а inside
            ("alice", "ａlice"),               // fullwidth
            ("office", "o\u{FB03}ce"),         // ligature ffi
            ("bob", "bob\u{FE0F}"),            // variation selector
            ("bob", "bob\u{034F}"),            // combining grapheme joiner
            ("bob", "bob\u{3164}"),            // Hangul filler
            ("bob smith", "bob\u{00A0}smith"), // no-break space
            ("bob smith", "bob\u{3000}smith"), // ideographic space
            ("bob smith", "bob  smith"),       // two spaces
            ("bob", "bob "),                   // trailing space
            ("bob", " bob"),                   // leading space
            ("bob", "bob\u{2028}"),            // line separator
            ("bob", "bob\u{E000}"),            // private use
            ("bob", "bob\u{F0000}"),           // supplementary private use
            ("bob", "bob\u{FFFF}"),            // noncharacter
            ("bob", "bob\u{0378}"),            // unassigned
            ("bob", "bob\u{E0041}"),           // tag character
            ("user-42", "user\u{2010}42"),     // hyphen
            ("o'brien", "o\u{2019}brien"),     // right single quotation mark
            ("o'brien", "o\u{02BC}brien"),     // modifier letter apostrophe
            ("alice", "al\u{0131}\u{0307}ce"), // dotless i + dot above
            ("alice", "ali\u{0307}ce"),        // i + dot above
            ("café", "café\u{0301}"),          // the mark twice
            ("100", "1\u{0966}\u{0966}"),      // Devanagari zeros among ASCII digits
            ("১০০", "১\u{0966}\u{0966}"),      // Bengali one, Devanagari zeros
            ("ace", "асе"),                    // wholly Cyrillic
            ("ABE", "ΑΒΕ"),                    // wholly Greek
            ("xopo", "хоро"),                  // wholly Cyrillic
            ("ace 7", "асе 7"),                // wholly Cyrillic letters, an ASCII digit
            ("TOP", "ТОР"),                    // Cyrillic capitals
        ] {
            assert!(AccountId::parse(plain).is_ok(), "{plain:?}");
            let refused = AccountId::parse(look_alike).expect_err(look_alike);
            assert!(
                matches!(&refused, InvalidInput::Account(why) if why.len() > 20),
                "{look_alike:?}: {refused}"
            );
        }
        for fine in [
            "café",
            "Ωμέγα",
            "Москва",
            "東京タワー",
            "서울",
            "user_42.acct-7@example",
            "Zoë Smith",
            "१००",
            "İstanbul",
            "Işık",
            "Nguyễn",
            "привет",
            "Αθήνα",
        ] {
            assert!(AccountId::parse(fine).is_ok(), "{fine:?}");
        }
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
