//! The request every HTTP suite sends and how its answers are read: one charge `POST` as
//! `acct_a`, and the replay marker.

use crate::server::TestServer;

/// The charge every request sends.
pub const BODY: &str = r#"{"amount":100}"#;

/// `POST path` as `acct_a` with `key` and the JSON [`BODY`].
pub fn post(
    client: &reqwest::Client,
    server: &TestServer,
    path: &str,
    key: &str,
) -> reqwest::RequestBuilder {
    client
        .post(server.url(path))
        .bearer_auth("acct_a")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(BODY)
}

/// Whether `headers` carry `Idempotent-Replayed: true`, the layer's replay marker.
pub fn replayed(headers: &http::HeaderMap) -> bool {
    headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}
