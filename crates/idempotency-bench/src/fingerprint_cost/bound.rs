//! The work any canonical fingerprint of a body must do, done with well-kept parts: the
//! body decoded as the canonical form needs it, each object's names (or the pairs) sorted,
//! and SHA-256 over as many bytes as the canonical form holds (timed apart, as plain bytes of
//! that length). It builds nothing else.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// Form bodies and queries with more pairs than this are hashed as bytes, not decoded
/// (mirrors the library's own limit).
const MAX_FORM_PAIRS: usize = 10_000;

/// Bytes hashed per decoded pair besides its name and value: their two length prefixes.
const PAIR_OVERHEAD: usize = 16;

/// Decodes `body` and sorts what the canonical form sorts, leaving out top-level members or
/// pairs named in `excluded`; the number of names sorted, or `None` if the JSON is invalid.
pub(super) fn decode_and_sort(json: bool, body: &[u8], excluded: &[&[u8]]) -> Option<usize> {
    if json {
        let mut state = State::default();
        let mut reader = serde_json::Deserializer::from_slice(body);
        ValueSeed {
            state: &mut state,
            excluded,
        }
        .deserialize(&mut reader)
        .ok()?;
        reader.end().ok()?;
        Some(state.sorted)
    } else if excluded.is_empty() && more_pairs_than(body, MAX_FORM_PAIRS) {
        Some(0)
    } else {
        // Leaving pairs out decodes every name; more than the limit kept are hashed as bytes.
        let mut pairs = Vec::new();
        let mut kept = 0;
        for (name, value) in form_urlencoded::parse(body) {
            if !excluded.contains(&name.as_bytes()) {
                kept += 1;
                if kept <= MAX_FORM_PAIRS {
                    pairs.push((name, value));
                }
            }
        }
        if kept > MAX_FORM_PAIRS {
            return Some(0);
        }
        pairs.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        Some(pairs.len())
    }
}

/// Walks `body` as [`decode_and_sort`] does, through the same visitor calls, keeping nothing:
/// the time between the two is what sorting and rewriting add to a parse.
pub(super) fn walk(body: &[u8]) -> bool {
    let mut reader = serde_json::Deserializer::from_slice(body);
    Walk.deserialize(&mut reader).is_ok() && reader.end().is_ok()
}

/// How many bytes the canonical form of a form body or query hashes, without `excluded`.
pub(super) fn canonical_pairs_len(body: &[u8], excluded: &[&[u8]]) -> usize {
    let kept: Vec<_> = form_urlencoded::parse(body)
        .filter(|(name, _)| !excluded.contains(&name.as_bytes()))
        .collect();
    if kept.len() > MAX_FORM_PAIRS {
        return body.len();
    }
    kept.iter()
        .map(|(name, value)| name.len() + value.len() + PAIR_OVERHEAD)
        .sum::<usize>()
        + 8
}

/// How many bytes the canonical form of a JSON body hashes, without top-level `excluded`.
pub(super) fn canonical_json_len(body: &[u8], excluded: &[&[u8]]) -> usize {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return body.len();
    };
    if let Some(object) = value.as_object_mut() {
        for name in excluded {
            object.remove(std::str::from_utf8(name).unwrap_or_default());
        }
    }
    let bytes = serde_json::to_vec(&value).expect("a value serialises");
    tower_idempotency::canonical_json(&bytes).map_or(body.len(), |c| c.len())
}

fn more_pairs_than(encoded: &[u8], limit: usize) -> bool {
    encoded
        .split(|b| *b == b'&')
        .filter(|pair| !pair.is_empty())
        .nth(limit)
        .is_some()
}

/// A member name: in the input when it has no escapes, else decoded into the arena.
#[derive(Clone, Copy)]
enum Name<'de> {
    Input(&'de [u8]),
    Arena(usize, usize),
}

impl<'de> Name<'de> {
    fn bytes<'a>(self, arena: &'a [u8]) -> &'a [u8]
    where
        'de: 'a,
    {
        match self {
            Name::Input(bytes) => bytes,
            Name::Arena(start, end) => &arena[start..end],
        }
    }
}

/// What the walk keeps: escaped names decoded, the names of every open object, formatted
/// numbers, and a count of names sorted.
#[derive(Default)]
struct State<'de> {
    arena: Vec<u8>,
    names: Vec<Name<'de>>,
    formatted: Vec<u8>,
    sorted: usize,
}

/// Walks one value; `excluded` applies to the members of the top-level object only.
struct ValueSeed<'s, 'de> {
    state: &'s mut State<'de>,
    excluded: &'s [&'s [u8]],
}

impl<'de> DeserializeSeed<'de> for ValueSeed<'_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    // Strings arrive decoded (borrowed when they have no escapes): nothing more to do.
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    /// An integral double came from a token with a fraction or exponent, which the canonical
    /// form always rewrites as an integer; other doubles are counted as already canonical.
    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        if v.fract() == 0.0 && v.abs() < 9_007_199_254_740_992.0 {
            self.state.formatted.clear();
            serde_json::to_writer(&mut self.state.formatted, &(v as i64)).expect("into a Vec");
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let state = self.state;
        while seq
            .next_element_seed(ValueSeed {
                state: &mut *state,
                excluded: &[],
            })?
            .is_some()
        {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let state = self.state;
        let first = state.names.len();
        while let Some(name) = map.next_key_seed(NameSeed(&mut *state))? {
            if !self.excluded.contains(&name.bytes(&state.arena)) {
                state.names.push(name);
            }
            map.next_value_seed(ValueSeed {
                state: &mut *state,
                excluded: &[],
            })?;
        }
        let (arena, names) = (&state.arena, &mut state.names[first..]);
        names.sort_unstable_by(|a, b| a.bytes(arena).cmp(b.bytes(arena)));
        state.sorted += names.len();
        state.names.truncate(first);
        if first == 0 {
            state.arena.clear();
        }
        Ok(())
    }
}

/// Reads one member name, decoded.
struct NameSeed<'s, 'de>(&'s mut State<'de>);

impl<'de> DeserializeSeed<'de> for NameSeed<'_, 'de> {
    type Value = Name<'de>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Name<'de>, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameSeed<'_, 'de> {
    type Value = Name<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E>(self, name: &'de str) -> Result<Name<'de>, E> {
        Ok(Name::Input(name.as_bytes()))
    }

    fn visit_str<E>(self, name: &str) -> Result<Name<'de>, E> {
        let start = self.0.arena.len();
        self.0.arena.extend_from_slice(name.as_bytes());
        Ok(Name::Arena(start, self.0.arena.len()))
    }
}

/// Visits every value, member name and element and keeps nothing.
#[derive(Clone, Copy)]
struct Walk;

impl<'de> DeserializeSeed<'de> for Walk {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key_seed(WalkName)?.is_some() {
            map.next_value_seed(self)?;
        }
        Ok(())
    }
}

/// Reads a member name and keeps nothing.
struct WalkName;

impl<'de> DeserializeSeed<'de> for WalkName {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(Walk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_object_is_sorted_and_exclusions_are_left_out() {
        let body = br#"{"b":{"y":1,"x":2},"a":[{"\u0063":1}],"z":0}"#;
        assert_eq!(decode_and_sort(true, body, &[]), Some(6));
        assert_eq!(decode_and_sort(true, body, &[b"z"]), Some(5));
        assert_eq!(decode_and_sort(true, b"{\"a\":", &[]), None);
        assert!(walk(body) && !walk(b"[1,"));
    }

    #[test]
    fn canonical_lengths_follow_the_canonical_form() {
        // `{"a":5000}` once `b` is left out, and the 5e3 rewritten.
        assert_eq!(canonical_json_len(br#"{ "b": 1, "a": 5e3 }"#, &[b"b"]), 10);
        // Two pairs, `a=1` and `b=22`: 8 + (1 + 1 + 16) + (1 + 2 + 16).
        assert_eq!(canonical_pairs_len(b"b=22&a=1", &[]), 45);
        assert_eq!(canonical_pairs_len(b"b=22&a=1", &[b"a"]), 27);
    }
}
