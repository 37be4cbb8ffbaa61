//! Which outcomes are kept for replay and which release the key: the retention policy, panics,
//! failing bodies, responses too large to keep.

use http::StatusCode;
use tower_idempotency::{Limits, RetentionPolicy};

use super::{Backend, Harness, Reply};

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

/// A response too large to keep is delivered whole; a retry gets its status, not a re-run.
pub async fn a_response_too_large_to_store_is_never_rerun<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer
            .with_limits(Limits::default().with_max_response_bytes(1024))
            .expect("a limit")
    })
    .await;
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
