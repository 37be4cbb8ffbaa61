//! Issue 45.2: a connection that answers as a standby (a demoted primary, `25006`) leaves the
//! pool, so the next statement reaches the new primary through the endpoint; meanwhile every
//! request is a `503` with `Retry-After` and no handler runs. And an error is an unknown outcome:
//! a completion retried after it committed succeeds.

use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicU32, Ordering},
};

use axum::{Router, body::Body, extract::State, http::Request, http::StatusCode, routing};
use idempotency_tests::{bounded, db::TestDb, init_tracing, postgres::claim_request};
use sqlx::{Executor, postgres::PgPoolOptions};
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyLayer, Scope,
    store::{ClaimStatus, KeyState, PostgresStore, Store},
};

/// A pool of one connection whose new connections are read-only while `standby` is set, as a
/// connection to a standby is.
async fn pool(db: &TestDb, standby: &Arc<AtomicBool>) -> sqlx::PgPool {
    let standby = Arc::clone(standby);
    PgPoolOptions::new()
        .max_connections(1)
        .after_connect(move |connection, _| {
            let standby = standby.load(Ordering::SeqCst);
            Box::pin(async move {
                if standby {
                    connection
                        .execute("SET default_transaction_read_only = on")
                        .await?;
                }
                Ok(())
            })
        })
        .connect_with(db.options().clone())
        .await
        .unwrap()
}

async fn charge(State(runs): State<Arc<AtomicU32>>) -> StatusCode {
    runs.fetch_add(1, Ordering::SeqCst);
    StatusCode::CREATED
}

async fn send(app: &Router, key: &str) -> (StatusCode, bool) {
    let request = Request::post("/")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    (
        response.status(),
        response.headers().contains_key("retry-after"),
    )
}

#[tokio::test]
async fn a_connection_to_a_standby_leaves_the_pool() {
    bounded(async {
        init_tracing();
        let db = TestDb::new().await;
        PostgresStore::new(db.pool().clone())
            .migrate()
            .await
            .unwrap();
        let standby = Arc::new(AtomicBool::new(false));
        let store = PostgresStore::new(pool(&db, &standby).await);
        let KeyState::Acquired { claim, .. } = store.claim(&claim_request(1, 1)).await.unwrap()
        else {
            panic!("a new key is acquired");
        };
        // The server under the pooled connection is demoted.
        store
            .pool()
            .execute("SET default_transaction_read_only = on")
            .await
            .unwrap();
        let lease = std::time::Duration::from_secs(30);
        let refused = store.renew(&claim, lease).await.unwrap_err();
        assert!(refused.to_string().contains("store"), "{refused}");
        // The next statement is on a new connection, to the primary.
        let renewed = store.renew(&claim, lease).await.expect("a new connection");
        assert_eq!(renewed, ClaimStatus::Held);
    })
    .await;
}

#[tokio::test]
async fn requests_during_a_failover_are_503_and_run_nothing() {
    bounded(async {
        init_tracing();
        let db = TestDb::new().await;
        PostgresStore::new(db.pool().clone())
            .migrate()
            .await
            .unwrap();
        let standby = Arc::new(AtomicBool::new(true));
        let store = PostgresStore::new(pool(&db, &standby).await);
        let runs = Arc::new(AtomicU32::new(0));
        let app = Router::new()
            .route("/", routing::post(charge))
            .layer(IdempotencyLayer::new(store).with_scope(Scope::single_tenant()))
            .with_state(Arc::clone(&runs));
        assert_eq!(
            send(&app, "k1").await,
            (StatusCode::SERVICE_UNAVAILABLE, true)
        );
        assert_eq!(
            send(&app, "k1").await,
            (StatusCode::SERVICE_UNAVAILABLE, true)
        );
        assert_eq!(runs.load(Ordering::SeqCst), 0, "no handler ran");
        // The failover is over: the endpoint now reaches a primary.
        standby.store(false, Ordering::SeqCst);
        assert_eq!(send(&app, "k1").await, (StatusCode::CREATED, false));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    })
    .await;
}

/// A completion whose answer was lost (the connection dropped during its commit) is retried;
/// the retry finds the record completed under its own token and succeeds, where the old code
/// answered `Lost`, as if another request had taken the key over.
#[tokio::test]
async fn a_completion_retried_after_it_committed_succeeds() {
    bounded(async {
        init_tracing();
        let db = TestDb::new().await;
        let store = PostgresStore::new(db.pool().clone());
        store.migrate().await.unwrap();
        let KeyState::Acquired { claim, .. } = store.claim(&claim_request(1, 1)).await.unwrap()
        else {
            panic!("a new key is acquired");
        };
        let (parts, ()) = http::Response::new(()).into_parts();
        let record = tower_idempotency::Record::capture(&parts, Some(bytes::Bytes::from("ok")));
        assert_eq!(
            store.complete(&claim, &record).await.unwrap(),
            ClaimStatus::Held
        );
        assert_eq!(
            store.complete(&claim, &record).await.unwrap(),
            ClaimStatus::Held,
            "the retry of a completion that committed"
        );
        // A completed claim is final all the same.
        assert_eq!(store.release(&claim).await.unwrap(), ClaimStatus::Lost);
        let KeyState::Completed { .. } = store.claim(&claim_request(1, 1)).await.unwrap() else {
            panic!("completed");
        };
    })
    .await;
}
