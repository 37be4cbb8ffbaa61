//! The quick start over real HTTP, against a PostgreSQL database of its own.

#[allow(
    dead_code,
    unreachable_pub,
    reason = "the binary's `main` is not called here, its `app` is"
)]
#[path = "../src/main.rs"]
mod quickstart;

use idempotency_tests::{db::TestDb, server::TestServer};
use reqwest::StatusCode;
use serde_json::{Value, json};

#[tokio::test]
async fn a_charge_runs_once_and_its_retries_replay() {
    let db = TestDb::new().await;
    let app = quickstart::app(db.pool().clone()).await.expect("the app");
    let server = TestServer::start(app).await;
    let client = reqwest::Client::new();
    let charge = |account: &str, key: Option<&str>, amount: u32| {
        let request = client
            .post(server.url("/v1/charges"))
            .bearer_auth(account)
            .json(&json!({ "amount": amount }));
        match key {
            Some(key) => request.header("idempotency-key", key),
            None => request,
        }
    };

    let first = charge("acct_1", Some("order-1"), 100)
        .send()
        .await
        .expect("send");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Value = first.json().await.expect("a charge");
    assert_eq!(first["amount"], 100);

    let retry = charge("acct_1", Some("order-1"), 100)
        .send()
        .await
        .expect("send");
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(
        retry.json::<Value>().await.expect("json"),
        first,
        "the same charge"
    );

    let reused = charge("acct_1", Some("order-1"), 200)
        .send()
        .await
        .expect("send");
    assert_eq!(reused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let keyless = charge("acct_1", None, 100).send().await.expect("send");
    assert_eq!(keyless.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        keyless.headers()["content-type"],
        "application/problem+json"
    );

    // The same key from another account is that account's own charge.
    let other = charge("acct_2", Some("order-1"), 100)
        .send()
        .await
        .expect("send");
    assert_eq!(other.status(), StatusCode::CREATED);
    let other: Value = other.json().await.expect("a charge");
    assert_ne!(other["id"], first["id"]);

    let anonymous = client
        .post(server.url("/v1/charges"))
        .send()
        .await
        .expect("send");
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
        .fetch_one(db.pool())
        .await
        .expect("the app migrated its store");
    assert_eq!(stored, 2, "one record per account's key");
}
