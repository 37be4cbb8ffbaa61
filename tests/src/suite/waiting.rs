//! Issue 29.3: a duplicate of a key in flight that waits for the first request's outcome
//! instead of getting a `409`.

use std::time::Duration;

use http::StatusCode;
use tokio::{io::AsyncWriteExt, net::TcpStream};
use tower_idempotency::{InFlightWait, Limits, StoreFailure};

use super::{Backend, CHARGE, Harness, Reply};

/// Issue 29.3: with waiting on, a duplicate of a key in flight waits for the first request
/// and gets its replay, never a `409`; the handler runs once.
pub async fn a_waiting_duplicate_gets_the_first_ones_replay<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(10)))
            .expect("a wait")
    })
    .await;
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
    let h = Harness::<B>::with(|layer| {
        layer
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(10)))
            .expect("a wait")
    })
    .await;
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
    let h = Harness::<B>::with(|layer| {
        layer
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_millis(300)))
            .expect("a wait")
    })
    .await;
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

/// Sends a duplicate of `key` (the body of [`CHARGE`], as JSON, from `acct_a`) on a connection
/// of its own, to hang up on later by dropping it.
async fn send_duplicate(h: &Harness<impl Backend>, key: &str) -> TcpStream {
    let mut stream = TcpStream::connect(h.server.addr()).await.expect("connect");
    let request = format!(
        "POST /charges HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer acct_a\r\n\
         Idempotency-Key: {key}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{CHARGE}",
        CHARGE.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    stream
}

/// Issue 34.1: duplicates that wait for a key in flight and whose clients hang up hold no
/// handler: they stop, claim nothing and count against no limit, so another principal's new
/// key still runs where two hung-up handlers would have filled `max_detached`.
pub async fn waiters_that_hang_up_hold_nothing<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer
            .with_limits(Limits::default().with_max_detached(2))
            .expect("a limit")
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(5)))
            .expect("a wait")
    })
    .await;
    let post = || {
        h.post("/charges", Some("k-slow"))
            .header("content-type", "application/json")
            .body(CHARGE)
    };
    let first = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
    h.probe.started(1).await;
    h.store.begun(1).await;
    for _ in 0..2 {
        let duplicate = send_duplicate(&h, "k-slow").await;
        // Its first read found the key in flight, its second (once subscribed) too: it waits.
        h.store.begun(2).await;
        drop(duplicate);
    }
    h.probe.abandoned(2).await;
    let other = Reply::of(
        h.post_as("acct_b", "/charges", Some("k-other"))
            .header("content-type", "application/json")
            .body(CHARGE),
    )
    .await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    h.probe.open_gate(1);
    assert_eq!(first.await.expect("task").status, StatusCode::CREATED);
    let retry = Reply::of(post()).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(h.probe.executions(), 2, "the waiters ran nothing");
}

/// Issue 34.2: a read that fails while a duplicate waits answers what it last saw, the key in
/// flight: `409`, never the handler a second time (fail-open) nor a `503` (fail-closed).
pub async fn a_failed_read_while_waiting_is_409<B: Backend>() {
    for failure in [StoreFailure::FailOpen, StoreFailure::default()] {
        let h = Harness::<B>::with(|layer| {
            layer
                .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(10)))
                .expect("a wait")
                .with_store_failure(failure)
        })
        .await;
        let post = || h.post("/charges", Some("k-wait-fails")).body(CHARGE);
        let first = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
        h.probe.started(1).await;
        h.store.begun(1).await;
        // The duplicate's first read finds the key in flight; its second fails.
        h.store.fail_begins_from(3);
        Reply::of(post()).await.assert_problem(409, "InFlight");
        assert_eq!(h.probe.executions(), 1, "{failure:?}: the handler ran once");
        h.probe.open_gate(1);
        assert_eq!(first.await.expect("task").status, StatusCode::CREATED);
        assert_eq!(h.probe.executions(), 1, "{failure:?}");
    }
}

/// A waiter whose read takes over a stopped handler's key just as its client hangs up hands the
/// key on as a takeover: the next request is still told a handler may have run in part
/// (transactional mode: the stopped handler was rolled back, so there is nothing to tell).
pub async fn a_takeover_by_a_waiter_that_hung_up_stays_a_takeover<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(20)))
            .expect("a wait")
            .with_limits(Limits::default().with_max_handler_time(Duration::from_millis(300)))
            .expect("valid")
    })
    .await;
    let post = || {
        h.post("/charges", Some("k-taken"))
            .header("content-type", "application/json")
            .body(CHARGE)
    };
    let hung = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
    h.probe.started(1).await;
    h.store.begun(1).await;
    let duplicate = send_duplicate(&h, "k-taken").await;
    // Its first read found the key in flight, its second (once subscribed) too: it waits.
    h.store.begun(2).await;
    h.store.hold_begins();
    hung.await
        .expect("task")
        .assert_problem(503, "HandlerTimedOut");
    // The waiter's next read would take the stopped handler's key over: its client leaves.
    h.store.beginning(1).await;
    drop(duplicate);
    h.probe.abandoned(1).await;
    h.store.let_begins_go();
    let retry = Reply::of(post()).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(retry.json()["takeover"], !B::TRANSACTIONAL, "{retry:?}");
}

/// A handler stopped at its maximum time frees its key at once, and that wakes the duplicates
/// waiting for it: they take it over at once rather than at their next periodic read (1 s).
pub async fn a_waiter_takes_a_stopped_handlers_key_over_at_once<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(20)))
            .expect("a wait")
            .with_limits(Limits::default().with_max_handler_time(Duration::from_millis(300)))
            .expect("valid")
    })
    .await;
    let post = || {
        h.post("/charges", Some("k-stopped"))
            .header("content-type", "application/json")
            .body(CHARGE)
    };
    let hung = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
    h.probe.started(1).await;
    h.store.begun(1).await;
    let waiter = tokio::spawn(Reply::of(post()));
    h.store.found_in_flight(1).await;
    hung.await
        .expect("task")
        .assert_problem(503, "HandlerTimedOut");
    let stopped = tokio::time::Instant::now();
    let waiter = waiter.await.expect("task");
    let after = stopped.elapsed();
    assert_eq!(waiter.status, StatusCode::CREATED, "{waiter:?}");
    assert!(
        after < Duration::from_millis(500),
        "the waiter answered {after:?} after the handler was stopped"
    );
}
