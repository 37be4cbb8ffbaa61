//! Downstream keys belong to one generation of a key (issue 44, defect 5): a key claimed again
//! after it expired is a new operation, whose steps run again under new downstream keys, so the
//! card network never replays the old authorization to it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
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
use idempotency_tests::{bounded, requests::replayed};
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyLayer, KeySource, Principal, StepError, Steps,
    store::{MemoryStore, Store},
};

/// The layers' step secret.
const SECRET: &[u8; 32] = b"steps test secret, 32 bytes long";

/// The layers' TTL.
const TTL: Duration = Duration::from_secs(60);

/// `authorize`, whose output is the downstream key it was handed; `calls` counts its runs.
async fn authorize(
    State(calls): State<Arc<AtomicUsize>>,
    steps: Steps,
) -> Result<(StatusCode, String), StepError<StatusCode>> {
    let sent: String = steps
        .run("authorize", |key| async move {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(key.to_string())
        })
        .await?;
    Ok((StatusCode::CREATED, sent))
}

fn app<St: Store>(store: St, calls: Arc<AtomicUsize>) -> Router {
    let layer = IdempotencyLayer::new(store)
        .with_key(KeySource::default().required())
        .with_ttl(TTL)
        .expect("a TTL")
        .with_step_secret(SECRET)
        .expect("a long enough secret");
    Router::new()
        .route("/charges", routing::post(authorize))
        .with_state(calls)
        .layer(layer)
}

/// `POST /charges` as `acct_a` with key `k1`: its status, whether it was replayed, its body.
async fn charge(app: &Router) -> (StatusCode, bool, String) {
    let mut request = Request::post("/charges")
        .header("idempotency-key", "k1")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount":100}"#))
        .expect("a request");
    let principal = Principal::new("acct_a").expect("a principal");
    request.extensions_mut().insert(principal);
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let replayed = replayed(response.headers());
    let body = response.into_body().collect().await.expect("a body");
    let body = String::from_utf8(body.to_bytes().to_vec()).expect("UTF-8");
    (status, replayed, body)
}

/// A store, and how time passes for it.
trait Backend {
    type Store: Store + Clone;
    fn store(&self) -> Self::Store;
    /// Makes `by` pass on the store's clock.
    async fn age(&self, by: Duration);
}

/// A charge, its replay, then the same key and payload after the key expired: the step runs
/// again with another downstream key, and the answer is not a replay. Twice, so that the second
/// reuse starts from a key that already changed generation.
async fn a_key_reused_after_it_expired_gets_new_downstream_keys<B: Backend>(backend: B) {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(backend.store(), Arc::clone(&calls));
    let (status, was_replayed, first) = charge(&app).await;
    assert_eq!((status, was_replayed), (StatusCode::CREATED, false));
    let replay = charge(&app).await;
    assert_eq!(replay, (StatusCode::CREATED, true, first.clone()));
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let mut sent = vec![first];
    for reuse in 2..=3 {
        backend.age(TTL + Duration::from_secs(1)).await;
        let (status, was_replayed, key) = charge(&app).await;
        assert_eq!(status, StatusCode::CREATED, "reuse {reuse}");
        assert!(!was_replayed, "reuse {reuse}: an expired key runs again");
        assert_eq!(calls.load(Ordering::SeqCst), reuse, "the step runs again");
        assert!(
            !sent.contains(&key),
            "reuse {reuse}: a new operation sent an old downstream key {key} ({sent:?})"
        );
        sent.push(key);
    }
}

mod memory {
    use super::*;

    struct Memory(MemoryStore);

    impl Backend for Memory {
        type Store = MemoryStore;

        fn store(&self) -> MemoryStore {
            self.0.clone()
        }

        async fn age(&self, by: Duration) {
            tokio::time::advance(by).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_reused_after_it_expired_gets_new_downstream_keys() {
        let backend = Memory(MemoryStore::new());
        super::a_key_reused_after_it_expired_gets_new_downstream_keys(backend).await;
    }
}

mod postgres {
    use idempotency_tests::{db::TestDb, postgres::migrated};
    use tower_idempotency::store::{ExpiredDeletion, PostgresStore};

    use super::*;

    struct Postgres(TestDb, PostgresStore);

    impl Backend for Postgres {
        type Store = PostgresStore;

        fn store(&self) -> PostgresStore {
            self.1.clone()
        }

        /// Moves every record and step `by` into the past, then runs the expiry loop's batch:
        /// records and steps age as they would have.
        async fn age(&self, by: Duration) {
            let pool = self.0.pool();
            for sql in [
                "UPDATE idempotency.records SET created_at = created_at - $1,
                     expires_at = expires_at - $1, lease_until = lease_until - $1,
                     completed_at = completed_at - $1",
                "UPDATE idempotency.steps SET expires_at = expires_at - $1,
                     recorded_at = recorded_at - $1",
            ] {
                sqlx::query(sql)
                    .bind(by)
                    .execute(pool)
                    .await
                    .expect("aging");
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_reused_after_it_expired_gets_new_downstream_keys() {
        bounded(async {
            let (db, store) = migrated().await;
            let backend = Postgres(db, store);
            super::a_key_reused_after_it_expired_gets_new_downstream_keys(backend).await;
        })
        .await;
    }

    /// The same once the expiry loop deleted the expired record: the key is inserted anew.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_reused_after_its_record_was_deleted_gets_new_downstream_keys() {
        bounded(async {
            let (db, store) = migrated().await;
            let backend = Deleted(Postgres(db, store));
            super::a_key_reused_after_it_expired_gets_new_downstream_keys(backend).await;
        })
        .await;
    }

    /// [`Postgres`], whose expiry loop runs once time has passed.
    struct Deleted(Postgres);

    impl Backend for Deleted {
        type Store = PostgresStore;

        fn store(&self) -> PostgresStore {
            self.0.store()
        }

        async fn age(&self, by: Duration) {
            self.0.age(by).await;
            let deleted = self.0.1.delete_expired(100).await.expect("expiry");
            assert!(deleted > 0, "the expired record was deleted");
        }
    }
}
