//! Issue 29.3: a duplicate of a key in flight that waits for the first request's outcome
//! instead of getting a `409`.

use std::time::Duration;

use http::StatusCode;

use super::{Backend, CHARGE, Harness, Reply};

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
