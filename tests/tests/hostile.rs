//! Hostile requests against the real app on a real socket: each gets a clear `4xx` (or the
//! documented outcome), runs no handler it should not, and leaves the server serving.
//!
//! Every test is bounded ([`bounded`]); waits are on the server's answers, never on sleeps.

use std::time::Duration;

use idempotency_tests::{
    app::{Probe, app},
    bounded,
    db::TestDb,
    hostile::{
        RawRequest, RawResponse, deep_unordered_json, exchange, is_closed, read_response,
        repeated_pairs_form,
    },
    server::TestServer,
    suite::Reply,
};
use tokio::{io::AsyncWriteExt, net::TcpStream, time::Instant};
use tower_idempotency::{
    IdempotencyLayer, Limits,
    store::{PostgresStore, Store},
};

/// How long a prompt answer may take.
const PROMPT: Duration = Duration::from_secs(5);

const CHARGE: &str = r#"{"amount":100,"currency":"usd"}"#;

/// Just under the layer's default body limit (2 MiB), and axum's.
const NEARLY_2_MIB: usize = 2 * 1024 * 1024 - 1024;

/// The test app on a real socket, and what it ran.
struct Target {
    // Dropped before the database it may use.
    server: TestServer,
    probe: Probe,
    client: reqwest::Client,
    _db: Option<TestDb>,
}

impl Target {
    async fn start<St: Store>(layer: IdempotencyLayer<St>, db: Option<TestDb>) -> Self {
        idempotency_tests::init_tracing();
        let probe = Probe::default();
        let server = TestServer::start(app(layer, probe.clone())).await;
        Self {
            server,
            probe,
            client: reqwest::Client::new(),
            _db: db,
        }
    }

    async fn memory() -> Self {
        Self::start(IdempotencyLayer::memory(), None).await
    }

    async fn postgres() -> Self {
        let db = TestDb::new().await;
        let store = PostgresStore::new(db.pool().clone());
        store.migrate().await.expect("migrate");
        Self::start(IdempotencyLayer::new(store), Some(db)).await
    }

    fn post(&self, key: Option<&[u8]>) -> reqwest::RequestBuilder {
        let request = self
            .client
            .post(self.server.url("/charges"))
            .bearer_auth("acct_a");
        match key {
            Some(key) => request.header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(key).expect("a header value"),
            ),
            None => request,
        }
    }

    /// Sends `request` on a new connection and reads the answer, promptly.
    async fn raw(&self, request: &[u8]) -> RawResponse {
        tokio::time::timeout(PROMPT, exchange(self.server.addr(), request))
            .await
            .expect("an answer within 5 s")
            .expect("a whole response")
    }

    /// A well-formed charge with a fresh key still runs: the server is serving.
    async fn assert_still_serves(&self) {
        let before = self.probe.executions();
        let key = uuid::Uuid::new_v4().to_string();
        let reply = Reply::of(
            self.post(Some(key.as_bytes()))
                .header("content-type", "application/json")
                .body(CHARGE),
        )
        .await;
        assert_eq!(
            reply.status, 201,
            "a normal request after; body {:?}",
            reply.body
        );
        assert_eq!(self.probe.executions(), before + 1);
    }
}

/// Runs each scenario against the memory store and against PostgreSQL (a database of its own).
macro_rules! on_every_store {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::bounded(super::$scenario(super::Target::memory().await)).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::bounded(super::$scenario(super::Target::postgres().await)).await
                }
            )*
        }
    };
}

on_every_store!(
    huge_content_length_that_never_arrives_is_413_at_once,
    repeated_key_is_400_and_runs_nothing,
    non_utf8_json_bodies_run_replay_and_mismatch_by_bytes,
    keys_of_255_characters_are_kept_and_256_refused,
    form_of_a_million_pairs_is_answered_promptly,
    deep_out_of_order_json_is_answered_promptly,
);

/// (a) `Content-Length: 1 GiB` and no body: `413` before a byte is read, not after waiting
/// for a gigabyte that never comes.
async fn huge_content_length_that_never_arrives_is_413_at_once(t: Target) {
    let request = RawRequest::post("/charges")
        .header("idempotency-key", b"k-huge")
        .header("content-type", b"application/json")
        .content_length(1 << 30)
        .into_bytes();
    let started = Instant::now();
    let mut stream = TcpStream::connect(t.server.addr()).await.expect("connect");
    stream.write_all(&request).await.expect("write the head");
    let response = tokio::time::timeout(PROMPT, read_response(&mut stream))
        .await
        .expect("413 within 5 s, without waiting for the body")
        .expect("a whole response");
    assert!(started.elapsed() < PROMPT);
    response.into_reply().assert_problem(413, "BodyTooLarge");
    assert_eq!(t.probe.executions(), 0);
    // The unread gigabyte cannot be skipped: the server ends the connection rather than wait.
    assert!(
        is_closed(&mut stream, PROMPT).await,
        "the connection is closed after the 413"
    );
    drop(stream);

    // The key was never claimed: the real request with it runs.
    let reply = Reply::of(
        t.post(Some(b"k-huge"))
            .header("content-type", "application/json")
            .body(CHARGE),
    )
    .await;
    assert_eq!(reply.status, 201);
    t.assert_still_serves().await;
}

/// (d) `Idempotency-Key` three times, with different values or the same one: `400`, nothing
/// run, no key taken.
async fn repeated_key_is_400_and_runs_nothing(t: Target) {
    for values in [[&b"k-one"[..], b"k-two", b"k-three"], [&b"k-one"[..]; 3]] {
        let mut request = RawRequest::post("/charges").header("content-type", b"application/json");
        for value in values {
            request = request.header("Idempotency-Key", value);
        }
        let reply = t
            .raw(&request.with_body(CHARGE.as_bytes()))
            .await
            .into_reply();
        reply.assert_problem(400, "KeyInvalid");
    }
    // The same through a client library, which sends them as separate lines too.
    let reply = Reply::of(
        t.post(Some(b"k-one"))
            .header("idempotency-key", "k-two")
            .header("idempotency-key", "k-three")
            .body(CHARGE),
    )
    .await;
    reply.assert_problem(400, "KeyInvalid");
    assert_eq!(t.probe.executions(), 0);

    // None of the values was claimed.
    for key in ["k-one", "k-two", "k-three"] {
        let reply = Reply::of(t.post(Some(key.as_bytes())).body(CHARGE)).await;
        assert_eq!(reply.status, 201, "{key}");
        assert!(!reply.replayed());
    }
    t.assert_still_serves().await;
}

/// (e) A "JSON" body that is not UTF-8 runs (the handler decides what it means), is
/// fingerprinted by its bytes: the same bytes replay, other bytes are `422`.
async fn non_utf8_json_bodies_run_replay_and_mismatch_by_bytes(t: Target) {
    let json = |key: &str, body: &'static [u8]| {
        t.post(Some(key.as_bytes()))
            .header("content-type", "application/json")
            .body(body)
    };
    let first = Reply::of(json("k-bytes", b"\xff\xfe{\"amount\":100}\x80")).await;
    assert_eq!(first.status, 201, "the handler runs; body {:?}", first.body);
    let retry = Reply::of(json("k-bytes", b"\xff\xfe{\"amount\":100}\x80")).await;
    assert!(retry.replayed(), "the same bytes are the same request");
    assert_eq!(retry.body, first.body);
    Reply::of(json("k-bytes", b"\xff\xfe{\"amount\":100}\x81"))
        .await
        .assert_problem(422, "Mismatch");

    // Valid JSON syntax around an invalid UTF-8 string is not JSON either: it is compared by
    // its bytes, so even a whitespace change is another request.
    let first = Reply::of(json("k-latin1", b"{\"name\": \"caf\xe9\"}")).await;
    assert_eq!(first.status, 201);
    let retry = Reply::of(json("k-latin1", b"{\"name\": \"caf\xe9\"}")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    Reply::of(json("k-latin1", b"{\"name\":\"caf\xe9\"}"))
        .await
        .assert_problem(422, "Mismatch");

    assert_eq!(t.probe.executions(), 2);
    t.assert_still_serves().await;
}

/// (g) 255 characters is the longest key (Stripe's limit), bare or quoted, and is stored and
/// replayed whole; 256 is refused, and so is a key far too long.
async fn keys_of_255_characters_are_kept_and_256_refused(t: Target) {
    let alphabet = b"aZ9-_.~!#$%&'*+^`|:/=";
    let longest: Vec<u8> = alphabet.iter().copied().cycle().take(255).collect();

    let first = Reply::of(t.post(Some(&longest)).body(CHARGE)).await;
    assert_eq!(first.status, 201);
    let retry = Reply::of(t.post(Some(&longest)).body(CHARGE)).await;
    assert!(retry.replayed(), "a 255-character key is stored whole");
    assert_eq!(retry.body, first.body);
    // Its sf-string form is the same key.
    let quoted = [&b"\""[..], &longest, b"\""].concat();
    assert!(
        Reply::of(t.post(Some(&quoted)).body(CHARGE))
            .await
            .replayed()
    );
    // A key that differs only in its last character is another key.
    let mut other = longest.clone();
    other[254] = b'@';
    let reply = Reply::of(t.post(Some(&other)).body(CHARGE)).await;
    assert_eq!(reply.status, 201);
    assert!(!reply.replayed());

    // A quoted key may hold spaces; 255 of its characters are still the limit.
    let spaced: String = "a b ".chars().cycle().take(255).collect();
    let reply = Reply::of(
        t.post(Some(format!("\"{spaced}\"").as_bytes()))
            .body(CHARGE),
    )
    .await;
    assert_eq!(reply.status, 201);

    let too_long = [&longest[..], b"k"].concat();
    Reply::of(t.post(Some(&too_long)).body(CHARGE))
        .await
        .assert_problem(400, "KeyInvalid");
    let quoted = [&b"\""[..], &too_long, b"\""].concat();
    Reply::of(t.post(Some(&quoted)).body(CHARGE))
        .await
        .assert_problem(400, "KeyInvalid");
    // 60 KiB of key: still a 400 from the layer, or hyper's 431 for an oversized head.
    let huge = vec![b'k'; 60 * 1024];
    let reply = Reply::of(t.post(Some(&huge)).body(CHARGE)).await;
    assert!(
        [400, 431].contains(&reply.status.as_u16()),
        "a 60 KiB key got {}",
        reply.status
    );
    assert_eq!(t.probe.executions(), 3);
    t.assert_still_serves().await;
}

/// Sends `body` as `content_type` with key `key` to `/status/201`, and reads the answer.
async fn post_status_201(t: &Target, key: &[u8], content_type: &[u8], body: &[u8]) -> Reply {
    let request = RawRequest::post("/status/201")
        .header("idempotency-key", key)
        .header("content-type", content_type)
        .with_body(body);
    t.raw(&request).await.into_reply()
}

/// A form of nearly 2 MiB, `a&a&a…`, a million pairs: fingerprinted by its bytes rather
/// than decoded and sorted, it is answered promptly and the handler runs; the same bytes
/// replay, and the same pairs in another order are another request.
async fn form_of_a_million_pairs_is_answered_promptly(t: Target) {
    const FORM: &[u8] = b"application/x-www-form-urlencoded";
    let form = repeated_pairs_form(NEARLY_2_MIB, false);
    let first = post_status_201(&t, b"k-form", FORM, &form).await;
    assert_eq!(first.status, 201, "body {:?}", first.body);
    assert_eq!(t.probe.executions(), 1);
    let retry = post_status_201(&t, b"k-form", FORM, &form).await;
    assert!(retry.replayed(), "the same bytes are the same request");
    assert_eq!(retry.body, first.body);
    post_status_201(
        &t,
        b"k-form",
        FORM,
        &repeated_pairs_form(NEARLY_2_MIB, true),
    )
    .await
    .assert_problem(422, "Mismatch");
    assert_eq!(t.probe.executions(), 1);
    t.assert_still_serves().await;
}

/// Nearly 2 MiB of JSON nested 120 objects deep, each object's members out of order:
/// sorting it would move the whole document once per level, so past the reordering budget it
/// is fingerprinted by its bytes. It is answered promptly, the same bytes replay, and the same
/// document written in another order is another request.
async fn deep_out_of_order_json_is_answered_promptly(t: Target) {
    const JSON: &[u8] = b"application/json";
    let doc = deep_unordered_json(120, NEARLY_2_MIB, false);
    let first = post_status_201(&t, b"k-deep", JSON, &doc).await;
    assert_eq!(first.status, 201, "body {:?}", first.body);
    assert_eq!(t.probe.executions(), 1);
    let retry = post_status_201(&t, b"k-deep", JSON, &doc).await;
    assert!(retry.replayed(), "the same bytes are the same request");
    assert_eq!(retry.body, first.body);
    post_status_201(
        &t,
        b"k-deep",
        JSON,
        &deep_unordered_json(120, NEARLY_2_MIB, true),
    )
    .await
    .assert_problem(422, "Mismatch");
    assert_eq!(t.probe.executions(), 1);
    t.assert_still_serves().await;
}

/// (b) A body that stalls half-way: `408` once the body timeout passes, nothing run, the key
/// free for the real request.
#[tokio::test]
async fn stalled_body_is_408_after_the_body_timeout() {
    bounded(async {
        let timeout = Duration::from_millis(500);
        let layer = IdempotencyLayer::memory()
            .with_limits(Limits::default().with_body_timeout(timeout))
            .expect("a valid timeout");
        let t = Target::start(layer, None).await;
        let mut request = RawRequest::post("/charges")
            .header("idempotency-key", b"k-stall")
            .header("content-type", b"application/json")
            .content_length(CHARGE.len() as u64)
            .into_bytes();
        request.extend_from_slice(&CHARGE.as_bytes()[..10]);

        let started = Instant::now();
        let mut stream = TcpStream::connect(t.server.addr()).await.expect("connect");
        stream.write_all(&request).await.expect("write");
        let response = tokio::time::timeout(timeout + PROMPT, read_response(&mut stream))
            .await
            .expect("an answer soon after the body timeout")
            .expect("a whole response");
        let elapsed = started.elapsed();
        response.into_reply().assert_problem(408, "BodyTimeout");
        assert!(
            elapsed >= timeout.mul_f32(0.9),
            "408 after {elapsed:?}, before the {timeout:?} timeout"
        );
        assert_eq!(t.probe.executions(), 0);
        drop(stream);

        let reply = Reply::of(
            t.post(Some(b"k-stall"))
                .header("content-type", "application/json")
                .body(CHARGE),
        )
        .await;
        assert_eq!(reply.status, 201, "the stalled request held no key");
        t.assert_still_serves().await;
    })
    .await;
}

/// (b) Slowloris proper: a byte every 50 ms keeps the connection busy but never finishes a
/// 4 KiB body; the body timeout is for the whole body, so it still ends in `408`.
#[tokio::test]
async fn trickled_body_is_408_after_the_body_timeout() {
    bounded(async {
        let timeout = Duration::from_millis(500);
        let layer = IdempotencyLayer::memory()
            .with_limits(Limits::default().with_body_timeout(timeout))
            .expect("a valid timeout");
        let t = Target::start(layer, None).await;
        let request = RawRequest::post("/charges")
            .header("idempotency-key", b"k-trickle")
            .header("content-type", b"application/json")
            .content_length(4096)
            .into_bytes();

        let started = Instant::now();
        let stream = TcpStream::connect(t.server.addr()).await.expect("connect");
        let (mut reader, mut writer) = stream.into_split();
        writer.write_all(&request).await.expect("write the head");
        let trickle = tokio::spawn(async move {
            let mut pace = tokio::time::interval(Duration::from_millis(50));
            for _ in 0..4096 {
                pace.tick().await;
                if writer.write_all(b" ").await.is_err() {
                    break;
                }
            }
        });
        let response = tokio::time::timeout(timeout + PROMPT, read_response(&mut reader))
            .await
            .expect("an answer soon after the body timeout")
            .expect("a whole response");
        let elapsed = started.elapsed();
        trickle.abort();
        response.into_reply().assert_problem(408, "BodyTimeout");
        assert!(elapsed >= timeout.mul_f32(0.9), "408 after {elapsed:?}");
        assert_eq!(t.probe.executions(), 0);
        t.assert_still_serves().await;
    })
    .await;
}

/// (c) 10 000 header lines: refused by the HTTP server before the layer (hyper answers `431`),
/// nothing run, and the server goes on.
#[tokio::test]
async fn ten_thousand_headers_are_refused() {
    bounded(async {
        let t = Target::memory().await;
        let mut request = RawRequest::post("/charges").header("idempotency-key", b"k-headers");
        for i in 0..10_000 {
            request = request.header(&format!("x-filler-{i}"), b"v");
        }
        let request = request.with_body(CHARGE.as_bytes());
        let stream = TcpStream::connect(t.server.addr()).await.expect("connect");
        let (mut reader, mut writer) = stream.into_split();
        // The server may answer and close before it has read everything: write beside reading.
        let writing = tokio::spawn(async move {
            let _ = writer.write_all(&request).await;
            writer
        });
        let response = tokio::time::timeout(PROMPT, read_response(&mut reader))
            .await
            .expect("an answer within 5 s")
            .expect("a whole response");
        assert!(
            (400..500).contains(&response.status),
            "10 000 headers got {} (hyper answers 431)",
            response.status
        );
        let _ = writing.await;
        assert_eq!(t.probe.executions(), 0);
        t.assert_still_serves().await;
    })
    .await;
}

/// (f) Keys with control bytes, obs-text, inner tabs or nothing at all: `400`. Bytes HTTP
/// itself forbids in a field value (NUL, DEL, other controls) are refused by hyper before the
/// layer sees them; what hyper lets through is the layer's `KeyInvalid` problem.
#[tokio::test]
async fn keys_with_control_bytes_or_obs_text_are_400() {
    bounded(async {
        let t = Target::memory().await;
        let layer_refuses: [&[u8]; 9] = [
            b"caf\xc3\xa9",
            b"\xff\xfe",
            b"k\x80",
            b"a\tb",
            b"\"a\tb\"",
            b"\"caf\xc3\xa9\"",
            b"\"k\\x\"",
            b"",
            b"  \t ",
        ];
        for key in layer_refuses {
            let request = RawRequest::post("/charges")
                .header("idempotency-key", key)
                .with_body(CHARGE.as_bytes());
            let reply = t.raw(&request).await.into_reply();
            assert!(reply.status == 400, "key {key:?} got {}", reply.status);
            reply.assert_problem(400, "KeyInvalid");
        }
        let http_refuses: [&[u8]; 5] = [b"a\x00b", b"a\x01b", b"a\x1bb", b"a\x7fb", b"a\rb"];
        for key in http_refuses {
            let request = RawRequest::post("/charges")
                .header("idempotency-key", key)
                .with_body(CHARGE.as_bytes());
            let response = t.raw(&request).await;
            assert_eq!(response.status, 400, "key {key:?}");
        }
        assert_eq!(t.probe.executions(), 0);
        t.assert_still_serves().await;
    })
    .await;
}
