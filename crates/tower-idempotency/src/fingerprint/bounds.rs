//! The canonicaliser's bounds, counted rather than timed: the memory it holds on each hostile
//! shape, and a depth beyond the parser's limit treated the same way on every retry.

use super::canon::{Rules, Stop, Work, canonicalise};
use super::fingerprinting::Fingerprinting;
use super::pointer::Exclusions;
use super::testing::{JSON, fp};
use super::{Fingerprint, FingerprintMode};

/// A body just under the layer's default limit.
const SIZE: usize = 2 * 1024 * 1024 - 1024;

/// Repeats `unit(i)` into a JSON array (`open` = `[`) or object (`{`) of about `SIZE` bytes.
fn repeated(open: char, mut unit: impl FnMut(usize) -> String) -> String {
    let close = if open == '[' { ']' } else { '}' };
    let mut doc = String::from(open);
    for i in 0.. {
        let item = unit(i);
        if doc.len() + item.len() + 2 > SIZE {
            break;
        }
        if i > 0 {
            doc.push(',');
        }
        doc.push_str(&item);
    }
    doc.push(close);
    doc
}

fn shapes() -> Vec<(&'static str, String)> {
    let deep = format!("{}0{}", "[".repeat(126), "]".repeat(126));
    let deep_objects = format!("{}0{}", r#"{"z":"#.repeat(126), r#","a":0}"#.repeat(126));
    vec![
        (
            "a million small numbers",
            repeated('[', |i| (i % 10).to_string()),
        ),
        (
            "integral doubles spelt short",
            repeated('[', |_| "9e15".to_owned()),
        ),
        ("arrays 127 deep", repeated('[', |_| deep.clone())),
        (
            "objects 127 deep out of order",
            repeated('[', |_| deep_objects.clone()),
        ),
        (
            "many keys in reverse",
            repeated('{', |i| format!("\"k{:07}\":0", 9_999_999 - i)),
        ),
        ("one key repeated", repeated('{', |_| r#""a":0"#.to_owned())),
        (
            "strings with escapes",
            repeated('[', |_| r#""\n\u0041\u00e9\"""#.to_owned()),
        ),
        (
            "names with escapes",
            repeated('{', |i| format!("\"\\u0061{i}\":0")),
        ),
    ]
}

fn work(doc: &str, rules: Rules<'_>) -> Result<Work, Stop> {
    canonicalise(doc.as_bytes(), rules, &mut Vec::new())
}

#[test]
fn memory_held_is_at_most_four_times_the_body() {
    let exclusions = Exclusions::new(&["/a".to_owned(), "/metadata".to_owned()]);
    for (name, doc) in shapes() {
        for rules in [
            Rules::default(),
            Rules {
                budget: None,
                exclusions: Some(&exclusions),
            },
        ] {
            let work = work(&doc, rules).unwrap_or_else(|stop| panic!("{name}: {stop:?}"));
            println!(
                "{name}: held {:.2}x the body",
                work.peak_held as f64 / doc.len() as f64
            );
            assert!(
                work.peak_held <= 4 * doc.len(),
                "{name}: held {} bytes for a body of {}",
                work.peak_held,
                doc.len()
            );
        }
    }
}

/// The reordering budget still decides, as before, which documents are hashed as bytes; but
/// objects are no longer moved, so it bounds no work, only keeps fingerprints as they were.
#[test]
fn out_of_order_bytes_are_counted_against_the_old_budget() {
    let doc = repeated('[', |_| r#"{"b":0,"a":0}"#.to_owned());
    let budget = 4 * doc.len() + 64 * 1024;
    let within = work(
        &doc,
        Rules {
            budget: Some(budget),
            exclusions: None,
        },
    )
    .unwrap();
    assert_eq!(within.moved, doc.len() - 2 - (doc.len() - 2) / 14);
    let over = work(
        &doc,
        Rules {
            budget: Some(within.moved - 1),
            exclusions: None,
        },
    );
    assert_eq!(over.unwrap_err(), Stop::OverBudget);
}

/// `depth` nested arrays around `0`.
fn nested(depth: usize) -> String {
    format!("{}0{}", "[".repeat(depth), "]".repeat(depth))
}

#[test]
fn json_deeper_than_the_parser_allows_is_hashed_as_its_bytes_every_time() {
    let text = Some("text/plain");
    let excluding = |body: &str| {
        let fingerprinting = Fingerprinting::semantic().excluding(["/a"]);
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        let uri = "/".parse().unwrap();
        fingerprinting.fingerprint(&http::Method::POST, &uri, &headers, body.as_bytes())
    };
    // serde_json's limit: 127 levels are read, the 128th is an error.
    let deepest = nested(127);
    let canonical = fp(FingerprintMode::Semantic, "/", JSON, &deepest);
    assert_ne!(
        canonical,
        fp(FingerprintMode::Semantic, "/", text, &deepest)
    );
    assert_eq!(
        canonical,
        fp(
            FingerprintMode::Semantic,
            "/",
            JSON,
            &format!(" {deepest} ")
        )
    );
    assert_eq!(excluding(&deepest), canonical);
    for depth in [128, 129, 100_000] {
        let deep = nested(depth);
        let raw = fp(FingerprintMode::Semantic, "/", text, &deep);
        let first: Fingerprint = fp(FingerprintMode::Semantic, "/", JSON, &deep);
        assert_eq!(first, raw, "depth {depth}");
        assert_eq!(
            fp(FingerprintMode::Semantic, "/", JSON, &deep),
            first,
            "a retry, depth {depth}"
        );
        assert_eq!(excluding(&deep), raw, "with fields left out, depth {depth}");
        // Whitespace is then part of the bytes: a retry must send the same ones.
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", JSON, &format!(" {deep}")),
            first
        );
    }
    // Objects too: one level past the limit, inside a member the exclusion names.
    let deep = format!(r#"{{"a":{}0{}}}"#, r#"{"b":"#.repeat(127), "}".repeat(127));
    let raw = fp(FingerprintMode::Semantic, "/", text, &deep);
    assert_eq!(fp(FingerprintMode::Semantic, "/", JSON, &deep), raw);
    assert_eq!(
        fp(FingerprintMode::Semantic, "/", JSON, &deep),
        raw,
        "a retry"
    );
    assert_eq!(excluding(&deep), raw, "with fields left out");
}
