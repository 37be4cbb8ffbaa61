//! The sealing store through the layer: replays byte for byte, rotation, and records that do
//! not open answered `500` without running the handler (issue 37.4).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, body::Body, routing::post};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

use super::{SealingKeys, SealingStore};
use crate::{
    IdempotencyLayer, Record, Scope, StoreFailure,
    store::{ClaimRequest, KeyState, MemoryStore, Store},
};

const OLD: [u8; 32] = [1; 32];
const NEW: [u8; 32] = [2; 32];

/// An app whose handler counts its runs and answers `201` with a body and repeated headers.
fn app(store: SealingStore<MemoryStore>, policy: StoreFailure) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler = move || {
        let n = counted.fetch_add(1, Ordering::SeqCst);
        async move {
            (
                StatusCode::CREATED,
                [("link", "<a>"), ("link", "<b>"), ("x-run", "first")],
                format!("{{\"charge\":\"ch_{n}\",\"card\":\"4242\"}}"),
            )
        }
    };
    let layer = IdempotencyLayer::new(store)
        .with_scope(Scope::single_tenant())
        .with_store_failure(policy);
    (Router::new().route("/", post(handler)).layer(layer), runs)
}

/// Status, headers in order and body of `app`'s answer to a request with `key`.
async fn send(app: &Router, key: &str) -> (StatusCode, Vec<(String, Vec<u8>)>, Bytes) {
    let request = Request::post("/")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let headers = response
        .headers()
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    let status = response.status();
    (
        status,
        headers,
        response.into_body().collect().await.unwrap().to_bytes(),
    )
}

fn without_replayed(headers: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let mut headers = headers.to_vec();
    headers.retain(|(n, _)| n != "idempotent-replayed");
    headers
}

#[tokio::test(start_paused = true)]
async fn replays_byte_for_byte_and_stores_no_plaintext() {
    let inner = MemoryStore::new();
    let (app, runs) = app(
        SealingStore::new(inner.clone(), SealingKeys::new(1, OLD)),
        StoreFailure::default(),
    );
    let first = send(&app, "k").await;
    let replay = send(&app, "k").await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!((replay.0, &replay.2), (first.0, &first.2));
    assert_eq!(without_replayed(&replay.1), without_replayed(&first.1));
    assert_eq!(inner.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn rotation_opens_old_records_and_seals_new_ones_with_the_new_key() {
    let inner = MemoryStore::new();
    let (before, _) = app(
        SealingStore::new(inner.clone(), SealingKeys::new(1, OLD)),
        StoreFailure::default(),
    );
    let old = send(&before, "old").await;
    let rotated = SealingKeys::new(2, NEW).with_old_key(1, OLD).unwrap();
    let (after, runs) = app(
        SealingStore::new(inner.clone(), rotated),
        StoreFailure::default(),
    );
    assert_eq!(send(&after, "old").await.2, old.2);
    let new = send(&after, "new").await;
    assert_eq!(send(&after, "new").await.2, new.2);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the new key ran");
    // Without key 1, the old record no longer opens; the new one does.
    let (new_only, runs) = app(
        SealingStore::new(inner, SealingKeys::new(2, NEW)),
        StoreFailure::default(),
    );
    assert_eq!(send(&new_only, "new").await.2, new.2);
    assert_eq!(
        send(&new_only, "old").await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_record_that_does_not_open_is_500_and_never_reruns_even_failing_open() {
    let inner = MemoryStore::new();
    let (sealer, _) = app(
        SealingStore::new(inner.clone(), SealingKeys::new(1, OLD)),
        StoreFailure::default(),
    );
    send(&sealer, "k").await;
    for policy in [StoreFailure::default(), StoreFailure::FailOpen] {
        let (app, runs) = app(
            SealingStore::new(inner.clone(), SealingKeys::new(2, NEW)),
            policy,
        );
        let (status, _, body) = send(&app, "k").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{policy:?}");
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(problem["code"], "record-unopenable");
        assert_eq!(runs.load(Ordering::SeqCst), 0, "{policy:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_record_stored_before_sealing_is_not_replayed_unsealed() {
    let inner = MemoryStore::new();
    let (plain, _) = {
        let layer = IdempotencyLayer::new(inner.clone()).with_scope(Scope::single_tenant());
        let handler = || async { "card 4242" };
        (Router::new().route("/", post(handler)).layer(layer), ())
    };
    let request = Request::post("/")
        .header("idempotency-key", "k")
        .body(Body::from("{}"))
        .unwrap();
    plain.oneshot(request).await.unwrap();
    let (sealed, runs) = app(
        SealingStore::new(inner, SealingKeys::new(1, OLD)),
        StoreFailure::FailOpen,
    );
    assert_eq!(
        send(&sealed, "k").await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn the_wrapped_store_sees_only_the_status_and_an_envelope() {
    let inner = MemoryStore::new();
    let store = SealingStore::new(inner.clone(), SealingKeys::new(5, OLD));
    let request = ClaimRequest {
        key: crate::ScopeKey::from_bytes([9; 32]),
        fingerprint: crate::Fingerprint::from_bytes([8; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(600),
        waiting: false,
        keeps_request: false,
    };
    let Ok(KeyState::Acquired { claim, .. }) = store.claim(&request).await else {
        panic!("acquired")
    };
    let mut headers = HeaderMap::new();
    headers.append("x-secret", "4242".parse().unwrap());
    let record = Record::from_parts(StatusCode::ACCEPTED, headers, Some("pan 4242".into()));
    let _ = store.complete(&claim, &record).await.unwrap();
    let Ok(KeyState::Completed { record: kept, .. }) = inner.claim(&request).await else {
        panic!("completed")
    };
    assert_eq!(kept.status(), StatusCode::ACCEPTED);
    assert!(kept.headers().is_empty());
    let envelope = kept.body().unwrap();
    assert!(!envelope.windows(4).any(|w| w == b"4242"));
    assert_eq!(envelope[..5], [1, 0, 0, 0, 5]);
}

#[cfg(feature = "conformance")]
#[tokio::test(start_paused = true)]
async fn keeps_the_protocol() {
    let store = SealingStore::new(MemoryStore::new(), SealingKeys::new(1, OLD));
    crate::store::conformance::check(&store, Duration::from_secs(1)).await;
    crate::store::conformance::check_expired_deletion(&store, Duration::from_secs(1)).await;
}
