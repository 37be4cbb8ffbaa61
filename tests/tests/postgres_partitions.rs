//! The suite again with `PostgresStore` in partitioned mode (lease and transactional), plus its
//! partition upkeep. Each test in its own database.

use std::time::Duration;

use idempotency_tests::{
    db::TestDb,
    suite::{InLeaseMode, InTransactionalMode, PostgresFixture},
};
use sqlx::{Executor, postgres::PgPoolOptions};
use tower_idempotency::{
    Fingerprint, ScopeKey,
    store::{
        ClaimRequest, ExpiredDeletion, KeyState, PgClaim, PostgresStore, PostgresStoreError, Store,
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
        let store = PostgresStore::new(db.pool().clone())
            .partitioned(WIDTH)
            .expect("a valid width");
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
/// changes, as the plain table does (see `claim_plans_made_when_autovacuum_first_looks_find_keys_by_index`,
/// in `postgres_batching`).
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
        .and_then(|store| store.with_partitions_ahead(Duration::from_secs(5 * 3600)))
        .expect("valid partitioning");
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
    let start: i64 =
        sqlx::query_scalar("SELECT (floor(extract(epoch FROM now()) / 3600) * 3600 - 7200)::int8")
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

    let runs = futures_util::future::join_all((0..3).map(|_| store.maintain_partitions())).await;
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
        .claim(&ClaimRequest {
            key: ScopeKey::from_bytes([key; 32]),
            fingerprint: Fingerprint::from_bytes([key; 32]),
            lease: Duration::from_secs(1),
            ttl: Duration::from_secs(ttl),
            waiting: false,
            keeps_request: false,
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
            .and_then(|store| store.with_partitions_ahead(old_ahead))
            .expect("valid partitioning");
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
        .and_then(|store| store.with_partitions_ahead(ahead))
        .expect("valid partitioning");
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
        .and_then(|store| store.with_partitions_ahead(WIDTH))
        .expect("valid partitioning");
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
    let store = store
        .with_partitions_ahead(3 * WIDTH)
        .expect("a valid window");
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
    let store = PostgresStore::new(db.pool().clone())
        .partitioned(WIDTH)
        .expect("a valid width");
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
