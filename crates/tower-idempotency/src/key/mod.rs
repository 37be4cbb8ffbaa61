//! Reading the key: see [`IdempotencyKey`].

use std::{fmt, sync::Arc};

use http::{HeaderMap, HeaderName, HeaderValue};

mod rule;
mod source;

pub use rule::KeyRule;
pub(crate) use source::KeyLookup;
pub use source::KeySource;

/// The `Idempotency-Key` header name.
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in characters (Stripe's limit).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, as the client sent it (without sf-string quoting).
///
/// ```
/// use http::HeaderMap;
/// use tower_idempotency::IdempotencyKey;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("idempotency-key", "\"8e03978e-40d5\"".parse().unwrap());
/// let quoted = IdempotencyKey::from_headers(&headers).unwrap().unwrap();
///
/// headers.insert("idempotency-key", "8e03978e-40d5".parse().unwrap());
/// let bare = IdempotencyKey::from_headers(&headers).unwrap().unwrap();
///
/// assert_eq!(quoted, bare);
/// assert_eq!(bare.as_str(), "8e03978e-40d5");
/// ```
///
/// The IETF draft defines the field as an RFC 9651 structured-field String
/// (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`). Clients in the wild, Stripe's own
/// SDKs among them, send the bare value instead, which is usually not a valid sf-token (a UUID may
/// start with a digit). Both forms are accepted and name the same key, as above.
///
/// A value that starts with `"` must parse as an sf-string (parameters, which the draft defines
/// none of, are ignored as RFC 9651 requires). Any other value is taken literally and must be
/// printable ASCII without spaces or quotes. Empty values, values longer than [`MAX_KEY_LEN`]
/// characters and repeated header lines are rejected; the layer answers those with `400`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Arc<str>);

impl IdempotencyKey {
    /// Reads the key from request headers: `Ok(None)` when the header is absent.
    ///
    /// # Errors
    ///
    /// A [`KeyError`] when the header is repeated or its value is not a valid key.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, KeyError> {
        Self::from_header(headers, &IDEMPOTENCY_KEY)
    }

    /// Reads the key from the header `name` (an API's own, such as `X-Idempotency-Key`), by the
    /// same rules: `Ok(None)` when the header is absent.
    ///
    /// # Errors
    ///
    /// A [`KeyError`] when the header is repeated or its value is not a valid key.
    pub fn from_header(headers: &HeaderMap, name: &HeaderName) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(name).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(value).map(Some)
    }

    /// Parses one header value.
    ///
    /// # Errors
    ///
    /// A [`KeyError`] saying why the value is not a valid key.
    pub fn parse(value: &HeaderValue) -> Result<Self, KeyError> {
        let raw = trim_ows(value.as_bytes());
        if raw.first() == Some(&b'"') {
            let item: sfv::Item = sfv::Parser::new(raw).parse_item().map_err(|err| {
                if is_list(raw) {
                    KeyError::Repeated
                } else {
                    KeyError::Malformed(err.to_string())
                }
            })?;
            match item.bare_item.as_string() {
                Some(s) => Self::checked(s.as_str()),
                None => Err(KeyError::Malformed("not a string".to_owned())),
            }
        } else {
            if let Some(&byte) = raw.iter().find(|b| !is_bare_key_byte(**b)) {
                return Err(if is_list(raw) {
                    KeyError::Repeated
                } else {
                    KeyError::InvalidCharacter(byte)
                });
            }
            // Every byte is printable ASCII, so this cannot fail.
            let key = std::str::from_utf8(raw).map_err(|e| KeyError::Malformed(e.to_string()))?;
            Self::checked(key)
        }
    }

    /// Makes a key from its unquoted text, checking its length and characters.
    ///
    /// # Errors
    ///
    /// [`KeyError::Empty`], [`KeyError::TooLong`] or [`KeyError::InvalidCharacter`].
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        Self::checked(&key.into())
    }

    fn checked(key: &str) -> Result<Self, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(key.len()));
        }
        // sf-strings may hold spaces; every other character must be visible ASCII.
        if let Some(&byte) = key.as_bytes().iter().find(|b| !(b' '..=b'~').contains(*b)) {
            return Err(KeyError::InvalidCharacter(byte));
        }
        Ok(Self(key.into()))
    }

    /// The key's text, without quoting.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Keys identify a client's operation; they are logged only as hashes, so `Debug` shows the
/// length, never the value.
impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(<{} chars>)", self.0.len())
    }
}

/// Why an `Idempotency-Key` header was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The header was sent more than once, or carries a list of keys (`a, b`).
    Repeated,
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    TooLong(usize),
    /// A byte that is not printable ASCII, or a space or quote in a bare (unquoted) key.
    InvalidCharacter(u8),
    /// A value starting with `"` that is not a valid structured-field String.
    Malformed(String),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Repeated => {
                f.write_str("the Idempotency-Key header must be sent once, with one key")
            }
            Self::Empty => f.write_str("the Idempotency-Key header is empty"),
            Self::TooLong(len) => write!(
                f,
                "the Idempotency-Key is {len} characters long; at most {MAX_KEY_LEN} are allowed"
            ),
            Self::InvalidCharacter(byte) => write!(
                f,
                "the Idempotency-Key contains byte 0x{byte:02x}; keys are printable ASCII, \
                 and an unquoted key has no spaces or quotes"
            ),
            Self::Malformed(reason) => write!(
                f,
                "the Idempotency-Key is not a valid structured-field string: {reason}"
            ),
        }
    }
}

impl std::error::Error for KeyError {}

/// A header's name as it is usually written (`Idempotency-Key`), for messages and documents.
pub(crate) fn header_title(name: &str) -> String {
    name.split('-')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect::<Vec<_>>()
        .join("-")
}

/// Whether a value that is no valid key is a list of several (`a, b` or `"a", "b"`), as a
/// client sending the header twice gets it once a proxy has joined the two. A comma alone does
/// not make a list: `a,b` is a valid bare key.
fn is_list(raw: &[u8]) -> bool {
    sfv::Parser::new(raw)
        .parse_list()
        .is_ok_and(|list: sfv::List| list.len() > 1)
}

fn is_bare_key_byte(byte: u8) -> bool {
    (b'!'..=b'~').contains(&byte) && byte != b'"'
}

fn trim_ows(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: &str) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::parse(&HeaderValue::from_str(value).expect("valid header value"))
    }

    #[test]
    fn quoted_and_bare_forms_are_the_same_key() {
        assert_eq!(parse("\"abc\"").unwrap(), parse("abc").unwrap());
        assert_eq!(parse("  abc\t").unwrap().as_str(), "abc");
    }

    #[test]
    fn uuid_that_is_no_sf_token_is_accepted_bare() {
        let key = parse("8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap();
        assert_eq!(key.as_str(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
    }

    #[test]
    fn sf_string_escapes_and_spaces_are_decoded() {
        assert_eq!(parse(r#""a \"b\" \\c""#).unwrap().as_str(), r#"a "b" \c"#);
    }

    #[test]
    fn sf_string_parameters_are_ignored() {
        assert_eq!(parse("\"abc\";v=1").unwrap().as_str(), "abc");
    }

    /// Issue 30.2: the UUID rule takes UUIDs in either case and nothing else.
    #[test]
    fn the_uuid_rule_takes_uuids_only() {
        let rule = KeyRule::uuid();
        for good in [
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
            "8E03978E-40D5-43E8-BC93-6894A57F9324",
            "00000000-0000-0000-0000-000000000000",
        ] {
            assert!(rule.accepts(good), "{good}");
        }
        for bad in [
            "",
            "order-1",
            "8e03978e40d543e8bc936894a57f9324",
            "8e03978e-40d5-43e8-bc93-6894a57f932",
            "8e03978e-40d5-43e8-bc93-6894a57f93245",
            "8e03978e-40d5-43e8-bc93_6894a57f9324",
            "ge03978e-40d5-43e8-bc93-6894a57f9324",
            "{8e03978e-40d5-43e8-bc93-6894a57f9324}",
        ] {
            assert!(!rule.accepts(bad), "{bad}");
        }
        assert_eq!(rule.format(), Some("uuid"));
    }

    #[test]
    fn a_named_header_is_read_by_the_same_rules() {
        let name = HeaderName::from_static("x-idempotency-key");
        let mut headers = HeaderMap::new();
        headers.insert(&name, HeaderValue::from_static("\"k1\""));
        assert_eq!(
            IdempotencyKey::from_header(&headers, &name)
                .unwrap()
                .unwrap()
                .as_str(),
            "k1"
        );
        assert_eq!(IdempotencyKey::from_headers(&headers), Ok(None));
        headers.append(&name, HeaderValue::from_static("k2"));
        assert_eq!(
            IdempotencyKey::from_header(&headers, &name),
            Err(KeyError::Repeated)
        );
    }

    #[test]
    fn rejects_empty_values() {
        assert_eq!(parse(""), Err(KeyError::Empty));
        assert_eq!(parse("\"\""), Err(KeyError::Empty));
    }

    #[test]
    fn rejects_long_values_at_the_boundary() {
        assert!(parse(&"k".repeat(MAX_KEY_LEN)).is_ok());
        assert_eq!(
            parse(&"k".repeat(MAX_KEY_LEN + 1)),
            Err(KeyError::TooLong(MAX_KEY_LEN + 1))
        );
        let quoted = format!("\"{}\"", "k".repeat(MAX_KEY_LEN + 1));
        assert_eq!(parse(&quoted), Err(KeyError::TooLong(MAX_KEY_LEN + 1)));
    }

    #[test]
    fn a_list_of_keys_is_a_repeated_header() {
        // As a proxy joins two headers into one.
        assert_eq!(parse("k1, k2"), Err(KeyError::Repeated));
        assert_eq!(parse(r#""k1", "k2""#), Err(KeyError::Repeated));
        assert_eq!(parse(r#""k1","k2""#), Err(KeyError::Repeated));
        // A tab is whitespace around a list's comma too (RFC 8941 section 4.2.1), so this is two
        // keys rather than one key holding a tab (found by the property test below).
        assert_eq!(
            IdempotencyKey::parse(&HeaderValue::from_static("aA,\tA")),
            Err(KeyError::Repeated)
        );
        // A comma inside one key is just a character of it.
        assert_eq!(parse("k1,k2").unwrap().as_str(), "k1,k2");
        assert_eq!(parse(r#""k1, k2""#).unwrap().as_str(), "k1, k2");
    }

    #[test]
    fn rejects_spaces_and_quotes_in_bare_values() {
        assert_eq!(parse("a b"), Err(KeyError::InvalidCharacter(b' ')));
        assert_eq!(parse("a\"b"), Err(KeyError::InvalidCharacter(b'"')));
    }

    #[test]
    fn rejects_unterminated_and_trailing_sf_strings() {
        assert!(matches!(parse("\"abc"), Err(KeyError::Malformed(_))));
        assert!(matches!(parse("\"a\" b"), Err(KeyError::Malformed(_))));
    }

    #[test]
    fn rejects_non_ascii_bytes() {
        let value = HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap();
        assert_eq!(
            IdempotencyKey::parse(&value),
            Err(KeyError::InvalidCharacter(0xc3))
        );
        let value = HeaderValue::from_bytes(b"\"caf\xc3\xa9\"").unwrap();
        assert!(matches!(
            IdempotencyKey::parse(&value),
            Err(KeyError::Malformed(_))
        ));
    }

    #[test]
    fn repeated_header_is_rejected_even_with_equal_values() {
        let mut headers = HeaderMap::new();
        headers.append(&IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        headers.append(&IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers),
            Err(KeyError::Repeated)
        );
    }

    #[test]
    fn absent_header_is_none() {
        assert_eq!(IdempotencyKey::from_headers(&HeaderMap::new()), Ok(None));
    }

    #[test]
    fn debug_never_shows_the_key() {
        let key = parse("secret-key").unwrap();
        assert!(!format!("{key:?}").contains("secret"));
    }

    /// Hostile header values: arbitrary bytes never panic the parser, and what it accepts is
    /// a key in range that reads the same quoted or bare.
    mod properties {
        use proptest::prelude::*;

        use super::*;

        /// RFC 9651 §4.1.6: `text` as an sf-string.
        fn sf_string(text: &str) -> String {
            let mut out = String::from("\"");
            for c in text.chars() {
                if matches!(c, '"' | '\\') {
                    out.push('\\');
                }
                out.push(c);
            }
            out.push('"');
            out
        }

        /// Bytes a header value is made of, controls and obs-text included, with the ones the
        /// parser treats specially (`"`, `\\`, whitespace, parameters) made common.
        fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
            prop::collection::vec(any::<u8>(), 0..300).prop_map(|mut bytes| {
                const SPECIAL: &[u8] = b" \t\"\\;=,";
                for b in &mut bytes {
                    // Half the control bytes (which `HeaderValue` refuses, but for tab) become
                    // special ones.
                    if *b < 32 && *b % 2 == 0 {
                        *b = SPECIAL[usize::from(*b / 2) % SPECIAL.len()];
                    }
                }
                bytes
            })
        }

        fn check_accepted(key: &IdempotencyKey) -> Result<(), TestCaseError> {
            let text = key.as_str();
            prop_assert!((1..=MAX_KEY_LEN).contains(&text.len()));
            prop_assert!(text.bytes().all(|b| (b' '..=b'~').contains(&b)), "{text:?}");
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn any_value_is_parsed_without_panic(
                mut bytes in header_bytes(),
                quote in any::<bool>(),
            ) {
                if quote {
                    bytes.insert(0, b'"');
                }
                // Only what `HeaderValue` holds reaches the layer (hyper parses the same way).
                if let Ok(value) = HeaderValue::from_bytes(&bytes) {
                    let parsed = IdempotencyKey::parse(&value);
                    if let Ok(key) = &parsed {
                        check_accepted(key)?;
                        let quoted = HeaderValue::from_str(&sf_string(key.as_str())).unwrap();
                        let reparsed = IdempotencyKey::parse(&quoted);
                        prop_assert_eq!(reparsed.as_ref(), Ok(key));
                    }
                    let mut headers = HeaderMap::new();
                    headers.append(&IDEMPOTENCY_KEY, value.clone());
                    prop_assert_eq!(IdempotencyKey::from_headers(&headers), parsed.map(Some));
                }
            }

            #[test]
            fn bare_keys_read_the_same_quoted(key in "[!#-~]{1,255}") {
                let bare = parse(&key).unwrap();
                prop_assert_eq!(bare.as_str(), key.as_str());
                prop_assert_eq!(parse(&sf_string(&key)), Ok(bare));
            }

            #[test]
            fn quoted_keys_may_hold_spaces_and_escapes(key in "[ -~]{1,255}") {
                let quoted = parse(&sf_string(&key)).unwrap();
                prop_assert_eq!(quoted.as_str(), key.as_str());
            }

            #[test]
            fn surrounding_whitespace_is_ignored(
                key in "[!#-~]{1,255}",
                before in "[ \t]{0,3}",
                after in "[ \t]{0,3}",
            ) {
                let bare = parse(&format!("{before}{key}{after}")).unwrap();
                prop_assert_eq!(bare.as_str(), key.as_str());
                let quoted = format!("{before}{}{after}", sf_string(&key));
                let quoted = parse(&quoted).unwrap();
                prop_assert_eq!(quoted.as_str(), key.as_str());
            }

            #[test]
            fn keys_over_the_limit_are_rejected_in_both_forms(key in "[!#-~]{256,300}") {
                prop_assert_eq!(parse(&key), Err(KeyError::TooLong(key.len())));
                prop_assert_eq!(parse(&sf_string(&key)), Err(KeyError::TooLong(key.len())));
            }

            /// Keys without commas: a tab after a comma is the whitespace of a list (two
            /// keys, `Repeated`), which `a_list_of_keys_is_a_repeated_header` covers.
            #[test]
            fn obs_text_and_inner_tabs_are_rejected(
                key in "[!#-+--~]{2,100}",
                at in any::<prop::sample::Index>(),
                bad in prop_oneof![Just(b'\t'), 0x80u8..=0xff],
            ) {
                let mut bytes = key.into_bytes();
                let at = 1 + at.index(bytes.len() - 1);
                bytes.insert(at, bad);
                let value = HeaderValue::from_bytes(&bytes).unwrap();
                prop_assert_eq!(
                    IdempotencyKey::parse(&value),
                    Err(KeyError::InvalidCharacter(bad))
                );
                let mut quoted = b"\"".to_vec();
                quoted.extend_from_slice(&bytes);
                quoted.push(b'"');
                let value = HeaderValue::from_bytes(&quoted).unwrap();
                let quoted = IdempotencyKey::parse(&value);
                prop_assert!(matches!(quoted, Err(KeyError::Malformed(_))), "{:?}", quoted);
            }

            #[test]
            fn a_repeated_header_is_always_rejected(a in "[!#-~]{1,20}", b in "[!#-~]{1,20}") {
                let mut headers = HeaderMap::new();
                headers.append(&IDEMPOTENCY_KEY, HeaderValue::from_str(&a).unwrap());
                headers.append(&IDEMPOTENCY_KEY, HeaderValue::from_str(&b).unwrap());
                prop_assert_eq!(IdempotencyKey::from_headers(&headers), Err(KeyError::Repeated));
            }
        }
    }
}
