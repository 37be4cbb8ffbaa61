use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::middleware::{self, Next};
use axum::{Json, Router, extract::Request, http::StatusCode, response::Response, routing::post};
use serde_json::{Value, json};
use tower_idempotency::store::continuously_delete_expired;
use tower_idempotency::{IdempotencyLayer, KeySource, Principal, sqlx::PgPool};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let pool = PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app(pool).await?).await?;
    Ok(())
}

/// `POST /v1/charges`: each key runs once per account, and its retries replay the response.
pub async fn app(pool: PgPool) -> Result<Router, Error> {
    let layer = IdempotencyLayer::postgres(pool).with_key(KeySource::default().required());
    layer.store().inner().migrate().await?; // schema `idempotency`, own migrations table
    let expiry = continuously_delete_expired(layer.store().clone(), Duration::from_secs(60), 1000);
    tokio::spawn(expiry);
    Ok(Router::new()
        .route("/v1/charges", post(create_charge))
        .layer(layer)
        // Outside the idempotency layer: it says whose keys these are.
        .layer(middleware::from_fn(authenticate)))
}

/// Runs once per key: a retry gets this response back, the same id included.
async fn create_charge(Json(charge): Json<Value>) -> (StatusCode, Json<Value>) {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    let id = format!("ch_{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
    let charge = json!({ "id": id, "amount": charge["amount"] });
    (StatusCode::CREATED, Json(charge))
}

/// Your authentication; here, naively, `Authorization: Bearer <account>`.
async fn authenticate(mut request: Request, next: Next) -> Result<Response, StatusCode> {
    let header = request.headers().get("authorization");
    let bearer = header.and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "));
    let principal = Principal::new(bearer.unwrap_or_default());
    request
        .extensions_mut()
        .insert(principal.map_err(|_| StatusCode::UNAUTHORIZED)?);
    Ok(next.run(request).await)
}
