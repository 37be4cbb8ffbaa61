//! Idempotency keys: their syntax, where they come from (a header, the API's own header, the
//! body), the app's rule for them, and requests without one.

use http::{HeaderValue, StatusCode};
use tokio::task::JoinSet;
use tower_idempotency::{KeyRule, KeySource};

use super::{Backend, CHARGE, Harness, Reply};

/// Keys may be sf-strings or bare tokens, and `"abc"` is `abc`.
pub async fn quoted_and_bare_keys_are_one_key<B: Backend>() {
    let h = Harness::<B>::start().await;
    let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let first = Reply::of(h.post("/charges", Some(uuid)).body(CHARGE)).await;
    let retry = Reply::of(
        h.post("/charges", Some(&format!("\"{uuid}\"")))
            .body(CHARGE),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(h.probe.executions(), 1);
}

/// Malformed keys are 400 and run nothing.
pub async fn malformed_keys_are_400<B: Backend>() {
    let h = Harness::<B>::start().await;
    let long = "k".repeat(256);
    for key in [
        "",
        "\"\"",
        "two words",
        "\"unterminated",
        "\"a\", \"b\"",
        long.as_str(),
        "caf\u{e9}",
    ] {
        let request = h
            .client
            .post(h.server.url("/charges"))
            .bearer_auth("acct_a");
        let request = match HeaderValue::from_bytes(key.as_bytes()) {
            Ok(value) => request.header("idempotency-key", value),
            Err(_) => continue,
        };
        Reply::of(request.body(CHARGE))
            .await
            .assert_problem(400, "KeyInvalid");
    }
    let repeated = h
        .post("/charges", Some("a"))
        .header("idempotency-key", "b")
        .body(CHARGE);
    Reply::of(repeated).await.assert_problem(400, "KeyInvalid");
    let repeated_equal = h
        .post("/charges", Some("a"))
        .header("idempotency-key", "a")
        .body(CHARGE);
    Reply::of(repeated_equal)
        .await
        .assert_problem(400, "KeyInvalid");
    assert_eq!(h.probe.executions(), 0);
}

/// `required()` makes a missing key 400; other methods still pass through.
pub async fn missing_key_is_400_when_required<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_key(KeySource::default().required())).await;
    Reply::of(h.post("/charges", None).body(CHARGE))
        .await
        .assert_problem(400, "KeyMissing");
    assert_eq!(h.probe.executions(), 0);
    let list = Reply::of(h.client.get(h.server.url("/charges")).bearer_auth("acct_a")).await;
    assert_eq!(list.status, StatusCode::OK);
}

/// Without `required()`, keyless requests and uncovered methods run every time.
pub async fn keyless_and_uncovered_requests_pass_through<B: Backend>() {
    let h = Harness::<B>::start().await;
    for _ in 0..2 {
        let reply = Reply::of(h.post("/charges", None).body(CHARGE)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
        let get = h
            .client
            .get(h.server.url("/charges"))
            .bearer_auth("acct_a")
            .header("idempotency-key", "k-get");
        assert!(!Reply::of(get).await.replayed());
    }
    assert_eq!(h.probe.executions(), 4);
}

/// Issue 30.1: an API keeps its own header name; `Idempotency-Key` is then just another header.
pub async fn a_key_in_the_apis_own_header_is_honoured<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer.with_key(KeySource::header(http::HeaderName::from_static(
            "x-idempotency-key",
        )))
    })
    .await;
    let post = || {
        h.post("/charges", None)
            .header("x-idempotency-key", "\"k-own\"")
            .body(CHARGE)
    };
    let first = Reply::of(post()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = Reply::of(post()).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    // The standard header is not read: both run, unprotected.
    for _ in 0..2 {
        let plain = Reply::of(h.post("/charges", Some("k-own")).body(CHARGE)).await;
        assert!(!plain.replayed());
    }
    assert_eq!(h.probe.executions(), 3);
}

/// Issue 30.1: a webhook receiver keyed by the event id in the JSON body applies each event
/// once, however often it is delivered, one after another or at once.
pub async fn a_webhook_keyed_by_its_event_id_is_applied_once<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer.with_key(KeySource::from_request(|_, body| {
            let event: serde_json::Value = serde_json::from_slice(body).ok()?;
            Some(event.get("id")?.as_str()?.to_owned())
        }))
    })
    .await;
    let deliver = |event: &str| {
        h.post("/charges", None)
            .header("content-type", "application/json")
            .body(format!(r#"{{"id":"{event}","type":"charge.succeeded"}}"#))
    };
    for _ in 0..3 {
        let delivered = Reply::of(deliver("evt_1")).await;
        assert_eq!(delivered.status, StatusCode::CREATED);
    }
    let mut at_once = JoinSet::new();
    for _ in 0..8 {
        at_once.spawn(Reply::of(deliver("evt_2")));
    }
    while let Some(delivered) = at_once.join_next().await {
        let status = delivered.expect("task").status;
        assert!(
            status == StatusCode::CREATED || status == StatusCode::CONFLICT,
            "{status}"
        );
    }
    let after = Reply::of(deliver("evt_2")).await;
    assert!(after.replayed());
    // An event without an id is no idempotent request: it runs, unprotected.
    let anonymous = Reply::of(h.post("/charges", None).body("{}")).await;
    assert_eq!(anonymous.status, StatusCode::CREATED);
    assert_eq!(
        h.probe.executions(),
        3,
        "evt_1 once, evt_2 once, the anonymous one"
    );
}

/// Issue 30.2: a key that breaks the app's rule is a `400` naming it, and reaches no store.
pub async fn a_key_that_breaks_the_rule_is_400_and_stores_nothing<B: Backend>() {
    let h =
        Harness::<B>::with(|layer| layer.with_key(KeySource::default().with_rule(KeyRule::uuid())))
            .await;
    let refused = Reply::of(h.post("/charges", Some("order-1042")).body(CHARGE)).await;
    refused.assert_problem(400, "KeyInvalid");
    assert!(
        refused.json()["detail"]
            .as_str()
            .is_some_and(|detail| detail.contains("`uuid`")),
        "{:?}",
        refused.json()
    );
    assert_eq!(h.store.begins(), 0, "nothing reached the store");
    let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    assert_eq!(
        Reply::of(h.post("/charges", Some(uuid)).body(CHARGE))
            .await
            .status,
        StatusCode::CREATED
    );
    assert_eq!(h.probe.executions(), 1);
}
