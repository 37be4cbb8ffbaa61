//! Arbitrary bytes through `canonical_json`.
//!
//! * it never panics, and its output is at most a small constant factor of its input (numbers
//!   like `1e20` are written out in full, nothing else grows);
//! * it accepts exactly what serde_json accepts as one `Value`, bar nesting deeper than both
//!   allow and documents whose objects would take more reordering than its budget allows;
//! * the canonical form is a fixed point: `canonical_json(canonical_json(x)) == canonical_json(x)`;
//! * the canonical form parses to the same JSON as the input (numbers compared as numbers,
//!   duplicate members as serde_json keeps them: the last one).
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tower_idempotency::{CanonicalJsonError, canonical_json};
use tower_idempotency_fuzz::same_json;

/// The most one input byte can grow by: `1e20` (4 bytes) is written `100000000000000000000`.
const MAX_GROWTH: usize = 8;

/// With serde_json's `raw_value` feature on (feature unification may turn it on), `Value`
/// reads an object whose first member has this name as a `RawValue`, and fails. Only the
/// comparison with `Value` is skipped for such inputs; `canonical_json` itself is still checked.
const RAW_VALUE_TOKEN: &[u8] = b"$serde_json::private::RawValue";

fuzz_target!(|data: &[u8]| {
    let canonical = canonical_json(data);
    if data
        .windows(RAW_VALUE_TOKEN.len())
        .any(|w| w == RAW_VALUE_TOKEN)
    {
        if let Ok(canonical) = canonical {
            assert_eq!(canonical_json(&canonical).ok(), Some(canonical));
        }
        return;
    }
    let parsed = serde_json::from_slice::<Value>(data);
    let canonical = match canonical {
        Ok(canonical) => canonical,
        // Valid or not, such a document is fingerprinted by its bytes.
        Err(CanonicalJsonError::OverBudget) => return,
        Err(_) => {
            // serde_json may accept a document only when it is not too deep for `Canonical`,
            // which also stops at serde_json's recursion limit: both reject the same inputs.
            assert!(
                parsed.is_err(),
                "serde_json parses what canonical_json rejects: {:?}",
                String::from_utf8_lossy(data)
            );
            return;
        }
    };
    let parsed = parsed.expect("canonical_json accepted what serde_json rejects");
    assert!(
        canonical.len() <= MAX_GROWTH * data.len() + 8,
        "{} bytes became {}",
        data.len(),
        canonical.len()
    );

    let again = canonical_json(&canonical).unwrap_or_else(|e| {
        panic!(
            "the canonical form {:?} does not parse: {e}",
            String::from_utf8_lossy(&canonical)
        )
    });
    assert_eq!(
        String::from_utf8_lossy(&again),
        String::from_utf8_lossy(&canonical),
        "not a fixed point; input {:?}",
        String::from_utf8_lossy(data)
    );

    let reparsed: Value = serde_json::from_slice(&canonical).expect("canonical form is JSON");
    assert!(
        same_json(&parsed, &reparsed),
        "canonical form {:?} means {reparsed:?}, the input {parsed:?}",
        String::from_utf8_lossy(&canonical)
    );
});
