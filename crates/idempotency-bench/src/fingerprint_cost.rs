//! The `fingerprint-costs` subcommand: what fingerprinting each hostile body shape costs, in
//! process, as a ratio to hashing plain bytes of the same size (issue 34, point 6: at most 5×)
//! and to the bound: the work any canonical fingerprint of that body must do.
//!
//! ```text
//! cargo run --release -p idempotency-bench -- fingerprint-costs [--iterations N] [--only NAME]
//! ```

use std::{hint::black_box, time::Instant};

use http::{HeaderValue, Method, Uri};
use tower_idempotency::{Fingerprint, FingerprintMode};

use crate::scenario::HOSTILE_BODY_BYTES;

mod bound;

/// The target: no body shape costs more than this many times plain bytes of its size...
const TARGET_RATIO: f64 = 5.0;

/// ...or, where the work any canonical fingerprint must do costs more than that, this many
/// times that work (the bound, see [`bound`]).
const TARGET_OVER_BOUND: f64 = 2.0;

/// A body shape, sent as `content_type` (a query shape is sent in the URI, with no body).
struct Shape {
    name: &'static str,
    content_type: &'static str,
    body: Vec<u8>,
    query: bool,
}

/// Fields left out, and what they match in the shapes.
const EXCLUSIONS: &[(&str, &[&str])] = &[
    ("—", &[]),
    // Names nothing in any shape.
    ("`/metadata`", &["/metadata"]),
    // Every member of the repeated-key object, every pair of the million-pair form.
    ("`/a`", &["/a"]),
];

/// Runs every shape with every exclusion set `iterations` times and prints the table.
pub(crate) fn run(iterations: usize, only: &str) {
    let shapes = shapes(HOSTILE_BODY_BYTES);
    println!(
        "Target: ≤ {TARGET_RATIO}× plain bytes, or within {TARGET_OVER_BOUND}× of the bound.\n"
    );
    println!(
        "| shape | fields left out | bytes | fingerprint (median) | plain bytes | bare parse \
         | bound | ratio | bound ratio | ratio to bare parse | ratio to bound | result |"
    );
    println!("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|");
    for shape in shapes.iter().filter(|shape| shape.name.contains(only)) {
        let plain = median(iterations, || plain_fingerprint(shape.body.len()));
        let parse = median(iterations, || bare_parse(shape));
        for (label, pointers) in EXCLUSIONS {
            let excluded: Vec<String> = pointers.iter().map(|p| (*p).to_owned()).collect();
            let took = median(iterations, || fingerprint(shape, &excluded));
            let bound = bound_of(iterations, shape, parse, pointers);
            let (ratio, over_bound) = (took / plain, took / bound);
            let pass = ratio <= TARGET_RATIO || over_bound <= TARGET_OVER_BOUND;
            println!(
                "| {} | {label} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {ratio:.1}× \
                 | {:.1}× | {:.1}× | {over_bound:.1}× | {} |",
                shape.name,
                shape.body.len(),
                took * 1e3,
                plain * 1e3,
                parse * 1e3,
                bound * 1e3,
                bound / plain,
                took / parse,
                if pass { "PASS" } else { "FAIL" },
            );
        }
    }
}

/// The bound's median, in seconds: what any canonical fingerprint must do beyond reading the
/// body. JSON: the bare parse, plus what sorting every object's decoded names and rewriting
/// its integral doubles add to a walk of the same visits (so decoding strings and parsing
/// numbers, which the walk does too, count for nothing); forms and queries: every pair
/// decoded and sorted by name. Either way plus hashing as many bytes as the canonical form
/// holds with `pointers` (top-level) left out.
fn bound_of(iterations: usize, shape: &Shape, parse: f64, pointers: &[&str]) -> f64 {
    let excluded: Vec<&[u8]> = pointers
        .iter()
        .map(|p| p.trim_start_matches('/').as_bytes())
        .collect();
    let json = shape.content_type == "application/json";
    let (canonical_len, read) = if json {
        let sorted = median(iterations, || {
            bound::decode_and_sort(true, &shape.body, &excluded)
        });
        let walked = median(iterations, || bound::walk(&shape.body));
        let len = bound::canonical_json_len(&shape.body, &excluded);
        (len, parse + (sorted - walked).max(0.0))
    } else {
        let len = bound::canonical_pairs_len(&shape.body, &excluded);
        let sorted = median(iterations, || {
            bound::decode_and_sort(false, &shape.body, &excluded)
        });
        (len, sorted)
    };
    read + median(iterations, || plain_fingerprint(canonical_len))
}

/// Validates the body as a fast, well-kept parser reads it, building nothing: serde_json
/// into `IgnoredAny` for JSON, `form_urlencoded::parse` iterated to its end for pairs.
fn bare_parse(shape: &Shape) -> usize {
    if shape.content_type == "application/json" {
        let parsed = serde_json::from_slice::<serde::de::IgnoredAny>(&shape.body);
        usize::from(parsed.is_ok())
    } else {
        form_urlencoded::parse(&shape.body).count()
    }
}

/// The median of `iterations` timings of `f`, in seconds, after one untimed run.
fn median<T>(iterations: usize, mut f: impl FnMut() -> T) -> f64 {
    black_box(f());
    let mut times: Vec<f64> = (0..iterations.max(1))
        .map(|_| {
            let start = Instant::now();
            black_box(f());
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The fingerprint of `len` bytes of no parsed type: their SHA-256 and a few header bytes.
fn plain_fingerprint(len: usize) -> Fingerprint {
    thread_local! {
        static PLAIN: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    PLAIN.with_borrow_mut(|plain| {
        plain.resize(len, b'x');
        let octets = HeaderValue::from_static("application/octet-stream");
        let uri = Uri::from_static("/v1/charges");
        Fingerprint::compute(
            FingerprintMode::Semantic,
            &Method::POST,
            &uri,
            Some(&octets),
            plain,
        )
    })
}

fn fingerprint(shape: &Shape, excluded: &[String]) -> Fingerprint {
    let content_type = HeaderValue::from_static(shape.content_type);
    let (uri, body): (Uri, &[u8]) = if shape.query {
        let query = std::str::from_utf8(&shape.body).expect("queries are ASCII");
        (
            format!("/v1/charges?{query}").parse().expect("a valid URI"),
            b"",
        )
    } else {
        (Uri::from_static("/v1/charges"), &shape.body)
    };
    let method = Method::POST;
    let mode = FingerprintMode::Semantic;
    Fingerprint::compute_excluding(mode, &method, &uri, Some(&content_type), body, excluded)
}

/// Repeats `unit(i)` into a JSON array `[…]` of at most `size` bytes.
fn array_of(size: usize, mut unit: impl FnMut(usize) -> String) -> Vec<u8> {
    let mut body = b"[".to_vec();
    for i in 0.. {
        let item = unit(i);
        if body.len() + item.len() + 2 > size {
            break;
        }
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(item.as_bytes());
    }
    body.push(b']');
    body
}

/// Repeats `member(i)` into a JSON object `{…}` of at most `size` bytes.
fn object_of(size: usize, member: impl FnMut(usize) -> String) -> Vec<u8> {
    let mut body = array_of(size, member);
    let last = body.len() - 1;
    (body[0], body[last]) = (b'{', b'}');
    body
}

/// A form (or query) of `pairs` pairs `k<i>=v` padded to about `size` bytes by long names.
fn form_of(size: usize, pairs: usize) -> Vec<u8> {
    let pad = (size / pairs).saturating_sub(12);
    let mut body = Vec::with_capacity(size);
    for i in (0..pairs).rev() {
        if !body.is_empty() {
            body.push(b'&');
        }
        body.extend(std::iter::repeat_n(b'n', pad));
        body.extend_from_slice(format!("{i:06}=v").as_bytes());
    }
    body
}

fn shapes(size: usize) -> Vec<Shape> {
    let json = |name, body| Shape {
        name,
        content_type: "application/json",
        body,
        query: false,
    };
    // Deepest the parser allows: 127 arrays, then the same again, to fill the body.
    let deep = format!("{}0{}", "[".repeat(126), "]".repeat(126));
    let mut shapes = vec![
        json(
            "JSON, a million small numbers",
            array_of(size, |i| (i % 10).to_string()),
        ),
        json(
            "JSON, decimals",
            array_of(size, |i| format!("{}.25", i % 100)),
        ),
        json(
            "JSON, numbers with exponents",
            array_of(size, |i| format!("{}e3", i % 10)),
        ),
        json("JSON, nested 127 deep", array_of(size, |_| deep.clone())),
        json(
            "JSON, objects 120 deep out of order",
            deep_unordered(size, 120),
        ),
        json(
            "JSON, many keys in reverse",
            object_of(size, |i| format!("\"k{:07}\":0", 10_000_000 - i)),
        ),
        json(
            "JSON, many keys shuffled",
            object_of(size, |i| format!("\"k{:07}\":0", scramble(i))),
        ),
        json(
            "JSON, one key repeated",
            object_of(size, |_| "\"a\":0".to_owned()),
        ),
        json(
            "JSON, strings with escapes",
            array_of(size, |_| r#""\n\t\"\\\u00e9\u0041x""#.to_owned()),
        ),
        json(
            "JSON, names with escapes",
            object_of(size, |i| {
                format!("\"\\u0061{:06}\":0", scramble(i) % 1_000_000)
            }),
        ),
    ];
    shapes.push(Shape {
        name: "form, a million pairs",
        content_type: "application/x-www-form-urlencoded",
        body: [b"a".as_slice(), &b"&a".repeat(size / 2 - 1)].concat(),
        query: false,
    });
    shapes.push(Shape {
        name: "form, 10,000 long pairs",
        content_type: "application/x-www-form-urlencoded",
        body: form_of(size, 10_000),
        query: false,
    });
    shapes.push(Shape {
        name: "query, 6,000 pairs",
        content_type: "application/octet-stream",
        // A URI holds at most 64 KiB.
        body: form_of(60 * 1024, 6_000),
        query: true,
    });
    shapes
}

/// A charge whose `metadata` nests `depth` objects `{"z":…,"a":0}`, every one out of order.
fn deep_unordered(size: usize, depth: usize) -> Vec<u8> {
    let (open, close) = (r#"{"z":"#, r#","a":0}"#);
    let frame = depth * (open.len() + close.len()) + 2;
    let mut body = open.repeat(depth).into_bytes();
    body.push(b'"');
    body.resize(body.len() + size.saturating_sub(frame), b'x');
    body.push(b'"');
    body.extend(close.repeat(depth).into_bytes());
    body
}

/// A fixed permutation-like scramble of `i`, for member names in no order.
fn scramble(i: usize) -> usize {
    (i.wrapping_mul(2_654_435_761) ^ (i >> 7)) % 10_000_000
}
