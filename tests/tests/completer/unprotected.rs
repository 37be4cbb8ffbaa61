//! Issue 44.1: a request the completer drives never runs unprotected. It is refused, running
//! nothing, when the layer finds no key in it, finds another key than the one kept, or cannot
//! claim it (whatever `StoreFailure` says); and credentials are never kept unless asked for.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderName, Request, StatusCode, header::AUTHORIZATION},
    routing,
};
use idempotency_tests::{bounded, db::TestDb, postgres::migrated};
use tower::ServiceExt;
use tower_idempotency::{
    Completer, Completion, ConfigError, Fingerprinting, IdempotencyLayer, KeySource, Limits,
    Principal, Round, StoreFailure, store::PostgresStore,
};

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Runs of the handler; the first one hangs (the crash that leaves the key to the completer).
async fn order(State(runs): State<Arc<AtomicU32>>) -> StatusCode {
    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
        std::future::pending::<()>().await;
    }
    StatusCode::CREATED
}

/// The key is the `X-Request-Id` header, else the body's `id`: a header the layer does not keep.
fn key_source() -> KeySource {
    KeySource::from_request(|parts, body| {
        if let Some(id) = parts.headers.get(&REQUEST_ID) {
            return id.to_str().ok().map(str::to_owned);
        }
        let body: serde_json::Value = serde_json::from_slice(body).ok()?;
        Some(body.get("id")?.as_str()?.to_owned())
    })
}

fn app(store: &PostgresStore, failure: StoreFailure, runs: &Arc<AtomicU32>) -> Router {
    let layer = IdempotencyLayer::new(store.clone())
        .with_key(key_source())
        .with_store_failure(failure)
        .with_limits(Limits::default().with_max_handler_time(Duration::from_millis(200)))
        .unwrap()
        .with_completion(Completion::new())
        .unwrap();
    Router::new()
        .route("/v1/orders", routing::post(order))
        .layer(layer)
        .with_state(Arc::clone(runs))
}

/// The client's request: its key in `X-Request-Id`, a body whose `id` is another key.
fn request() -> Request<Body> {
    let mut request = Request::post("/v1/orders")
        .header(REQUEST_ID, "r1")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"id":"b1","amount":100}"#))
        .unwrap();
    request
        .extensions_mut()
        .insert(Principal::new("acct_a").unwrap());
    request
}

/// The client's first request hangs and its key is given up; then `attempts` completer rounds.
async fn crash_then_complete(
    db: &TestDb,
    app: &Router,
    store: &PostgresStore,
    attempts: u32,
) -> Round {
    let response = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "the crash stands in"
    );
    let completer = Completer::new(store, app.clone())
        .unwrap()
        .with_grace(Duration::from_millis(300))
        .unwrap()
        .with_max_attempts(attempts)
        .unwrap();
    let mut total = Round::default();
    while total.picked < attempts {
        let round = completer.complete_abandoned().await.expect("a round");
        total.picked += round.picked;
        total.completed += round.completed;
        total.gave_up += round.gave_up;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency.pending_requests")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(kept, 1, "the request stays kept for its client");
    total
}

/// The kept request lacks `X-Request-Id`, so the completer's request finds the body's key: a
/// key of its own, which the old code claimed and ran, once per round.
#[tokio::test]
async fn a_completer_request_that_finds_another_key_runs_nothing() {
    bounded(async {
        let (db, store) = migrated().await;
        let runs = Arc::new(AtomicU32::new(0));
        let app = app(&store, StoreFailure::default(), &runs);
        let round = crash_then_complete(&db, &app, &store, 2).await;
        assert_eq!((round.completed, round.gave_up), (0, 1), "{round:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "only the client's run");
        // The key is still its client's: the retry takes it over and runs.
        let retry = app.clone().oneshot(request()).await.unwrap();
        assert_eq!(retry.status(), StatusCode::CREATED);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    })
    .await;
}

/// Without a key in its body either, the completer's request has none: the old code ran the
/// handler unprotected (the key is not required), once per round.
#[tokio::test]
async fn a_completer_request_without_a_key_runs_nothing() {
    bounded(async {
        let (db, store) = migrated().await;
        let runs = Arc::new(AtomicU32::new(0));
        let layer = IdempotencyLayer::new(store.clone())
            .with_key(KeySource::from_request(|parts, _| {
                Some(parts.headers.get(&REQUEST_ID)?.to_str().ok()?.to_owned())
            }))
            .with_limits(Limits::default().with_max_handler_time(Duration::from_millis(200)))
            .unwrap()
            .with_completion(Completion::new())
            .unwrap();
        let app = Router::new()
            .route("/v1/orders", routing::post(order))
            .layer(layer)
            .with_state(Arc::clone(&runs));
        let round = crash_then_complete(&db, &app, &store, 2).await;
        assert_eq!((round.completed, round.gave_up), (0, 1), "{round:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "only the client's run");
    })
    .await;
}

/// Failing open is for clients: a completer whose claim fails runs nothing.
#[tokio::test]
async fn a_completer_request_whose_claim_fails_runs_nothing_even_failing_open() {
    bounded(async {
        let (db, store) = migrated().await;
        let runs = Arc::new(AtomicU32::new(0));
        // The key in a kept header this time, so that only the store stands in the way.
        let layer = IdempotencyLayer::new(store.clone())
            .with_store_failure(StoreFailure::FailOpen)
            .with_limits(Limits::default().with_max_handler_time(Duration::from_millis(200)))
            .unwrap()
            .with_completion(Completion::new())
            .unwrap();
        let app = Router::new()
            .route("/v1/orders", routing::post(order))
            .layer(layer)
            .with_state(Arc::clone(&runs));
        let mut first = request();
        first
            .headers_mut()
            .insert("idempotency-key", "k1".parse().unwrap());
        let response = app.clone().oneshot(first).await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "the crash stands in"
        );
        // From now on every claim of an existing key (a takeover) fails.
        sqlx::raw_sql(
            "CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN RAISE EXCEPTION 'claims refused by the test'; END $$;
             CREATE TRIGGER refuse_claims BEFORE UPDATE ON idempotency.records
                 FOR EACH ROW EXECUTE FUNCTION refuse_claims();",
        )
        .execute(db.pool())
        .await
        .unwrap();
        let completer = Completer::new(&store, app.clone())
            .unwrap()
            .with_grace(Duration::from_millis(300))
            .unwrap()
            .with_max_attempts(2)
            .unwrap();
        let mut picked = 0;
        while picked < 2 {
            picked += completer
                .complete_abandoned()
                .await
                .expect("a round")
                .picked;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "only the client's run");
    })
    .await;
}

/// Credentials are kept only by a method that says so, whichever setting names them.
#[tokio::test]
async fn credentials_are_kept_only_when_asked_for_by_name() {
    let pool = sqlx::PgPool::connect_lazy("postgres://127.0.0.1/unused").unwrap();
    let layer = || IdempotencyLayer::new(PostgresStore::new(pool.clone()));
    let refused = Some(ConfigError::CredentialKept(AUTHORIZATION));
    let named = layer().with_completion(Completion::storing_headers([AUTHORIZATION]));
    assert_eq!(named.err(), refused);
    let cookie = layer().with_completion(Completion::storing_headers([
        HeaderName::from_static("x-merchant"),
        HeaderName::from_static("cookie"),
    ]));
    assert_eq!(
        cookie.err(),
        Some(ConfigError::CredentialKept(HeaderName::from_static(
            "cookie"
        )))
    );
    let fingerprinted = Fingerprinting::semantic().with_headers([AUTHORIZATION]);
    let after = layer()
        .with_completion(Completion::new())
        .unwrap()
        .with_fingerprint(fingerprinted.clone());
    assert_eq!(after.err(), refused);
    let before = layer()
        .with_fingerprint(fingerprinted.clone())
        .unwrap()
        .with_completion(Completion::new());
    assert_eq!(before.err(), refused);
    let asked = layer()
        .with_fingerprint(fingerprinted)
        .unwrap()
        .with_completion(Completion::storing_credentials([AUTHORIZATION]));
    assert!(asked.is_ok());
}
