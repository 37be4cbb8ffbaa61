//! Issue 28.3: keys under axum's `Router::nest` are scoped by the path the client sent, not by
//! what is left of it once the nesting prefix is stripped.

use axum::{
    Router,
    extract::{Path, Request},
    middleware::{self, Next},
    response::Response,
    routing::post,
};
use http::StatusCode;
use idempotency_tests::{server::TestServer, suite::Reply};
use tower_idempotency::{IdempotencyLayer, Principal, store::MemoryStore};

/// An invoice created for the organisation in the path.
async fn create_invoice(Path(org): Path<String>) -> (StatusCode, String) {
    (StatusCode::CREATED, format!("invoice for {org}"))
}

async fn as_one_user(mut request: Request, next: Next) -> Response {
    request
        .extensions_mut()
        .insert(Principal::new("user_1").expect("principal"));
    next.run(request).await
}

fn invoices() -> Router {
    Router::new().route("/invoices", post(create_invoice))
}

/// The same user, key and body for two organisations: two invoices, never one replayed.
async fn two_tenants_get_their_own_invoices(app: Router) {
    let server = TestServer::start(app.layer(middleware::from_fn(as_one_user))).await;
    let client = reqwest::Client::new();
    let create = |org: &str| {
        client
            .post(server.url(&format!("/orgs/{org}/invoices")))
            .header("idempotency-key", "invoice-1")
            .body("{}")
    };
    let a = Reply::of(create("acme")).await;
    let b = Reply::of(create("globex")).await;
    assert_eq!(a.body, "invoice for acme");
    assert!(!b.replayed(), "org B got org A's replay: {b:?}");
    assert_eq!(b.body, "invoice for globex");
    // Each organisation's retry is its own replay.
    let b_again = Reply::of(create("globex")).await;
    assert!(b_again.replayed());
    assert_eq!(b_again.body, "invoice for globex");
}

#[tokio::test]
async fn a_layer_outside_the_nesting_scopes_by_the_full_path() {
    let layer = IdempotencyLayer::new(MemoryStore::new());
    two_tenants_get_their_own_invoices(Router::new().nest("/orgs/{org}", invoices()).layer(layer))
        .await;
}

#[tokio::test]
async fn a_layer_inside_the_nested_router_scopes_by_the_full_path() {
    let layer = IdempotencyLayer::new(MemoryStore::new());
    two_tenants_get_their_own_invoices(Router::new().nest("/orgs/{org}", invoices().layer(layer)))
        .await;
}
