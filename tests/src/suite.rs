//! The protocol every store must keep, as scenarios over real HTTP.
//!
//! Each scenario is generic over a [`Backend`]; [`store_suite!`](crate::store_suite) turns them
//! into tests for one backend. A store in this repository passes it by implementing `Backend`
//! for it and invoking the macro; a store outside it runs the store-level checks this crate is
//! not published with, `tower_idempotency::store::conformance`.

use std::{future::Future, time::Duration};

use http::{HeaderValue, Method, StatusCode};
use sqlx::Executor;
use tokio::{io::AsyncWriteExt, net::TcpStream, task::JoinSet};
use tower_idempotency::{
    Disconnect, Fingerprint, FingerprintMode, IdempotencyKey, IdempotencyLayer, Principal,
    RetentionPolicy, ScopeKey, StoreFailure,
    store::{ClaimRequest, ClaimStatus, KeyState, PostgresStore, Store},
};

use crate::{
    app::{Probe, app},
    db::TestDb,
    server::TestServer,
    store::ObservedStore,
};

/// A store under test, with the means to move its clock.
pub trait Backend: Send + Sync + Sized + 'static {
    /// The store.
    type Store: Store + Clone;

    /// A fresh, empty, isolated store.
    fn start() -> impl Future<Output = Self> + Send;

    /// The store (a handle to the same data each time).
    fn store(&self) -> Self::Store;

    /// Makes every in-flight lease lapse now, as if its holder had stopped renewing it.
    fn lapse_leases(&self) -> impl Future<Output = ()> + Send;

    /// Makes every record pass its TTL now.
    fn expire_records(&self) -> impl Future<Output = ()> + Send;

    /// Makes `by` pass for every record and claim: each is that much older, leases included.
    fn pass_time(&self, by: Duration) -> impl Future<Output = ()> + Send;

    /// Whether a claim in flight is an open transaction (PostgreSQL's transactional mode) rather
    /// than a lease: it then ends with its holder, with no lease to lapse.
    const TRANSACTIONAL: bool = false;
}

/// A `PostgresStore` on a test database of its own, which the suite runs in both of the
/// store's modes: as [`InLeaseMode`] and as [`InTransactionalMode`]. Leases and expiry act on
/// `idempotency.records` unless the fixture keeps its records elsewhere.
pub trait PostgresFixture: Send + Sync + Sized + 'static {
    /// A fresh fixture.
    fn start() -> impl Future<Output = Self> + Send;

    /// The test database (a direct connection, whatever the store goes through).
    fn db(&self) -> &TestDb;

    /// The store, in lease mode (the suite switches it to transactional mode where it runs
    /// that).
    fn store(&self) -> PostgresStore;

    /// As [`Backend::lapse_leases`].
    fn lapse_leases(&self) -> impl Future<Output = ()> + Send {
        async {
            self.db()
                .pool()
                .execute(
                    "UPDATE idempotency.records SET lease_until = now() - interval '1 second' \
                     WHERE status IS NULL",
                )
                .await
                .expect("lapse leases");
        }
    }

    /// As [`Backend::expire_records`].
    fn expire_records(&self) -> impl Future<Output = ()> + Send {
        async {
            self.db()
                .pool()
                .execute("UPDATE idempotency.records SET expires_at = now() - interval '1 second'")
                .await
                .expect("expire records");
        }
    }

    /// The table the fixture's store keeps its records in.
    const TABLE: &'static str = "records";

    /// As [`Backend::pass_time`], on `table` (`records` or `partitioned_records`).
    fn pass_time_in(&self, table: &str, by: Duration) -> impl Future<Output = ()> + Send {
        let sql = format!(
            "UPDATE idempotency.{table} SET created_at = created_at - $1,
                 expires_at = expires_at - $1, lease_until = lease_until - $1,
                 completed_at = completed_at - $1"
        );
        async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(by)
                .execute(self.db().pool())
                .await
                .expect("pass time");
        }
    }
}

/// A [`PostgresFixture`] as a [`Backend`], its store in transactional mode when `TRANSACTIONAL`.
pub struct InMode<F, const TRANSACTIONAL: bool>(pub F);

/// The suite against a fixture's store in lease mode.
pub type InLeaseMode<F> = InMode<F, false>;

/// The suite against a fixture's store in transactional mode.
pub type InTransactionalMode<F> = InMode<F, true>;

impl<F: PostgresFixture, const TRANSACTIONAL: bool> Backend for InMode<F, TRANSACTIONAL> {
    type Store = PostgresStore;
    const TRANSACTIONAL: bool = TRANSACTIONAL;

    async fn start() -> Self {
        Self(F::start().await)
    }

    fn store(&self) -> PostgresStore {
        let store = self.0.store();
        if TRANSACTIONAL {
            store.transactional()
        } else {
            store
        }
    }

    async fn lapse_leases(&self) {
        self.0.lapse_leases().await;
    }

    async fn expire_records(&self) {
        self.0.expire_records().await;
    }

    async fn pass_time(&self, by: Duration) {
        self.0.pass_time_in(F::TABLE, by).await;
    }
}

type Layer<B> = IdempotencyLayer<ObservedStore<<B as Backend>::Store>>;

/// One backend, one app on a real socket, one HTTP client.
pub struct Harness<B: Backend> {
    /// The backend.
    pub backend: B,
    /// The store the layer uses, observed.
    pub store: ObservedStore<B::Store>,
    /// What the handlers did.
    pub probe: Probe,
    /// The server.
    pub server: TestServer,
    /// A keep-alive client.
    pub client: reqwest::Client,
}

impl<B: Backend> Harness<B> {
    /// The app with the default layer settings.
    pub async fn start() -> Self {
        Self::with(|layer| layer).await
    }

    /// The app with the layer as `configure` makes it.
    pub async fn with(configure: impl FnOnce(Layer<B>) -> Layer<B>) -> Self {
        let backend = B::start().await;
        let store = ObservedStore::new(backend.store());
        let probe = Probe::default();
        let layer = configure(IdempotencyLayer::new(store.clone()));
        let server = TestServer::start(app(layer, probe.clone())).await;
        Self {
            backend,
            store,
            probe,
            server,
            client: reqwest::Client::new(),
        }
    }

    /// `POST path` as account `acct_a`, with `key` if given.
    pub fn post(&self, path: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        self.post_as("acct_a", path, key)
    }

    /// `POST path` as `account`, with `key` if given.
    pub fn post_as(&self, account: &str, path: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        let request = self.client.post(self.server.url(path)).bearer_auth(account);
        match key {
            Some(key) => request.header("idempotency-key", key),
            None => request,
        }
    }
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: http::HeaderMap,
    /// Body bytes.
    pub body: bytes::Bytes,
}

impl Reply {
    /// Sends `request` and reads the response.
    pub async fn of(request: reqwest::RequestBuilder) -> Self {
        let response = request.send().await.expect("request sent");
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await.expect("body read");
        Self {
            status,
            headers,
            body,
        }
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// Whether `Idempotent-Replayed: true` is set.
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// Asserts an RFC 9457 problem of `kind` with `status`.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, kind: &str) {
        assert_eq!(self.status.as_u16(), status, "status; body {:?}", self.body);
        assert_eq!(self.headers["content-type"], "application/problem+json");
        let json = self.json();
        let ty = json["type"].as_str().expect("type");
        assert!(
            ty.ends_with(&format!("#variant.{kind}")),
            "type {ty} is not {kind}"
        );
        assert_eq!(json["status"], status);
        assert!(!json["title"].as_str().expect("title").is_empty());
        assert!(!json["detail"].as_str().expect("detail").is_empty());
    }
}

/// A charge's JSON body.
pub const CHARGE: &str = r#"{"amount":100,"currency":"usd"}"#;

fn charge_json(amount: u64) -> serde_json::Value {
    serde_json::json!({ "amount": amount, "currency": "usd" })
}

/// The first request runs; a retry gets its status, headers and bytes back, marked replayed.
pub async fn retry_replays_the_response_verbatim<B: Backend>() {
    let h = Harness::<B>::start().await;
    let first = Reply::of(h.post("/binary", Some("k-binary")).body("payload")).await;
    let retry = Reply::of(h.post("/binary", Some("k-binary")).body("payload")).await;

    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert!(!first.replayed());
    assert!(retry.replayed());
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.body, first.body, "body bytes");
    assert_eq!(&retry.body[..], &[0, 159, 146, 150, 255, 1]);
    for name in ["content-type", "etag", "content-length"] {
        assert_eq!(retry.headers.get(name), first.headers.get(name), "{name}");
    }
    let traces: Vec<_> = retry.headers.get_all("x-trace").iter().collect();
    assert_eq!(traces, ["a", "b"], "repeated headers survive in order");
    assert_ne!(
        retry.headers.get("date").map(HeaderValue::as_bytes),
        Some(&b"Thu, 01 Jan 1970 00:00:00 GMT"[..]),
        "the handler's Date is not replayed"
    );
    assert_eq!(h.probe.executions(), 1);
}

/// A response's cookies reach its own client, never the store or a replay.
pub async fn cookies_are_not_replayed<B: Backend>() {
    let h = Harness::<B>::start().await;
    let first = Reply::of(h.post("/charges", Some("k-cookie")).body(CHARGE)).await;
    let retry = Reply::of(h.post("/charges", Some("k-cookie")).body(CHARGE)).await;
    assert_eq!(first.headers["set-cookie"], "session=secret");
    assert!(retry.replayed());
    assert!(retry.headers.get("set-cookie").is_none());
    assert_eq!(retry.headers["location"], first.headers["location"]);
    assert_eq!(retry.body, first.body);
}

/// 64 concurrent requests with one key: one runs, the others get 409 while it does, and
/// everyone after gets its response.
pub async fn concurrent_duplicates_execute_once<B: Backend>() {
    const N: usize = 64;
    let h = Harness::<B>::start().await;
    let mut requests = JoinSet::new();
    for _ in 0..N {
        let request = h
            .post("/charges", Some("k-concurrent"))
            .header("x-test-gate", "1")
            .json(&charge_json(100));
        requests.spawn(Reply::of(request));
    }
    // The holder waits at the gate until every duplicate has been answered; a second holder
    // would wait there too, and its duplicate's answer would never come.
    h.probe.started(1).await;
    let conflicts = tokio::time::timeout(Duration::from_secs(60), async {
        let mut conflicts = 0;
        for _ in 0..N - 1 {
            let reply = requests.join_next().await.expect("reply").expect("task");
            reply.assert_problem(409, "InFlight");
            assert_eq!(reply.headers["retry-after"], "1");
            conflicts += 1;
        }
        conflicts
    })
    .await
    .unwrap_or_else(|_| panic!("{} handlers ran at once", h.probe.executions()));
    assert_eq!(
        h.probe.executions(),
        1,
        "one holder while the others were refused"
    );
    h.probe.open_gate(1);
    let winner = requests.join_next().await.expect("reply").expect("task");
    assert_eq!(winner.status, StatusCode::CREATED);
    assert_eq!(conflicts, N - 1);

    let retry = Reply::of(
        h.post("/charges", Some("k-concurrent"))
            .json(&charge_json(100)),
    )
    .await;
    assert!(retry.replayed());
    assert_eq!(retry.body, winner.body);
    assert_eq!(h.probe.executions(), 1);
}

/// A key reused with another payload is 422, in flight or completed, and the record stays.
pub async fn reused_key_with_another_payload_is_422<B: Backend>() {
    let h = Harness::<B>::start().await;
    let in_flight = tokio::spawn(Reply::of(
        h.post("/charges", Some("k-reuse"))
            .header("x-test-gate", "1")
            .json(&charge_json(100)),
    ));
    h.probe.started(1).await;
    let during = Reply::of(h.post("/charges", Some("k-reuse")).json(&charge_json(200))).await;
    if B::TRANSACTIONAL {
        // The holder's claim is uncommitted, so its payload cannot be compared yet.
        during.assert_problem(409, "InFlight");
    } else {
        during.assert_problem(422, "Mismatch");
    }
    h.probe.open_gate(1);
    let first = in_flight.await.expect("task");
    assert_eq!(first.status, StatusCode::CREATED);

    for other in [
        h.post("/charges", Some("k-reuse")).json(&charge_json(200)),
        h.post("/charges?capture=false", Some("k-reuse"))
            .json(&charge_json(100)),
        h.post("/charges", Some("k-reuse"))
            .body("amount=100&currency=usd"),
    ] {
        Reply::of(other).await.assert_problem(422, "Mismatch");
    }
    let retry = Reply::of(h.post("/charges", Some("k-reuse")).json(&charge_json(100))).await;
    assert!(retry.replayed(), "the record is untouched by mismatches");
    assert_eq!(retry.body, first.body);
    assert_eq!(h.probe.executions(), 1);
}

/// The same parameters in another order or spacing are the same request.
pub async fn reordered_parameters_are_the_same_request<B: Backend>() {
    let h = Harness::<B>::start().await;
    let json = |body: &'static str| {
        h.post("/charges", Some("k-json"))
            .header("content-type", "application/json")
            .body(body)
    };
    let first = Reply::of(json(
        r#"{"amount":100,"currency":"usd","metadata":{"a":"1","b":"2"}}"#,
    ))
    .await;
    let retry = Reply::of(json(
        "{ \"metadata\": {\"b\":\"2\", \"a\":\"1\"},\n  \"currency\": \"usd\", \"amount\": 100 }",
    ))
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());

    let form = |body: &'static str| {
        h.post("/charges", Some("k-form"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
    };
    let first = Reply::of(form("amount=100&currency=usd&metadata%5Border%5D=6735")).await;
    let retry = Reply::of(form("metadata[order]=6735&currency=usd&amount=100")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(h.probe.executions(), 2);
}

/// `FingerprintMode::Raw`: the body's bytes are the payload, so the same parameters reordered
/// are another request (`422`), and only the same bytes replay.
pub async fn raw_fingerprints_compare_bytes<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_fingerprint(FingerprintMode::Raw)).await;
    let json = |body: &'static str| {
        h.post("/charges", Some("k-raw"))
            .header("content-type", "application/json")
            .body(body)
    };
    let first = Reply::of(json(r#"{"amount":100,"currency":"usd"}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    Reply::of(json(r#"{"currency":"usd","amount":100}"#))
        .await
        .assert_problem(422, "Mismatch");
    let retry = Reply::of(json(r#"{"amount":100,"currency":"usd"}"#)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(h.probe.executions(), 1);
}

/// Keys may be sf-strings or bare tokens, and `"abc"` is `abc`.
pub async fn quoted_and_bare_keys_are_one_key<B: Backend>() {
    let h = Harness::<B>::start().await;
    let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let first = Reply::of(h.post("/charges", Some(uuid)).body(CHARGE)).await;
    let retry = Reply::of(
        h.post("/charges", Some(&format!("\"{uuid}\"")))
            .body(CHARGE),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(h.probe.executions(), 1);
}

/// Malformed keys are 400 and run nothing.
pub async fn malformed_keys_are_400<B: Backend>() {
    let h = Harness::<B>::start().await;
    let long = "k".repeat(256);
    for key in [
        "",
        "\"\"",
        "two words",
        "\"unterminated",
        "\"a\", \"b\"",
        long.as_str(),
        "caf\u{e9}",
    ] {
        let request = h
            .client
            .post(h.server.url("/charges"))
            .bearer_auth("acct_a");
        let request = match HeaderValue::from_bytes(key.as_bytes()) {
            Ok(value) => request.header("idempotency-key", value),
            Err(_) => continue,
        };
        Reply::of(request.body(CHARGE))
            .await
            .assert_problem(400, "KeyInvalid");
    }
    let repeated = h
        .post("/charges", Some("a"))
        .header("idempotency-key", "b")
        .body(CHARGE);
    Reply::of(repeated).await.assert_problem(400, "KeyInvalid");
    let repeated_equal = h
        .post("/charges", Some("a"))
        .header("idempotency-key", "a")
        .body(CHARGE);
    Reply::of(repeated_equal)
        .await
        .assert_problem(400, "KeyInvalid");
    assert_eq!(h.probe.executions(), 0);
}

/// `required()` makes a missing key 400; other methods still pass through.
pub async fn missing_key_is_400_when_required<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.required()).await;
    Reply::of(h.post("/charges", None).body(CHARGE))
        .await
        .assert_problem(400, "KeyMissing");
    assert_eq!(h.probe.executions(), 0);
    let list = Reply::of(h.client.get(h.server.url("/charges")).bearer_auth("acct_a")).await;
    assert_eq!(list.status, StatusCode::OK);
}

/// Without `required()`, keyless requests and uncovered methods run every time.
pub async fn keyless_and_uncovered_requests_pass_through<B: Backend>() {
    let h = Harness::<B>::start().await;
    for _ in 0..2 {
        let reply = Reply::of(h.post("/charges", None).body(CHARGE)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
        let get = h
            .client
            .get(h.server.url("/charges"))
            .bearer_auth("acct_a")
            .header("idempotency-key", "k-get");
        assert!(!Reply::of(get).await.replayed());
    }
    assert_eq!(h.probe.executions(), 4);
}

/// Bodies over the limit are 413, whether declared or streamed, and free the key.
pub async fn oversize_bodies_are_413<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_max_body_bytes(1024).expect("limit")).await;
    let declared = Reply::of(h.post("/charges", Some("k-big")).body(vec![b'a'; 1025])).await;
    declared.assert_problem(413, "BodyTooLarge");

    let frames: Vec<Result<http_body::Frame<bytes::Bytes>, std::io::Error>> = (0..8)
        .map(|_| Ok(http_body::Frame::data(bytes::Bytes::from(vec![b'b'; 200]))))
        .collect();
    let streamed = h.post("/charges", Some("k-big")).body(reqwest::Body::wrap(
        http_body_util::StreamBody::new(futures_util::stream::iter(frames)),
    ));
    Reply::of(streamed)
        .await
        .assert_problem(413, "BodyTooLarge");
    assert_eq!(h.probe.executions(), 0);

    let fitting = Reply::of(h.post("/charges", Some("k-big")).body(vec![b'a'; 1024])).await;
    assert_eq!(
        fitting.status,
        StatusCode::CREATED,
        "nothing was claimed for the key"
    );
}

/// Two principals with the same key never meet.
pub async fn principals_never_share_a_key<B: Backend>() {
    let h = Harness::<B>::start().await;
    let a = Reply::of(
        h.post_as("acct_a", "/charges", Some("k-shared"))
            .json(&charge_json(100)),
    )
    .await;
    let b = Reply::of(
        h.post_as("acct_b", "/charges", Some("k-shared"))
            .json(&charge_json(100)),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(b.status, StatusCode::CREATED);
    assert!(!b.replayed(), "B must not get A's response");
    assert_ne!(a.json()["id"], b.json()["id"]);
    let b_other = Reply::of(
        h.post_as("acct_b", "/charges", Some("k-a-only"))
            .json(&charge_json(7)),
    )
    .await;
    assert!(!b_other.replayed());
    let a_retry = Reply::of(
        h.post_as("acct_a", "/charges", Some("k-shared"))
            .json(&charge_json(100)),
    )
    .await;
    assert!(a_retry.replayed());
    assert_eq!(a_retry.body, a.body);
    assert_eq!(h.probe.executions(), 3);
}

/// No principal: refused, not shared.
pub async fn missing_principal_is_refused<B: Backend>() {
    let h = Harness::<B>::start().await;
    let anonymous = h
        .client
        .post(h.server.url("/charges"))
        .header("idempotency-key", "k-anon")
        .body(CHARGE);
    Reply::of(anonymous)
        .await
        .assert_problem(500, "PrincipalMissing");
    assert_eq!(h.probe.executions(), 0);
}

/// Final outcomes are kept; "nothing was done" answers and 5xx release the key.
pub async fn retention_follows_the_policy<B: Backend>() {
    let h = Harness::<B>::start().await;
    for (path, kept) in [
        ("/status/200", true),
        ("/status/402", true),
        ("/status/404", true),
        ("/status/400", false),
        ("/status/422", false),
        ("/status/429", false),
        ("/status/500", false),
        ("/status/503", false),
        ("/keep/500", true),
        ("/release/201", false),
    ] {
        let first = Reply::of(h.post(path, Some("k-retention")).body("x")).await;
        let retry = Reply::of(h.post(path, Some("k-retention")).body("x")).await;
        assert_eq!(retry.status, first.status, "{path}");
        assert_eq!(retry.replayed(), kept, "{path}");
        if kept {
            assert_eq!(retry.body, first.body, "{path}");
        } else {
            assert_ne!(retry.body, first.body, "{path}: the handler ran again");
        }
    }
}

/// A released key accepts a corrected payload: Stripe's "validation errors store nothing".
pub async fn a_rejected_request_can_be_corrected<B: Backend>() {
    let h = Harness::<B>::start().await;
    let rejected = Reply::of(h.post("/status/400", Some("k-fix")).body("amount=-1")).await;
    assert_eq!(rejected.status, StatusCode::BAD_REQUEST);
    let corrected = Reply::of(h.post("/status/400", Some("k-fix")).body("amount=2")).await;
    assert!(
        !corrected.replayed(),
        "another payload under a released key is not a mismatch"
    );
    assert_eq!(corrected.body, "status 400 #2");
    assert_eq!(h.probe.executions(), 2);
}

/// `keep_server_errors()`: a 5xx is replayed, as Stripe does.
pub async fn server_errors_can_be_kept<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_retention(RetentionPolicy::keep_server_errors()))
        .await;
    let first = Reply::of(h.post("/status/500", Some("k-500")).body("x")).await;
    let retry = Reply::of(h.post("/status/500", Some("k-500")).body("x")).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(retry.replayed());
    assert_eq!(h.probe.executions(), 1);
}

/// A panicking handler is a 500 problem, and the key is free for the retry.
pub async fn a_panicking_handler_releases_the_key<B: Backend>() {
    let h = Harness::<B>::start().await;
    Reply::of(h.post("/panic", Some("k-panic")).body("x"))
        .await
        .assert_problem(500, "HandlerPanicked");
    let retry = Reply::of(h.post("/panic", Some("k-panic")).body("x")).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert_eq!(retry.body, "survived #2");
    assert_eq!(h.store.released(), 1);
}

/// The claim the layer makes for `POST /charges` as `acct_a` with `key` and a JSON `body`
/// (a 30 s lease, a 24 h TTL): for claiming a key directly, as a holder that then crashes.
pub fn claim_request(key: &str, body: &str) -> ClaimRequest {
    let json = HeaderValue::from_static("application/json");
    ClaimRequest {
        key: ScopeKey::new(
            &Principal::new("acct_a").expect("principal"),
            &Method::POST,
            "/charges",
            &IdempotencyKey::new(key).expect("key"),
        ),
        fingerprint: Fingerprint::compute(
            FingerprintMode::Semantic,
            &Method::POST,
            &"/charges".parse().expect("uri"),
            Some(&json),
            body.as_bytes(),
        ),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(24 * 3600),
    }
}

/// After the store answered one retry, later retries to this instance are answered from the
/// process (the store sees no further `begin`), mismatches included; verbatim all the same.
pub async fn repeated_replays_skip_the_store<B: Backend>() {
    let h = Harness::<B>::start().await;
    let first = Reply::of(h.post("/binary", Some("k-cache")).body("payload")).await;
    let from_store = Reply::of(h.post("/binary", Some("k-cache")).body("payload")).await;
    let begins = h.store.begins();
    let from_cache = Reply::of(h.post("/binary", Some("k-cache")).body("payload")).await;
    Reply::of(h.post("/binary", Some("k-cache")).body("other"))
        .await
        .assert_problem(422, "Mismatch");
    assert_eq!(h.store.begins(), begins, "answered without the store");
    assert!(from_store.replayed() && from_cache.replayed());
    for reply in [&from_store, &from_cache] {
        assert_eq!(reply.status, first.status);
        assert_eq!(reply.body, first.body);
        let traces: Vec<_> = reply.headers.get_all("x-trace").iter().collect();
        assert_eq!(traces, ["a", "b"]);
    }
    assert_eq!(h.probe.executions(), 1);
}

/// A holder that stopped (crashed) blocks its key only until its lease lapses; the request that
/// takes over runs, and the stale holder can no longer write.
pub async fn a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out<B: Backend>() {
    let h = Harness::<B>::start().await;
    let Ok(KeyState::Acquired { claim: stale, .. }) = h
        .store
        .inner()
        .begin(&claim_request("k-crash", CHARGE))
        .await
    else {
        panic!("the crashed holder acquires the key first");
    };
    let post = || {
        h.post("/charges", Some("k-crash"))
            .header("content-type", "application/json")
            .body(CHARGE)
    };
    Reply::of(post()).await.assert_problem(409, "InFlight");

    let store = h.store.inner();
    if B::TRANSACTIONAL {
        // The holder's transaction ends (as PostgreSQL ends a dead client's): free at once.
        assert_eq!(store.release(&stale).await.ok(), Some(ClaimStatus::Held));
    } else {
        h.backend.lapse_leases().await;
    }
    // The new holder is held in its handler while the stale one tries to write.
    let taking = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
    h.probe.started(1).await;
    let record = tower_idempotency::Record::from_parts(
        StatusCode::OK,
        Default::default(),
        Some("stale".into()),
    );
    assert_eq!(
        store.renew(&stale, Duration::from_secs(30)).await.ok(),
        Some(ClaimStatus::Lost)
    );
    assert_eq!(
        store.complete(&stale, &record).await.ok(),
        Some(ClaimStatus::Lost)
    );
    assert_eq!(store.release(&stale).await.ok(), Some(ClaimStatus::Lost));
    h.probe.open_gate(1);
    let taken = taking.await.expect("task");
    assert_eq!(taken.status, StatusCode::CREATED);
    assert_eq!(
        taken.json()["takeover"],
        !B::TRANSACTIONAL,
        "the handler is told whether it took a lapsed lease over"
    );

    let retry = Reply::of(post()).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, taken.body, "the stale holder wrote nothing");
    assert_eq!(h.probe.executions(), 1);
}

/// A record past its TTL is gone: the key is new again.
pub async fn expired_records_are_new<B: Backend>() {
    // The backend expires records behind the layer's back (PostgreSQL: by rewriting their
    // expiry), which an in-process copy cannot see; in production both expire together.
    let h = Harness::<B>::with(|layer| layer.with_replay_cache(0)).await;
    let first = Reply::of(h.post("/charges", Some("k-ttl")).body(CHARGE)).await;
    assert!(
        Reply::of(h.post("/charges", Some("k-ttl")).body(CHARGE))
            .await
            .replayed()
    );
    h.backend.expire_records().await;
    let after = Reply::of(h.post("/charges", Some("k-ttl")).body("{\"other\":1}")).await;
    assert_eq!(after.status, StatusCode::CREATED);
    assert!(!after.replayed());
    assert_ne!(after.body, first.body);
    assert_eq!(h.probe.executions(), 2);
}

/// Issue 28.5, a TTL shorter than the lease: a claim in flight is its holder's until it ends,
/// past its TTL too; a completed record expires at its TTL counted from its claim, not after
/// the lease.
pub async fn a_ttl_shorter_than_the_lease_still_expires_records<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer
            .with_ttl(Duration::from_secs(2))
            .and_then(|layer| layer.with_lease(Duration::from_secs(30)))
            .expect("valid settings")
            .with_replay_cache(0)
    })
    .await;
    let post = || h.post("/charges", Some("k-short")).body(CHARGE);
    let holding = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
    h.probe.started(1).await;
    h.backend.pass_time(Duration::from_secs(3)).await;
    Reply::of(post()).await.assert_problem(409, "InFlight");
    h.probe.open_gate(1);
    let first = holding.await.expect("task");
    assert_eq!(first.status, StatusCode::CREATED);
    h.backend.pass_time(Duration::from_secs(3)).await;
    let after = Reply::of(post()).await;
    assert_eq!(after.status, StatusCode::CREATED);
    assert!(!after.replayed(), "a record past its TTL is not replayed");
    assert_ne!(after.body, first.body);
    assert_eq!(h.probe.executions(), 2);
}

/// Issue 28.7: a handler that hangs is stopped at the layer's maximum handler time: its client
/// gets a `503`, its claim is given up, and the retry takes the key over at once, told so
/// (transactional mode: rolled back, so nothing to tell).
pub async fn a_hung_handler_is_stopped_and_its_key_taken_over<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer
            .with_max_handler_time(Duration::from_millis(300))
            .expect("valid")
    })
    .await;
    let post = || {
        h.post("/charges", Some("k-hung"))
            .header("content-type", "application/json")
            .body(CHARGE)
    };
    let hung = tokio::time::timeout(
        Duration::from_secs(10),
        Reply::of(post().header("x-test-gate", "1")),
    )
    .await
    .expect("the hung handler is stopped");
    hung.assert_problem(503, "HandlerTimedOut");
    assert!(hung.headers.contains_key("retry-after"));
    let taken = Reply::of(post()).await;
    assert_eq!(taken.status, StatusCode::CREATED);
    assert_eq!(taken.json()["takeover"], !B::TRANSACTIONAL);
    assert!(Reply::of(post()).await.replayed());
    assert_eq!(h.probe.executions(), 2);
}

/// Issue 28.10: a response whose body fails half-way is not a known outcome: nothing is stored
/// (no record of a status without its body) and the key is released, so the retry runs again.
pub async fn a_response_body_that_fails_releases_the_key<B: Backend>() {
    let h = Harness::<B>::start().await;
    // The client sees the failure: the connection ends before the head or mid-body.
    let send = || async {
        if let Ok(response) = h.post("/broken", Some("k-broken")).send().await {
            assert_eq!(response.status(), StatusCode::CREATED);
            assert!(
                response.headers().get("idempotent-replayed").is_none(),
                "never a replay"
            );
            assert!(response.bytes().await.is_err(), "the body fails");
        }
    };
    send().await;
    h.store.settled(1).await;
    assert_eq!(h.store.completed(), 0, "nothing stored");
    send().await;
    assert_eq!(h.probe.executions(), 2);
}

/// Issue 29.3: with waiting on, a duplicate of a key in flight waits for the first request
/// and gets its replay, never a `409`; the handler runs once.
pub async fn a_waiting_duplicate_gets_the_first_ones_replay<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_in_flight_wait(Duration::from_secs(10))).await;
    let post = || h.post("/charges", Some("k-wait")).body(CHARGE);
    let first = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
    h.probe.started(1).await;
    h.store.begun(1).await;
    let duplicate = tokio::spawn(Reply::of(post()));
    // Its first read found the key in flight, its second (once subscribed) too: it waits.
    h.store.begun(2).await;
    h.probe.open_gate(1);
    let first = first.await.expect("task");
    let duplicate = duplicate.await.expect("task");
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(duplicate.replayed(), "{duplicate:?}");
    assert_eq!(duplicate.body, first.body);
    assert_eq!(h.probe.executions(), 1);
}

/// Issue 29.3: when the first request is released (a `400`: nothing was done), the waiting
/// duplicate runs itself.
pub async fn a_waiting_duplicate_runs_when_the_first_is_released<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_in_flight_wait(Duration::from_secs(10))).await;
    let post = || h.post("/status/400", Some("k-released")).body(CHARGE);
    let first = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
    h.probe.started(1).await;
    h.store.begun(1).await;
    let duplicate = tokio::spawn(Reply::of(post()));
    h.store.begun(2).await;
    h.probe.open_gate(1);
    assert_eq!(first.await.expect("task").body, "status 400 #1");
    let duplicate = duplicate.await.expect("task");
    assert_eq!(duplicate.status, StatusCode::BAD_REQUEST);
    assert!(!duplicate.replayed());
    assert_eq!(duplicate.body, "status 400 #2", "it ran itself");
}

/// Issue 29.3: a wait that runs out is a `409`, as without waiting.
pub async fn a_wait_that_runs_out_is_409<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_in_flight_wait(Duration::from_millis(300))).await;
    let post = || h.post("/charges", Some("k-wait-out")).body(CHARGE);
    let first = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
    h.probe.started(1).await;
    let started = tokio::time::Instant::now();
    Reply::of(post()).await.assert_problem(409, "InFlight");
    assert!(started.elapsed() >= Duration::from_millis(300), "it waited");
    h.probe.open_gate(1);
    assert_eq!(first.await.expect("task").status, StatusCode::CREATED);
    assert_eq!(h.probe.executions(), 1);
}

/// Issue 30.1: an API keeps its own header name; `Idempotency-Key` is then just another header.
pub async fn a_key_in_the_apis_own_header_is_honoured<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer.with_header(http::HeaderName::from_static("x-idempotency-key"))
    })
    .await;
    let post = || {
        h.post("/charges", None)
            .header("x-idempotency-key", "\"k-own\"")
            .body(CHARGE)
    };
    let first = Reply::of(post()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = Reply::of(post()).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    // The standard header is not read: both run, unprotected.
    for _ in 0..2 {
        let plain = Reply::of(h.post("/charges", Some("k-own")).body(CHARGE)).await;
        assert!(!plain.replayed());
    }
    assert_eq!(h.probe.executions(), 3);
}

/// Issue 30.1: a webhook receiver keyed by the event id in the JSON body applies each event
/// once, however often it is delivered, one after another or at once.
pub async fn a_webhook_keyed_by_its_event_id_is_applied_once<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer.with_key_from_request(|_, body| {
            let event: serde_json::Value = serde_json::from_slice(body).ok()?;
            Some(event.get("id")?.as_str()?.to_owned())
        })
    })
    .await;
    let deliver = |event: &str| {
        h.post("/charges", None)
            .header("content-type", "application/json")
            .body(format!(r#"{{"id":"{event}","type":"charge.succeeded"}}"#))
    };
    for _ in 0..3 {
        let delivered = Reply::of(deliver("evt_1")).await;
        assert_eq!(delivered.status, StatusCode::CREATED);
    }
    let mut at_once = JoinSet::new();
    for _ in 0..8 {
        at_once.spawn(Reply::of(deliver("evt_2")));
    }
    while let Some(delivered) = at_once.join_next().await {
        let status = delivered.expect("task").status;
        assert!(
            status == StatusCode::CREATED || status == StatusCode::CONFLICT,
            "{status}"
        );
    }
    let after = Reply::of(deliver("evt_2")).await;
    assert!(after.replayed());
    // An event without an id is no idempotent request: it runs, unprotected.
    let anonymous = Reply::of(h.post("/charges", None).body("{}")).await;
    assert_eq!(anonymous.status, StatusCode::CREATED);
    assert_eq!(
        h.probe.executions(),
        3,
        "evt_1 once, evt_2 once, the anonymous one"
    );
}

/// Issue 30.2: a key that breaks the app's rule is a `400` naming it, and reaches no store.
pub async fn a_key_that_breaks_the_rule_is_400_and_stores_nothing<B: Backend>() {
    let h =
        Harness::<B>::with(|layer| layer.with_key_rule(tower_idempotency::KeyRule::uuid())).await;
    let refused = Reply::of(h.post("/charges", Some("order-1042")).body(CHARGE)).await;
    refused.assert_problem(400, "KeyInvalid");
    assert!(
        refused.json()["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("`uuid`")),
        "{:?}",
        refused.json()
    );
    assert_eq!(h.store.begins(), 0, "nothing reached the store");
    let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    assert_eq!(
        Reply::of(h.post("/charges", Some(uuid)).body(CHARGE))
            .await
            .status,
        StatusCode::CREATED
    );
    assert_eq!(h.probe.executions(), 1);
}

/// Issue 30.3: by default a key is per endpoint (another endpoint's key runs); scoped to the
/// principal across endpoints, the same key on another endpoint is a `422`.
pub async fn a_key_reaches_across_endpoints_only_when_scoped_so<B: Backend>() {
    let per_endpoint = Harness::<B>::start().await;
    let first = Reply::of(per_endpoint.post("/charges", Some("k-ep")).body(CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = Reply::of(per_endpoint.post("/binary", Some("k-ep")).body(CHARGE)).await;
    assert_eq!(other.status, StatusCode::ACCEPTED, "another endpoint's key");

    let across = Harness::<B>::with(|layer| {
        layer.with_scope(tower_idempotency::Scope::principal_extension().across_endpoints())
    })
    .await;
    let first = Reply::of(across.post("/charges", Some("k-ep")).body(CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    Reply::of(across.post("/binary", Some("k-ep")).body(CHARGE))
        .await
        .assert_problem(422, "Mismatch");
    assert!(
        Reply::of(across.post("/charges", Some("k-ep")).body(CHARGE))
            .await
            .replayed()
    );
    // Principals still never meet.
    let other_account = Reply::of(
        across
            .post_as("acct_b", "/binary", Some("k-ep"))
            .body(CHARGE),
    )
    .await;
    assert_eq!(other_account.status, StatusCode::ACCEPTED);
}

/// Issue 30.4: fields left out of the fingerprint may change between retries; headers taken
/// in may not.
pub async fn fingerprints_leave_out_fields_and_take_in_headers<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer
            .with_fingerprint_excluding(["/client_sent_at", "/meta/trace"])
            .expect("pointers")
            .with_fingerprint_headers([http::HeaderName::from_static("stripe-version")])
    })
    .await;
    let json = |sent: &str, trace: &str, version: &str| {
        h.post("/charges", Some("k-fp"))
            .header("content-type", "application/json")
            .header("stripe-version", version)
            .body(format!(
                r#"{{"amount":100,"client_sent_at":"{sent}","meta":{{"trace":"{trace}","k":1}}}}"#
            ))
    };
    let first = Reply::of(json("10:00", "t1", "2024-06-20")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = Reply::of(json("10:01", "t2", "2024-06-20")).await;
    assert!(retry.replayed(), "only left-out fields changed: {retry:?}");
    Reply::of(json("10:00", "t1", "2025-01-01"))
        .await
        .assert_problem(422, "Mismatch");
    let form = |sent: &str, amount: u32| {
        h.post("/charges", Some("k-fp-form"))
            .header("content-type", "application/x-www-form-urlencoded")
            .header("stripe-version", "2024-06-20")
            .body(format!("amount={amount}&client_sent_at={sent}"))
    };
    assert_eq!(Reply::of(form("1", 100)).await.status, StatusCode::CREATED);
    assert!(Reply::of(form("2", 100)).await.replayed());
    Reply::of(form("1", 200))
        .await
        .assert_problem(422, "Mismatch");
    assert_eq!(h.probe.executions(), 2);
}

async fn send_and_hang_up(h: &Harness<impl Backend>, key: &str) {
    let mut stream = TcpStream::connect(h.server.addr()).await.expect("connect");
    let request = format!(
        "POST /charges HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer acct_a\r\n\
         Idempotency-Key: {key}\r\nX-Test-Gate: 1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{CHARGE}",
        CHARGE.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    h.probe.started(1).await;
    drop(stream);
}

/// The client hangs up mid-handler: the handler finishes anyway and the retry gets its result.
pub async fn a_disconnected_client_still_gets_its_charge_on_retry<B: Backend>() {
    let h = Harness::<B>::start().await;
    send_and_hang_up(&h, "k-hangup").await;
    // The server has dropped the request before the handler may finish.
    h.probe.abandoned(1).await;
    h.probe.open_gate(1);
    h.store.settled(1).await;
    assert_eq!(h.store.completed(), 1);
    let retry = Reply::of(
        h.post("/charges", Some("k-hangup"))
            .header("content-type", "application/json")
            .body(CHARGE),
    )
    .await;
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], "ch_1");
    assert_eq!(h.probe.executions(), 1);
}

/// `Disconnect::Cancel`: the handler is dropped with the connection and the key released.
pub async fn cancel_on_disconnect_releases_the_key<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_disconnect(Disconnect::Cancel)).await;
    send_and_hang_up(&h, "k-cancel").await;
    h.probe.abandoned(1).await;
    h.store.settled(1).await;
    assert_eq!(h.store.released(), 1);
    let retry = Reply::of(
        h.post("/charges", Some("k-cancel"))
            .header("content-type", "application/json")
            .body(CHARGE),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(h.probe.executions(), 2);
}

/// A store outage is a 503 problem and runs nothing, unless the app chose to fail open.
pub async fn a_store_outage_fails_closed_or_open<B: Backend>() {
    let closed = Harness::<B>::start().await;
    closed.store.set_down(true);
    let reply = Reply::of(closed.post("/charges", Some("k-down")).body(CHARGE)).await;
    reply.assert_problem(503, "StoreUnavailable");
    assert_eq!(reply.headers["retry-after"], "1");
    assert_eq!(closed.probe.executions(), 0);
    closed.store.set_down(false);
    let recovered = Reply::of(closed.post("/charges", Some("k-down")).body(CHARGE)).await;
    assert_eq!(
        recovered.status,
        StatusCode::CREATED,
        "nothing was lost or stuck"
    );

    let open = Harness::<B>::with(|layer| layer.with_store_failure(StoreFailure::FailOpen)).await;
    open.store.set_down(true);
    let reply = Reply::of(open.post("/charges", Some("k-down")).body(CHARGE)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(open.probe.executions(), 1);
}

/// A response too large to keep is delivered whole; a retry gets its status, not a re-run.
pub async fn a_response_too_large_to_store_is_never_rerun<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_max_response_bytes(1024)).await;
    let first = Reply::of(h.post("/large?bytes=100000", Some("k-large")).body("x")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.len(), 100_000);
    let retry = Reply::of(h.post("/large?bytes=100000", Some("k-large")).body("x")).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert!(retry.replayed());
    assert_eq!(retry.headers["location"], "/exports/1");
    assert_eq!(retry.headers["content-type"], "application/problem+json");
    assert_eq!(retry.json()["status"], 200);
    assert_eq!(h.probe.executions(), 1);
}

/// Instantiates the suite for a [`Backend`]:
///
/// ```ignore
/// idempotency_tests::store_suite!(MyBackend);
/// // For a backend that needs something not every machine has (its tests then do nothing):
/// idempotency_tests::store_suite!(MyBackend, run_if: my_backend_is_installed());
/// ```
#[macro_export]
macro_rules! store_suite {
    ($backend:ty) => {
        $crate::store_suite!($backend, run_if: async { true });
    };
    ($backend:ty, run_if: $available:expr) => {
        $crate::store_suite!(@tests $backend, $available;
            current_thread:
                retry_replays_the_response_verbatim,
                cookies_are_not_replayed,
                reused_key_with_another_payload_is_422,
                reordered_parameters_are_the_same_request,
                raw_fingerprints_compare_bytes,
                quoted_and_bare_keys_are_one_key,
                malformed_keys_are_400,
                missing_key_is_400_when_required,
                keyless_and_uncovered_requests_pass_through,
                oversize_bodies_are_413,
                principals_never_share_a_key,
                missing_principal_is_refused,
                retention_follows_the_policy,
                a_rejected_request_can_be_corrected,
                server_errors_can_be_kept,
                a_panicking_handler_releases_the_key,
                a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out,
                expired_records_are_new,
                a_ttl_shorter_than_the_lease_still_expires_records,
                a_hung_handler_is_stopped_and_its_key_taken_over,
                a_response_body_that_fails_releases_the_key,
                a_waiting_duplicate_gets_the_first_ones_replay,
                a_waiting_duplicate_runs_when_the_first_is_released,
                a_wait_that_runs_out_is_409,
                a_key_in_the_apis_own_header_is_honoured,
                a_webhook_keyed_by_its_event_id_is_applied_once,
                a_key_that_breaks_the_rule_is_400_and_stores_nothing,
                a_key_reaches_across_endpoints_only_when_scoped_so,
                fingerprints_leave_out_fields_and_take_in_headers,
                repeated_replays_skip_the_store,
                a_disconnected_client_still_gets_its_charge_on_retry,
                cancel_on_disconnect_releases_the_key,
                a_store_outage_fails_closed_or_open,
                a_response_too_large_to_store_is_never_rerun;
            multi_thread:
                concurrent_duplicates_execute_once
        );
    };
    (@tests $backend:ty, $available:expr; current_thread: $($c:ident),*; multi_thread: $($m:ident),*) => {
        $(
            #[tokio::test(flavor = "current_thread")]
            async fn $c() {
                $crate::init_tracing();
                if $available.await {
                    $crate::suite::$c::<$backend>().await;
                }
            }
        )*
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $m() {
                $crate::init_tracing();
                if $available.await {
                    $crate::suite::$m::<$backend>().await;
                }
            }
        )*
    };
}
