//! Issue 44.2: keys whose steps went wrong are given up part-way, never stored or released.
//!
//! A lease that lapsed while renewals failed, with nobody taking the key over: the old code
//! refused the step (`Lost`), the handler's `?` answered `409`, and the default retention stored
//! that `409` as the key's answer: every retry replayed it, the card authorized and nothing left
//! to finish the charge. A response made after `Lost` is never stored. And a handler that handed
//! a downstream key out and failed is not released by the retention policy: its retry takes the
//! key over, with its downstream keys.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{Request, StatusCode},
    routing,
};
use http_body_util::BodyExt;
use idempotency_tests::{bounded, postgres::migrated, requests::replayed};
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, Scope, StepError, Steps};

const LEASE: Duration = Duration::from_millis(300);

struct Seen {
    runs: AtomicU32,
    /// The downstream keys `authorize` was handed.
    keys: Mutex<Vec<String>>,
    reached: Semaphore,
    go: Semaphore,
}

impl Default for Seen {
    fn default() -> Self {
        Self {
            runs: AtomicU32::new(0),
            keys: Mutex::default(),
            reached: Semaphore::new(0),
            go: Semaphore::new(0),
        }
    }
}

/// The first run waits at its hold point before its step; every run authorizes in a step.
async fn charge(
    State(seen): State<Arc<Seen>>,
    steps: Steps,
) -> Result<(StatusCode, String), StepError<StatusCode>> {
    if seen.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        seen.reached.add_permits(1);
        seen.go.acquire().await.unwrap().forget();
    }
    let s = Arc::clone(&seen);
    let auth: String = steps
        .run("authorize", move |key| async move {
            let mut keys = s.keys.lock().unwrap();
            keys.push(key.to_string());
            Ok::<_, StatusCode>(format!("auth_{}", keys.len()))
        })
        .await?;
    Ok((StatusCode::CREATED, auth))
}

fn request() -> Request<Body> {
    Request::post("/v1/charges")
        .header("idempotency-key", "k1")
        .body(Body::from("amount=100"))
        .unwrap()
}

async fn answer(app: &Router) -> (StatusCode, bool, String) {
    let response = app.clone().oneshot(request()).await.unwrap();
    let (status, replay) = (response.status(), replayed(response.headers()));
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replay, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test]
async fn a_step_after_a_lapsed_lease_never_leaves_a_stored_conflict() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let layer = IdempotencyLayer::new(store)
            .with_scope(Scope::single_tenant())
            .with_lease(LEASE)
            .unwrap()
            .with_step_secret(*b"steps lapsed test secret, 32 by!")
            .unwrap();
        let app = Router::new()
            .route("/v1/charges", routing::post(charge))
            .layer(layer)
            .with_state(Arc::clone(&seen));
        let first = tokio::spawn({
            let app = app.clone();
            async move { answer(&app).await }
        });
        seen.reached.acquire().await.unwrap().forget();
        // Renewals fail from now on (the store is unreachable for the holder) ...
        sqlx::raw_sql(
            "CREATE FUNCTION refuse_renewals() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN RAISE EXCEPTION 'renewals refused by the test'; END $$;
             CREATE TRIGGER refuse_renewals BEFORE UPDATE ON idempotency.records
                 FOR EACH ROW WHEN (NEW.status IS NULL) EXECUTE FUNCTION refuse_renewals();",
        )
        .execute(db.pool())
        .await
        .unwrap();
        // ... until the lease has lapsed, with nobody taking the key over.
        loop {
            let lapsed: bool =
                sqlx::query_scalar("SELECT bool_and(lease_until < now()) FROM idempotency.records")
                    .fetch_one(db.pool())
                    .await
                    .unwrap();
            if lapsed {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        sqlx::raw_sql("DROP TRIGGER refuse_renewals ON idempotency.records")
            .execute(db.pool())
            .await
            .unwrap();
        seen.go.add_permits(1);
        let (status, _, _) = first.await.unwrap();
        assert!(
            status == StatusCode::CREATED || status == StatusCode::CONFLICT,
            "{status}"
        );
        // Whatever the first run answered, the retry gets the charge, not a stored conflict.
        let (status, _, body) = answer(&app).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert!(body.starts_with("auth_"), "{body}");
        let keys = seen.keys.lock().unwrap().clone();
        assert!(
            keys.windows(2).all(|w| w[0] == w[1]),
            "one downstream key: {keys:?}"
        );
    })
    .await;
}

/// `authorize` fails on the first run (its answer lost: a `502` through `?`), then succeeds.
async fn charge_once_failing(
    State(seen): State<Arc<Seen>>,
    idempotency: IdempotencyContext,
    steps: Steps,
) -> Result<(StatusCode, String), StepError<StatusCode>> {
    let first = seen.runs.fetch_add(1, Ordering::SeqCst) == 0;
    let s = Arc::clone(&seen);
    let auth: String = steps
        .run("authorize", move |key| async move {
            s.keys.lock().unwrap().push(key.to_string());
            if first {
                return Err(StatusCode::BAD_GATEWAY);
            }
            Ok(format!("auth_{}", s.keys.lock().unwrap().len()))
        })
        .await?;
    let takeover = idempotency.takeover();
    Ok((StatusCode::CREATED, format!("{auth} takeover={takeover}")))
}

/// The policy releases a `502`; with a downstream key handed out the key is given up instead,
/// so the retry takes it over (and its generation, with its downstream keys) at once.
#[tokio::test]
async fn a_failed_step_gives_its_key_up_rather_than_release_it() {
    bounded(async {
        let (_db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let layer = IdempotencyLayer::new(store)
            .with_scope(Scope::single_tenant())
            .with_step_secret(*b"steps lapsed test secret, 32 by!")
            .unwrap();
        let app = Router::new()
            .route("/v1/charges", routing::post(charge_once_failing))
            .layer(layer);
        let app = app.with_state(Arc::clone(&seen));
        let (status, _, _) = answer(&app).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        let (status, replay, body) = answer(&app).await;
        assert_eq!((status, replay), (StatusCode::CREATED, false), "{body}");
        assert_eq!(body, "auth_2 takeover=true");
        let keys = seen.keys.lock().unwrap().clone();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], keys[1], "the same downstream key, resent");
    })
    .await;
}
