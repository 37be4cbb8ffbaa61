//! Time: leases that lapse and are taken over (the stale holder fenced out), records that
//! expire, handlers that hang past the maximum handler time.

use std::time::Duration;
use tower_idempotency::Limits;

use http::StatusCode;
use tower_idempotency::{
    IdempotencyLayer,
    store::{ClaimStatus, KeyState, Store},
};

use super::{Backend, CHARGE, Harness, Reply, claim_request};

/// A holder that stopped (crashed) blocks its key only until its lease lapses; the request that
/// takes over runs, and the stale holder can no longer write.
pub async fn a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out<B: Backend>() {
    let h = Harness::<B>::start().await;
    let Ok(KeyState::Acquired { claim: stale, .. }) = h
        .store
        .inner()
        .claim(&claim_request("k-crash", CHARGE))
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
    // expiry), which a CachingStore's copy cannot see; in production both expire together.
    let h = Harness::<B>::serving(IdempotencyLayer::new).await;
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
    // No cache in front, as above.
    let h = Harness::<B>::serving(|store| {
        IdempotencyLayer::new(store)
            .with_ttl(Duration::from_secs(2))
            .and_then(|layer| layer.with_lease(Duration::from_secs(30)))
            .expect("valid settings")
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
            .with_limits(Limits::default().with_max_handler_time(Duration::from_millis(300)))
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

/// Issue 34.7: a delivered response keeps its lease while it is stored, however long storing
/// takes: a retry meanwhile is in flight (`409`), never a takeover that runs the handler again.
pub async fn a_response_being_stored_keeps_its_lease<B: Backend>() {
    let h =
        Harness::<B>::with(|layer| layer.with_lease(Duration::from_millis(300)).expect("valid"))
            .await;
    let post = || {
        h.post("/charges", Some("k-storing"))
            .header("content-type", "application/json")
            .body(CHARGE)
    };
    h.store.hold_completions();
    let first = tokio::spawn(Reply::of(post()));
    h.store.completing(1).await;
    // Storing takes four leases: only renewals keep the key.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Taken over, the retry would run the handler and wait on its own held completion.
    let retry = tokio::time::timeout(Duration::from_secs(10), Reply::of(post()))
        .await
        .expect("the retry is answered at once, not run again");
    retry.assert_problem(409, "InFlight");
    h.store.let_completions_go();
    assert_eq!(first.await.expect("task").status, StatusCode::CREATED);
    assert!(Reply::of(post()).await.replayed());
    assert_eq!(h.probe.executions(), 1);
}
