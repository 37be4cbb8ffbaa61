//! Arbitrary bytes as an `Idempotency-Key` header value.
//!
//! * `IdempotencyKey::parse` and `from_headers` never panic;
//! * an accepted key has 1..=255 characters, all printable ASCII (space included);
//! * `from_headers` with the value once agrees with `parse`; with it twice, it is `Repeated`;
//! * an accepted key's sf-string form (`"…"` with `\` and `"` escaped) parses to the same key,
//!   and so does its bare form when it has no space or quote.
#![no_main]

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::{
    IdempotencyKey,
    IDEMPOTENCY_KEY, KeyError, MAX_KEY_LEN,
};

fuzz_target!(|data: &[u8]| {
    // hyper hands the layer only values `HeaderValue` accepts (no NUL, CR, LF or other controls
    // but tab); anything else never reaches it.
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    let parsed = IdempotencyKey::parse(&value);

    let mut headers = HeaderMap::new();
    headers.append(&IDEMPOTENCY_KEY, value.clone());
    assert_eq!(
        IdempotencyKey::from_headers(&headers),
        parsed.clone().map(Some)
    );
    headers.append(&IDEMPOTENCY_KEY, value);
    assert_eq!(
        IdempotencyKey::from_headers(&headers),
        Err(KeyError::Repeated)
    );

    let Ok(key) = parsed else {
        return;
    };
    let text = key.as_str();
    assert!(
        (1..=MAX_KEY_LEN).contains(&text.len()),
        "accepted a key of {} characters",
        text.len()
    );
    assert!(
        text.bytes().all(|b| (b' '..=b'~').contains(&b)),
        "accepted a key with a byte that is not printable ASCII: {text:?}"
    );

    let quoted = sf_string(text);
    let value = HeaderValue::from_str(&quoted).expect("an sf-string is a valid header value");
    assert_eq!(
        IdempotencyKey::parse(&value).as_ref(),
        Ok(&key),
        "quoted form {quoted:?}"
    );

    if text.bytes().all(|b| b != b' ' && b != b'"') {
        let value = HeaderValue::from_str(text).expect("printable ASCII");
        assert_eq!(
            IdempotencyKey::parse(&value).as_ref(),
            Ok(&key),
            "bare form {text:?}"
        );
    }
});

/// RFC 9651 §4.1.6: an sf-string, escaping `\` and `"`.
fn sf_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}
