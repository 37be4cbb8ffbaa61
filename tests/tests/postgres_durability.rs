//! Issue 45.3: the store says what the cluster promises of an acknowledged record. This server
//! has no standby: it promises nothing past itself, which the store reports, and a store that
//! requires a synchronous standby refuses to start and refuses claims (the layer's `503`).

use axum::{Router, body::Body, http::Request, http::StatusCode, routing};
use idempotency_tests::{bounded, db::TestDb, init_tracing, postgres::claim_request};
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyLayer, Scope,
    store::{Durability, PostgresStore, PostgresStoreError, Store},
};

#[tokio::test]
async fn a_server_without_a_synchronous_standby_is_reported_and_refused_when_required() {
    bounded(async {
        init_tracing();
        let db = TestDb::new().await;
        let reported = PostgresStore::new(db.pool().clone());
        reported.migrate().await.expect("the default only reports");
        let report = reported.durability().await.unwrap();
        assert!(!report.in_recovery);
        assert!(!report.survives_failover(), "{report}");

        let required = reported
            .clone()
            .with_durability(Durability::SynchronousStandby);
        let refused = required.migrate().await.unwrap_err();
        assert!(
            matches!(refused, PostgresStoreError::NotDurable(_)),
            "{refused}"
        );
        assert!(refused.to_string().contains("synchronous"), "{refused}");
        let claimed = required.claim(&claim_request(1, 1)).await;
        assert!(matches!(claimed, Err(PostgresStoreError::NotDurable(_))));

        // Through the layer: `503`, and the handler never runs.
        let app = Router::new()
            .route("/", routing::post(refused_before_the_handler))
            .layer(IdempotencyLayer::new(required).with_scope(Scope::single_tenant()));
        let request = Request::post("/")
            .header("idempotency-key", "k1")
            .body(Body::empty())
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(response.headers().contains_key("retry-after"));
        // Nothing was claimed.
        assert!(reported.claim(&claim_request(1, 1)).await.is_ok());
    })
    .await;
}

async fn refused_before_the_handler() -> StatusCode {
    unreachable!("the claim is refused before the handler")
}
