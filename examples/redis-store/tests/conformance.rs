//! The Redis store held to the store protocol, as any third-party store would be.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderValue, StatusCode};
use redis_store::RedisStore;
use tower_idempotency::{Record, store::conformance};

/// Against a real Redis: `REDIS_URL`, else `redis://127.0.0.1:6379`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Redis server (REDIS_URL, else redis://127.0.0.1:6379); CI runs it with --include-ignored"]
async fn keeps_the_store_protocol() {
    conformance::check(&connect().await, Duration::from_millis(500)).await;
}

/// Every part of a record comes back from the bytes this store keeps, and cut-short bytes are
/// an error.
#[test]
fn records_round_trip_through_their_bytes() {
    let mut headers = HeaderMap::new();
    headers.append("link", HeaderValue::from_static("<a>; rel=a"));
    headers.append("content-type", HeaderValue::from_static("application/json"));
    headers.append("link", HeaderValue::from_static("<b>; rel=b"));
    headers.append(
        "x-binary",
        HeaderValue::from_bytes(&[0x80, 0xff]).expect("valid"),
    );
    for body in [
        None,
        Some(bytes::Bytes::new()),
        Some("{\"id\":1}\0\u{e9}".into()),
    ] {
        let record = Record::from_parts(StatusCode::PAYMENT_REQUIRED, headers.clone(), body);
        let bytes = record.to_bytes();
        let back = Record::from_bytes(bytes.clone()).expect("decodes");
        assert_eq!(back, record);
        let order = |r: &Record| {
            r.headers()
                .iter()
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(order(&back), order(&record));
        // Cut anywhere before the body, the bytes are refused rather than misread.
        let body = record.body().map_or(0, bytes::Bytes::len);
        for end in 0..bytes.len() - body {
            assert!(
                Record::from_bytes(bytes.slice(..end)).is_err(),
                "cut at {end}"
            );
        }
    }
}

/// The layer over the Redis store, as an app would use it: the handler runs once, the retry
/// gets its response back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Redis server (REDIS_URL, else redis://127.0.0.1:6379); CI runs it with --include-ignored"]
async fn a_retry_replays_through_the_layer() {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use axum::{Router, body::Body, http::Request, routing::post};
    use tower::ServiceExt;
    use tower_idempotency::{IdempotencyLayer, Scope};

    let store = connect().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/v1/charges",
            post({
                let runs = Arc::clone(&runs);
                move || async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    (StatusCode::CREATED, format!("charge {n}"))
                }
            }),
        )
        .layer(IdempotencyLayer::new(store).with_scope(Scope::single_tenant()));
    let charge = || {
        Request::post("/v1/charges")
            .header("idempotency-key", "order-1042")
            .body(Body::from("amount=100"))
            .expect("a request")
    };
    let first = app.clone().oneshot(charge()).await.expect("served");
    let retry = app.oneshot(charge()).await.expect("served");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let body = |response: axum::response::Response| async move {
        axum::body::to_bytes(response.into_body(), 1024)
            .await
            .expect("a body")
    };
    assert_eq!(body(retry).await, body(first).await);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A store on the test's Redis, under a prefix no other run uses.
async fn connect() -> RedisStore {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let run = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos();
    let prefix = format!("redis-store-test:{}:{run}", std::process::id());
    RedisStore::connect(&url, &prefix)
        .await
        .unwrap_or_else(|error| panic!("no Redis at {url} (set REDIS_URL): {error}"))
}
