//! The sealing store through the layer: replays byte for byte, rotation, and records that do
//! not open answered `500` without running the handler (issue 37.4); records sealed before
//! per-record keys, and none sealed under the sealing key itself (issue 44).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use aes_gcm::{Aes256Gcm, KeyInit, aead::AeadInPlace};
use axum::{Router, body::Body, routing::post};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

use super::{
    SealedClaim, SealingKeys, SealingStore,
    v1::tests::{RESPONSE, STEP, unhex},
};
use crate::{
    IdempotencyLayer, Record, Scope, StoreFailure,
    store::{ClaimHandle, ClaimRequest, ClaimStatus, KeyState, MemoryStore, StepRecord, Store},
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
    assert_eq!(envelope[..5], [2, 0, 0, 0, 5]);
}

/// A held claim of scope key `[0x11; 32]` (the key of `v1`'s envelopes) on `store`.
async fn held(
    store: &SealingStore<MemoryStore>,
) -> (ClaimRequest, SealedClaim<<MemoryStore as Store>::Claim>) {
    let request = ClaimRequest {
        key: crate::ScopeKey::from_bytes([0x11; 32]),
        fingerprint: crate::Fingerprint::from_bytes([8; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(600),
        waiting: false,
        keeps_request: false,
    };
    let Ok(KeyState::Acquired { claim, .. }) = store.claim(&request).await else {
        panic!("acquired")
    };
    (request, claim)
}

/// A response and a step output sealed before per-record keys (envelope version 1) open
/// through the store, so an upgrade leaves the records of the day before readable.
#[tokio::test(start_paused = true)]
async fn records_sealed_before_per_record_keys_still_open() {
    let inner = MemoryStore::new();
    let store = SealingStore::new(inner.clone(), SealingKeys::new(7, [0x42; 32]));
    let (request, claim) = held(&store).await;
    let fence = claim.fence().unwrap();
    let step = StepRecord {
        name: "authorize".to_owned(),
        output: unhex(STEP),
    };
    let plain_steps = inner.capabilities().step_log().cloned().unwrap();
    let status = plain_steps
        .record(&fence, &request.fingerprint, &step)
        .await
        .unwrap();
    assert_eq!(status, ClaimStatus::Held);
    let sealed_steps = store.capabilities().step_log().cloned().unwrap();
    let opened = sealed_steps
        .recorded(&fence, &request.fingerprint)
        .await
        .unwrap();
    assert_eq!(opened[0].output, "\"auth_1\"");

    let old = Record::from_parts(StatusCode::CREATED, HeaderMap::new(), Some(unhex(RESPONSE)));
    let status = inner.complete(claim.inner(), &old).await.unwrap();
    assert_eq!(status, ClaimStatus::Held);
    let Ok(KeyState::Completed { record, .. }) = store.claim(&request).await else {
        panic!("completed")
    };
    assert_eq!(record.headers()["location"], "/v1/charges/ch_1");
    assert_eq!(record.body().unwrap(), "{\"id\":\"ch_1\"}");
}

/// Whether `envelope` opens as version 1 did: under the sealing key `key` itself, its nonce
/// after the key id, bound to `scope_key` and `key_id`.
fn opens_under_the_sealing_key(
    envelope: &[u8],
    key: [u8; 32],
    scope_key: &[u8; 32],
    key_id: u32,
) -> bool {
    let (nonce, sealed) = envelope[5..].split_at(12);
    let (sealed, tag) = sealed.split_at(sealed.len() - 16);
    let mut aad = b"tower-idempotency sealed record v1\0".to_vec();
    aad.extend_from_slice(scope_key);
    aad.extend_from_slice(&key_id.to_be_bytes());
    let mut plain = sealed.to_vec();
    Aes256Gcm::new(&key.into())
        .decrypt_in_place_detached(nonce.into(), &aad, &mut plain, tag.into())
        .is_ok()
}

/// The nonce budget: AES-GCM under random nonces is safe for about 2^32 seals per key, so no
/// record is sealed under the sealing key itself, which every record would share.
#[tokio::test(start_paused = true)]
async fn no_record_is_sealed_under_the_sealing_key_itself() {
    let inner = MemoryStore::new();
    let store = SealingStore::new(inner.clone(), SealingKeys::new(5, OLD));
    let (request, claim) = held(&store).await;
    let record = Record::from_parts(StatusCode::CREATED, HeaderMap::new(), Some("ch_1".into()));
    let _ = store.complete(&claim, &record).await.unwrap();
    let Ok(KeyState::Completed { record: kept, .. }) = inner.claim(&request).await else {
        panic!("completed")
    };
    let envelope = kept.body().unwrap();
    assert!(!opens_under_the_sealing_key(
        envelope,
        OLD,
        request.key.as_bytes(),
        5
    ));
    let Ok(KeyState::Completed { record: opened, .. }) = store.claim(&request).await else {
        panic!("completed")
    };
    assert_eq!(opened, record);
}

#[cfg(feature = "conformance")]
#[tokio::test(start_paused = true)]
async fn keeps_the_protocol() {
    let store = SealingStore::new(MemoryStore::new(), SealingKeys::new(1, OLD));
    crate::store::conformance::check(&store, Duration::from_secs(1)).await;
    crate::store::conformance::check_expired_deletion(&store, Duration::from_secs(1)).await;
}
