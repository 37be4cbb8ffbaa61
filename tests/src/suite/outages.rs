//! The store down: fail closed (`503`) or, where the app chose it, open.

use http::StatusCode;
use tower_idempotency::StoreFailure;

use super::{Backend, CHARGE, Harness, Reply};

/// A store outage is a 503 problem and runs nothing, unless the app chose to fail open.
pub async fn a_store_outage_fails_closed_or_open<B: Backend>() {
    let closed = Harness::<B>::start().await;
    closed.store.set_down(true);
    let reply = Reply::of(closed.post("/charges", Some("k-down")).body(CHARGE)).await;
    reply.assert_problem(503, "StoreUnavailable");
    assert_eq!(reply.headers["retry-after"], "1");
    assert_eq!(closed.probe.executions(), 0);
    closed.store.set_down(false);
    let recovered = Reply::of(closed.post("/charges", Some("k-down")).body(CHARGE)).await;
    assert_eq!(
        recovered.status,
        StatusCode::CREATED,
        "nothing was lost or stuck"
    );

    let open = Harness::<B>::with(|layer| layer.with_store_failure(StoreFailure::FailOpen)).await;
    open.store.set_down(true);
    let reply = Reply::of(open.post("/charges", Some("k-down")).body(CHARGE)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(open.probe.executions(), 1);
}
