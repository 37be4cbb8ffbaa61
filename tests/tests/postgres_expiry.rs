//! `PostgresStore`'s reaper (`ExpiredDeletion`): expired records go in bounded batches, oldest
//! first, none skipped for good, and never one a claim took over meanwhile. Each test in its
//! own database. (Partitioned mode drops whole partitions instead: `postgres_partitions`.)

use std::time::Duration;

use http::StatusCode;
use idempotency_tests::postgres::migrated;
use sqlx::Executor;
use tokio::task::JoinSet;
use tower_idempotency::store::ExpiredDeletion;

/// The reaper deletes only expired rows, in bounded batches.
#[tokio::test]
async fn expired_records_are_deleted_in_bounded_batches() {
    let (db, store) = migrated().await;
    db.pool()
        .execute(
            "INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, status, header_names, header_values, body)
             SELECT md5(i::text)::uuid, sha256('f'), i, now() - interval '1 minute', 200, '{}'::text[], '{}'::bytea[], 'x'::bytea
             FROM generate_series(1, 2500) i
             UNION ALL
             SELECT md5('live' || i)::uuid, sha256('f'), i, now() + interval '1 hour', 200, '{}'::text[], '{}'::bytea[], 'x'::bytea
             FROM generate_series(1, 10) i",
        )
        .await
        .expect("seed");
    for expected in [1000, 1000, 500, 0] {
        assert_eq!(store.delete_expired(1000).await.expect("batch"), expected);
    }
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency.records WHERE expires_at > now()")
            .fetch_one(db.pool())
            .await
            .expect("count");
    assert_eq!(left, 10, "live records stay");
}

/// A drain's batches go oldest first, each from where the last stopped; a record skipped
/// because a transaction held it is not forgotten: the next drain starts from the oldest
/// record again. (Without prepared statements, as behind an old PgBouncer.)
#[tokio::test]
async fn an_expiry_drain_resumes_where_it_stopped_and_skipped_records_are_not_lost() {
    let (db, store) = migrated().await;
    let store = store.without_prepared_statements();
    db.pool()
        .execute(
            "INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, status, header_names, header_values, body)
             SELECT md5(i::text)::uuid, sha256('f'), i, now() - interval '1 hour' + i * interval '1 second', 200, '{}'::text[], '{}'::bytea[], 'x'::bytea
             FROM generate_series(1, 2500) i",
        )
        .await
        .expect("seed");
    // Another transaction holds the oldest record (a claim taking it over, say).
    let mut holder = db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM idempotency.records WHERE token = 1 FOR UPDATE")
        .execute(&mut *holder)
        .await
        .expect("lock the oldest");
    for expected in [1000, 1000, 499] {
        assert_eq!(store.delete_expired(1000).await.expect("batch"), expected);
    }
    let newest_left: i64 = sqlx::query_scalar("SELECT max(token) FROM idempotency.records")
        .fetch_one(db.pool())
        .await
        .expect("left");
    assert_eq!(newest_left, 1, "oldest first: only the held record is left");
    holder.rollback().await.expect("rollback");
    // The short batch ended the drain; the next starts from the oldest again.
    assert_eq!(store.delete_expired(1000).await.expect("batch"), 1);
    assert_eq!(store.delete_expired(1000).await.expect("batch"), 0);
}

/// Expiry racing claims that take expired keys over. Each round, of 600 expired records,
/// the 300 keys claimed again and completed while small batches delete all around them
/// keep their new record (each replays its new response), and the other 300 all go. The
/// race is a race, so four rounds of it: a reaper that deletes by key without locking (and
/// so deletes what a claim took over meanwhile) failed it in 4 of 6 runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_never_deletes_a_record_taken_over_while_it_runs() {
    use tower_idempotency::{
        Fingerprint, Record, ScopeKey,
        store::{ClaimRequest, ClaimStatus, KeyState, Store},
    };

    let (db, store) = migrated().await;
    let request = |i: u16| ClaimRequest {
        key: ScopeKey::from_bytes(std::array::from_fn(|b| {
            i.to_be_bytes()[b % 2].wrapping_add(b as u8)
        })),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        waiting: false,
        keeps_request: false,
    };
    let record = |i: u16| {
        Record::from_parts(
            StatusCode::CREATED,
            Default::default(),
            Some(format!("charge {i}").into()),
        )
    };
    for round in 0..4u16 {
        let keys = round * 600..(round + 1) * 600;
        for i in keys.clone() {
            let KeyState::Acquired { .. } = store.claim(&request(i)).await.expect("claim") else {
                panic!("key {i} not acquired");
            };
        }
        // This round's claims, still in flight; the records of the rounds before are done.
        db.pool()
            .execute(
                "UPDATE idempotency.records SET expires_at = now() - interval '1 minute'
                 WHERE status IS NULL",
            )
            .await
            .expect("expire them");

        let mut tasks = JoinSet::new();
        for i in keys.clone().step_by(2) {
            let store = store.clone();
            tasks.spawn(async move {
                let KeyState::Acquired { claim, .. } =
                    store.claim(&request(i)).await.expect("claim")
                else {
                    panic!("expired key {i} not taken over");
                };
                let stored = store.complete(&claim, &record(i)).await.expect("complete");
                assert_eq!(stored, ClaimStatus::Held, "key {i}: its record was deleted");
            });
        }
        let reaper = tokio::spawn({
            let store = store.clone();
            async move {
                let mut deleted = 0;
                for _ in 0..1000 {
                    match store.delete_expired(25).await.expect("batch") {
                        0 => return deleted,
                        n => deleted += n,
                    }
                }
                panic!("the drain never ended");
            }
        });
        while let Some(task) = tasks.join_next().await {
            task.expect("claim task");
        }
        let mut deleted = reaper.await.expect("reaper");
        // What the drain skipped while claims held rows goes in the next.
        while let n @ 1.. = store.delete_expired(1000).await.expect("batch") {
            deleted += n;
        }

        // An expired record the reaper reached before its claim did was deleted, and the
        // claim inserted the key afresh; one the claim reached first was taken over.
        assert!(
            (300..=600).contains(&deleted),
            "every record nobody took over, and some before they were: {deleted}"
        );
        let expired: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency.records WHERE expires_at <= now()",
        )
        .fetch_one(db.pool())
        .await
        .expect("count");
        assert_eq!(expired, 0, "no expired record left");
        for i in keys {
            match store.claim(&request(i)).await.expect("claim") {
                KeyState::Completed { record: stored, .. } if i % 2 == 0 => {
                    assert_eq!(stored, record(i), "key {i}");
                }
                KeyState::Acquired { claim, .. } if i % 2 == 1 => {
                    // Gone, as it should be; let the key go again.
                    let released = store.release(&claim).await.expect("release");
                    assert_eq!(released, ClaimStatus::Held, "key {i}");
                }
                other => panic!("key {i}: {other:?}"),
            }
        }
    }
}
