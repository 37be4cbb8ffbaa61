//! What the PostgreSQL-only tests share: a migrated store, claims made by hand (and held
//! uncommitted), the instances' pools and requests, and waiting on the database for what
//! happens in the background.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use tower_idempotency::store::PostgresStore;

use crate::{db::TestDb, init_tracing, server::TestServer};

/// A fresh test database with a store migrated on it (lease mode).
pub async fn migrated() -> (TestDb, PostgresStore) {
    init_tracing();
    let db = TestDb::new().await;
    let store = PostgresStore::new(db.pool().clone());
    store.migrate().await.expect("migrate");
    (db, store)
}

/// A claim of key `[key; 32]` for a request fingerprinted `[fingerprint; 32]`, with the
/// layer's default lease and a one-hour TTL.
pub fn claim_request(key: u8, fingerprint: u8) -> tower_idempotency::store::ClaimRequest {
    tower_idempotency::store::ClaimRequest {
        key: tower_idempotency::ScopeKey::from_bytes([key; 32]),
        fingerprint: tower_idempotency::Fingerprint::from_bytes([fingerprint; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        waiting: false,
        keeps_request: false,
    }
}

/// An open transaction that has inserted `request`'s key as a claim in flight: until it
/// ends, a batch claiming the same key waits on its row.
pub async fn held_uncommitted(
    db: &TestDb,
    request: &tower_idempotency::store::ClaimRequest,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut blocker = db.pool().begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, lease_until)
         VALUES (encode(substring($1::bytea FROM 1 FOR 16), 'hex')::uuid, $2, 0,
                 now() + interval '1 hour', now() + interval '30 s')",
    )
    .bind(&request.key.as_bytes()[..])
    .bind(&request.fingerprint.as_bytes()[..])
    .execute(&mut *blocker)
    .await
    .expect("blocking insert");
    blocker
}

/// `POST /charges` as `acct_a` with `key`: [`requests::post`](crate::requests::post) on the
/// lease app's route.
pub fn post(client: &reqwest::Client, server: &TestServer, key: &str) -> reqwest::RequestBuilder {
    crate::requests::post(client, server, "/charges", key)
}

/// The pool of one app instance of the multi-instance races: ten connections of its own.
pub async fn instance_pool(db: &TestDb) -> sqlx::PgPool {
    PgPoolOptions::new()
        .max_connections(10)
        .connect_with(db.options().clone())
        .await
        .expect("pool")
}

/// Polls `condition` (a query returning one boolean) until it holds: for what happens in
/// a background task with nothing to signal it. Bounded: fails after 10 s.
pub async fn wait_until(db: &TestDb, condition: &'static str) {
    poll(db, condition, None).await;
}

/// Waits until the store's statement whose text matches `like` (a `LIKE` pattern, such as
/// `%unnest%` for a batched claim) waits on a row lock.
pub async fn statement_waits_on_a_lock(db: &TestDb, like: &str) {
    poll(
        db,
        "SELECT count(*) = 1 FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE $1",
        Some(like),
    )
    .await;
}

/// Once the store's statement matching `like` has ended (a claim is invisible until it
/// commits, so "no row" alone would not tell a release from a statement still under way),
/// asserts that it left no record and that `next` claims the key as new: the claim its
/// caller had gone from was released.
pub async fn claim_released_after(
    db: &TestDb,
    store: &PostgresStore,
    like: &str,
    next: &tower_idempotency::store::ClaimRequest,
) {
    use tower_idempotency::store::{KeyState, Store};

    poll(
        db,
        "SELECT count(*) = 0 FROM pg_stat_activity
         WHERE datname = current_database() AND state <> 'idle'
           AND query LIKE $1 AND pid <> pg_backend_pid()",
        Some(like),
    )
    .await;
    wait_until(db, "SELECT count(*) = 0 FROM idempotency.records").await;
    let begin = store.claim(next).await.expect("claim");
    assert!(
        matches!(
            begin,
            KeyState::Acquired {
                takeover: false,
                ..
            }
        ),
        "{begin:?}"
    );
}

async fn poll(db: &TestDb, condition: &'static str, like: Option<&str>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut query = sqlx::query_scalar::<_, bool>(condition);
        if let Some(like) = like {
            query = query.bind(like);
        }
        let holds = query.fetch_one(db.pool()).await.expect("condition");
        if holds {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never held: {condition} ({like:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
