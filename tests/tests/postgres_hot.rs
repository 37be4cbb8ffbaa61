//! A completion stays a HOT update (no index entries written, no bloat) for claims that keep no
//! request for the completer: the index of unkept claims (issue 44.6) names only
//! `keeps_request` in its predicate, since a column named in any index predicate blocks HOT for
//! every row that changes it.

use std::time::Duration;

use idempotency_tests::{bounded, db::TestDb, init_tracing};
use tower_idempotency::{
    Fingerprint, Record, ScopeKey,
    store::{ClaimRequest, ClaimStatus, KeyState, PostgresStore, Store},
};

#[tokio::test]
async fn completions_of_claims_without_a_kept_request_are_hot_updates() {
    bounded(async {
        init_tracing();
        let db = TestDb::new().await;
        let pool = sqlx::PgPool::connect_with(db.options().clone())
            .await
            .unwrap();
        let store = PostgresStore::new(pool.clone());
        store.migrate().await.unwrap();
        let (parts, ()) = http::Response::new(()).into_parts();
        let record = Record::capture(&parts, Some(bytes::Bytes::from("ok")));
        for key in 0..50u8 {
            let request = ClaimRequest {
                key: ScopeKey::from_bytes([key; 32]),
                fingerprint: Fingerprint::from_bytes([1; 32]),
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(3600),
                waiting: false,
                keeps_request: false,
            };
            let KeyState::Acquired { claim, .. } = store.claim(&request).await.unwrap() else {
                panic!("a new key is acquired");
            };
            assert_eq!(
                store.complete(&claim, &record).await.unwrap(),
                ClaimStatus::Held
            );
        }
        // Backends report their statistics when they exit.
        pool.close().await;
        let (updated, hot): (i64, i64) = loop {
            let counts: (i64, i64) = sqlx::query_as(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
                 WHERE schemaname = 'idempotency' AND relname = 'records'",
            )
            .fetch_one(db.pool())
            .await
            .unwrap();
            if counts.0 >= 50 {
                break counts;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(hot, updated, "every completion a HOT update");
    })
    .await;
}
