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

/// `POST /charges` as `acct_a` with `key` and a JSON body.
pub fn post(client: &reqwest::Client, server: &TestServer, key: &str) -> reqwest::RequestBuilder {
    client
        .post(server.url("/charges"))
        .bearer_auth("acct_a")
        .header("idempotency-key", key)
        .body(r#"{"amount":100}"#)
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
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let holds: bool = sqlx::query_scalar(condition)
            .fetch_one(db.pool())
            .await
            .expect("condition");
        if holds {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never held: {condition}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
