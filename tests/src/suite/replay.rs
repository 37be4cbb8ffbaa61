//! The promise itself: a request runs once, however often and however concurrently it is sent,
//! and its retries get its response back, byte for byte.

use std::time::Duration;

use http::{HeaderValue, StatusCode};
use tokio::task::JoinSet;
use tower_idempotency::{IdempotencyLayer, store::CachingStore};

use super::{Backend, CHARGE, Harness, Reply, charge_json};

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

/// Behind a [`CachingStore`], after the store answered one retry, later retries to this
/// instance are answered from the process (the store sees no further `claim`), mismatches
/// included; verbatim all the same. Without one, the store is asked every time.
pub async fn repeated_replays_skip_the_store<B: Backend>() {
    let cached = Harness::<B>::serving(|store| IdempotencyLayer::new(CachingStore::new(store)));
    let bare = Harness::<B>::serving(IdempotencyLayer::new);
    for (h, asked) in [(cached.await, 0), (bare.await, 2)] {
        replays_ask_the_store(&h, asked).await;
    }
}

/// Three retries of a request and a mismatch, of which the last two reach the store `asked`
/// times.
async fn replays_ask_the_store<B: Backend>(h: &Harness<B>, asked: usize) {
    let first = Reply::of(h.post("/binary", Some("k-cache")).body("payload")).await;
    let from_store = Reply::of(h.post("/binary", Some("k-cache")).body("payload")).await;
    let begins = h.store.begins();
    let from_cache = Reply::of(h.post("/binary", Some("k-cache")).body("payload")).await;
    Reply::of(h.post("/binary", Some("k-cache")).body("other"))
        .await
        .assert_problem(422, "Mismatch");
    assert_eq!(
        h.store.begins(),
        begins + asked,
        "claims that reached the store"
    );
    assert!(from_store.replayed() && from_cache.replayed());
    for reply in [&from_store, &from_cache] {
        assert_eq!(reply.status, first.status);
        assert_eq!(reply.body, first.body);
        let traces: Vec<_> = reply.headers.get_all("x-trace").iter().collect();
        assert_eq!(traces, ["a", "b"]);
    }
    assert_eq!(h.probe.executions(), 1);
}
