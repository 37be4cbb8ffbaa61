//! The protocol suite against `PostgresStore`, each test in its own database, plus what only
//! PostgreSQL has: many pools racing, outages, migrations, the reaper.

use idempotency_tests::{
    db::TestDb,
    suite::{InLeaseMode, PostgresFixture},
};
use tower_idempotency::store::PostgresStore;

struct Postgres {
    db: TestDb,
    store: PostgresStore,
}

impl PostgresFixture for Postgres {
    async fn start() -> Self {
        let db = TestDb::new().await;
        let store = PostgresStore::new(db.pool().clone());
        store.migrate().await.expect("migrate");
        Self { db, store }
    }

    fn db(&self) -> &TestDb {
        &self.db
    }

    fn store(&self) -> PostgresStore {
        self.store.clone()
    }
}

idempotency_tests::store_suite!(InLeaseMode<Postgres>);

/// The same suite with the store in transactional mode.
mod transactional {
    use idempotency_tests::suite::InTransactionalMode;

    idempotency_tests::store_suite!(InTransactionalMode<super::Postgres>);
}

mod postgres_only {
    use std::time::Duration;

    use http::StatusCode;
    use idempotency_tests::{
        app::{Probe, app},
        db::TestDb,
        init_tracing,
        server::TestServer,
        suite::Reply,
    };
    use sqlx::{Executor, postgres::PgPoolOptions};
    use tokio::task::JoinSet;
    use tower_idempotency::{
        IdempotencyLayer,
        store::{ExpiredDeletion, PostgresStore},
    };

    async fn migrated() -> (TestDb, PostgresStore) {
        init_tracing();
        let db = TestDb::new().await;
        let store = PostgresStore::new(db.pool().clone());
        store.migrate().await.expect("migrate");
        (db, store)
    }

    /// A claim of key `[key; 32]` for a request fingerprinted `[fingerprint; 32]`, with the
    /// layer's default lease and a one-hour TTL.
    fn claim_request(key: u8, fingerprint: u8) -> tower_idempotency::store::ClaimRequest {
        tower_idempotency::store::ClaimRequest {
            key: tower_idempotency::ScopeKey::from_bytes([key; 32]),
            fingerprint: tower_idempotency::Fingerprint::from_bytes([fingerprint; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        }
    }

    /// An open transaction that has inserted `request`'s key as a claim in flight: until it
    /// ends, a batch claiming the same key waits on its row.
    async fn held_uncommitted(
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

    fn post(client: &reqwest::Client, server: &TestServer, key: &str) -> reqwest::RequestBuilder {
        client
            .post(server.url("/charges"))
            .bearer_auth("acct_a")
            .header("idempotency-key", key)
            .body(r#"{"amount":100}"#)
    }

    /// The store protocol's checks, as a third-party store runs them (`store::conformance`),
    /// on PostgreSQL's clock: leases of one second lapse for real.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keeps_the_store_protocol() {
        let (_db, store) = migrated().await;
        let short = Duration::from_secs(1);
        tower_idempotency::store::conformance::check(&store, short).await;
        tower_idempotency::store::conformance::check_expired_deletion(&store, short).await;
    }

    /// The pool of one app instance of the multi-instance races: ten connections of its own.
    async fn instance_pool(db: &TestDb) -> sqlx::PgPool {
        PgPoolOptions::new()
            .max_connections(10)
            .connect_with(db.options().clone())
            .await
            .expect("pool")
    }

    /// Four app instances, each with its own pool, race 200 requests over 20 keys: every key
    /// runs once, every 201 for a key carries the same body.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_instances_run_each_key_once() {
        let (db, _) = migrated().await;
        let probe = Probe::default();
        let mut servers = Vec::new();
        for _ in 0..4 {
            let pool = instance_pool(&db).await;
            servers.push(
                TestServer::start(app(IdempotencyLayer::postgres(pool), probe.clone())).await,
            );
        }
        let client = reqwest::Client::new();
        let mut requests = JoinSet::new();
        for i in 0..200 {
            let key = format!("k-{}", i % 20);
            let request = post(&client, &servers[i % 4], &key);
            requests.spawn(async move { (key, Reply::of(request).await) });
        }
        let mut bodies = std::collections::HashMap::new();
        while let Some(result) = requests.join_next().await {
            let (key, reply) = result.expect("task");
            match reply.status {
                StatusCode::CREATED => {
                    let first = bodies.entry(key).or_insert_with(|| reply.body.clone());
                    assert_eq!(
                        *first, reply.body,
                        "every 201 for a key is the same response"
                    );
                }
                StatusCode::CONFLICT => reply.assert_problem(409, "InFlight"),
                other => panic!("unexpected {other}: {:?}", reply.body),
            }
        }
        assert_eq!(
            probe.executions(),
            20,
            "one execution per key across instances"
        );
    }

    /// The same race counted by the handler's real side effect in lease mode: 200 requests over
    /// 20 keys to four instances, whose handler inserts a row through its instance's own pool
    /// (outside any transaction of the layer's). One row per key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_instances_write_one_row_per_key_in_lease_mode() {
        use idempotency_tests::app::{CHARGES_TABLE, tx_app};

        let (db, _) = migrated().await;
        db.pool()
            .execute(CHARGES_TABLE)
            .await
            .expect("charges table");
        let mut servers = Vec::new();
        for _ in 0..4 {
            let pool = instance_pool(&db).await;
            let layer = IdempotencyLayer::postgres(pool.clone());
            servers.push(TestServer::start(tx_app(layer, Probe::default(), pool)).await);
        }
        let client = reqwest::Client::new();
        let mut requests = JoinSet::new();
        for i in 0..200 {
            let request = client
                .post(servers[i % 4].url("/tx/untransacted"))
                .bearer_auth("acct_a")
                .header("idempotency-key", format!("k-{}", i % 20))
                .body(r#"{"amount":100}"#);
            requests.spawn(Reply::of(request));
        }
        while let Some(reply) = requests.join_next().await {
            let reply = reply.expect("task");
            match reply.status {
                StatusCode::CREATED => {}
                StatusCode::CONFLICT => reply.assert_problem(409, "InFlight"),
                other => panic!("unexpected {other}: {:?}", reply.body),
            }
        }
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT idempotency_key, count(*) FROM charges GROUP BY 1 ORDER BY 1")
                .fetch_all(db.pool())
                .await
                .expect("rows");
        assert_eq!(rows.len(), 20, "every key ran: {rows:?}");
        assert!(rows.iter().all(|(_, n)| *n == 1), "once each: {rows:?}");
    }

    #[tokio::test]
    async fn an_unreachable_database_is_a_prompt_503() {
        init_tracing();
        let pool = idempotency_tests::db::unreachable_pool(Duration::from_secs(1));
        let store = PostgresStore::new(pool).with_timeout(Duration::from_secs(2));
        let probe = Probe::default();
        let server = TestServer::start(app(IdempotencyLayer::new(store), probe.clone())).await;
        let started = tokio::time::Instant::now();
        let reply = Reply::of(post(&reqwest::Client::new(), &server, "k-down")).await;
        reply.assert_problem(503, "StoreUnavailable");
        assert_eq!(reply.headers["retry-after"], "1");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(probe.executions(), 0);
    }

    #[tokio::test]
    async fn migrations_keep_to_their_own_schema_and_table() {
        let (db, store) = migrated().await;
        store.migrate().await.expect("migrating again is a no-op");
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT table_schema || '.' || table_name FROM information_schema.tables
             WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1",
        )
        .fetch_all(db.pool())
        .await
        .expect("tables");
        assert_eq!(
            tables,
            [
                "idempotency._sqlx_migrations",
                "idempotency.partitioned_records",
                "idempotency.records"
            ]
        );
        // The application's own migrations (default table) run beside it untouched.
        let mut app_migrator =
            sqlx::migrate::Migrator::with_migrations(vec![sqlx::migrate::Migration::new(
                1,
                "app".into(),
                sqlx::migrate::MigrationType::Simple,
                sqlx::SqlSafeStr::into_sql_str("CREATE TABLE app_things (id int)"),
                false,
            )]);
        app_migrator.set_locking(true);
        app_migrator.run(db.pool()).await.expect("app migrations");
        store.migrate().await.expect("ours still applied");
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM public._sqlx_migrations")
            .fetch_one(db.pool())
            .await
            .expect("app migrations table");
        assert_eq!(applied, 1);
    }

    /// Records written while keys were stored whole (32 bytes of `bytea`) are found by the same
    /// keys once the migration to 128-bit `uuid` keys has run: a completed one replays, an
    /// in-flight one is still held, and the table takes new keys.
    #[tokio::test]
    async fn records_from_before_the_uuid_key_migration_are_found_after_it() {
        use tower_idempotency::store::{KeyState, Store};

        init_tracing();
        let db = TestDb::new().await;
        let all = PostgresStore::migrator();
        let mut before =
            sqlx::migrate::Migrator::with_migrations(all.iter().take(2).cloned().collect());
        before.create_schema("idempotency");
        before.dangerous_set_table_name("idempotency._sqlx_migrations");
        before.run(db.pool()).await.expect("the schema before");
        // Keys whose every byte differs, so that only the right 16 of them find the record.
        let request = |seed: u8| tower_idempotency::store::ClaimRequest {
            key: tower_idempotency::ScopeKey::from_bytes(std::array::from_fn(|i| {
                seed.wrapping_mul(32).wrapping_add(i as u8)
            })),
            ..claim_request(0, 7)
        };
        let (completed, in_flight) = (request(1), request(2));
        sqlx::query(
            "INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at,
                 completed_at, status, header_names, header_values, body)
             VALUES ($1, $2, 1, now() + interval '1 hour', now(), 201, '{content-type}',
                     ARRAY['application/json'::bytea], '{\"id\":1}')",
        )
        .bind(&completed.key.as_bytes()[..])
        .bind(&completed.fingerprint.as_bytes()[..])
        .execute(db.pool())
        .await
        .expect("a completed record");
        sqlx::query(
            "INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, lease_until)
             VALUES ($1, $2, 2, now() + interval '1 hour', now() + interval '30 s')",
        )
        .bind(&in_flight.key.as_bytes()[..])
        .bind(&in_flight.fingerprint.as_bytes()[..])
        .execute(db.pool())
        .await
        .expect("a claim in flight");

        let store = PostgresStore::new(db.pool().clone());
        store.migrate().await.expect("the uuid key migration");
        match store.begin(&completed).await.expect("begin") {
            KeyState::Completed { record, .. } => {
                assert_eq!(record.status(), StatusCode::CREATED);
                assert_eq!(record.headers()["content-type"], "application/json");
                assert_eq!(record.body().map(|b| &b[..]), Some(&b"{\"id\":1}"[..]));
            }
            other => panic!("the completed record is lost: {other:?}"),
        }
        assert!(
            matches!(
                store.begin(&in_flight).await.expect("begin"),
                KeyState::InFlight { .. }
            ),
            "the claim in flight is still held"
        );
        assert!(matches!(
            store.begin(&request(3)).await.expect("begin"),
            KeyState::Acquired {
                takeover: false,
                ..
            }
        ));
    }

    /// Neither the key nor the principal reaches the database in clear.
    #[tokio::test]
    async fn raw_keys_and_principals_are_not_stored() {
        let (db, store) = migrated().await;
        let server = TestServer::start(app(IdempotencyLayer::new(store), Probe::default())).await;
        let key = "secret-key-8e03978e";
        let reply = Reply::of(post(&reqwest::Client::new(), &server, key)).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        let leaked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency.records r
             WHERE position($1::bytea IN r::text::bytea) > 0 OR position($2::bytea IN r::text::bytea) > 0",
        )
        .bind(key.as_bytes())
        .bind("acct_a".as_bytes())
        .fetch_one(db.pool())
        .await
        .expect("search");
        assert_eq!(leaked, 0);
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
            .fetch_one(db.pool())
            .await
            .expect("count");
        assert_eq!(rows, 1);
    }

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
            claims.spawn(async move { (i, store.begin(&request(i)).await.expect("begin")) });
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
            match store.begin(&request(i)).await.expect("replay") {
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
            match store.begin(&request(i)).await.expect("begin") {
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
            tasks.spawn(
                async move { Done::Claimed(i, store.begin(&request(i)).await.expect("begin")) },
            );
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
            match store.begin(&request(i)).await.expect("replay") {
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
            claims.spawn(async move { store.begin(&request(i)).await.expect("claim") });
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
                session.begin(&request(i)).await.expect("retry"),
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
            session.begin(&request(500)).await.expect("retry"),
            KeyState::InFlight { .. }
        ));
        let after = scans().await;
        assert_eq!(after.0 - before.0, 0, "no sequential scan of the table");
        assert!(after.1 > before.1, "the key looked up by index");
    }

    /// A claim written in a batch for a request that has gone meanwhile (cancelled while it
    /// waited) is released at once, not left in flight until its lease lapses.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_batched_for_a_request_that_is_gone_is_released() {
        use tower_idempotency::store::{KeyState, Store};

        let (db, store) = migrated().await;
        let request = claim_request(9, 1);
        // Another transaction inserts the same key and stays open: the batch waits on it.
        let blocker = held_uncommitted(&db, &request).await;
        let claiming = tokio::spawn({
            let (store, request) = (store.clone(), request.clone());
            async move { store.begin(&request).await }
        });
        wait_until(&db, "SELECT count(*) = 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%unnest%'").await;
        // The request goes away; then the batch gets through and claims the key for no one.
        claiming.abort();
        assert!(claiming.await.expect_err("aborted").is_cancelled());
        blocker.rollback().await.expect("rollback");
        // The batch commits its claim (the row is invisible until then, so "no row" alone
        // would not tell a release from a batch still under way)...
        wait_until(
            &db,
            "SELECT count(*) = 0 FROM pg_stat_activity
             WHERE datname = current_database() AND state <> 'idle'
               AND query LIKE '%unnest%' AND pid <> pg_backend_pid()",
        )
        .await;
        // ...and the claim is released.
        wait_until(&db, "SELECT count(*) = 0 FROM idempotency.records").await;
        assert!(matches!(
            store.begin(&request).await.expect("begin"),
            KeyState::Acquired {
                takeover: false,
                ..
            }
        ));
    }

    /// The connection a batch writer keeps between batches can die under it (a server restart,
    /// a terminated backend): that batch's claims go alone, the connection is not reused, and
    /// the batches queued behind it go out on a fresh one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_whose_connection_dies_is_claimed_alone_and_batching_goes_on() {
        use tower_idempotency::store::{KeyState, Store};

        let (db, store) = migrated().await;
        let request = |i: u8| claim_request(i, i);
        let claim = |i: u8| {
            let store = store.clone();
            tokio::spawn(async move { (i, store.begin(&request(i)).await) })
        };
        // Another transaction holds key 0's row uncommitted: the first batch waits on it.
        let blocker = held_uncommitted(&db, &request(0)).await;
        let mut claims = vec![claim(0)];
        wait_until(&db, "SELECT count(*) = 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%unnest%'").await;
        // Eight more queue behind that batch.
        claims.extend((1..=8).map(claim));
        // The batch writer's connection dies mid-batch.
        let terminated: bool = sqlx::query_scalar(
            "SELECT bool_and(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE '%unnest%' AND pid <> pg_backend_pid()",
        )
        .fetch_one(db.pool())
        .await
        .expect("terminate");
        assert!(terminated);
        // The blocker gives key 0 up; its claim, sent alone after the failed batch, gets it.
        blocker.rollback().await.expect("rollback");
        for claimed in claims {
            let (i, begin) = claimed.await.expect("task");
            assert!(
                matches!(
                    begin,
                    Ok(KeyState::Acquired {
                        takeover: false,
                        ..
                    })
                ),
                "key {i}: {begin:?}"
            );
        }
        // Batching goes on.
        for claimed in (9..=16).map(claim) {
            let (i, begin) = claimed.await.expect("task");
            assert!(
                matches!(begin, Ok(KeyState::Acquired { .. })),
                "key {i}: {begin:?}"
            );
        }
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
            .fetch_one(db.pool())
            .await
            .expect("count");
        assert_eq!(rows, 17);
    }

    /// Issue 28.4, claims orphaned by errors: a batch of claims that committed but whose answer
    /// was lost (the connection cut right after the server confirmed the `INSERT`) is not left
    /// in flight for nobody: the request's own claim, retried alone, finds its row and holds it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batched_claim_that_committed_then_failed_is_held_by_its_request() {
        use idempotency_tests::faults::CuttingProxy;
        use tower_idempotency::store::{KeyState, Store};

        let (db, _) = migrated().await;
        let proxy = CuttingProxy::start(&db).await;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(proxy.options(&db))
            .await
            .expect("pool through the proxy");
        let store = PostgresStore::new(pool);
        let request = claim_request(11, 1);
        proxy.cut_after("INSERT");
        let begin = store.begin(&request).await.expect("begin");
        assert!(proxy.has_cut(), "the batch's answer was cut");
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
        let KeyState::Acquired { claim, .. } = begin else {
            unreachable!()
        };
        // The claim is really held: it completes, and the key replays.
        let record =
            tower_idempotency::Record::from_parts(StatusCode::OK, Default::default(), None);
        assert_eq!(
            store.complete(&claim, &record).await.expect("complete"),
            tower_idempotency::store::ClaimStatus::Held
        );
        assert!(matches!(
            store.begin(&request).await.expect("begin"),
            KeyState::Completed { .. }
        ));
    }

    /// Issue 28.4: a batched claim whose caller stopped waiting (the store's timeout) and that
    /// commits afterwards is released once it does, not left to block its key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batched_claim_that_timed_out_is_released_when_it_commits() {
        use tower_idempotency::store::{KeyState, Store};

        let (db, store) = migrated().await;
        let store = store.with_timeout(Duration::from_millis(300));
        let request = claim_request(12, 1);
        let blocker = held_uncommitted(&db, &request).await;
        let claiming = tokio::spawn({
            let (store, request) = (store.clone(), request.clone());
            async move { store.begin(&request).await }
        });
        wait_until(&db, "SELECT count(*) = 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%unnest%'").await;
        assert!(
            matches!(
                claiming.await.expect("task"),
                Err(tower_idempotency::store::PostgresStoreError::Timeout { .. })
            ),
            "the caller stopped waiting"
        );
        // The blocker gives the key up: the batch claims it, for nobody.
        blocker.rollback().await.expect("rollback");
        wait_until(
            &db,
            "SELECT count(*) = 0 FROM pg_stat_activity
             WHERE datname = current_database() AND state <> 'idle'
               AND query LIKE '%unnest%' AND pid <> pg_backend_pid()",
        )
        .await;
        wait_until(&db, "SELECT count(*) = 0 FROM idempotency.records").await;
        // Another payload under the key is a new request, not a 422.
        assert!(matches!(
            store.begin(&claim_request(12, 2)).await.expect("begin"),
            KeyState::Acquired {
                takeover: false,
                ..
            }
        ));
    }

    /// Issue 28.4: a single-key claim (a key with a row: here a lapsed lease, taken over)
    /// cancelled while its statement waits (what `Disconnect::Cancel` does when the client
    /// hangs up) leaves no claim behind once the statement commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_single_key_claim_is_released_when_it_commits() {
        use tower_idempotency::store::{KeyState, Store};

        let (db, store) = migrated().await;
        let request = claim_request(13, 1);
        assert!(matches!(
            store.begin(&request).await.expect("begin"),
            KeyState::Acquired { .. }
        ));
        db.pool()
            .execute("UPDATE idempotency.records SET lease_until = now() - interval '1 second'")
            .await
            .expect("lapse");
        // Another transaction locks the row: the takeover's statement waits on it.
        let mut blocker = db.pool().begin().await.expect("begin");
        blocker
            .execute("SELECT * FROM idempotency.records FOR UPDATE")
            .await
            .expect("lock the row");
        let claiming = tokio::spawn({
            let (store, request) = (store.clone(), request.clone());
            async move { store.begin(&request).await }
        });
        wait_until(&db, "SELECT count(*) = 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%taken AS%'").await;
        claiming.abort();
        assert!(claiming.await.expect_err("aborted").is_cancelled());
        blocker.rollback().await.expect("rollback");
        wait_until(
            &db,
            "SELECT count(*) = 0 FROM pg_stat_activity
             WHERE datname = current_database() AND state <> 'idle'
               AND query LIKE '%taken AS%' AND pid <> pg_backend_pid()",
        )
        .await;
        wait_until(&db, "SELECT count(*) = 0 FROM idempotency.records").await;
        assert!(matches!(
            store.begin(&claim_request(13, 2)).await.expect("begin"),
            KeyState::Acquired {
                takeover: false,
                ..
            }
        ));
    }

    /// Issue 28.1: the database refuses to store a delivered response for longer than the lease
    /// (a trigger rejects every completion). The layer keeps the claim alive while it retries,
    /// so a retry sent after the lease gets `409`, never a second execution; once the database
    /// takes the record again, the retry gets the replay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_response_the_database_refuses_keeps_its_key_past_the_lease() {
        let (db, store) = migrated().await;
        db.pool()
            .execute(
                "CREATE FUNCTION idempotency.refuse_completion() RETURNS trigger
                 LANGUAGE plpgsql AS $$ BEGIN
                     IF NEW.status IS NOT NULL AND OLD.status IS NULL THEN
                         RAISE EXCEPTION 'completions refused for the test';
                     END IF;
                     RETURN NEW;
                 END $$;
                 CREATE TRIGGER refuse_completion BEFORE UPDATE ON idempotency.records
                     FOR EACH ROW EXECUTE FUNCTION idempotency.refuse_completion();",
            )
            .await
            .expect("trigger");
        let lease = Duration::from_millis(600);
        let probe = Probe::default();
        let layer = IdempotencyLayer::new(store)
            .with_lease(lease)
            .expect("lease")
            .with_replay_cache(0);
        let server = TestServer::start(app(layer, probe.clone())).await;
        let client = reqwest::Client::new();
        let first = Reply::of(post(&client, &server, "k-refused")).await;
        assert_eq!(
            first.status,
            StatusCode::CREATED,
            "delivered though not stored"
        );
        // The scenario is time passing: the refusal outlasts the lease three times over.
        tokio::time::sleep(lease * 3).await;
        Reply::of(post(&client, &server, "k-refused"))
            .await
            .assert_problem(409, "InFlight");
        db.pool()
            .execute("DROP TRIGGER refuse_completion ON idempotency.records")
            .await
            .expect("drop trigger");
        wait_until(
            &db,
            "SELECT count(*) = 1 FROM idempotency.records WHERE status IS NOT NULL",
        )
        .await;
        let retry = Reply::of(post(&client, &server, "k-refused")).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, first.body);
        assert_eq!(probe.executions(), 1);
    }

    /// Issue 29.3 across instances: the first request (slow: 1.5 s) runs on instance A; its
    /// duplicate, sent to instance B, waits (5 s at most) and gets A's replay as soon as A
    /// commits, woken by PostgreSQL's `NOTIFY`, not by its once-a-second re-read; the handler
    /// runs once.
    async fn a_duplicate_on_another_instance_is_woken_when_the_first_commits(transactional: bool) {
        use idempotency_tests::store::ObservedStore;

        let (db, _) = migrated().await;
        let mode = |store: PostgresStore| {
            if transactional {
                store.transactional()
            } else {
                store
            }
        };
        let probe = Probe::default();
        let a = TestServer::start(app(
            IdempotencyLayer::new(mode(PostgresStore::new(instance_pool(&db).await)))
                .with_in_flight_wait(Duration::from_secs(5)),
            probe.clone(),
        ))
        .await;
        let b_store = ObservedStore::new(mode(PostgresStore::new(instance_pool(&db).await)));
        let b = TestServer::start(app(
            IdempotencyLayer::new(b_store.clone()).with_in_flight_wait(Duration::from_secs(5)),
            probe.clone(),
        ))
        .await;
        let client = reqwest::Client::new();
        let first = tokio::spawn(Reply::of(
            post(&client, &a, "k-across").header("x-test-gate", "1"),
        ));
        probe.started(1).await;
        let duplicate = tokio::spawn({
            let request = post(&client, &b, "k-across");
            async move {
                let reply = Reply::of(request).await;
                (reply, tokio::time::Instant::now())
            }
        });
        // Found in flight, subscribed, found in flight again: it waits.
        b_store.begun(2).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        probe.open_gate(1);
        let first = first.await.expect("task");
        let answered = tokio::time::Instant::now();
        let (duplicate, duplicate_answered) = duplicate.await.expect("task");
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(duplicate.replayed(), "{duplicate:?}");
        assert_eq!(duplicate.body, first.body);
        let behind = duplicate_answered.saturating_duration_since(answered);
        assert!(
            behind < Duration::from_millis(300),
            "the duplicate was answered {behind:?} after the first: woken by a re-read, not by NOTIFY"
        );
        assert_eq!(probe.executions(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_duplicate_on_another_instance_is_woken_when_the_first_commits_in_lease_mode() {
        a_duplicate_on_another_instance_is_woken_when_the_first_commits(false).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_duplicate_on_another_instance_is_woken_when_the_first_commits_in_transactional_mode()
    {
        a_duplicate_on_another_instance_is_woken_when_the_first_commits(true).await;
    }

    /// Polls `condition` (a query returning one boolean) until it holds: for what happens in
    /// a background task with nothing to signal it. Bounded: fails after 10 s.
    async fn wait_until(db: &TestDb, condition: &'static str) {
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

    /// A handler slower than its lease keeps the key: the heartbeat renews it.
    #[tokio::test]
    async fn the_heartbeat_keeps_a_slow_handlers_key() {
        let (db, store) = migrated().await;
        let lease = Duration::from_millis(300);
        let probe = Probe::default();
        let layer = IdempotencyLayer::new(store)
            .with_lease(lease)
            .expect("lease");
        let server = TestServer::start(app(layer, probe.clone())).await;
        let client = reqwest::Client::new();
        let slow = tokio::spawn(Reply::of(
            post(&client, &server, "k-slow").header("x-test-gate", "1"),
        ));
        probe.started(1).await;
        // Let several leases' worth of time pass: without renewal the key would be taken over.
        tokio::time::sleep(lease * 5).await;
        let lease_until_in_future: bool =
            sqlx::query_scalar("SELECT bool_and(lease_until > now()) FROM idempotency.records")
                .fetch_one(db.pool())
                .await
                .expect("lease");
        assert!(lease_until_in_future, "the lease was renewed");
        Reply::of(post(&client, &server, "k-slow"))
            .await
            .assert_problem(409, "InFlight");
        probe.open_gate(1);
        assert_eq!(slow.await.expect("task").status, StatusCode::CREATED);
        assert_eq!(probe.executions(), 1);
    }

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
                let KeyState::Acquired { .. } = store.begin(&request(i)).await.expect("begin")
                else {
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
                        store.begin(&request(i)).await.expect("begin")
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
                match store.begin(&request(i)).await.expect("begin") {
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
}

/// Forgetting `migrate()` is a 503 and an error that says what to do, not a mystery.
#[tokio::test]
async fn an_unmigrated_database_says_so() {
    use std::time::Duration;

    use http::StatusCode;
    use idempotency_tests::{
        app::{Probe, app},
        server::TestServer,
        suite::Reply,
    };
    use tower_idempotency::{
        Fingerprint, IdempotencyLayer, ScopeKey,
        store::{ClaimRequest, PostgresStoreError, Store},
    };

    let db = TestDb::new().await;
    let store = PostgresStore::new(db.pool().clone());
    let request = ClaimRequest {
        key: ScopeKey::from_bytes([1; 32]),
        fingerprint: Fingerprint::from_bytes([2; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    };
    let error = store.begin(&request).await.expect_err("no schema");
    assert!(
        matches!(error, PostgresStoreError::NotMigrated(_)),
        "{error:?}"
    );
    assert!(error.to_string().contains("migrate()"));

    let probe = Probe::default();
    let server = TestServer::start(app(IdempotencyLayer::new(store), probe.clone())).await;
    let reply = Reply::of(
        reqwest::Client::new()
            .post(server.url("/charges"))
            .bearer_auth("acct_a")
            .header("idempotency-key", "k")
            .body("{}"),
    )
    .await;
    reply.assert_problem(503, "StoreUnavailable");
    assert_ne!(reply.status, StatusCode::CREATED);
    assert_eq!(probe.executions(), 0);
}

/// The suite again with the store in partitioned mode (lease and transactional), plus its
/// partition upkeep.
mod partitioned {
    use std::time::Duration;

    use idempotency_tests::{
        db::TestDb,
        suite::{InLeaseMode, InTransactionalMode, PostgresFixture},
    };
    use sqlx::{Executor, postgres::PgPoolOptions};
    use tower_idempotency::{
        Fingerprint, ScopeKey,
        store::{
            ClaimRequest, ExpiredDeletion, KeyState, PgClaim, PostgresStore, PostgresStoreError,
            Store,
        },
    };

    const WIDTH: Duration = Duration::from_secs(3600);

    struct Partitioned {
        db: TestDb,
        store: PostgresStore,
    }

    impl PostgresFixture for Partitioned {
        const TABLE: &'static str = "partitioned_records";

        async fn start() -> Self {
            let db = TestDb::new().await;
            let store = PostgresStore::new(db.pool().clone()).partitioned(WIDTH);
            store
                .migrate()
                .await
                .expect("migrate and create partitions");
            Self { db, store }
        }

        fn db(&self) -> &TestDb {
            &self.db
        }

        fn store(&self) -> PostgresStore {
            self.store.clone()
        }

        async fn lapse_leases(&self) {
            self.db
                .pool()
                .execute(
                    "UPDATE idempotency.partitioned_records
                     SET lease_until = now() - interval '1 second' WHERE status IS NULL",
                )
                .await
                .expect("lapse leases");
        }

        /// Expired, yet still inside the current (existing) hourly partition.
        async fn expire_records(&self) {
            self.db
                .pool()
                .execute(
                    "UPDATE idempotency.partitioned_records
                     SET expires_at = to_timestamp(floor(extract(epoch FROM now()) / 3600) * 3600)",
                )
                .await
                .expect("expire records");
        }
    }

    mod lease {
        use super::*;

        idempotency_tests::store_suite!(InLeaseMode<Partitioned>);
    }

    mod transactional {
        use super::*;

        idempotency_tests::store_suite!(InTransactionalMode<Partitioned>);
    }

    /// The store protocol's checks in partitioned mode. Its expiry drops whole partitions,
    /// not records one by one, so `check_expired_deletion` does not apply (the upkeep test
    /// below covers it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keeps_the_store_protocol() {
        let fixture = <Partitioned as PostgresFixture>::start().await;
        tower_idempotency::store::conformance::check(&fixture.store, Duration::from_secs(1)).await;
    }

    async fn partitions(db: &TestDb) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'idempotency.partitioned_records'::regclass ORDER BY 1",
        )
        .fetch_all(db.pool())
        .await
        .expect("partitions")
    }

    /// Each partition the upkeep creates tells autovacuum to first look at it after 1,000
    /// changes, as the plain table does (see `claim_plans_made_when_autovacuum_first_looks_find_keys_by_index`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn partitions_are_first_analyzed_after_a_thousand_changes() {
        let fixture = <Partitioned as PostgresFixture>::start().await;
        let made = partitions(&fixture.db).await;
        assert!(!made.is_empty());
        let options: Vec<(String, Vec<String>)> = sqlx::query_as(
            "SELECT c.relname::text, coalesce(c.reloptions, '{}')
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'idempotency.partitioned_records'::regclass",
        )
        .fetch_all(fixture.db.pool())
        .await
        .expect("options");
        assert_eq!(options.len(), made.len());
        for (partition, options) in options {
            for option in [
                "autovacuum_analyze_threshold=1000",
                "autovacuum_vacuum_threshold=1000",
            ] {
                assert!(
                    options.iter().any(|o| o == option),
                    "{partition}: {options:?}"
                );
            }
        }
    }

    /// Partitions are made ahead, expired ones dropped whole with their rows, live ones kept;
    /// several instances running the upkeep at once agree.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn upkeep_creates_ahead_and_drops_expired_partitions() {
        let db = TestDb::new().await;
        let store = PostgresStore::new(db.pool().clone())
            .partitioned(WIDTH)
            .with_partitions_ahead(Duration::from_secs(5 * 3600));
        store.migrate().await.expect("migrate");
        let ahead = partitions(&db).await;
        assert!((5..=6).contains(&ahead.len()), "{ahead:?}");

        // An old partition full of expired records, as an earlier day would have left.
        db.pool()
            .execute(
                "CREATE TABLE idempotency.old (LIKE idempotency.partitioned_records INCLUDING ALL);
                 INSERT INTO idempotency.old (scope_key, fingerprint, token, expires_at, status, header_names, header_values, body)
                 SELECT md5(i::text)::uuid, sha256('f'), i,
                        to_timestamp(floor(extract(epoch FROM now()) / 3600) * 3600 - 7200 + i % 3600),
                        200, '{}'::text[], '{}'::bytea[], 'x'::bytea
                 FROM generate_series(1, 5000) i;",
            )
            .await
            .expect("old rows");
        let start: i64 = sqlx::query_scalar(
            "SELECT (floor(extract(epoch FROM now()) / 3600) * 3600 - 7200)::int8",
        )
        .fetch_one(db.pool())
        .await
        .expect("bucket");
        let name = format!("partitioned_records_{start}_{}", start + 3600);
        db.pool()
            .execute(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE idempotency.old RENAME TO {name};
                 ALTER TABLE idempotency.partitioned_records ATTACH PARTITION idempotency.{name}
                     FOR VALUES FROM (to_timestamp({start})) TO (to_timestamp({}));
                 ANALYZE idempotency.{name};",
                start + 3600
            )))
            .await
            .expect("attach old partition");

        let runs =
            futures_util::future::join_all((0..3).map(|_| store.maintain_partitions())).await;
        let dropped: u64 = runs
            .into_iter()
            .map(|run| run.expect("upkeep").rows_dropped)
            .sum();
        // Counted once, from the statistics (which ANALYZE, as autovacuum would, made exact).
        assert_eq!(dropped, 5000, "the old partition's rows, counted once");
        let left = partitions(&db).await;
        assert!(!left.contains(&name), "{left:?}");
        assert_eq!(left, ahead, "live partitions kept");
        assert_eq!(store.delete_expired(1000).await.expect("nothing to do"), 0);
    }

    /// The partitions' ranges in Unix seconds, from PostgreSQL's bounds rather than their names.
    async fn bounds(db: &TestDb) -> Vec<(i64, i64)> {
        sqlx::query_as(
            r#"SELECT extract(epoch FROM b[1]::timestamptz)::int8,
                      extract(epoch FROM b[2]::timestamptz)::int8
               FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid,
                    regexp_match(pg_get_expr(c.relpartbound, c.oid), $$FROM \('(.*)'\) TO \('(.*)'\)$$) b
               WHERE i.inhparent = 'idempotency.partitioned_records'::regclass ORDER BY 1"#,
        )
        .fetch_all(db.pool())
        .await
        .expect("partition bounds")
    }

    async fn db_now(db: &TestDb) -> f64 {
        sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
            .fetch_one(db.pool())
            .await
            .expect("now")
    }

    /// Claims key `[key; 32]` so that it expires at `expiry` (Unix seconds, in the future, give or
    /// take half a second).
    async fn claim_expiring_at(
        db: &TestDb,
        store: &PostgresStore,
        key: u8,
        expiry: f64,
    ) -> Result<KeyState<PgClaim>, PostgresStoreError> {
        // Whole seconds: sqlx refuses a `Duration` finer than an `interval`'s microseconds.
        let ttl = (expiry - db_now(db).await).round() as u64;
        store
            .begin(&ClaimRequest {
                key: ScopeKey::from_bytes([key; 32]),
                fingerprint: Fingerprint::from_bytes([key; 32]),
                lease: Duration::from_secs(1),
                ttl: Duration::from_secs(ttl),
            })
            .await
    }

    /// A store whose width changes on a live table fills what the old width's partitions
    /// leave of each new bucket, the one straddling their end included (PostgreSQL refuses a
    /// partition overlapping them), so claims expiring anywhere up to the horizon find one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_width_change_on_a_live_table_leaves_no_gap() {
        const NEW_WIDTH: i64 = 25 * 60;
        let db = TestDb::new().await;
        // Hourly partitions, made further ahead until they end off the 25-minute grid (one
        // hour in five ends on it), where a new bucket straddles their end.
        let mut old_ahead = 2 * WIDTH;
        let (old, old_end) = loop {
            let old = PostgresStore::new(db.pool().clone())
                .partitioned(WIDTH)
                .with_partitions_ahead(old_ahead);
            old.migrate().await.expect("migrate");
            let end = bounds(&db).await.last().expect("hourly partitions").1;
            if end % NEW_WIDTH != 0 {
                break (old, end);
            }
            old_ahead += WIDTH;
        };
        for key in 0..3 {
            let expiry = db_now(&db).await + 1800.0 * f64::from(key + 1);
            let begun = claim_expiring_at(&db, &old, key, expiry).await;
            assert!(matches!(begun, Ok(KeyState::Acquired { .. })), "{begun:?}");
        }

        let ahead = old_ahead + 2 * WIDTH;
        let new = PostgresStore::new(db.pool().clone())
            .partitioned(Duration::from_secs(NEW_WIDTH as u64))
            .with_partitions_ahead(ahead);
        new.maintain_partitions().await.expect("upkeep");

        let now = db_now(&db).await;
        let live = bounds(&db).await;
        assert!(live[0].0 as f64 <= now, "{live:?}");
        assert!(
            live[live.len() - 1].1 as f64 >= now + ahead.as_secs_f64(),
            "{live:?}"
        );
        for pair in live.windows(2) {
            assert_eq!(pair[0].1, pair[1].0, "gap or overlap in {live:?}");
        }
        let straddled_end = (old_end / NEW_WIDTH + 1) * NEW_WIDTH;
        assert!(live.contains(&(old_end, straddled_end)), "{live:?}");

        for (key, &(start, end)) in (10..).zip(&live) {
            let expiry = (start as f64)
                .max(db_now(&db).await + 60.0)
                .midpoint(end as f64);
            let begun = claim_expiring_at(&db, &new, key, expiry).await;
            assert!(
                matches!(begun, Ok(KeyState::Acquired { .. })),
                "expiring at {expiry} in [{start}, {end}): {begun:?}"
            );
        }
    }

    /// A partition that overlaps one the store cannot account for (here one it did not name)
    /// is not taken for made: that step fails, the next ones are made, and the failed attach
    /// leaves the connection it used fit for claims.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_overlap_the_store_cannot_account_for_fails_only_its_own_step() {
        let db = TestDb::new().await;
        let one_connection = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(db.options().clone())
            .await
            .expect("pool");
        let store = PostgresStore::new(one_connection)
            .partitioned(WIDTH)
            .with_partitions_ahead(WIDTH);
        store.migrate().await.expect("migrate");
        let end = bounds(&db).await.last().expect("hourly partitions").1;
        db.pool()
            .execute(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE idempotency.someone_elses (LIKE idempotency.partitioned_records INCLUDING ALL);
                 ALTER TABLE idempotency.partitioned_records ATTACH PARTITION idempotency.someone_elses
                     FOR VALUES FROM (to_timestamp({})) TO (to_timestamp({}));",
                end + 1800,
                end + 3600
            )))
            .await
            .expect("attach a partition the store did not name");

        // Buckets `end` (overlapping, half uncovered) and `end + 1 h` are due.
        let before = bounds(&db).await.len();
        let store = store.with_partitions_ahead(3 * WIDTH);
        let report = store.maintain_partitions().await.expect("upkeep");
        let live = bounds(&db).await;
        assert!(!live.iter().any(|&(start, _)| start == end), "{live:?}");
        assert!(live.contains(&(end + 3600, end + 7200)), "{live:?}");
        // The refused step is not counted as made.
        let made = live.len() + report.dropped as usize - before;
        assert_eq!(report.created as usize, made, "{report:?} {live:?}");

        let begun = claim_expiring_at(&db, &store, 1, (end + 5400) as f64).await;
        assert!(matches!(begun, Ok(KeyState::Acquired { .. })), "{begun:?}");
    }

    /// Partitions narrower than the width (left by a width change) go once they expire.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn narrow_partitions_are_dropped_once_expired() {
        let db = TestDb::new().await;
        let store = PostgresStore::new(db.pool().clone()).partitioned(WIDTH);
        store.migrate().await.expect("migrate");
        let ahead = bounds(&db).await;
        let start = ahead[0].0 - 600;
        let name = format!("partitioned_records_{start}_{}", start + 300);
        db.pool()
            .execute(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE idempotency.{name} (LIKE idempotency.partitioned_records INCLUDING ALL);
                 ALTER TABLE idempotency.partitioned_records ATTACH PARTITION idempotency.{name}
                     FOR VALUES FROM (to_timestamp({start})) TO (to_timestamp({}));",
                start + 300
            )))
            .await
            .expect("attach a narrow expired partition");

        let report = store.maintain_partitions().await.expect("upkeep");
        assert!(report.dropped >= 1, "{report:?}");
        let left = bounds(&db).await;
        assert!(!left.contains(&(start, start + 300)), "{left:?}");
        let now = db_now(&db).await;
        let live: Vec<_> = ahead
            .into_iter()
            .filter(|&(_, end)| end as f64 > now)
            .collect();
        assert!(live.iter().all(|p| left.contains(p)), "{left:?}");
    }
}
