//! Whose a key is: each principal's own, per endpoint unless scoped across them.

use http::StatusCode;

use super::{Backend, CHARGE, Harness, Reply, charge_json};

/// Two principals with the same key never meet.
pub async fn principals_never_share_a_key<B: Backend>() {
    let h = Harness::<B>::start().await;
    let a = Reply::of(
        h.post_as("acct_a", "/charges", Some("k-shared"))
            .json(&charge_json(100)),
    )
    .await;
    let b = Reply::of(
        h.post_as("acct_b", "/charges", Some("k-shared"))
            .json(&charge_json(100)),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(b.status, StatusCode::CREATED);
    assert!(!b.replayed(), "B must not get A's response");
    assert_ne!(a.json()["id"], b.json()["id"]);
    let b_other = Reply::of(
        h.post_as("acct_b", "/charges", Some("k-a-only"))
            .json(&charge_json(7)),
    )
    .await;
    assert!(!b_other.replayed());
    let a_retry = Reply::of(
        h.post_as("acct_a", "/charges", Some("k-shared"))
            .json(&charge_json(100)),
    )
    .await;
    assert!(a_retry.replayed());
    assert_eq!(a_retry.body, a.body);
    assert_eq!(h.probe.executions(), 3);
}

/// No principal: refused, not shared.
pub async fn missing_principal_is_refused<B: Backend>() {
    let h = Harness::<B>::start().await;
    let anonymous = h
        .client
        .post(h.server.url("/charges"))
        .header("idempotency-key", "k-anon")
        .body(CHARGE);
    Reply::of(anonymous)
        .await
        .assert_problem(500, "PrincipalMissing");
    assert_eq!(h.probe.executions(), 0);
}

/// Issue 30.3: by default a key is per endpoint (another endpoint's key runs); scoped to the
/// principal across endpoints, the same key on another endpoint is a `422`.
pub async fn a_key_reaches_across_endpoints_only_when_scoped_so<B: Backend>() {
    let per_endpoint = Harness::<B>::start().await;
    let first = Reply::of(per_endpoint.post("/charges", Some("k-ep")).body(CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = Reply::of(per_endpoint.post("/binary", Some("k-ep")).body(CHARGE)).await;
    assert_eq!(other.status, StatusCode::ACCEPTED, "another endpoint's key");

    let across = Harness::<B>::with(|layer| {
        layer.with_scope(tower_idempotency::Scope::principal_extension().across_endpoints())
    })
    .await;
    let first = Reply::of(across.post("/charges", Some("k-ep")).body(CHARGE)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    Reply::of(across.post("/binary", Some("k-ep")).body(CHARGE))
        .await
        .assert_problem(422, "Mismatch");
    assert!(
        Reply::of(across.post("/charges", Some("k-ep")).body(CHARGE))
            .await
            .replayed()
    );
    // Principals still never meet.
    let other_account = Reply::of(
        across
            .post_as("acct_b", "/binary", Some("k-ep"))
            .body(CHARGE),
    )
    .await;
    assert_eq!(other_account.status, StatusCode::ACCEPTED);
}
