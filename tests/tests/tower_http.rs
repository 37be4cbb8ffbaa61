//! The layer among tower-http's: the order the README recommends, and why.
//!
//! In axum the last `.layer(...)` is the outermost. A timeout and compression belong outside
//! the idempotency layer: a timeout then ends the client's wait, not the handler, and each
//! response (a replay too) is compressed for the client that asked for it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, body::Body, routing::post};
use http::{
    Request, Response, StatusCode,
    header::{ACCEPT_ENCODING, CONTENT_ENCODING},
};
use http_body_util::BodyExt;
use idempotency_tests::requests::replayed;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_http::{compression::CompressionLayer, timeout::TimeoutLayer};
use tower_idempotency::{IdempotencyLayer, KeySource, Scope};

fn charge(key: &str) -> http::request::Builder {
    Request::post("/v1/charges").header("idempotency-key", key)
}

async fn send(app: &Router, request: http::request::Builder) -> Response<Body> {
    app.clone()
        .oneshot(request.body(Body::from("amount=100")).unwrap())
        .await
        .unwrap()
}

async fn text(response: Response<Body>) -> String {
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// A timeout outside the layer answers the client, while the handler goes on in the layer's
/// own task and its response is stored: the retry is told to wait (`409`), then gets the
/// replay, and the handler ran once.
#[tokio::test]
async fn a_timeout_outside_the_layer_ends_the_wait_not_the_handler() {
    let release = Arc::new(Notify::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (release, runs) = (Arc::clone(&release), Arc::clone(&runs));
        move || async move {
            release.notified().await;
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("charged, run {run}"))
        }
    };
    let app = Router::new()
        .route("/v1/charges", post(handler))
        .layer(IdempotencyLayer::memory().with_scope(Scope::single_tenant()))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(20),
        ));

    let first = send(&app, charge("slow-1")).await;
    assert_eq!(first.status(), StatusCode::REQUEST_TIMEOUT);
    let during = send(&app, charge("slow-1")).await;
    assert_eq!(
        during.status(),
        StatusCode::CONFLICT,
        "the handler still runs under its key"
    );

    release.notify_one();
    // The handler finishes and its response is stored; until then a retry gets 409.
    let mut retry = send(&app, charge("slow-1")).await;
    for _ in 0..10_000 {
        if retry.status() != StatusCode::CONFLICT {
            break;
        }
        tokio::task::yield_now().await;
        retry = send(&app, charge("slow-1")).await;
    }
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(replayed(retry.headers()));
    assert_eq!(text(retry).await, "charged, run 1");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Compression outside the layer: the record is kept as the handler wrote it, and each
/// response, a replay too, is encoded for the client that asked for it.
#[tokio::test]
async fn compression_outside_the_layer_encodes_each_replay_for_its_client() {
    let receipt = "charged: ".to_owned() + &"a receipt line that compresses well; ".repeat(20);
    let app = Router::new()
        .route(
            "/v1/charges",
            post({
                let receipt = receipt.clone();
                move || async move { (StatusCode::CREATED, receipt) }
            }),
        )
        .layer(IdempotencyLayer::memory().with_scope(Scope::single_tenant()))
        .layer(CompressionLayer::new());

    let first = send(&app, charge("gz-1").header(ACCEPT_ENCODING, "gzip")).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(first.headers()[CONTENT_ENCODING], "gzip");
    assert!(!replayed(first.headers()));

    let plain = send(&app, charge("gz-1")).await;
    assert!(replayed(plain.headers()));
    assert!(plain.headers().get(CONTENT_ENCODING).is_none());
    assert_eq!(text(plain).await, receipt);

    let gzipped = send(&app, charge("gz-1").header(ACCEPT_ENCODING, "gzip")).await;
    assert!(replayed(gzipped.headers()));
    assert_eq!(gzipped.headers()[CONTENT_ENCODING], "gzip");
}

/// A layer outside sees each refusal as a [`Rejection`](tower_idempotency::Rejection) in the
/// response's extensions, of the kind the problem document names; a handler's own answer
/// carries none. For an outer layer that logs refusals or renders them in its own format.
#[tokio::test]
async fn an_outer_layer_sees_the_rejection_in_the_response_extensions() {
    use tower_idempotency::Rejection;

    let app = Router::new()
        .route("/v1/charges", post(|| async { "charged" }))
        .layer(
            IdempotencyLayer::memory()
                .with_scope(Scope::single_tenant())
                .with_key(KeySource::default().required()),
        )
        .layer(axum::middleware::map_response(
            |mut response: Response<Body>| async move {
                let seen = response
                    .extensions()
                    .get::<Rejection>()
                    .map_or("none", |rejection| rejection.kind().label());
                response
                    .headers_mut()
                    .insert("x-seen-rejection", http::HeaderValue::from_static(seen));
                response
            },
        ));
    let seen = |response: &Response<Body>| response.headers()["x-seen-rejection"].clone();

    let charged = send(&app, charge("k1")).await;
    assert_eq!(charged.status(), StatusCode::OK);
    assert_eq!(seen(&charged), "none");
    let missing = send(&app, Request::post("/v1/charges")).await;
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert_eq!(seen(&missing), "key_missing");
    let other_payload = app
        .clone()
        .oneshot(charge("k1").body(Body::from("amount=200")).unwrap())
        .await
        .unwrap();
    assert_eq!(other_payload.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(seen(&other_payload), "mismatch");
}
