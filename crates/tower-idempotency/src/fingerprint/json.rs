//! JSON bodies in canonical form: members sorted, whitespace dropped, strings and numbers
//! written one way, within a reordering budget.

use super::*;

/// Hashes the canonical form of a JSON body; `false` (nothing hashed) when it is not JSON or
/// over the reordering budget, and the caller hashes the raw bytes instead.
pub(super) fn hash_json(hasher: &mut Sha256, body: &[u8]) -> bool {
    match canonical_json(body) {
        Ok(canonical) => {
            hasher.update(b"json\0");
            hasher.update(&canonical);
            true
        }
        Err(_) => false,
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
    let mut writer = Writer::new(input.len());
    writer.canonicalise(input)?;
    Ok(writer.out)
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

/// The canonical form being written, and what sorting objects may still cost.
struct Writer {
    out: Vec<u8>,
    /// An out-of-order object's members wait here while they are written back sorted; one
    /// buffer for every object.
    scratch: Vec<u8>,
    /// Bytes of out-of-order objects that may still be moved into place.
    budget: usize,
    /// Bytes of out-of-order objects moved into place so far.
    moved: usize,
    over_budget: bool,
}

impl Writer {
    fn new(input_len: usize) -> Self {
        Self {
            // The canonical form is never longer than the input, except for the rare number
            // written shorter than its canonical form (`1e9`).
            out: Vec::with_capacity(input_len),
            scratch: Vec::new(),
            budget: reorder_budget(input_len),
            moved: 0,
            over_budget: false,
        }
    }

    fn canonicalise(&mut self, input: &[u8]) -> Result<(), CanonicalJsonError> {
        let mut deserializer = serde_json::Deserializer::from_slice(input);
        let read = Canonical(self)
            .deserialize(&mut deserializer)
            .and_then(|()| deserializer.end());
        match read {
            Ok(()) => Ok(()),
            Err(_) if self.over_budget => Err(CanonicalJsonError::OverBudget),
            Err(error) => Err(CanonicalJsonError::Invalid(error)),
        }
    }
}

/// Writes the canonical form of the JSON value it is given to the end of its writer's buffer:
/// values are written as they are read, into one buffer, and an object's members are only
/// moved when they arrive out of order.
struct Canonical<'a>(&'a mut Writer);

impl<'de> DeserializeSeed<'de> for Canonical<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// Integers below this magnitude are exact as doubles, so `1.0`, `1e0` and `1` meet there.
const EXACT_INTEGER_LIMIT: f64 = 9_007_199_254_740_992.0; // 2^53

impl<'de> Visitor<'de> for Canonical<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.0.out.extend_from_slice(b"null");
        Ok(())
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.0
            .out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        write_json(&mut self.0.out, &v);
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        write_json(&mut self.0.out, &v);
        Ok(())
    }

    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        if v.fract() == 0.0 && v.abs() < EXACT_INTEGER_LIMIT {
            // Exact: the value is an integer below 2^53.
            write_json(&mut self.0.out, &(v as i64));
            return Ok(());
        }
        // JSON numbers are finite, so serde_json writes ryu's shortest round-trip form.
        write_json(&mut self.0.out, &v);
        Ok(())
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        write_json(&mut self.0.out, v);
        Ok(())
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<(), E> {
        write_unescaped(&mut self.0.out, v);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let writer = self.0;
        writer.out.push(b'[');
        let mut first = true;
        loop {
            let comma = writer.out.len();
            if !first {
                writer.out.push(b',');
            }
            if seq.next_element_seed(Canonical(&mut *writer))?.is_none() {
                writer.out.truncate(comma);
                break;
            }
            first = false;
        }
        writer.out.push(b']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let writer = self.0;
        let start = writer.out.len();
        writer.out.push(b'{');
        // Each member's name and where its `"name":value` was written.
        let mut members: Vec<(Name<'de>, usize, usize)> = Vec::new();
        while let Some(name) = map.next_key::<Name<'de>>()? {
            let out = &mut writer.out;
            if !members.is_empty() {
                out.push(b',');
            }
            let at = out.len();
            match &name.0 {
                Cow::Borrowed(name) => write_unescaped(out, name),
                Cow::Owned(name) => write_json(out, name.as_str()),
            }
            out.push(b':');
            map.next_value_seed(Canonical(&mut *writer))?;
            members.push((name, at, writer.out.len()));
        }
        writer.out.push(b'}');
        // Stable: members with the same name keep their order. Usually already in order.
        if !members.is_sorted_by(|(a, ..), (b, ..)| a.0 <= b.0) {
            // Each level of out-of-order nesting moves everything inside it once more: the
            // budget keeps the total linear in the input.
            let length = writer.out.len() - start;
            if length > writer.budget {
                writer.over_budget = true;
                return Err(A::Error::custom("over the reordering budget"));
            }
            writer.budget -= length;
            writer.moved += length;
            members.sort_by(|(a, ..), (b, ..)| a.0.cmp(&b.0));
            let Writer { out, scratch, .. } = writer;
            scratch.clear();
            scratch.extend_from_slice(&out[start..]);
            out.truncate(start);
            out.push(b'{');
            for (i, (_, from, to)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(&scratch[from - start..to - start]);
            }
            out.push(b'}');
        }
        Ok(())
    }
}

/// An object member's name, borrowed from the input unless it had escapes to decode.
struct Name<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NameVisitor;

        impl<'de> Visitor<'de> for NameVisitor {
            type Value = Name<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object member name")
            }

            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Borrowed(v)))
            }

            fn visit_str<E>(self, v: &str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(v.to_owned())))
            }
        }

        deserializer.deserialize_str(NameVisitor)
    }
}

/// Appends a number or string as serde_json writes it: strings minimally escaped, integers in
/// decimal, other numbers in ryu's shortest round-trip form.
fn write_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    // Serialising a number or `str` into a `Vec` cannot fail.
    let _ = value.serialize(&mut serde_json::Serializer::new(out));
}

/// Appends a string read straight from the input, quoted. Borrowed from the input, it held no
/// escape, so none of what minimal escaping escapes (`"`, `\`, control characters, which JSON
/// does not allow unescaped): it is its own canonical form, and is copied without a second scan.
fn write_unescaped(out: &mut Vec<u8>, v: &str) {
    out.reserve(v.len() + 2);
    out.push(b'"');
    out.extend_from_slice(v.as_bytes());
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let mut writer = Writer::new(doc.len());
        assert!(matches!(
            writer.canonicalise(doc.as_bytes()),
            Err(CanonicalJsonError::OverBudget)
        ));
        assert!(
            writer.moved <= reorder_budget(doc.len()),
            "moved {} bytes for {}",
            writer.moved,
            doc.len()
        );
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
        let mut writer = Writer::new(doc.len());
        writer.canonicalise(doc.as_bytes()).unwrap();
        assert_eq!(String::from_utf8(writer.out).unwrap(), sorted);
        assert!(writer.moved <= reorder_budget(doc.len()));
    }
}
