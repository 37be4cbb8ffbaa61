//! `SealingStore` over `PostgresStore` (issue 37.4): replays byte for byte, no plaintext in the
//! table, rotation, and rows moved or altered in SQL answered `500 record-unopenable` without
//! running the handler, failing open too. Each test in its own database.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{Router, body::Body, routing::post};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency_tests::postgres::migrated;
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyLayer, Scope, StoreFailure,
    store::{PostgresStore, SealingKeys, SealingStore},
};

const KEY_1: [u8; 32] = [1; 32];
const KEY_2: [u8; 32] = [2; 32];
/// What the handler answers; never to be found in the table.
const SECRET: &str = "card-4242-4242-4242-4242";

/// An app over `store` sealed with `keys`, whose handler counts its runs.
fn app(
    store: &PostgresStore,
    keys: SealingKeys,
    policy: StoreFailure,
) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler = move || {
        let n = counted.fetch_add(1, Ordering::SeqCst);
        async move {
            (
                StatusCode::CREATED,
                [("x-secret", SECRET), ("link", "<a>"), ("link", "<b>")],
                format!("{{\"run\":{n},\"pan\":\"{SECRET}\"}}"),
            )
        }
    };
    let layer = IdempotencyLayer::new(SealingStore::new(store.clone(), keys))
        .with_scope(Scope::single_tenant())
        .with_store_failure(policy);
    (Router::new().route("/", post(handler)).layer(layer), runs)
}

/// Status, headers in order (without `idempotent-replayed`) and body of the answer to `key`.
async fn send(app: &Router, key: &str) -> (StatusCode, Vec<(String, Vec<u8>)>, Bytes) {
    let request = Request::post("/")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .expect("request");
    let response = app.clone().oneshot(request).await.expect("response");
    let headers = response
        .headers()
        .iter()
        .filter(|(name, _)| *name != "idempotent-replayed")
        .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
        .collect();
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, headers, body)
}

/// The problem code of an answer.
fn code(body: &Bytes) -> String {
    let problem: serde_json::Value = serde_json::from_slice(body).expect("a problem document");
    problem["code"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn replays_byte_for_byte_and_the_table_holds_no_plaintext() {
    let (db, store) = migrated().await;
    let (app, runs) = app(&store, SealingKeys::new(1, KEY_1), StoreFailure::default());
    let first = send(&app, "k").await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(send(&app, "k").await, first);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let (status, names, body): (i16, Vec<String>, Vec<u8>) =
        sqlx::query_as("SELECT status, header_names, body FROM idempotency.records")
            .fetch_one(db.pool())
            .await
            .expect("the row");
    assert_eq!(status, 201, "the status stays clear");
    assert!(names.is_empty(), "headers are sealed: {names:?}");
    assert!(!body.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()));
    assert_eq!(body[..5], [2, 0, 0, 0, 1], "envelope version 2, key id 1");
}

#[tokio::test]
async fn after_a_rotation_old_records_open_and_new_ones_are_sealed_with_the_new_key() {
    let (db, store) = migrated().await;
    let (before, _) = app(&store, SealingKeys::new(1, KEY_1), StoreFailure::default());
    let old = send(&before, "old").await;
    let rotated = SealingKeys::new(2, KEY_2)
        .with_old_key(1, KEY_1)
        .expect("two ids");
    let (after, runs) = app(&store, rotated, StoreFailure::default());
    assert_eq!(send(&after, "old").await, old);
    let new = send(&after, "new").await;
    assert_eq!(send(&after, "new").await, new);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the new key ran");
    let key_ids: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT substring(body FROM 2 FOR 4) FROM idempotency.records ORDER BY created_at",
    )
    .fetch_all(db.pool())
    .await
    .expect("key ids");
    assert_eq!(key_ids, [vec![0, 0, 0, 1], vec![0, 0, 0, 2]]);
}

/// Every other row's sealed record replaced by the one in `$1`, as an operator or attacker
/// could in SQL.
const MOVE: &str = "UPDATE idempotency.records SET body = $1 WHERE body IS DISTINCT FROM $1";

/// One byte of the ciphertext flipped.
const TAMPER: &str =
    "UPDATE idempotency.records SET body = set_byte(body, 30, get_byte(body, 30) # 1)";

#[tokio::test]
async fn a_record_moved_under_another_key_is_500_and_never_reruns() {
    for policy in [StoreFailure::default(), StoreFailure::FailOpen] {
        let (db, store) = migrated().await;
        let (app, runs) = app(&store, SealingKeys::new(1, KEY_1), policy);
        send(&app, "a").await;
        let sealed_a: Vec<u8> = sqlx::query_scalar("SELECT body FROM idempotency.records")
            .fetch_one(db.pool())
            .await
            .expect("a's row");
        send(&app, "b").await;
        let moved = sqlx::query(MOVE)
            .bind(sealed_a)
            .execute(db.pool())
            .await
            .expect("move");
        assert_eq!(moved.rows_affected(), 1);
        let (status, _, body) = send(&app, "b").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{policy:?}");
        assert_eq!(code(&body), "record-unopenable");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            2,
            "{policy:?}: the handler did not run"
        );
        assert_eq!(
            send(&app, "a").await.0,
            StatusCode::CREATED,
            "the original still opens"
        );
    }
}

#[tokio::test]
async fn a_tampered_record_is_500_and_never_reruns() {
    for policy in [StoreFailure::default(), StoreFailure::FailOpen] {
        let (db, store) = migrated().await;
        let (app, runs) = app(&store, SealingKeys::new(1, KEY_1), policy);
        send(&app, "k").await;
        sqlx::query(TAMPER)
            .execute(db.pool())
            .await
            .expect("tamper");
        let (status, _, body) = send(&app, "k").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{policy:?}");
        assert_eq!(code(&body), "record-unopenable");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "{policy:?}: the handler did not run"
        );
    }
}

#[tokio::test]
async fn a_record_under_a_key_no_longer_given_is_500() {
    let (_db, store) = migrated().await;
    let (before, _) = app(&store, SealingKeys::new(1, KEY_1), StoreFailure::default());
    send(&before, "k").await;
    let (after, runs) = app(&store, SealingKeys::new(2, KEY_2), StoreFailure::FailOpen);
    let (status, _, body) = send(&after, "k").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(code(&body), "record-unopenable");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}
