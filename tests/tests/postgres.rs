//! The protocol suite against `PostgresStore`, each test in its own database, plus what only
//! PostgreSQL has that is no concern of the other `postgres_*` binaries: the store protocol's
//! checks, many instances racing, migrations, what is stored, the heartbeat. Beside it:
//! `postgres_batching` (group commit and its plans), `postgres_faults` (outages, cut and
//! cancelled claims), `postgres_expiry` (the reaper), `postgres_partitions` (partitioned mode),
//! `postgres_announcements` (which settled keys are announced).

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
        postgres::{claim_request, instance_pool, migrated, post},
        server::TestServer,
        suite::Reply,
    };
    use sqlx::Executor;
    use tokio::task::JoinSet;
    use tower_idempotency::{
        IdempotencyLayer, InFlightWait,
        store::{CachingStore, PostgresStore},
    };

    /// The store protocol's checks, as a third-party store runs them (`store::conformance`),
    /// on PostgreSQL's clock: leases of one second lapse for real.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keeps_the_store_protocol() {
        let (_db, store) = migrated().await;
        let short = Duration::from_secs(1);
        tower_idempotency::store::conformance::check(&store, short).await;
        tower_idempotency::store::conformance::check_expired_deletion(&store, short).await;
    }

    /// The same checks through the `CachingStore` `IdempotencyLayer::postgres` puts in front:
    /// its copies expire with their records on PostgreSQL's clock, and it forwards the rest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keeps_the_store_protocol_behind_a_cache() {
        let (_db, store) = migrated().await;
        let store = CachingStore::new(store);
        let short = Duration::from_secs(1);
        tower_idempotency::store::conformance::check(&store, short).await;
        tower_idempotency::store::conformance::check_expired_deletion(&store, short).await;
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
                "idempotency.pending_requests",
                "idempotency.records",
                "idempotency.steps"
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
        match store.claim(&completed).await.expect("claim") {
            KeyState::Completed { record, .. } => {
                assert_eq!(record.status(), StatusCode::CREATED);
                assert_eq!(record.headers()["content-type"], "application/json");
                assert_eq!(record.body().map(|b| &b[..]), Some(&b"{\"id\":1}"[..]));
            }
            other => panic!("the completed record is lost: {other:?}"),
        }
        assert!(
            matches!(
                store.claim(&in_flight).await.expect("claim"),
                KeyState::InFlight { .. }
            ),
            "the claim in flight is still held"
        );
        assert!(matches!(
            store.claim(&request(3)).await.expect("claim"),
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
                .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(5)))
                .expect("a wait"),
            probe.clone(),
        ))
        .await;
        let b_store = ObservedStore::new(mode(PostgresStore::new(instance_pool(&db).await)));
        let b = TestServer::start(app(
            IdempotencyLayer::new(b_store.clone())
                .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(5)))
                .expect("a wait"),
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

    /// A released first request deletes its row, and the waiter that then claims the key makes
    /// a new one: the duplicate still waiting must mark that one too, so that its completion
    /// wakes it by `NOTIFY` rather than by its once-a-second re-read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_is_woken_by_the_claim_that_followed_a_release() {
        use idempotency_tests::store::ObservedStore;

        let (db, _) = migrated().await;
        let store = ObservedStore::new(PostgresStore::new(instance_pool(&db).await));
        let probe = Probe::default();
        let server = TestServer::start(app(
            IdempotencyLayer::new(store.clone())
                .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(5)))
                .expect("a wait"),
            probe.clone(),
        ))
        .await;
        let client = reqwest::Client::new();
        // `/panic` panics on its first execution (the key is released) and answers after.
        let send = || {
            let request = client
                .post(server.url("/panic"))
                .bearer_auth("acct_a")
                .header("idempotency-key", "k-again")
                .header("x-test-gate", "1")
                .body("x");
            tokio::spawn(async move {
                let reply = Reply::of(request).await;
                (reply, tokio::time::Instant::now())
            })
        };
        let first = send();
        probe.started(1).await;
        store.begun(1).await;
        let waiters = [send(), send()];
        // Each found the key in flight and found it so again: both wait.
        store.begun(4).await;
        probe.open_gate(1);
        first
            .await
            .expect("task")
            .0
            .assert_problem(500, "HandlerPanicked");
        // One waiter claimed the released key and runs; the other found it in flight again.
        probe.started(1).await;
        store.begun(2).await;
        probe.open_gate(1);
        let mut replies = Vec::new();
        for waiter in waiters {
            replies.push(waiter.await.expect("task"));
        }
        replies.sort_by_key(|(reply, _)| reply.replayed());
        let [(ran, ran_at), (replayed, replayed_at)] = <[_; 2]>::try_from(replies).expect("two");
        assert_eq!(
            (ran.status, &ran.body[..]),
            (StatusCode::OK, &b"survived #2"[..])
        );
        assert!(replayed.replayed(), "{replayed:?}");
        assert_eq!(replayed.body, ran.body);
        let behind = replayed_at.saturating_duration_since(ran_at);
        assert!(
            behind < Duration::from_millis(300),
            "the last waiter was answered {behind:?} after the second run: woken by a re-read, not by NOTIFY"
        );
        assert_eq!(probe.executions(), 2);
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
        waiting: false,
        keeps_request: false,
    };
    let error = store.claim(&request).await.expect_err("no schema");
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
