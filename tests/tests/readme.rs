//! The README's Rust blocks, compiled and run as they are written. Each block's lines stand in
//! this file between two marker comments, exactly as in the README (the first test fails if the
//! two drift apart): the quick start, served over real HTTP against its own PostgreSQL database
//! (a charge, its retry replayed, a request without a key refused); the opening lines and the
//! layers around it, built; and transactional mode's handler, whose charge commits with its record.

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use axum::{
    Form, Json, Router,
    extract::Request,
    http::{HeaderMap, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use idempotency_tests::{db::TestDb, init_tracing, server::TestServer};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, postgres::PgPoolOptions};
use tower_idempotency::{IdempotentTx, Principal};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The README's quick start. `pool`, `create_charge` and `authenticate` are the app's own; the
/// block's lines stand between the two marker comments exactly as in the README, so this
/// function is not formatted.
#[rustfmt::skip]
#[expect(unused_imports, reason = "the README imports `Principal` for the app's authentication")]
async fn quick_start(
    pool: PgPool,
    create_charge: impl Fn() -> Response + Clone + Send + Sync + 'static,
) -> Result<Router, BoxError> {
    let create_charge = move || {
        let create_charge = create_charge.clone();
        async move { create_charge() }
    };
    // README quick start: begin
    use std::time::Duration;
    use axum::{Router, routing::post, middleware};
    use tower_idempotency::{IdempotencyLayer, Principal, store::continuously_delete_expired};

    let layer = IdempotencyLayer::postgres(pool.clone()).required();
    layer.store().migrate().await?;                  // schema `idempotency`, its own migrations table
    tokio::spawn(continuously_delete_expired(layer.store().clone(), Duration::from_secs(60), 1000));

    let app = Router::new()
        .route("/v1/charges", post(create_charge))
        .layer(layer)
        // Your authentication, outside the layer, inserts the account the keys belong to:
        .layer(middleware::from_fn(authenticate));   // request.extensions_mut().insert(Principal::new(account_id))
    // README quick start: end
    Ok(app)
}

/// The app's authentication: `Authorization: Bearer <account>` becomes the [`Principal`].
async fn authenticate(mut request: Request, next: Next) -> Result<Response, Infallible> {
    let account = bearer(request.headers());
    let Some(principal) = account.and_then(|id| Principal::new(id).ok()) else {
        return Ok(StatusCode::UNAUTHORIZED.into_response());
    };
    request.extensions_mut().insert(principal);
    Ok(next.run(request).await)
}

fn bearer(headers: &HeaderMap) -> Option<String> {
    let value = headers.get("authorization")?.to_str().ok()?;
    value.strip_prefix("Bearer ").map(str::to_owned)
}

/// The lines of `text` between the line containing `begin` and the one containing `end`, each
/// trimmed (the README's block is not indented; this file's copy is).
fn lines_between<'a>(text: &'a str, begin: &str, end: &str) -> Vec<&'a str> {
    text.lines()
        .skip_while(|line| !line.contains(begin))
        .skip(1)
        .take_while(|line| !line.contains(end))
        .map(str::trim)
        .collect()
}

/// The README's blocks: the heading each one follows, and the marker of this file's copy.
const BLOCKS: [(&str, &str); 4] = [
    ("# tower-idempotency", "README at a glance"),
    ("## Quick start", "README quick start"),
    ("### Among other layers", "README among other layers"),
    (
        "## Lease mode or transactional mode",
        "README transactional mode",
    ),
];

#[test]
fn the_readmes_rust_blocks_are_the_ones_here() {
    // Headings are found at the start of a line, the first one included.
    let readme = format!("\n{}", include_str!("../../README.md"));
    let here = include_str!("readme.rs");
    for (heading, marker) in BLOCKS {
        let section = readme
            .split_once(&format!("\n{heading}\n"))
            .unwrap_or_else(|| panic!("the README has no `{heading}`"))
            .1;
        let block = lines_between(section, "```rust", "```");
        assert!(!block.is_empty(), "no rust block under `{heading}`");
        let copy = lines_between(
            here,
            &format!("// {marker}: begin"),
            &format!("// {marker}: end"),
        );
        assert_eq!(
            copy, block,
            "tests/tests/readme.rs must hold the README's block under `{heading}` as written"
        );
    }
}

#[tokio::test]
async fn the_quick_start_charges_once_and_replays_the_retry() {
    init_tracing();
    let db = TestDb::new().await;
    let charges = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&charges);
    let app = quick_start(db.pool().clone(), move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        (StatusCode::CREATED, format!("{{\"id\":\"ch_{n}\"}}")).into_response()
    })
    .await
    .expect("the quick start builds its app");
    let server = TestServer::start(app).await;
    let client = reqwest::Client::new();
    let charge = |key: Option<&str>| {
        let request = client
            .post(server.url("/v1/charges"))
            .bearer_auth("acct_1")
            .body("amount=100&currency=usd");
        match key {
            Some(key) => request.header("idempotency-key", key),
            None => request,
        }
    };

    let first = charge(Some("order-1")).send().await.expect("first request");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first = first.text().await.expect("first body");

    let retry = charge(Some("order-1")).send().await.expect("retry");
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.text().await.expect("retry body"), first);

    // `.required()`: a charge without a key is refused before the handler runs.
    let keyless = charge(None).send().await.expect("keyless request");
    assert_eq!(keyless.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        keyless.headers()["content-type"],
        "application/problem+json"
    );

    assert_eq!(charges.load(Ordering::SeqCst), 1, "the handler ran once");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
        .fetch_one(db.pool())
        .await
        .expect("the quick start's migration created the records table");
    assert_eq!(stored, 1);
}

/// The README's opening lines.
#[rustfmt::skip]
fn at_a_glance(pool: PgPool) -> Router {
    use axum::routing::post;
    use tower_idempotency::IdempotencyLayer;
    let create_charge = || async { StatusCode::CREATED };
    // README at a glance: begin
    let app = Router::new()
        .route("/v1/charges", post(create_charge))
        .layer(IdempotencyLayer::postgres(pool).required());
    // README at a glance: end
    app
}

/// The README's "Among other layers": which layers go outside the idempotency layer.
#[rustfmt::skip]
fn among_other_layers(pool: PgPool) -> Router {
    use std::time::Duration;
    use axum::{middleware, routing::post};
    use tower_http::{compression::CompressionLayer, timeout::TimeoutLayer};
    use tower_idempotency::IdempotencyLayer;
    let create_charge = || async { StatusCode::CREATED };
    // README among other layers: begin
    let app = Router::new()
        .route("/v1/charges", post(create_charge))
        .layer(IdempotencyLayer::postgres(pool).required())
        .layer(middleware::from_fn(authenticate))
        .layer(CompressionLayer::new())
        .layer(TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, Duration::from_secs(10)));
    // README among other layers: end
    app
}

#[tokio::test]
async fn the_short_blocks_build() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://127.0.0.1/unused")
        .expect("a lazy pool");
    let _app: Router = at_a_glance(pool.clone());
    let _app: Router = among_other_layers(pool);
}

#[derive(Deserialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

#[derive(Serialize, sqlx::FromRow)]
struct Charge {
    id: i64,
    amount: i64,
    currency: String,
}

/// The app's error type: a database error is a `500`.
struct ApiError(sqlx::Error);

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        Self(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.0.to_string()).into_response()
    }
}

#[rustfmt::skip]
// README transactional mode: begin
async fn create_charge(mut tx: IdempotentTx, Form(charge): Form<NewCharge>) -> Result<Json<Charge>, ApiError> {
    let charge = sqlx::query_as("INSERT INTO charges (amount, currency) VALUES ($1, $2) RETURNING *")
        .bind(charge.amount).bind(&charge.currency)
        .fetch_one(&mut *tx).await?;    // commits with the stored response, or not at all
    Ok(Json(charge))
}
// README transactional mode: end

#[tokio::test]
async fn the_transactional_handler_commits_its_charge_with_the_record() {
    init_tracing();
    let db = TestDb::new().await;
    sqlx::query(
        "CREATE TABLE charges (id bigserial PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL)",
    )
    .execute(db.pool())
    .await
    .expect("charges table");
    let layer = tower_idempotency::IdempotencyLayer::postgres(db.pool().clone())
        .transactional()
        .required();
    layer.store().migrate().await.expect("migrate");
    let app = Router::new()
        .route("/v1/charges", axum::routing::post(create_charge))
        .layer(layer)
        .layer(axum::middleware::from_fn(authenticate));
    let server = TestServer::start(app).await;
    let client = reqwest::Client::new();
    let charge = || {
        client
            .post(server.url("/v1/charges"))
            .bearer_auth("acct_1")
            .header("idempotency-key", "order-7")
            .header("content-type", "application/x-www-form-urlencoded")
            .body("amount=4999&currency=usd")
    };

    let first = charge().send().await.expect("first request");
    assert_eq!(first.status(), StatusCode::OK);
    let first: serde_json::Value = first.json().await.expect("a charge");
    assert_eq!(first["amount"], 4999);
    let retry = charge().send().await.expect("retry");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let retry: serde_json::Value = retry.json().await.expect("the same charge");
    assert_eq!(retry, first);

    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(db.pool())
        .await
        .expect("count");
    assert_eq!(rows, 1, "one charge, committed with its record");
}
