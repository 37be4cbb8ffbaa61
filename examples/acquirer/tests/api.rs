//! The acquirer's API through its router: once per key, declines kept, bad input refused and
//! nothing kept, failures retried with the same key authorizing once.

use acquirer::{Acquirer, Settings, app};
use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode},
};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

async fn send(router: &Router, request: Request<Body>) -> (StatusCode, Value) {
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn authorize(key: Option<&str>, form: &str) -> Request<Body> {
    let mut request = Request::post("/v1/authorizations")
        .header("content-type", "application/x-www-form-urlencoded");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(Body::from(form.to_owned())).unwrap()
}

async fn listed(router: &Router) -> Vec<Value> {
    let request = Request::get("/v1/authorizations")
        .body(Body::empty())
        .unwrap();
    let (status, body) = send(router, request).await;
    assert_eq!(status, StatusCode::OK);
    body["data"].as_array().unwrap().clone()
}

const VISA: &str = "amount=2000&currency=usd&source=tok_visa";

#[tokio::test]
async fn one_authorization_per_key_and_the_list_shows_each() {
    let router = app(Acquirer::new(Settings::default()));
    let (status, first) = send(&router, authorize(Some("k1"), VISA)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(first["object"], "authorization");
    assert_eq!(first["status"], "approved");
    assert_eq!(first["amount"], 2000);
    let (_, again) = send(&router, authorize(Some("k1"), VISA)).await;
    assert_eq!(
        again["id"], first["id"],
        "the same key answers the same authorization"
    );
    let (_, other) = send(&router, authorize(Some("k2"), VISA)).await;
    assert_ne!(other["id"], first["id"]);

    let list = listed(&router).await;
    assert_eq!(list.len(), 2);
    assert_eq!(list[0]["id"], first["id"]);
    assert_eq!(list[0]["idempotency_key"], "k1");
    assert_eq!(list[1]["idempotency_key"], "k2");
}

#[tokio::test]
async fn a_declined_card_is_an_authorization_with_its_code() {
    let router = app(Acquirer::new(Settings::default()));
    let form = "amount=100&currency=eur&source=tok_chargeDeclinedInsufficientFunds";
    let (status, body) = send(&router, authorize(Some("k1"), form)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["status"], "declined");
    assert_eq!(body["decline_code"], "insufficient_funds");
    assert_eq!(listed(&router).await.len(), 1);
}

#[tokio::test]
async fn json_bodies_are_read_too() {
    let router = app(Acquirer::new(Settings::default()));
    let request = Request::post("/v1/authorizations")
        .header("idempotency-key", "k1")
        .header("content-type", "application/json")
        .body(Body::from(
            r#"{"amount": 5, "currency": "usd", "source": "tok_visa"}"#,
        ))
        .unwrap();
    let (status, body) = send(&router, request).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["amount"], 5);
}

#[tokio::test]
async fn bad_input_is_refused_keeps_nothing_and_frees_the_key() {
    let router = app(Acquirer::new(Settings::default()));
    let (status, body) = send(&router, authorize(Some("k1"), "amount=0&currency=usd")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["param"], "amount");
    let (status, _) = send(&router, authorize(None, VISA)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "the key is required");
    assert!(listed(&router).await.is_empty());
    // The refusal was not kept: the corrected request runs under the same key.
    let (status, _) = send(&router, authorize(Some("k1"), VISA)).await;
    assert_eq!(status, StatusCode::OK);
}

/// Every call fails, half of them after authorizing: still never two under one key.
#[tokio::test]
async fn failing_calls_never_authorize_twice_under_one_key() {
    let acquirer = Acquirer::new(Settings {
        fail_rate: 1.0,
        seed: Some(7),
        ..Settings::default()
    });
    let router = app(acquirer.clone());
    for _ in 0..20 {
        let (status, body) = send(&router, authorize(Some("k1"), VISA)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["error"]["type"], "api_error");
    }
    assert_eq!(
        acquirer.authorizations().len(),
        1,
        "one lost answer, kept once"
    );
}

/// Retried with the same key until answered: the answer is the one authorization made.
#[tokio::test]
async fn a_caller_retrying_with_its_key_gets_the_one_authorization() {
    let acquirer = Acquirer::new(Settings {
        fail_rate: 0.5,
        seed: Some(11),
        ..Settings::default()
    });
    let router = app(acquirer.clone());
    for key in ["a", "b", "c", "d", "e", "f", "g", "h"] {
        let answer = loop {
            let (status, body) = send(&router, authorize(Some(key), VISA)).await;
            if status == StatusCode::OK {
                break body;
            }
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        };
        let made: Vec<_> = acquirer
            .authorizations()
            .into_iter()
            .filter(|made| made.idempotency_key == key)
            .collect();
        assert_eq!(made.len(), 1);
        assert_eq!(answer["id"], made[0].id);
    }
}
