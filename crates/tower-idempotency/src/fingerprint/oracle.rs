//! The fingerprint as computed before the streaming canonicaliser, kept as the oracle its
//! tests compare against: a deploy must not change a stored request's fingerprint.

#![allow(dead_code)]

use std::{borrow::Cow, fmt};

use http::{HeaderValue, Method, Uri};
use serde::{
    Serialize,
    de::{Deserialize, DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor},
};
use sha2::{Digest, Sha256};

use super::form::{form_decode, put_pairs};
use super::{BodyKind, Fingerprint, FingerprintMode, put_field};

/// The old `CanonicalJsonError`.
#[derive(Debug)]
pub(super) enum CanonicalJsonError {
    Invalid(serde_json::Error),
    OverBudget,
}

/// The old `Fingerprint::compute`.
pub(super) fn compute(
    mode: FingerprintMode,
    method: &Method,
    uri: &Uri,
    content_type: Option<&HeaderValue>,
    body: &[u8],
) -> Fingerprint {
    let mut hasher = Sha256::new();
    hasher.update(b"tower-idempotency/fingerprint/v1\0");
    put_field(&mut hasher, method.as_str().as_bytes());
    put_field(&mut hasher, uri.path().as_bytes());
    let query = uri.query().unwrap_or("").as_bytes();
    match mode {
        FingerprintMode::Raw => {
            put_field(&mut hasher, query);
            hasher.update(b"raw\0");
            hasher.update(body);
        }
        FingerprintMode::Semantic => {
            put_pairs(&mut hasher, query);
            match BodyKind::of(content_type) {
                BodyKind::Json if hash_json(&mut hasher, body) => {}
                BodyKind::Form => {
                    hasher.update(b"form\0");
                    put_pairs(&mut hasher, body);
                }
                BodyKind::Json | BodyKind::Other => {
                    hasher.update(b"raw\0");
                    hasher.update(body);
                }
            }
        }
    }
    Fingerprint(hasher.finalize().into())
}

/// The old body part of `Fingerprinting::fingerprint` (no headers): fields left out first.
pub(super) fn compute_excluding(
    method: &Method,
    uri: &Uri,
    content_type: Option<&HeaderValue>,
    body: &[u8],
    excluded: &[String],
) -> Fingerprint {
    let trimmed = match BodyKind::of(content_type) {
        BodyKind::Json => without_json_fields(body, excluded),
        BodyKind::Form => Some(without_form_fields(body, excluded)),
        BodyKind::Other => None,
    };
    let body = trimmed.as_deref().unwrap_or(body);
    compute(FingerprintMode::Semantic, method, uri, content_type, body)
}

fn hash_json(hasher: &mut Sha256, body: &[u8]) -> bool {
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
pub(super) fn canonical_json(input: &[u8]) -> Result<Vec<u8>, CanonicalJsonError> {
    let mut writer = Writer::new(input.len());
    writer.canonicalise(input)?;
    Ok(writer.out)
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

/// `body` without the members at `pointers`, re-serialised: `None` when it is not JSON (the
/// caller then hashes it as it is). Only object members are removed; a pointer that names
/// nothing, or an array element, is ignored.
fn without_json_fields(body: &[u8], pointers: &[String]) -> Option<Vec<u8>> {
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    for pointer in pointers {
        let Some((parent, last)) = pointer.rsplit_once('/') else {
            continue;
        };
        let last = last.replace("~1", "/").replace("~0", "~");
        if let Some(serde_json::Value::Object(members)) = value.pointer_mut(parent) {
            members.remove(&last);
        }
    }
    serde_json::to_vec(&value).ok()
}

/// A form body without the fields named by top-level pointers (`/name`), re-encoded pair by pair
/// as it came.
fn without_form_fields(body: &[u8], pointers: &[String]) -> Vec<u8> {
    let names: Vec<String> = pointers
        .iter()
        .filter_map(|pointer| pointer.strip_prefix('/'))
        .filter(|name| !name.contains('/'))
        .map(|name| name.replace("~1", "/").replace("~0", "~"))
        .collect();
    let kept: Vec<&[u8]> = body
        .split(|b| *b == b'&')
        .filter(|pair| {
            let name = pair.split(|b| *b == b'=').next().unwrap_or_default();
            !names
                .iter()
                .any(|excluded| *form_decode(name) == *excluded.as_bytes())
        })
        .collect();
    kept.join(&b'&')
}
