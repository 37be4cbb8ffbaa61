//! Through PgBouncer in transaction pooling mode: consecutive transactions of one client
//! connection run on different server connections, so nothing may rely on session state
//! (session advisory locks, `SET`, `LISTEN`, prepared statements of a previous transaction).
//!
//! The protocol suite runs with the store in lease mode and in transactional mode, with
//! `without_prepared_statements()` (PgBouncer before 1.21, as Debian 12 ships 1.18, cannot
//! follow prepared statements). Migrations run on a direct connection, as they must: sqlx's
//! migrator holds a session advisory lock.
//!
//! Needs `pgbouncer` installed (`apt install pgbouncer`); without it these tests do nothing,
//! except under `CI`, where they fail.

use idempotency_tests::{
    db::TestDb,
    pgbouncer::{SERVER_POOL_SIZE, pgbouncer},
    suite::{InLeaseMode, InTransactionalMode, PostgresFixture},
};
use sqlx::{PgPool, postgres::PgPoolOptions};
use tower_idempotency::store::PostgresStore;

struct Bounced {
    db: TestDb,
    store: PostgresStore,
}

async fn available() -> bool {
    pgbouncer().await.is_some()
}

/// The store goes through PgBouncer; the test's own updates (leases, expiry) go direct.
impl PostgresFixture for Bounced {
    async fn start() -> Self {
        let bouncer = pgbouncer().await.expect("checked by run_if");
        let db = TestDb::new().await;
        PostgresStore::new(db.pool().clone())
            .migrate()
            .await
            .expect("migrate directly");
        // More client connections than PgBouncer has server connections.
        let pool: PgPool = PgPoolOptions::new()
            .max_connections(SERVER_POOL_SIZE * 4)
            .connect_with(bouncer.options(&db))
            .await
            .expect("connect through pgbouncer");
        // `LISTEN` does not work through transaction pooling: waiting duplicates poll.
        let store = PostgresStore::new(pool)
            .without_prepared_statements()
            .with_in_flight_polling(std::time::Duration::from_millis(50))
            .expect("a valid interval");
        Self { db, store }
    }

    fn db(&self) -> &TestDb {
        &self.db
    }

    fn store(&self) -> PostgresStore {
        self.store.clone()
    }
}

mod lease {
    use super::*;

    idempotency_tests::store_suite!(InLeaseMode<Bounced>, run_if: available());
}

mod transactional {
    use super::*;

    idempotency_tests::store_suite!(InTransactionalMode<Bounced>, run_if: available());
}

/// The negative control: the same traffic with sqlx's (default) cached prepared statements
/// breaks through this PgBouncer, so the suites above really run through it.
#[tokio::test]
async fn prepared_statements_break_through_pgbouncer_before_1_21() {
    use std::time::Duration;

    use sqlx::{ConnectOptions, Connection};
    use tower_idempotency::{
        Fingerprint, ScopeKey,
        store::{ClaimRequest, Store},
    };

    if !available().await {
        return;
    }
    let bouncer = pgbouncer().await.expect("available");
    let db = TestDb::new().await;
    PostgresStore::new(db.pool().clone())
        .migrate()
        .await
        .expect("migrate directly");
    let mut failures = Vec::new();
    // One client connection after another: PgBouncer hands each the same idle server
    // connection, where the previous client's `sqlx_s_1` already exists.
    for i in 0..6u8 {
        let mut conn = bouncer.options(&db).connect().await.expect("connect");
        let result = sqlx::query("SELECT $1::int4 AS n")
            .bind(i32::from(i))
            .fetch_one(&mut conn)
            .await;
        if let Err(error) = result {
            failures.push(error.to_string());
        }
        conn.close().await.expect("close");
    }
    assert!(
        failures.iter().any(|e| e.contains("prepared statement")),
        "expected prepared statements to collide through pgbouncer, got {failures:?}"
    );

    // The store without prepared statements is unaffected by the same pattern.
    for i in 0..6u8 {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(bouncer.options(&db))
            .await
            .expect("pool");
        let store = PostgresStore::new(pool.clone()).without_prepared_statements();
        let request = ClaimRequest {
            key: ScopeKey::from_bytes([i; 32]),
            fingerprint: Fingerprint::from_bytes([0; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            waiting: false,
            keeps_request: false,
        };
        store
            .claim(&request)
            .await
            .expect("claim through pgbouncer");
        pool.close().await;
    }

    // Nothing holds an advisory lock beyond its transaction.
    let locks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
         WHERE l.locktype = 'advisory' AND d.datname = current_database()",
    )
    .fetch_one(db.pool())
    .await
    .expect("pg_locks");
    assert_eq!(locks, 0);
}
