//! The README's quick start, compiled and run as it is written: [`quick_start`]'s body is the
//! README's block line for line (the first test fails if the two drift apart), and the second
//! serves it over real HTTP against its own PostgreSQL database: a charge, its retry replayed,
//! a request without a key refused, and the expiry loop running.

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use axum::{
    Router,
    extract::Request,
    http::{HeaderMap, StatusCode},
    middleware::Next,
    response::{IntoResponse, Response},
};
use idempotency_tests::{db::TestDb, init_tracing, server::TestServer};
use sqlx::PgPool;
use tower_idempotency::Principal;

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
    let Some(account_id) = account else {
        return Ok(StatusCode::UNAUTHORIZED.into_response());
    };
    request.extensions_mut().insert(Principal::new(account_id));
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

#[test]
fn the_quick_start_here_is_the_readmes() {
    let readme = include_str!("../../README.md");
    let section = readme
        .split_once("## Quick start")
        .expect("the README has a Quick start section")
        .1;
    let block = lines_between(section, "```rust", "```");
    assert!(
        block.len() > 5,
        "the README's quick start has no rust block"
    );
    let here = lines_between(
        include_str!("readme.rs"),
        "// README quick start: begin",
        "// README quick start: end",
    );
    assert_eq!(
        here, block,
        "tests/tests/readme.rs must hold the README's quick start as it is written"
    );
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
