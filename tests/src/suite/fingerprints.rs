//! The payload a key is bound to: what makes a retry the same request (fingerprints, semantic or
//! raw, with fields left out and headers taken in), a key reused with another one, and the
//! limit on the body the layer reads to fingerprint it.

use http::StatusCode;
use tower_idempotency::{Fingerprinting, Limits};

use super::{Backend, Harness, Reply, charge_json};

/// A key reused with another payload is 422, in flight or completed, and the record stays.
pub async fn reused_key_with_another_payload_is_422<B: Backend>() {
    let h = Harness::<B>::start().await;
    let in_flight = tokio::spawn(Reply::of(
        h.post("/charges", Some("k-reuse"))
            .header("x-test-gate", "1")
            .json(&charge_json(100)),
    ));
    h.probe.started(1).await;
    let during = Reply::of(h.post("/charges", Some("k-reuse")).json(&charge_json(200))).await;
    if B::TRANSACTIONAL {
        // The holder's claim is uncommitted, so its payload cannot be compared yet.
        during.assert_problem(409, "InFlight");
    } else {
        during.assert_problem(422, "Mismatch");
    }
    h.probe.open_gate(1);
    let first = in_flight.await.expect("task");
    assert_eq!(first.status, StatusCode::CREATED);

    for other in [
        h.post("/charges", Some("k-reuse")).json(&charge_json(200)),
        h.post("/charges?capture=false", Some("k-reuse"))
            .json(&charge_json(100)),
        h.post("/charges", Some("k-reuse"))
            .body("amount=100&currency=usd"),
    ] {
        Reply::of(other).await.assert_problem(422, "Mismatch");
    }
    let retry = Reply::of(h.post("/charges", Some("k-reuse")).json(&charge_json(100))).await;
    assert!(retry.replayed(), "the record is untouched by mismatches");
    assert_eq!(retry.body, first.body);
    assert_eq!(h.probe.executions(), 1);
}

/// The same parameters in another order or spacing are the same request.
pub async fn reordered_parameters_are_the_same_request<B: Backend>() {
    let h = Harness::<B>::start().await;
    let json = |body: &'static str| {
        h.post("/charges", Some("k-json"))
            .header("content-type", "application/json")
            .body(body)
    };
    let first = Reply::of(json(
        r#"{"amount":100,"currency":"usd","metadata":{"a":"1","b":"2"}}"#,
    ))
    .await;
    let retry = Reply::of(json(
        "{ \"metadata\": {\"b\":\"2\", \"a\":\"1\"},\n  \"currency\": \"usd\", \"amount\": 100 }",
    ))
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());

    let form = |body: &'static str| {
        h.post("/charges", Some("k-form"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
    };
    let first = Reply::of(form("amount=100&currency=usd&metadata%5Border%5D=6735")).await;
    let retry = Reply::of(form("metadata[order]=6735&currency=usd&amount=100")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(h.probe.executions(), 2);
}

/// `Fingerprinting::raw()`: the body's bytes are the payload, so the same parameters reordered
/// are another request (`422`), and only the same bytes replay.
pub async fn raw_fingerprints_compare_bytes<B: Backend>() {
    let h = Harness::<B>::with(|layer| layer.with_fingerprint(Fingerprinting::raw()).expect("raw"))
        .await;
    let json = |body: &'static str| {
        h.post("/charges", Some("k-raw"))
            .header("content-type", "application/json")
            .body(body)
    };
    let first = Reply::of(json(r#"{"amount":100,"currency":"usd"}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    Reply::of(json(r#"{"currency":"usd","amount":100}"#))
        .await
        .assert_problem(422, "Mismatch");
    let retry = Reply::of(json(r#"{"amount":100,"currency":"usd"}"#)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(h.probe.executions(), 1);
}

/// Issue 30.4: fields left out of the fingerprint may change between retries; headers taken
/// in may not.
pub async fn fingerprints_leave_out_fields_and_take_in_headers<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        let fingerprinting = Fingerprinting::semantic()
            .excluding(["/client_sent_at", "/meta/trace"])
            .with_headers([http::HeaderName::from_static("stripe-version")]);
        layer.with_fingerprint(fingerprinting).expect("pointers")
    })
    .await;
    let json = |sent: &str, trace: &str, version: &str| {
        h.post("/charges", Some("k-fp"))
            .header("content-type", "application/json")
            .header("stripe-version", version)
            .body(format!(
                r#"{{"amount":100,"client_sent_at":"{sent}","meta":{{"trace":"{trace}","k":1}}}}"#
            ))
    };
    let first = Reply::of(json("10:00", "t1", "2024-06-20")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = Reply::of(json("10:01", "t2", "2024-06-20")).await;
    assert!(retry.replayed(), "only left-out fields changed: {retry:?}");
    Reply::of(json("10:00", "t1", "2025-01-01"))
        .await
        .assert_problem(422, "Mismatch");
    let form = |sent: &str, amount: u32| {
        h.post("/charges", Some("k-fp-form"))
            .header("content-type", "application/x-www-form-urlencoded")
            .header("stripe-version", "2024-06-20")
            .body(format!("amount={amount}&client_sent_at={sent}"))
    };
    assert_eq!(Reply::of(form("1", 100)).await.status, StatusCode::CREATED);
    assert!(Reply::of(form("2", 100)).await.replayed());
    Reply::of(form("1", 200))
        .await
        .assert_problem(422, "Mismatch");
    assert_eq!(h.probe.executions(), 2);
}

/// Bodies over the limit are 413, whether declared or streamed, and free the key.
pub async fn oversize_bodies_are_413<B: Backend>() {
    let h = Harness::<B>::with(|layer| {
        layer
            .with_limits(Limits::default().with_max_request_bytes(1024))
            .expect("limit")
    })
    .await;
    let declared = Reply::of(h.post("/charges", Some("k-big")).body(vec![b'a'; 1025])).await;
    declared.assert_problem(413, "BodyTooLarge");

    let frames: Vec<Result<http_body::Frame<bytes::Bytes>, std::io::Error>> = (0..8)
        .map(|_| Ok(http_body::Frame::data(bytes::Bytes::from(vec![b'b'; 200]))))
        .collect();
    let streamed = h.post("/charges", Some("k-big")).body(reqwest::Body::wrap(
        http_body_util::StreamBody::new(futures_util::stream::iter(frames)),
    ));
    Reply::of(streamed)
        .await
        .assert_problem(413, "BodyTooLarge");
    assert_eq!(h.probe.executions(), 0);

    let fitting = Reply::of(h.post("/charges", Some("k-big")).body(vec![b'a'; 1024])).await;
    assert_eq!(
        fitting.status,
        StatusCode::CREATED,
        "nothing was claimed for the key"
    );
}
