//! JSON bodies in canonical form: members sorted, whitespace dropped, strings and numbers
//! written one way, within a reordering budget; computed by the streaming
//! canonicaliser in `canon`.

use std::fmt;

use serde::de::Error as _;
use sha2::{Digest, Sha256};

use super::canon::{Rules, Sink, Stop, Work, canonicalise};
use super::pointer::Exclusions;

/// Hashes the canonical form of a JSON body; `false` (the hasher as it was) when it is not
/// JSON or over the reordering budget, and the caller hashes the raw bytes instead.
pub(super) fn hash_json(hasher: &mut Sha256, body: &[u8]) -> bool {
    let rules = Rules {
        budget: Some(reorder_budget(body.len())),
        exclusions: None,
    };
    hash_canonical(hasher, body, rules)
}

/// Hashes the canonical form of a JSON body without the members named by `excluded`, and
/// with each repeated member name's last value only; `false` as for [`hash_json`].
///
/// This is the canonical form of the body read into a `serde_json::Value`, those members
/// removed and written out again, as fingerprints with fields left out were first computed:
/// written out sorted, it is never over the reordering budget.
pub(super) fn hash_json_excluding(hasher: &mut Sha256, body: &[u8], excluded: &Exclusions) -> bool {
    let rules = Rules {
        budget: None,
        exclusions: Some(excluded),
    };
    hash_canonical(hasher, body, rules)
}

fn hash_canonical(hasher: &mut Sha256, body: &[u8], rules: Rules<'_>) -> bool {
    // The canonical form is hashed as it is written: a body found not to be JSON halfway
    // leaves the hasher as it was before.
    let before = hasher.clone();
    hasher.update(b"json\0");
    let mut sink = HashSink {
        hasher,
        buffer: Vec::with_capacity(HASH_CHUNK),
    };
    let done = canonicalise(body, rules, &mut sink);
    sink.flush();
    if done.is_err() {
        *hasher = before;
    }
    done.is_ok()
}

/// Pieces of canonical form are gathered up to this size before hashing.
const HASH_CHUNK: usize = 16 * 1024;

/// Hashes what it is given in chunks: the many small pieces of a sorted object cost one
/// copy each rather than one hasher call each.
struct HashSink<'h> {
    hasher: &'h mut Sha256,
    buffer: Vec<u8>,
}

impl HashSink<'_> {
    fn flush(&mut self) {
        self.hasher.update(&self.buffer);
        self.buffer.clear();
    }
}

impl Sink for HashSink<'_> {
    fn put(&mut self, bytes: &[u8]) {
        if bytes.len() >= HASH_CHUNK {
            self.flush();
            self.hasher.update(bytes);
            return;
        }
        self.buffer.extend_from_slice(bytes);
        if self.buffer.len() >= HASH_CHUNK {
            self.flush();
        }
    }
}

/// The canonical form of a JSON document (see the [`Fingerprint`](crate::Fingerprint)), computed in
/// one pass.
///
/// Nesting deeper than serde_json's recursion limit (128) is an error, and the members it moves
/// to sort objects are bounded by the [reordering budget](crate::Fingerprint#bounded-work), so hostile input
/// can exhaust neither the stack nor the CPU.
///
/// # Errors
///
/// When `input` is not a single valid JSON document, or sorting its objects would exceed the
/// budget.
pub fn canonical_json(input: &[u8]) -> Result<Vec<u8>, CanonicalJsonError> {
    canonical_json_with_work(input).map(|(out, _)| out)
}

fn canonical_json_with_work(input: &[u8]) -> Result<(Vec<u8>, Work), CanonicalJsonError> {
    let rules = Rules {
        budget: Some(reorder_budget(input.len())),
        exclusions: None,
    };
    let mut out = Vec::with_capacity(input.len());
    match canonicalise(input, rules, &mut out) {
        Ok(work) => Ok((out, work)),
        Err(Stop::OverBudget) => Err(CanonicalJsonError::OverBudget),
        Err(Stop::Invalid(at)) => Err(CanonicalJsonError::Invalid(serde_json::Error::custom(
            format_args!("not a single JSON document (byte {at})"),
        ))),
    }
}

/// Why [`canonical_json`] gave no canonical form.
#[derive(Debug)]
#[non_exhaustive]
pub enum CanonicalJsonError {
    /// The input is not a single JSON document, or nests deeper than 128.
    Invalid(serde_json::Error),
    /// Sorting the members of its objects would move more than the
    /// [reordering budget](crate::Fingerprint#bounded-work) allows; the input was not read to its end.
    OverBudget,
}

impl fmt::Display for CanonicalJsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(_) => f.write_str("not a single JSON document"),
            Self::OverBudget => f.write_str(
                "sorting the members of its objects would move more than 4 times its length \
                 plus 64 KiB",
            ),
        }
    }
}

impl std::error::Error for CanonicalJsonError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Invalid(error) => Some(error),
            Self::OverBudget => None,
        }
    }
}

/// The bytes of out-of-order objects that canonicalising `input_len` bytes may move into place.
fn reorder_budget(input_len: usize) -> usize {
    input_len.saturating_mul(4).saturating_add(64 * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::FingerprintMode;
    use crate::fingerprint::testing::*;

    #[test]
    fn json_objects_are_sorted_and_compacted() {
        assert_eq!(
            canon(r#" { "b" : [ 1 , { "d":null, "c":true } ], "a" : "x" } "#),
            r#"{"a":"x","b":[1,{"c":true,"d":null}]}"#
        );
    }

    #[test]
    fn json_numbers_compare_as_numbers() {
        assert_eq!(
            canon("[1, 1.0, 1e0, 100, 1e2, -0, 0.5, 1.50]"),
            "[1,1,1,100,100,0,0.5,1.5]"
        );
        assert_eq!(
            canon("[18446744073709551615, -9223372036854775808]"),
            "[18446744073709551615,-9223372036854775808]"
        );
        assert_eq!(
            canon("[9007199254740993, 1e300]"),
            "[9007199254740993,1e+300]"
        );
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", JSON, r#"{"amount":1000}"#),
            fp(FingerprintMode::Semantic, "/", JSON, r#"{"amount":1001}"#),
        );
    }

    #[test]
    fn json_strings_are_escaped_minimally() {
        assert_eq!(canon(r#""caf\u00e9 \/ \u0041 \n""#), "\"café / A \\n\"");
        // A string without escapes is copied from the input; one with them is decoded and
        // escaped again: the two meet.
        assert_eq!(
            canon(r#"{"caf\u00e9":"\ud83d\ude00 \/"}"#),
            canon(r#"{"café":"😀 /"}"#)
        );
        assert_eq!(canon(r#"{"café":"😀 /"}"#), r#"{"café":"😀 /"}"#);
    }

    #[test]
    fn json_duplicate_members_keep_their_order() {
        assert_eq!(canon(r#"{"b":1,"a":2,"b":3}"#), r#"{"a":2,"b":1,"b":3}"#);
        assert_ne!(canon(r#"{"a":1,"a":2}"#), canon(r#"{"a":2,"a":1}"#));
    }

    #[test]
    fn canonical_json_is_a_fixed_point() {
        for doc in [
            r#"{"z":{"y":[{"b":1,"a":2}]},"a":"\n"}"#,
            "[]",
            "{}",
            "\"\"",
            "0",
        ] {
            let once = canonical_json(doc.as_bytes()).unwrap();
            assert_eq!(canonical_json(&once).unwrap(), once);
        }
    }

    #[test]
    fn deep_json_is_an_error_not_a_stack_overflow() {
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(canonical_json(deep.as_bytes()).is_err());
    }

    /// `depth` nested objects `{"z":…,"a":0}`, each out of order, around a string that pads the
    /// document to `size` bytes: sorting moves everything inside each object once per level.
    fn deep_unordered_json(depth: usize, size: usize) -> String {
        let (open, close) = (r#"{"z":"#, r#","a":0}"#);
        let padding = size.saturating_sub(depth * (open.len() + close.len()) + 2);
        let mut doc = open.repeat(depth);
        doc.push('"');
        doc.push_str(&"x".repeat(padding));
        doc.push('"');
        doc.push_str(&close.repeat(depth));
        doc
    }

    #[test]
    fn deep_out_of_order_json_stops_at_the_reordering_budget() {
        let doc = deep_unordered_json(120, 2 << 20);
        assert!(matches!(
            canonical_json(doc.as_bytes()),
            Err(CanonicalJsonError::OverBudget)
        ));
        // Hashed as its raw bytes, as a body that is not JSON is.
        assert_eq!(
            fp(FingerprintMode::Semantic, "/", JSON, &doc),
            fp(FingerprintMode::Semantic, "/", Some("text/plain"), &doc),
        );
    }

    #[test]
    fn deep_out_of_order_json_within_the_budget_is_sorted() {
        let depth = 16;
        let doc = deep_unordered_json(depth, 4096);
        let open = r#"{"a":0,"z":"#;
        let mut sorted = open.repeat(depth);
        sorted.push('"');
        sorted.push_str(&"x".repeat(doc.len() - depth * (open.len() + 1) - 2));
        sorted.push('"');
        sorted.push_str(&"}".repeat(depth));
        let (out, work) = canonical_json_with_work(doc.as_bytes()).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), sorted);
        assert!(work.moved <= reorder_budget(doc.len()));
    }
}
