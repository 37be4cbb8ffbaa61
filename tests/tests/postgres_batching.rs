//! `PostgresStore`'s group commit: concurrent claims of new keys and their completions share
//! statements, yet every key stays apart, and the statements' plans find records by key however
//! the table has grown. Each test in its own database.

use idempotency_tests::postgres::{claim_request, migrated};
use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinSet;
use tower_idempotency::store::PostgresStore;

/// Group commit: concurrent claims of new keys and their completions go to PostgreSQL in
/// shared statements, yet each key is acquired once (a key sent twice at once included),
/// and each record replays exactly as it was completed, whatever its neighbours in the
/// batch carried: no headers, repeated headers, no body, an empty body, a large one, one too
/// large to share a batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_claims_and_completions_keep_every_key_apart() {
    use http::{HeaderMap, HeaderValue};
    use tower_idempotency::{
        Record,
        store::{ClaimStatus, KeyState, Store},
    };

    let (_db, store) = migrated().await;
    let request = |i: u8| claim_request(i, i.wrapping_add(1));
    let record = |i: u8| {
        let mut headers = HeaderMap::new();
        for h in 0..i % 4 {
            headers.append(
                "link",
                HeaderValue::from_str(&format!("<{i}/{h}>")).unwrap(),
            );
        }
        if i.is_multiple_of(2) {
            headers.append("content-type", HeaderValue::from_static("application/json"));
        }
        let body = match i % 5 {
            // Too large to share a batch: stored alone, among the others.
            _ if i == 63 => Some(bytes::Bytes::from(vec![b'x'; 100 * 1024])),
            0 => None,
            1 => Some(bytes::Bytes::new()),
            _ => Some(bytes::Bytes::from(
                format!("body {i} ").repeat(usize::from(i) * 40),
            )),
        };
        Record::from_parts(
            http::StatusCode::from_u16(200 + u16::from(i % 7)).unwrap(),
            headers,
            body,
        )
    };

    // 64 new keys, the first 8 of them sent twice, all at once.
    let mut claims = JoinSet::new();
    for i in (0..64u8).chain(0..8) {
        let store = store.clone();
        claims.spawn(async move { (i, store.claim(&request(i)).await.expect("claim")) });
    }
    let mut held = std::collections::HashMap::new();
    let mut in_flight = vec![0; 64];
    while let Some(claimed) = claims.join_next().await {
        match claimed.expect("task") {
            (
                i,
                KeyState::Acquired {
                    claim,
                    takeover: false,
                },
            ) => {
                assert!(held.insert(i, claim).is_none(), "key {i} acquired twice");
            }
            (i, KeyState::InFlight { .. }) => in_flight[usize::from(i)] += 1,
            (i, other) => panic!("key {i}: {other:?}"),
        }
    }
    assert_eq!(held.len(), 64, "every key acquired");
    assert_eq!(in_flight.iter().sum::<i32>(), 8);
    assert!(
        in_flight[..8].iter().all(|&n| n == 1),
        "each duplicate is in flight: {in_flight:?}"
    );

    // All completed at once.
    let mut completions = JoinSet::new();
    for (i, claim) in held {
        let store = store.clone();
        completions.spawn(async move { (i, store.complete(&claim, &record(i)).await) });
    }
    while let Some(completed) = completions.join_next().await {
        let (i, status) = completed.expect("task");
        assert_eq!(status.expect("complete"), ClaimStatus::Held, "key {i}");
    }

    for i in 0..64u8 {
        match store.claim(&request(i)).await.expect("replay") {
            KeyState::Completed { record: stored, .. } => {
                assert_eq!(stored, record(i), "key {i}")
            }
            other => panic!("key {i}: {other:?}"),
        }
    }
}

/// Claims and completions batched side by side: while the responses of 32 held keys are
/// stored, 32 new keys are claimed and each of the 32 held keys is retried, all at once.
/// Each new key is acquired once, a retry never acquires a key that is held or completed
/// (it is in flight or replays), and each completed key replays its own record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_completions_batched_together_stay_apart() {
    use tower_idempotency::{
        Record,
        store::{ClaimStatus, KeyState, Store},
    };

    enum Done {
        Completed(u8, ClaimStatus),
        Claimed(u8, KeyState<tower_idempotency::store::PgClaim>),
    }

    let (_db, store) = migrated().await;
    let request = |i: u8| claim_request(i, i);
    let record = |i: u8| {
        Record::from_parts(
            http::StatusCode::CREATED,
            Default::default(),
            Some(format!("charge {i}").into()),
        )
    };
    let mut held = Vec::new();
    for i in 0..32u8 {
        match store.claim(&request(i)).await.expect("claim") {
            KeyState::Acquired { claim, .. } => held.push((i, claim)),
            other => panic!("key {i}: {other:?}"),
        }
    }

    let mut tasks = JoinSet::new();
    for (i, claim) in held {
        let store = store.clone();
        tasks.spawn(async move {
            Done::Completed(
                i,
                store.complete(&claim, &record(i)).await.expect("complete"),
            )
        });
    }
    for i in (0..32u8).chain(100..132) {
        let store = store.clone();
        tasks
            .spawn(async move { Done::Claimed(i, store.claim(&request(i)).await.expect("claim")) });
    }
    let mut acquired = Vec::new();
    while let Some(done) = tasks.join_next().await {
        match done.expect("task") {
            Done::Completed(i, status) => assert_eq!(status, ClaimStatus::Held, "key {i}"),
            Done::Claimed(i, KeyState::Acquired { .. }) if i >= 100 => acquired.push(i),
            Done::Claimed(i, KeyState::InFlight { .. }) if i < 32 => {}
            Done::Claimed(i, KeyState::Completed { record: stored, .. }) if i < 32 => {
                assert_eq!(stored, record(i), "key {i}");
            }
            Done::Claimed(i, other) => panic!("key {i}: {other:?}"),
        }
    }
    acquired.sort_unstable();
    assert_eq!(acquired, (100..132).collect::<Vec<_>>());
    for i in 0..32u8 {
        match store.claim(&request(i)).await.expect("replay") {
            KeyState::Completed { record: stored, .. } => {
                assert_eq!(stored, record(i), "key {i}")
            }
            other => panic!("key {i}: {other:?}"),
        }
    }
}

/// The batched completion (`idempotency.complete_many`) finds each record by its primary
/// key, never by scanning the table, even when its plan was made while the table was
/// nearly empty and analyzed as such (when PostgreSQL would rather scan) and the table has
/// grown since: a scan per batch would make every batch cost the whole table. Counted by
/// PostgreSQL itself, in the transaction that ran the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_completions_look_records_up_by_key_however_small_the_table_was() {
    let (db, _store) = migrated().await;
    let insert_in_flight = "INSERT INTO idempotency.records
            (scope_key, fingerprint, token, expires_at, lease_until)
        SELECT gen_random_uuid(), decode(repeat('ab', 32), 'hex'), n,
               now() + interval '1 hour', now() + interval '30 seconds'
        FROM generate_series($1::int8, $2::int8) AS n
        RETURNING scope_key, token";
    let complete_many = "SELECT scope_key, token FROM idempotency.complete_many(
            $1, $2, array_fill(201::int2, ARRAY[cardinality($1)]),
            array_fill('\\x6f6b'::bytea, ARRAY[cardinality($1)]),
            array_fill(1, ARRAY[cardinality($1)]), array_fill(1, ARRAY[cardinality($1)]),
            ARRAY['content-type'], ARRAY['text/plain'::bytea])";
    let scans = "SELECT seq_scan, idx_scan FROM pg_stat_xact_user_tables
        WHERE relid = 'idempotency.records'::regclass";

    sqlx::query(insert_in_flight)
        .bind(1_i64)
        .bind(1_i64)
        .execute(db.pool())
        .await
        .expect("one row");
    sqlx::query("ANALYZE idempotency.records")
        .execute(db.pool())
        .await
        .expect("analyze");
    // One session, whose cached plan is made now, on the one-row table, and kept: the
    // first batches (PostgreSQL plans the first five afresh) find nothing.
    let mut session = db.pool().acquire().await.expect("connection");
    for _ in 0..6 {
        let none: Vec<(sqlx::types::Uuid, i64)> = sqlx::query_as(complete_many)
            .bind(vec![sqlx::types::Uuid::nil()])
            .bind(vec![7_i64])
            .fetch_all(&mut *session)
            .await
            .expect("an empty batch");
        assert!(none.is_empty());
    }
    let grown: Vec<(sqlx::types::Uuid, i64)> = sqlx::query_as(insert_in_flight)
        .bind(2_i64)
        .bind(20_001_i64)
        .fetch_all(db.pool())
        .await
        .expect("grown");

    // The counts read back are the session's not yet reported to the statistics system,
    // which happens only between transactions: what one transaction did is the difference.
    let mut tx = sqlx::Connection::begin(&mut *session).await.expect("begin");
    let before: (i64, i64) = sqlx::query_as(scans)
        .fetch_one(&mut *tx)
        .await
        .expect("scans");
    let batch = [&grown[5], &grown[10_000], &grown[19_999]];
    let mut completed: Vec<(sqlx::types::Uuid, i64)> = sqlx::query_as(complete_many)
        .bind(batch.iter().map(|(key, _)| *key).collect::<Vec<_>>())
        .bind(batch.iter().map(|(_, token)| *token).collect::<Vec<_>>())
        .fetch_all(&mut *tx)
        .await
        .expect("a batch");
    let after: (i64, i64) = sqlx::query_as(scans)
        .fetch_one(&mut *tx)
        .await
        .expect("scans");
    tx.commit().await.expect("commit");

    completed.sort_unstable();
    let mut expected: Vec<_> = batch.iter().map(|&&row| row).collect();
    expected.sort_unstable();
    assert_eq!(completed, expected, "each record of the batch completed");
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (0, 3),
        "one primary-key lookup per record, no scan of the table"
    );
    let stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency.records
         WHERE status = 201 AND body = 'ok' AND header_names = ARRAY['content-type']
           AND lease_until IS NULL",
    )
    .fetch_one(db.pool())
    .await
    .expect("count");
    assert_eq!(stored, 3);
}

/// Autovacuum first looks at the records table after 1,000 changes (by default it would
/// after 50), and the claim plans a session makes from the statistics it takes then look
/// keys up in the primary key, also after the table has grown twentyfold: plans made from
/// a table of a page or two would read the whole table for every claim until the next
/// analyze. Scans counted by PostgreSQL for the one session that made the plans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_plans_made_when_autovacuum_first_looks_find_keys_by_index() {
    use tower_idempotency::store::{KeyState, Store};

    let (db, store) = migrated().await;
    let options: Vec<String> = sqlx::query_scalar(
        "SELECT unnest(reloptions) FROM pg_class WHERE oid = 'idempotency.records'::regclass",
    )
    .fetch_all(db.pool())
    .await
    .expect("options");
    for option in [
        "autovacuum_analyze_threshold=1000",
        "autovacuum_vacuum_threshold=1000",
    ] {
        assert!(options.iter().any(|o| o == option), "{option}: {options:?}");
    }

    // The 1,000 changes after which autovacuum first analyzes the table: claims.
    let request = |i: u16| tower_idempotency::store::ClaimRequest {
        key: tower_idempotency::ScopeKey::from_bytes(std::array::from_fn(|b| {
            i.to_be_bytes()[b % 2]
        })),
        ..claim_request(0, 1)
    };
    let mut claims = JoinSet::new();
    for i in 0..1_000 {
        let store = store.clone();
        claims.spawn(async move { store.claim(&request(i)).await.expect("claim") });
    }
    while let Some(claim) = claims.join_next().await {
        assert!(matches!(claim.expect("task"), KeyState::Acquired { .. }));
    }
    sqlx::query("ANALYZE idempotency.records")
        .execute(db.pool())
        .await
        .expect("analyze");

    // One session, whose plans PostgreSQL makes now (after five custom ones) and keeps.
    let single = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options().clone())
        .await
        .expect("pool");
    let session = PostgresStore::new(single.clone());
    for i in 0..7 {
        assert!(matches!(
            session.claim(&request(i)).await.expect("retry"),
            KeyState::InFlight { .. }
        ));
    }
    sqlx::query(
        "INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, lease_until)
         SELECT gen_random_uuid(), decode(repeat('ab', 32), 'hex'), -n,
                now() + interval '1 hour', now() + interval '30 seconds'
         FROM generate_series(1, 20000) AS n",
    )
    .execute(db.pool())
    .await
    .expect("grown");

    // The session's scans: those reported to the statistics system and those it has not
    // reported yet (it does so between transactions, at most once a second).
    let scans = || async {
        let mut connection = single.acquire().await.expect("the session");
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT s.seq_scan + x.seq_scan, s.idx_scan + x.idx_scan
             FROM pg_stat_user_tables s JOIN pg_stat_xact_user_tables x USING (relid)
             WHERE relid = 'idempotency.records'::regclass",
        )
        .fetch_one(&mut *connection)
        .await
        .expect("scans")
    };
    let before = scans().await;
    assert!(matches!(
        session.claim(&request(500)).await.expect("retry"),
        KeyState::InFlight { .. }
    ));
    let after = scans().await;
    assert_eq!(after.0 - before.0, 0, "no sequential scan of the table");
    assert!(after.1 > before.1, "the key looked up by index");
}
