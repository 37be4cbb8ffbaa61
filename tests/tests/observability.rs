//! Tracing: every keyed request runs in an `idempotency` span that carries the key's hash and
//! the request's outcome, and never the raw key or the principal.

use std::{
    io,
    sync::{Arc, Mutex},
};

use http::{Method, StatusCode};
use idempotency_tests::{
    app::{Probe, app},
    server::TestServer,
    suite::Reply,
};
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, Principal, ScopeKey};
use tracing_subscriber::fmt::MakeWriter;

/// What the subscriber wrote, shared with the test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
    }
}

impl io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Self;

    fn make_writer(&'a self) -> Self {
        self.clone()
    }
}

/// The server runs on this test's thread (a current-thread runtime), so the subscriber set
/// for the thread sees its spans.
#[tokio::test(flavor = "current_thread")]
async fn the_span_names_the_key_by_its_hash_and_records_the_outcome() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let (account, raw_key) = ("acct_secret_principal", "order-secret-raw-key-7");
    let server = TestServer::start(app(IdempotencyLayer::memory(), Probe::default())).await;
    let client = reqwest::Client::new();
    let post = |body: &'static str| {
        client
            .post(server.url("/charges"))
            .bearer_auth(account)
            .header("idempotency-key", raw_key)
            .body(body)
    };
    assert_eq!(Reply::of(post("a")).await.status, StatusCode::CREATED);
    assert!(Reply::of(post("a")).await.replayed());
    Reply::of(post("b")).await.assert_problem(422, "Mismatch");
    drop(server);

    let hash = ScopeKey::new(
        &Principal::new(account).expect("principal"),
        &Method::POST,
        "/charges",
        &IdempotencyKey::new(raw_key).expect("key"),
    )
    .to_string();
    let text = captured.text();
    // The event that records each request's outcome, in the request's span.
    let outcomes: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("idempotent request"))
        .collect();
    assert_eq!(outcomes.len(), 3, "one per keyed request:\n{text}");
    for (line, outcome) in outcomes.iter().zip(["acquired", "replayed", "mismatch"]) {
        assert!(
            line.contains(&format!("idempotency{{key={hash} outcome=\"{outcome}\"}}")),
            "{line}"
        );
    }
    assert!(
        !text.contains(raw_key),
        "the raw key is never logged:\n{text}"
    );
    assert!(
        !text.contains(account),
        "the principal is never logged:\n{text}"
    );
}
