//! Issue 29.1: an app renders the layer's refusals as its own errors, or points their problem
//! `type`s at its own documentation; the default stays RFC 9457.

use axum::{
    Router,
    body::Bytes,
    extract::Request,
    http::{HeaderValue, Response, StatusCode, header},
    middleware::{self, Next},
};
use idempotency_tests::{
    app::{Probe, app},
    server::TestServer,
    suite::Reply,
};
use tower_idempotency::{
    IDEMPOTENT_REPLAYED, IdempotencyLayer, KeySource, Rejection, RejectionKind, Rendering,
    store::MemoryStore,
};

/// The app's error envelope: `{"error": {"code", "message", "retryable"}}`.
fn envelope(rejection: &Rejection) -> Response<Bytes> {
    let body = serde_json::json!({
        "error": {
            "code": rejection.kind().label(),
            "message": rejection.detail(),
            "retryable": rejection.retry_after().is_some(),
        }
    });
    Response::builder()
        .status(rejection.kind().status())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Bytes::from(body.to_string()))
        .expect("response")
}

/// Outside the layer: says which kind of refusal the response carries, as a logging or
/// metrics layer would read it.
async fn tag_rejections(request: Request, next: Next) -> axum::response::Response {
    let mut response = next.run(request).await;
    let kind = response
        .extensions()
        .get::<Rejection>()
        .map(|rejection| rejection.kind().label());
    if let Some(kind) = kind {
        response
            .headers_mut()
            .insert("x-rejected", HeaderValue::from_static(kind));
    }
    response
}

async fn serve(layer: IdempotencyLayer<MemoryStore>, probe: Probe) -> TestServer {
    let router: Router = app(layer.with_key(KeySource::default().required()), probe)
        .layer(middleware::from_fn(tag_rejections));
    TestServer::start(router).await
}

fn post(server: &TestServer, key: Option<&str>, body: &'static str) -> reqwest::RequestBuilder {
    let request = reqwest::Client::new()
        .post(server.url("/charges"))
        .bearer_auth("acct_a")
        .header("content-type", "application/json")
        .body(body);
    match key {
        Some(key) => request.header("idempotency-key", key),
        None => request,
    }
}

#[tokio::test]
async fn an_apps_own_envelope_renders_every_refusal() {
    let probe = Probe::default();
    let server = serve(
        IdempotencyLayer::new(MemoryStore::new()).with_rendering(Rendering::custom(envelope)),
        probe.clone(),
    )
    .await;

    let missing = Reply::of(post(&server, None, "{}")).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.headers["content-type"], "application/json");
    assert_eq!(missing.json()["error"]["code"], "key_missing");
    assert_eq!(missing.headers["x-rejected"], "key_missing");
    assert_eq!(missing.headers["cache-control"], "no-store");

    let holding = tokio::spawn(Reply::of(
        post(&server, Some("k1"), r#"{"amount":1}"#).header("x-test-gate", "1"),
    ));
    probe.started(1).await;
    let in_flight = Reply::of(post(&server, Some("k1"), r#"{"amount":1}"#)).await;
    assert_eq!(in_flight.status, StatusCode::CONFLICT);
    assert_eq!(in_flight.json()["error"]["code"], "in_flight");
    assert_eq!(in_flight.json()["error"]["retryable"], true);
    assert_eq!(
        in_flight.headers["retry-after"], "1",
        "Retry-After kept though the app did not set it"
    );
    probe.open_gate(1);
    assert_eq!(holding.await.expect("task").status, StatusCode::CREATED);

    let reused = Reply::of(post(&server, Some("k1"), r#"{"amount":2}"#)).await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.json()["error"]["code"], "mismatch");
    assert_eq!(reused.headers["x-rejected"], "mismatch");
    // The handler's own answers are untouched.
    let replay = Reply::of(post(&server, Some("k1"), r#"{"amount":1}"#)).await;
    assert!(replay.replayed());
    assert!(replay.headers.get("x-rejected").is_none());
}

#[tokio::test]
async fn problem_types_point_at_the_apps_documentation() {
    let server = serve(
        IdempotencyLayer::new(MemoryStore::new()).with_rendering(
            Rendering::problem_details().with_type_base("https://api.example.com/docs/errors#"),
        ),
        Probe::default(),
    )
    .await;
    let missing = Reply::of(post(&server, None, "{}")).await;
    assert_eq!(missing.headers["content-type"], "application/problem+json");
    let problem = missing.json();
    assert_eq!(
        problem["type"],
        "https://api.example.com/docs/errors#key_missing"
    );
    assert_eq!(problem["status"], 400);
    assert_eq!(problem["title"], RejectionKind::KeyMissing.title());
    assert!(problem["detail"].is_string());
}

/// Issue 35.4: the replay marker is spelled as the API spells it, and only so.
#[tokio::test]
async fn the_replay_marker_is_spelled_as_the_api_spells_it() {
    let spelled = axum::http::HeaderName::from_static("idempotency-replayed");
    let rendering = Rendering::problem_details().with_replayed_header(spelled.clone());
    let server = serve(
        IdempotencyLayer::new(MemoryStore::new()).with_rendering(rendering),
        Probe::default(),
    )
    .await;
    let first = Reply::of(post(&server, Some("k1"), r#"{"amount":1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.headers.get(&spelled).is_none());
    let replay = Reply::of(post(&server, Some("k1"), r#"{"amount":1}"#)).await;
    assert_eq!(replay.headers[&spelled], "true");
    assert!(replay.headers.get(&IDEMPOTENT_REPLAYED).is_none());
    assert_eq!(replay.body, first.body);
}

/// The default is an RFC 9457 document: the four members, of the right JSON types, the status
/// member equal to the response's, an absolute `type` URI, and the media type; and the refusal's
/// stable `code`.
#[tokio::test]
async fn the_default_is_an_rfc_9457_problem() {
    let server = serve(IdempotencyLayer::new(MemoryStore::new()), Probe::default()).await;
    let missing = Reply::of(post(&server, None, "{}")).await;
    assert_eq!(missing.headers["content-type"], "application/problem+json");
    let problem = missing.json();
    let members: Vec<&str> = problem
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(members, ["code", "detail", "status", "title", "type"]);
    assert_eq!(problem["code"], "missing-key");
    assert_eq!(problem["status"], missing.status.as_u16());
    let uri = problem["type"].as_str().expect("a string");
    assert!(uri.starts_with("https://"), "{uri}");
    assert!(problem["title"].is_string() && problem["detail"].is_string());
}
