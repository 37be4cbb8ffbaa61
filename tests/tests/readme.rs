//! The README holds to the code: its quick start is the `examples/quickstart` crate (whose own
//! test runs it), each row of its protocol table names the tests that show it, and its links,
//! and the other READMEs', lead somewhere.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

/// The README's protocol table, row by row: the situation (its first cell, as written) and the
/// tests that show what the second cell says. Every status code in that cell must be asserted
/// by one of them.
const PROTOCOL: &[(&str, &[&str])] = &[
    (
        "first request with a key",
        &["retry_replays_the_response_verbatim"],
    ),
    (
        "retry after it completed",
        &[
            "retry_replays_the_response_verbatim",
            "repeated_replays_skip_the_store",
        ],
    ),
    (
        "retry while the first is still running",
        &[
            "concurrent_duplicates_execute_once",
            "a_waiting_duplicate_gets_the_first_ones_replay",
        ],
    ),
    (
        "same key and endpoint, different query or body",
        &["reused_key_with_another_payload_is_422"],
    ),
    (
        "same key, another endpoint (method or path)",
        &["a_key_reaches_across_endpoints_only_when_scoped_so"],
    ),
    (
        "key missing where `KeySource::required()`",
        &["missing_key_is_400_when_required"],
    ),
    (
        "key malformed, empty, over 255 characters, repeated, or against `KeySource::with_rule`",
        &[
            "malformed_keys_are_400",
            "a_key_that_breaks_the_rule_is_400_and_stores_nothing",
        ],
    ),
    (
        "body over `Limits::with_max_request_bytes` (declared or streamed)",
        &["oversize_bodies_are_413"],
    ),
    (
        "body slower than `Limits::with_body_timeout`",
        &[
            "stalled_body_is_408_after_the_body_timeout",
            "trickled_body_is_408_after_the_body_timeout",
        ],
    ),
    (
        "handler answers 400/401/403/405/408/411/413/414/415/422/429/431 or 5xx",
        &[
            "retention_follows_the_policy",
            "a_rejected_request_can_be_corrected",
        ],
    ),
    (
        "handler answers 2xx, 3xx or another 4xx (402 declined, 404...)",
        &["retention_follows_the_policy"],
    ),
    ("handler panics", &["a_panicking_handler_releases_the_key"]),
    (
        "client disconnects mid-handler",
        &["a_disconnected_client_still_gets_its_charge_on_retry"],
    ),
    (
        "the holder's process crashes",
        &[
            "a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out",
            "a_killed_process_leaves_nothing_and_frees_the_key_at_once",
        ],
    ),
    (
        "handler still running after `Limits::with_max_handler_time` (10 min)",
        &["a_hung_handler_is_stopped_and_its_key_taken_over"],
    ),
    (
        "response larger than `Limits::with_max_response_bytes`",
        &["a_response_too_large_to_store_is_never_rerun"],
    ),
    (
        "store unreachable",
        &["a_store_outage_fails_closed_or_open"],
    ),
];

fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the repository")
}

fn readme() -> String {
    fs::read_to_string(repository().join("README.md")).expect("README.md")
}

/// The section of `markdown` under the heading line `heading`, up to the next `## ` heading.
fn section<'a>(markdown: &'a str, heading: &str) -> &'a str {
    let start = markdown
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no `{heading}` section"));
    let rest = &markdown[start + heading.len() + 2..];
    rest.find("\n## ").map_or(rest, |end| &rest[..end])
}

#[test]
fn the_readme_is_read_in_five_minutes() {
    let lines = readme().lines().count();
    assert!(
        lines <= 200,
        "README.md has {lines} lines; guides belong in the crate docs"
    );
}

#[test]
fn the_quick_start_is_the_example_that_runs() {
    let readme = readme();
    let quick_start = section(&readme, "## Quick start");
    let block = quick_start
        .split_once("```rust,no_run\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .expect("a rust block in the quick start")
        .0;
    let example = fs::read_to_string(repository().join("examples/quickstart/src/main.rs"))
        .expect("the example");
    assert_eq!(
        block,
        example.trim_end(),
        "the README's quick start must be examples/quickstart/src/main.rs as it is"
    );
}

/// Every `.rs` file of the test suite, read once.
fn test_sources() -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    let mut dirs = vec![
        repository().join("tests/src"),
        repository().join("tests/tests"),
    ];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).expect("a test directory") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                let text = fs::read_to_string(&path).expect("a test file");
                files.push((path, text));
            }
        }
    }
    files
}

/// The text of the function `name`: from its signature to the first closing brace in column 0.
fn function<'a>(sources: &'a [(PathBuf, String)], name: &str) -> Option<&'a str> {
    sources.iter().find_map(|(_, text)| {
        let start = [format!("fn {name}<"), format!("fn {name}(")]
            .iter()
            .find_map(|signature| text.find(signature.as_str()))?;
        let body = &text[start..];
        Some(body.find("\n}\n").map_or(body, |end| &body[..end]))
    })
}

/// The status codes a cell names, written as `409`.
fn statuses(cell: &str) -> Vec<u16> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|code| code.parse().ok())
        .filter(|code| (100..600).contains(code))
        .collect()
}

/// How a test may assert `status`: by number or by `StatusCode`'s name for it.
fn asserts(test: &str, status: u16) -> bool {
    let name = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|code| code.canonical_reason())
        .map(|reason| reason.to_uppercase().replace([' ', '-'], "_"));
    // `StatusCode`'s names differ from the reasons here and there.
    let name = match status {
        413 => Some("PAYLOAD_TOO_LARGE".to_owned()),
        _ => name,
    };
    test.contains(&status.to_string()) || name.is_some_and(|name| test.contains(&name))
}

#[test]
fn each_row_of_the_protocol_table_is_shown_by_its_tests() {
    let readme = readme();
    let rows: Vec<(String, String)> = section(&readme, "## The protocol")
        .lines()
        .filter(|line| line.starts_with("| ") && !line.starts_with("| situation"))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split(" | ").collect();
            assert_eq!(cells.len(), 2, "a row of two cells: {line}");
            (cells[0].trim().to_owned(), cells[1].trim().to_owned())
        })
        .collect();
    let in_readme: BTreeSet<&str> = rows
        .iter()
        .map(|(situation, _)| situation.as_str())
        .collect();
    let mapped: BTreeSet<&str> = PROTOCOL.iter().map(|(situation, _)| *situation).collect();
    assert_eq!(
        in_readme, mapped,
        "each row of the README's protocol table names its tests here, and only those rows"
    );

    let sources = test_sources();
    for (situation, response) in &rows {
        let tests = PROTOCOL
            .iter()
            .find(|(mapped, _)| mapped == situation)
            .map(|(_, tests)| *tests)
            .expect("mapped");
        let bodies: Vec<&str> = tests
            .iter()
            .map(|test| {
                function(&sources, test)
                    .unwrap_or_else(|| panic!("`{situation}`: no test `{test}` in tests/"))
            })
            .collect();
        for status in statuses(response) {
            assert!(
                bodies.iter().any(|body| asserts(body, status)),
                "`{situation}`: the README says `{status}`, which none of {tests:?} asserts"
            );
        }
    }
}

/// The targets of a Markdown file's links that stay in the repository: `[text](target)` and
/// `[label]: target`, without their `#fragment`.
fn local_links(markdown: &str) -> Vec<String> {
    let inline = markdown
        .split("](")
        .skip(1)
        .filter_map(|rest| rest.split_once(')'));
    let defined = markdown
        .lines()
        .filter(|line| line.starts_with('['))
        .filter_map(|line| line.split_once("]: "));
    inline
        .map(|(target, _)| target)
        .chain(defined.map(|(_, target)| target))
        .map(|target| {
            target
                .split('#')
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned()
        })
        .filter(|target| !target.is_empty() && !target.contains("://"))
        .filter(|target| !target.starts_with("crate::") && !target.contains("::"))
        .collect()
}

#[test]
fn the_readmes_links_lead_somewhere() {
    let mut readmes = vec![repository().join("README.md")];
    let mut dirs = vec![repository().join("crates"), repository().join("examples")];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).expect("a directory") {
            let entry = entry.expect("an entry");
            // The library's README.md links to the repository's, which is read from its place.
            if entry.file_type().expect("a file type").is_symlink() {
                continue;
            }
            let path = entry.path();
            let name = path
                .file_name()
                .and_then(|name| name.to_str())
                .unwrap_or("");
            if path.is_dir() && !matches!(name, "target" | "node_modules" | ".venv") {
                dirs.push(path);
            } else if name.ends_with(".md") {
                readmes.push(path);
            }
        }
    }
    for readme in readmes {
        let text = fs::read_to_string(&readme).expect("a Markdown file");
        let base = readme.parent().expect("a directory");
        for target in local_links(&text) {
            assert!(
                base.join(&target).exists(),
                "{}: the link `{target}` leads nowhere",
                readme.display()
            );
        }
    }
}

/// The README is also the crate's front page: each of its links that is relative to the
/// repository has a definition in `lib.rs` first, which rustdoc uses instead.
#[test]
fn the_front_page_overrides_every_relative_link() {
    let readme = readme();
    let lib = fs::read_to_string(repository().join("crates/tower-idempotency/src/lib.rs"))
        .expect("lib.rs");
    let overridden: BTreeSet<&str> = lib
        .lines()
        .filter_map(|line| line.strip_prefix("//! ["))
        .filter_map(|line| line.split_once("]: "))
        .map(|(label, _)| label)
        .collect();
    for line in readme.lines().filter(|line| line.starts_with('[')) {
        let Some((label, target)) = line[1..].split_once("]: ") else {
            continue;
        };
        assert!(
            overridden.contains(label) || target.starts_with("https://"),
            "README link `[{label}]: {target}` would break on docs.rs: define `[{label}]` in lib.rs"
        );
    }
    assert!(
        !readme.contains("](")
            || readme
                .split("](")
                .skip(1)
                .all(|rest| rest.starts_with("http")),
        "inline links in the README must be absolute (relative ones break on docs.rs)"
    );
}
