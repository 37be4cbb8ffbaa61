//! Structured requests through `Fingerprint::compute`.
//!
//! * Semantic mode: one JSON document written twice, with its object members permuted, other
//!   whitespace and other spellings of the same numbers (`7`, `7.0`, `7e0`), has one
//!   fingerprint, unless sorting either writing's objects is over the reordering budget (then
//!   each is fingerprinted by its bytes); two documents that mean different things have
//!   different ones;
//! * Raw mode: different body bytes, or different query strings, give different fingerprints,
//!   and the same bytes the same one.
#![no_main]

use arbitrary::Arbitrary;
use http::{HeaderValue, Method, Uri};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tower_idempotency::{
    Fingerprint, FingerprintMode,
    CanonicalJsonError, canonical_json,
};
use tower_idempotency_fuzz::same_json;

/// Deeper than this is written as `null`, far below serde_json's limit of 128.
const MAX_DEPTH: usize = 24;

/// Integers below this magnitude may be written as `n.0` or `ne0` and stay the same number.
const EXACT: u64 = 1 << 53;

#[derive(Arbitrary, Debug)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    doc: Json,
    other: Json,
    /// Drives member order, whitespace and number spelling of the second writing.
    seed: u64,
    raw_a: Vec<u8>,
    raw_b: Vec<u8>,
    query_a: String,
    query_b: String,
}

fuzz_target!(|input: Input| {
    let plain = write(&input.doc, None);
    let mut rng = Rng(input.seed | 1);
    let shuffled = write(&input.doc, Some(&mut rng));
    let json = Some("application/json");

    let a = fingerprint(FingerprintMode::Semantic, "", json, plain.as_bytes());
    let b = fingerprint(FingerprintMode::Semantic, "", json, shuffled.as_bytes());
    match (
        canonical_json(plain.as_bytes()),
        canonical_json(shuffled.as_bytes()),
    ) {
        (Ok(x), Ok(y)) => {
            assert_eq!(x, y, "{plain} vs {shuffled}");
            assert_eq!(a, b, "{plain} vs {shuffled}");
        }
        // Fingerprinted by its bytes: the two writings are two requests.
        (Err(CanonicalJsonError::OverBudget), _) | (_, Err(CanonicalJsonError::OverBudget)) => {}
        (x, y) => panic!("wrote invalid JSON: {plain} / {shuffled}: {x:?} / {y:?}"),
    }

    let other = write(&input.other, None);
    // With serde_json's `raw_value` feature on, `Value` cannot read an object whose first
    // member has this name; such documents are not compared through `Value`.
    if [&plain, &other]
        .iter()
        .any(|doc| doc.contains("$serde_json::private::RawValue"))
    {
        return;
    }
    let (Ok(doc_value), Ok(other_value)) = (
        serde_json::from_str::<Value>(&plain),
        serde_json::from_str::<Value>(&other),
    ) else {
        panic!("wrote invalid JSON: {plain} / {other}");
    };
    if !same_json(&doc_value, &other_value) {
        let c = fingerprint(FingerprintMode::Semantic, "", json, other.as_bytes());
        assert_ne!(a, c, "{plain} and {other} collide");
    }

    for mode in [FingerprintMode::Raw, FingerprintMode::Semantic] {
        let x = fingerprint(mode, "", None, &input.raw_a);
        let y = fingerprint(mode, "", None, &input.raw_b);
        assert_eq!(input.raw_a == input.raw_b, x == y, "{mode:?} raw bodies");
    }
    // What the server sees of a query: `Uri` drops a `#fragment`, and may refuse the text.
    let (Some(query_a), Some(query_b)) = (query_of(&input.query_a), query_of(&input.query_b))
    else {
        return;
    };
    let x = fingerprint(FingerprintMode::Raw, &query_a, None, b"");
    let y = fingerprint(FingerprintMode::Raw, &query_b, None, b"");
    assert_eq!(
        query_a == query_b,
        x == y,
        "raw queries {query_a:?} and {query_b:?}"
    );
    // A query byte is never mistaken for a body byte.
    if !query_a.is_empty() {
        let moved = fingerprint(FingerprintMode::Raw, "", None, query_a.as_bytes());
        assert_ne!(x, moved, "query {query_a:?} collides with a body");
    }
});

fn fingerprint(
    mode: FingerprintMode,
    query: &str,
    content_type: Option<&'static str>,
    body: &[u8],
) -> Fingerprint {
    let uri: Uri = format!("/v1/charges?{query}")
        .parse()
        .expect("checked by the caller");
    Fingerprint::compute(
        mode,
        &Method::POST,
        &uri,
        content_type.map(HeaderValue::from_static).as_ref(),
        body,
    )
}

/// The query a request for `/v1/charges?{query}` has, if that URI parses.
fn query_of(query: &str) -> Option<String> {
    let uri: Uri = format!("/v1/charges?{query}").parse().ok()?;
    Some(uri.query().unwrap_or("").to_owned())
}

/// xorshift64: deterministic choices from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn space(&mut self, out: &mut String) {
        const WS: [&str; 5] = ["", " ", "\n", "\t", "\r\n  "];
        out.push_str(WS[self.below(WS.len())]);
    }
}

/// Writes `doc` as JSON: compactly and in order without `rng`, otherwise with members shuffled,
/// whitespace between tokens and integers spelt in other ways. Repeated member names keep only
/// their first occurrence, so that any order means the same document.
fn write(doc: &Json, rng: Option<&mut Rng>) -> String {
    let mut out = String::new();
    write_into(&mut out, doc, rng, 0);
    out
}

fn write_into(out: &mut String, doc: &Json, mut rng: Option<&mut Rng>, depth: usize) {
    if let Some(rng) = rng.as_deref_mut() {
        rng.space(out);
    }
    match doc {
        _ if depth >= MAX_DEPTH => out.push_str("null"),
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Int(n) => {
            let style = rng.as_deref_mut().map_or(0, |r| r.below(3));
            match style {
                1 if n.unsigned_abs() < EXACT => out.push_str(&format!("{n}.0")),
                2 if n.unsigned_abs() < EXACT => out.push_str(&format!("{n}e0")),
                _ => out.push_str(&n.to_string()),
            }
        }
        Json::Uint(n) => out.push_str(&n.to_string()),
        Json::Float(f) if f.is_finite() => {
            out.push_str(&serde_json::to_string(f).expect("finite"));
        }
        Json::Float(_) => out.push_str("null"),
        Json::Str(s) => out.push_str(&serde_json::to_string(s).expect("a string")),
        Json::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_into(out, item, rng.as_deref_mut(), depth + 1);
            }
            if let Some(rng) = rng.as_deref_mut() {
                rng.space(out);
            }
            out.push(']');
        }
        Json::Object(members) => {
            let mut unique: Vec<&(String, Json)> = Vec::new();
            for member in members {
                if !unique.iter().any(|(name, _)| *name == member.0) {
                    unique.push(member);
                }
            }
            if let Some(rng) = rng.as_deref_mut() {
                for i in (1..unique.len()).rev() {
                    unique.swap(i, rng.below(i + 1));
                }
            }
            out.push('{');
            for (i, (name, value)) in unique.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                if let Some(rng) = rng.as_deref_mut() {
                    rng.space(out);
                }
                out.push_str(&serde_json::to_string(name).expect("a string"));
                if let Some(rng) = rng.as_deref_mut() {
                    rng.space(out);
                }
                out.push(':');
                write_into(out, value, rng.as_deref_mut(), depth + 1);
            }
            if let Some(rng) = rng {
                rng.space(out);
            }
            out.push('}');
        }
    }
}
