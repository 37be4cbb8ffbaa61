//! The scale scenarios' work on the database (issue 7): filling a store with SQL, putting the
//! expired records back before each expiry measurement, sizes and WAL, sampling lock waits
//! while the reaper runs, and the cross-instance duplicate burst.
//!
//! Records are written by one `INSERT ... SELECT ... FROM generate_series` per chunk, never
//! through HTTP. They look like the layer's own: the scope key is the SHA-256 that
//! `ScopeKey::new` computes, stored as the store does (its first 128 bits as a `uuid`;
//! recomputed in SQL, and checked against the crate after the fill),
//! the fingerprint is the one of the benchmark's small charge body, status `201`, two headers
//! (`content-type`, `request-id`) and a charge as the JSON body (about 190 to 400 bytes).
//! Record `n` is key `fill-<n>` of account `acct_<n % 16>`, so replays can pick any of them.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, StatusCode, Uri, header};
use http_body_util::Full;
use sqlx::{AssertSqlSafe, Row};
use tokio::{sync::watch, time::Instant};
use tower_idempotency::{
    Fingerprint, FingerprintMode, IdempotencyKey, Principal, ScopeKey, store::PostgresStore,
};

use crate::{
    BoxError,
    app::CHARGES_PATH,
    db::BenchDb,
    load::{self, ACCOUNTS, Answer, BodySize, FILLED_KEY_PREFIX},
    procfs,
    report::{format_bytes, format_micros, format_rate},
};

/// Records in the "empty" store: a handful for the replay scenarios to find.
pub(crate) const EMPTY_STORE_ROWS: u64 = 1_000;

/// The layer's default TTL: a filled record was created this long before it expires.
const TTL_SECS: f64 = 24.0 * 60.0 * 60.0;

/// Completed records expire between 1 h and 24 h from the fill: spread over the next day, and
/// none during a run, so every record a replay picks is still there.
const COMPLETED_FROM_SECS: f64 = 60.0 * 60.0;

/// The two tables a store may keep its records in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Table {
    /// `idempotency.records`, the default.
    Records,
    /// `idempotency.partitioned_records`, partitioned mode's.
    Partitioned,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Self::Records => "idempotency.records",
            Self::Partitioned => "idempotency.partitioned_records",
        }
    }
}

/// Which records a fill writes. Record `n` of `rows` expires at `from + spread × (n + jitter) /
/// rows`: as with a fixed TTL, records expire in the order they were written, so those that
/// expire together sit together in the heap (two workers write interleaved chunks).
struct FillSpec<'a> {
    table: Table,
    /// Keys are this prefix followed by the record's number.
    key_prefix: &'a str,
    /// Record numbers `0..rows`.
    rows: u64,
    /// `expires_at` is uniformly spread over `from .. from + spread` (Unix seconds).
    expires_from: f64,
    expires_spread: f64,
}

/// The `INSERT` of records `$1..$2` (see the module documentation).
fn fill_sql(table: Table) -> String {
    format!(
        r#"
INSERT INTO {table}
    (scope_key, fingerprint, token, takeover, created_at, expires_at, lease_until,
     completed_at, status, header_names, header_values, body)
SELECT
    encode(substring(sha256(convert_to('tower-idempotency/scope/v1', 'UTF8') || decode('00', 'hex')
        || int8send(octet_length(account)::int8) || convert_to(account, 'UTF8')
        || int8send(4) || convert_to('POST', 'UTF8')
        || int8send(octet_length($5::text)::int8) || convert_to($5::text, 'UTF8')
        || int8send(octet_length(key)::int8) || convert_to(key, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid,
    $3::bytea,
    nextval('idempotency.fencing_tokens'),
    false,
    expires_at - $8::float8 * interval '1 second',
    expires_at,
    NULL,
    expires_at - $8::float8 * interval '1 second' + interval '40 milliseconds',
    201,
    ARRAY['content-type', 'request-id'],
    ARRAY[convert_to('application/json', 'UTF8'), convert_to('req_' || substr(h, 1, 24), 'UTF8')],
    convert_to(format(
        '{{"id":"ch_%s","object":"charge","account":"%s","amount":%s,"currency":"usd",'
        '"description":"idempotency-bench fill","metadata":{{"order_id":"%s","note":"%s"}}}}',
        n, account, 50 + n % 100000, h, substr(repeat(h, 7), 1, ((n * 7919) % 200)::int)
    ), 'UTF8')
FROM (
    SELECT n,
           'acct_' || (n % $9::int8) AS account,
           $4::text || n AS key,
           md5(n::text) AS h,
           to_timestamp($6::float8 + $7::float8 * (n + random()) / $10::float8) AS expires_at
    FROM generate_series($1::int8, $2::int8 - 1) AS n
) AS fill
"#,
        table = table.name()
    )
}

/// The fingerprint the layer computes for the benchmark's small charge body: the one every
/// filled record carries, so that requests with that body replay them.
fn small_body_fingerprint() -> Fingerprint {
    Fingerprint::compute(
        FingerprintMode::Semantic,
        &Method::POST,
        &Uri::from_static(CHARGES_PATH),
        Some(&HeaderValue::from_static("application/json")),
        &BodySize::Small.bytes(),
    )
}

/// Writes the records of `spec` in chunks, over `workers` connections, printing progress
/// when `label` is given.
async fn fill(db: &BenchDb, spec: &FillSpec<'_>, label: Option<&str>) -> Result<(), BoxError> {
    const WORKERS: u32 = 2;
    let chunk = (spec.rows / 10).clamp(50_000, 1_000_000);
    let pool = db.pool(WORKERS).await?;
    let sql: Arc<str> = fill_sql(spec.table).into();
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let end = spec.rows;
    let fingerprint = small_body_fingerprint().as_bytes().to_vec();
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..WORKERS {
        let (pool, sql, next, done) = (
            pool.clone(),
            Arc::clone(&sql),
            Arc::clone(&next),
            Arc::clone(&done),
        );
        let (prefix, fingerprint) = (spec.key_prefix.to_owned(), fingerprint.clone());
        let (from, spread) = (spec.expires_from, spec.expires_spread);
        let label = label.map(str::to_owned);
        let total = spec.rows;
        tasks.spawn(async move {
            loop {
                let start = next.fetch_add(chunk, Ordering::Relaxed);
                if start >= end {
                    return Ok::<_, BoxError>(());
                }
                let stop = (start + chunk).min(end);
                sqlx::query(AssertSqlSafe(sql.to_string()))
                    .bind(i64::try_from(start)?)
                    .bind(i64::try_from(stop)?)
                    .bind(&fingerprint)
                    .bind(&prefix)
                    .bind(CHARGES_PATH)
                    .bind(from)
                    .bind(spread)
                    .bind(TTL_SECS)
                    .bind(ACCOUNTS as i64)
                    .bind(total as f64)
                    .execute(&pool)
                    .await?;
                let written = done.fetch_add(stop - start, Ordering::Relaxed) + (stop - start);
                if let Some(label) = &label {
                    eprintln!(
                        "  {label}: {} / {} records ({:.0}%), {:.0} s",
                        format_rate(written as f64),
                        format_rate(total as f64),
                        written as f64 * 100.0 / total.max(1) as f64,
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        });
    }
    let mut outcome = Ok(());
    while let Some(joined) = tasks.join_next().await {
        if let Err(error) = joined.map_err(BoxError::from).and_then(|r| r) {
            outcome = Err(error);
            tasks.abort_all();
        }
    }
    pool.close().await;
    outcome
}

/// The database's clock, in Unix seconds.
async fn db_now(db: &BenchDb) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
        .fetch_one(db.control())
        .await
}

/// `VACUUM ANALYZE` of `table`, then a checkpoint (best effort: it needs the right to), so
/// the measurement after it starts from the same WAL state whatever came before.
async fn settle(db: &BenchDb, table: Table) -> Result<Duration, BoxError> {
    let started = Instant::now();
    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM ANALYZE {}", table.name())))
        .execute(db.control())
        .await?;
    let _ = sqlx::raw_sql("CHECKPOINT").execute(db.control()).await;
    Ok(started.elapsed())
}

/// What a one-off fill did.
#[derive(Debug, Clone)]
pub(crate) struct FillReport {
    pub(crate) rows: u64,
    pub(crate) took: Duration,
    pub(crate) vacuum: Duration,
    pub(crate) sizes: Sizes,
}

impl FillReport {
    pub(crate) fn describe(&self, what: &str) -> String {
        format!(
            "{what}: {} completed records written by SQL in {:.1} s ({} records/s), \
             `VACUUM ANALYZE` + `CHECKPOINT` {:.1} s; {}",
            format_rate(self.rows as f64),
            self.took.as_secs_f64(),
            format_rate(self.rows as f64 / self.took.as_secs_f64().max(1e-9)),
            self.vacuum.as_secs_f64(),
            self.sizes,
        )
    }
}

/// Fills `db`'s `idempotency.records` with `rows` completed records that replays can find
/// (keys `fill-0` .. `fill-<rows - 1>`), vacuums, and checks a few against the crate's own
/// `ScopeKey`.
pub(crate) async fn fill_completed(
    db: &BenchDb,
    rows: u64,
    label: Option<&str>,
) -> Result<FillReport, BoxError> {
    let now = db_now(db).await?;
    let started = Instant::now();
    fill(
        db,
        &FillSpec {
            table: Table::Records,
            key_prefix: FILLED_KEY_PREFIX,
            rows,
            expires_from: now + COMPLETED_FROM_SECS,
            expires_spread: TTL_SECS - COMPLETED_FROM_SECS,
        },
        label,
    )
    .await?;
    let took = started.elapsed();
    let vacuum = settle(db, Table::Records).await?;
    verify_filled(db, rows).await?;
    Ok(FillReport {
        rows,
        took,
        vacuum,
        sizes: sizes(db, Table::Records).await?,
    })
}

/// Response body sizes the storage table reports on.
const PROBE_BODIES: [usize; 5] = [0, 256, 1024, 4096, 16384];

/// Records written per body size by [`record_sizes`].
const PROBE_ROWS: u64 = 20_000;

/// Bytes on disk per completed record, by response body size, as a markdown table (indented
/// to sit under a list item): for each size, [`PROBE_ROWS`] records with three response
/// headers (`content-type`, `request-id`, `location`) and a body of random bytes (nothing for
/// TOAST to compress: the worst case) go into a scratch copy of `idempotency.records` — same
/// columns, indexes and fillfactor — which is vacuumed, measured with
/// `pg_total_relation_size` and dropped.
pub(crate) async fn record_sizes(db: &BenchDb) -> Result<String, BoxError> {
    let mut out = String::from(
        "bytes on disk per completed record by response body size, indexes and TOAST \
         included (20,000 records each, three response headers, incompressible bodies; a \
         scratch copy of `idempotency.records`):\n\n  | response body | bytes per record | \
         per million records |\n  |--:|--:|--:|\n",
    );
    for body in PROBE_BODIES {
        sqlx::raw_sql(
            "DROP TABLE IF EXISTS idempotency.size_probe;
             CREATE TABLE idempotency.size_probe (LIKE idempotency.records INCLUDING ALL)
                 WITH (fillfactor = 80);",
        )
        .execute(db.control())
        .await?;
        sqlx::query(
            "INSERT INTO idempotency.size_probe
                 (scope_key, fingerprint, token, expires_at, lease_until, completed_at, status,
                  header_names, header_values, body)
             SELECT md5(int8send(n))::uuid, sha256(int8send(-n)), n,
                    now() + interval '1 day', NULL, now(), 200,
                    ARRAY['content-type', 'request-id', 'location'],
                    ARRAY[convert_to('application/json', 'UTF8'),
                          convert_to('req_' || substr(md5(n::text), 1, 24), 'UTF8'),
                          convert_to('/v1/charges/ch_' || substr(md5(n::text), 1, 24), 'UTF8')],
                    substr((SELECT coalesce(string_agg(decode(md5(n || ':' || i || random()), 'hex'), ''), '')
                            FROM generate_series(1, ($2::int8 + 15) / 16) AS i), 1, $2::int4)
             FROM generate_series(1, $1::int8) AS n",
        )
        .bind(PROBE_ROWS as i64)
        .bind(body as i64)
        .execute(db.control())
        .await?;
        sqlx::raw_sql("VACUUM ANALYZE idempotency.size_probe")
            .execute(db.control())
            .await?;
        let total: i64 =
            sqlx::query_scalar("SELECT pg_total_relation_size('idempotency.size_probe')")
                .fetch_one(db.control())
                .await?;
        let per_record = total as f64 / PROBE_ROWS as f64;
        let body = match body {
            0 => "none".to_owned(),
            1..1024 => format!("{body} B"),
            _ => format!("{} KiB", body / 1024),
        };
        out.push_str(&format!(
            "  | {body} | {} | {:.2} GB |\n",
            format_rate(per_record),
            per_record * 1e6 / 1e9,
        ));
    }
    sqlx::raw_sql("DROP TABLE idempotency.size_probe")
        .execute(db.control())
        .await?;
    Ok(out)
}

/// Checks that filled records are where the layer will look for them: the scope key and
/// fingerprint the crate computes for `fill-<n>` find record `n`.
async fn verify_filled(db: &BenchDb, rows: u64) -> Result<(), BoxError> {
    let fingerprint = small_body_fingerprint();
    for n in [0, rows / 2, rows.saturating_sub(1)] {
        let principal = Principal::new(load::account(n % ACCOUNTS as u64))?;
        let key = IdempotencyKey::new(format!("{FILLED_KEY_PREFIX}{n}"))
            .map_err(|e| format!("fill key: {e}"))?;
        let scope = ScopeKey::new(&principal, &Method::POST, CHARGES_PATH, &key);
        let stored: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT fingerprint FROM idempotency.records
             WHERE scope_key = encode(substring($1 FROM 1 FOR 16), 'hex')::uuid AND status = 201",
        )
        .bind(scope.as_bytes().as_slice())
        .fetch_optional(db.control())
        .await?;
        match stored {
            Some(stored) if stored == fingerprint.as_bytes() => {}
            Some(_) => return Err(format!("filled record {n} has another fingerprint").into()),
            None => {
                return Err(format!(
                    "filled record {n} is not where ScopeKey::new puts it: the fill's SQL \
                     and the crate's scope key disagree"
                )
                .into());
            }
        }
    }
    Ok(())
}

/// The size on disk of a record table (all its partitions, for a partitioned one).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub(crate) total: u64,
    pub(crate) heap: u64,
    pub(crate) indexes: u64,
    pub(crate) rows: u64,
}

impl std::fmt::Display for Sizes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`pg_total_relation_size` {} (heap {}, indexes {}, TOAST and the rest {}), {} \
             bytes per record",
            format_bytes(self.total as f64),
            format_bytes(self.heap as f64),
            format_bytes(self.indexes as f64),
            format_bytes(self.total.saturating_sub(self.heap + self.indexes) as f64),
            format_rate(self.total as f64 / self.rows.max(1) as f64),
        )
    }
}

/// `pg_total_relation_size` and friends of `table`, summed over its partitions (a plain table
/// has none: `pg_partition_tree` lists nothing for it, hence the `UNION` with itself).
pub(crate) async fn sizes(db: &BenchDb, table: Table) -> Result<Sizes, sqlx::Error> {
    let row = sqlx::query(
        "SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::int8,
                coalesce(sum(pg_relation_size(relid)), 0)::int8,
                coalesce(sum(pg_indexes_size(relid)), 0)::int8,
                coalesce(sum(greatest(c.reltuples, 0)), 0)::int8
         FROM (SELECT relid FROM pg_partition_tree($1::regclass) UNION SELECT $1::regclass) t
         JOIN pg_class c ON c.oid = t.relid",
    )
    .bind(table.name())
    .fetch_one(db.control())
    .await?;
    let get = |i: usize| -> Result<u64, sqlx::Error> {
        Ok(u64::try_from(row.try_get::<i64, _>(i)?).unwrap_or(0))
    };
    Ok(Sizes {
        total: get(0)?,
        heap: get(1)?,
        indexes: get(2)?,
        rows: get(3)?,
    })
}

/// Keys of expired records are `expired-<generation>-<n>`: a new generation per restore.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Expired records in `table` (past their `expires_at`).
async fn count_expired(db: &BenchDb, table: Table) -> Result<u64, sqlx::Error> {
    let count: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE expires_at <= now()",
        table.name()
    )))
    .fetch_one(db.control())
    .await?;
    Ok(u64::try_from(count).unwrap_or(0))
}

/// Tops `idempotency.records` up to `target` expired records (completed records whose 24 h
/// TTL ran out during the last hour), then `VACUUM ANALYZE` and `CHECKPOINT`, so every expiry
/// measurement starts from the same table: `target` expired records, no dead rows.
pub(crate) async fn restore_expired(db: &BenchDb, target: u64) -> Result<String, BoxError> {
    let present = count_expired(db, Table::Records).await?;
    let missing = target.saturating_sub(present);
    let started = Instant::now();
    if missing > 0 {
        let now = db_now(db).await?;
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
        fill(
            db,
            &FillSpec {
                table: Table::Records,
                key_prefix: &format!("expired-{generation}-"),
                rows: missing,
                expires_from: now - 3_600.0,
                expires_spread: 3_590.0,
            },
            None,
        )
        .await?;
    }
    let inserted = started.elapsed();
    let vacuum = settle(db, Table::Records).await?;
    Ok(format!(
        "before: {} expired records ({} put back in {:.1} s), `VACUUM ANALYZE` + `CHECKPOINT` \
         {:.1} s",
        format_rate(target.max(present) as f64),
        format_rate(missing as f64),
        inserted.as_secs_f64(),
        vacuum.as_secs_f64()
    ))
}

/// How many expired partitions the partitioned scenarios spread their expired records over.
pub(crate) const EXPIRED_PARTITIONS: u64 = 4;

/// Partitioned mode's counterpart of [`restore_expired`]: creates the partitions ahead (with
/// the store's own `maintain_partitions`) and `EXPIRED_PARTITIONS` partitions of `width`
/// that ended before now, named as the store names its own so that its expiry drops them,
/// and tops them up to `target` expired records.
pub(crate) async fn restore_expired_partitions(
    db: &BenchDb,
    target: u64,
    width: Duration,
) -> Result<String, BoxError> {
    let store = PostgresStore::new(db.control().clone()).partitioned(width);
    store.maintain_partitions().await?;
    let width = width.as_secs().max(1);
    let now = db_now(db).await?;
    let current = (now as u64 / width) * width;
    let first = current - EXPIRED_PARTITIONS * width;
    for k in 0..EXPIRED_PARTITIONS {
        let (start, end) = (first + k * width, first + (k + 1) * width);
        let name = format!("partitioned_records_{start}_{end}");
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(format!("idempotency.{name}"))
            .fetch_one(db.control())
            .await?;
        if !exists {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE TABLE idempotency.{name} (LIKE idempotency.partitioned_records INCLUDING ALL);
                 ALTER TABLE idempotency.partitioned_records ATTACH PARTITION idempotency.{name}
                     FOR VALUES FROM (to_timestamp({start})) TO (to_timestamp({end}))"
            )))
            .execute(db.control())
            .await?;
        }
    }
    let present = count_expired(db, Table::Partitioned).await?;
    let missing = target.saturating_sub(present);
    let started = Instant::now();
    if missing > 0 {
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
        fill(
            db,
            &FillSpec {
                table: Table::Partitioned,
                key_prefix: &format!("expired-{generation}-"),
                rows: missing,
                expires_from: first as f64,
                expires_spread: (EXPIRED_PARTITIONS * width) as f64 - 1.0,
            },
            None,
        )
        .await?;
    }
    let inserted = started.elapsed();
    let vacuum = settle(db, Table::Partitioned).await?;
    Ok(format!(
        "before: {} expired records in {EXPIRED_PARTITIONS} expired partitions of {} h ({} put \
         back in {:.1} s), `VACUUM ANALYZE` + `CHECKPOINT` {:.1} s",
        format_rate(target.max(present) as f64),
        width / 3600,
        format_rate(missing as f64),
        inserted.as_secs_f64(),
        vacuum.as_secs_f64()
    ))
}

/// Expired records still in `table`, after a reaping measurement.
pub(crate) async fn expired_left(db: &BenchDb, table: Table) -> Result<u64, sqlx::Error> {
    count_expired(db, table).await
}

/// Where the server's WAL and the database's block counters stand.
#[derive(Debug, Clone)]
pub(crate) struct Counters {
    lsn: String,
    blks_read: i64,
    blks_hit: i64,
    /// Updates of the store's records, and of those the HOT ones (`pg_stat_user_tables`).
    updates: i64,
    hot_updates: i64,
    /// The machine's disk reads: count, bytes.
    disk: Option<(u64, u64)>,
}

/// The counters now, if they can be read.
pub(crate) async fn snapshot(db: &BenchDb) -> Option<Counters> {
    counters(db).await.ok()
}

async fn counters(db: &BenchDb) -> Result<Counters, sqlx::Error> {
    let row = sqlx::query(
        "SELECT pg_current_wal_lsn()::text, blks_read, blks_hit, updates, hot_updates
         FROM pg_stat_database,
              (SELECT coalesce(sum(n_tup_upd), 0)::int8 AS updates,
                      coalesce(sum(n_tup_hot_upd), 0)::int8 AS hot_updates
               FROM pg_stat_user_tables WHERE schemaname = 'idempotency') AS records
         WHERE datname = current_database()",
    )
    .fetch_one(db.control())
    .await?;
    Ok(Counters {
        lsn: row.try_get(0)?,
        blks_read: row.try_get(1)?,
        blks_hit: row.try_get(2)?,
        updates: row.try_get(3)?,
        hot_updates: row.try_get(4)?,
        disk: procfs::disk_reads(),
    })
}

/// Makes `pg_walinspect` available in `db`, if this server has it and lets the benchmark
/// create it; says whether it is.
pub(crate) async fn enable_wal_inspection(db: &BenchDb) -> bool {
    sqlx::raw_sql("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        .execute(db.control())
        .await
        .is_ok()
}

/// A window being watched: its start, and a temporary replication slot that keeps the
/// window's WAL from being recycled (by a checkpoint) before it is read back.
pub(crate) struct WalWatch {
    start: Counters,
    slot: Option<String>,
}

/// Starts watching the database's activity (call when the window opens).
pub(crate) async fn watch(db: &BenchDb) -> Option<WalWatch> {
    let slot = format!("{}_wal", db.name());
    // Temporary: it goes with the benchmark's connection, whatever happens.
    let slot = sqlx::query("SELECT pg_create_physical_replication_slot($1, true, true)")
        .bind(&slot)
        .execute(db.control())
        .await
        .ok()
        .map(|_| slot);
    Some(WalWatch {
        start: counters(db).await.ok()?,
        slot,
    })
}

/// What the database did during a window.
#[derive(Debug, Clone, Default)]
pub(crate) struct DbDelta {
    /// WAL written by the whole server (`pg_wal_lsn_diff` of `pg_current_wal_lsn()`): other
    /// databases' included.
    pub(crate) server_wal: u64,
    /// The WAL records of this database's relations, read back with `pg_walinspect` (commit
    /// records, which name no relation, are left out): bytes, of which full-page images,
    /// and the relations that wrote most.
    pub(crate) own_wal: Option<OwnWal>,
    /// Blocks the database's backends found in `shared_buffers`, and read from outside it (the
    /// OS page cache or the disk), from `pg_stat_database` (which backends update at most once
    /// a second: approximate at both ends).
    pub(crate) blks_hit: u64,
    pub(crate) blks_read: u64,
    /// Updates of the store's records (completions, renewals, takeovers), and how many of
    /// them were HOT: the new version stayed on its page and no index entry was written
    /// (`pg_stat_user_tables`, approximate like the blocks).
    pub(crate) updates: u64,
    pub(crate) hot_updates: u64,
    /// Reads the machine's disks completed, and bytes (`/proc/diskstats`): whether the blocks
    /// read from outside `shared_buffers` came from the OS page cache or the disk.
    pub(crate) disk: Option<(u64, u64)>,
}

/// The WAL of one database's relations over a window.
#[derive(Debug, Clone, Default)]
pub(crate) struct OwnWal {
    pub(crate) bytes: u64,
    pub(crate) fpi_bytes: u64,
    pub(crate) records: u64,
    /// Relation, bytes, full-page image bytes; largest first.
    pub(crate) relations: Vec<(String, u64, u64)>,
}

impl DbDelta {
    /// The WAL this database wrote, as well as it is known.
    pub(crate) fn wal_bytes(&self) -> u64 {
        self.own_wal
            .as_ref()
            .map_or(self.server_wal, |own| own.bytes)
    }

    pub(crate) fn describe(&self, requests: u64, window: Duration) -> String {
        let secs = window.as_secs_f64().max(1e-9);
        let per_request = |n: u64| n as f64 / requests.max(1) as f64;
        let mut out = format!(
            "WAL: {} server-wide ({}/s, other databases' included)",
            format_bytes(self.server_wal as f64),
            format_bytes(self.server_wal as f64 / secs),
        );
        if let Some(own) = &self.own_wal {
            let share = |part: u64, of: u64| part as f64 * 100.0 / of.max(1) as f64;
            let mut relations: Vec<String> = own
                .relations
                .iter()
                .take(4)
                .map(|(name, bytes, fpi)| {
                    format!(
                        "{name} {} ({:.0}% full-page images)",
                        format_bytes(*bytes as f64),
                        share(*fpi, *bytes)
                    )
                })
                .collect();
            if relations.is_empty() {
                relations.push("none".to_owned());
            }
            out.push_str(&format!(
                "; this database's relations: {} ({}/s, {:.1} KiB per request, {} records), \
                 {:.0}% of it full-page images; by relation: {}",
                format_bytes(own.bytes as f64),
                format_bytes(own.bytes as f64 / secs),
                per_request(own.bytes) / 1024.0,
                format_rate(own.records as f64),
                share(own.fpi_bytes, own.bytes),
                relations.join(", "),
            ));
        }
        if window >= Duration::from_secs(3) {
            out.push_str(&format!(
                ". Blocks per request (`pg_stat_database`, approximate): {:.1} found in \
                 `shared_buffers`, {:.2} read from outside it",
                per_request(self.blks_hit),
                per_request(self.blks_read),
            ));
            if let Some((reads, bytes)) = self.disk {
                out.push_str(&format!(
                    "; the machine's disks read {} ({:.0} reads/s, {:.2} per request)",
                    format_bytes(bytes as f64),
                    reads as f64 / window.as_secs_f64().max(1e-9),
                    per_request(reads),
                ));
            }
            if self.updates > 0 {
                out.push_str(&format!(
                    ". Record updates HOT (`pg_stat_user_tables`, approximate): {:.0}% of {}",
                    self.hot_updates as f64 * 100.0 / self.updates as f64,
                    format_rate(self.updates as f64),
                ));
            }
        }
        out
    }
}

/// What the database did from `watch`'s start to `end`; reads that WAL back when
/// `pg_walinspect` is enabled, and lets the slot go.
pub(crate) async fn finish(
    db: &BenchDb,
    watch: WalWatch,
    end: Option<Counters>,
    inspect: bool,
) -> Option<DbDelta> {
    let mut delta = None;
    if let Some(end) = end {
        let wal: Option<i64> =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::int8")
                .bind(&end.lsn)
                .bind(&watch.start.lsn)
                .fetch_one(db.control())
                .await
                .ok();
        let own_wal = if inspect {
            own_wal(db, &watch.start.lsn, &end.lsn).await.ok()
        } else {
            None
        };
        delta = Some(DbDelta {
            server_wal: wal.map_or(0, |w| u64::try_from(w).unwrap_or(0)),
            own_wal,
            blks_read: u64::try_from(end.blks_read - watch.start.blks_read).unwrap_or(0),
            blks_hit: u64::try_from(end.blks_hit - watch.start.blks_hit).unwrap_or(0),
            updates: u64::try_from(end.updates - watch.start.updates).unwrap_or(0),
            hot_updates: u64::try_from(end.hot_updates - watch.start.hot_updates).unwrap_or(0),
            disk: end
                .disk
                .zip(watch.start.disk)
                .map(|(end, start)| (end.0.saturating_sub(start.0), end.1.saturating_sub(start.1))),
        });
    }
    if let Some(slot) = watch.slot {
        let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(slot)
            .execute(db.control())
            .await;
    }
    delta
}

/// The WAL records between `from` and `to` that touch this database's relations, by
/// relation (the first block a record references).
async fn own_wal(db: &BenchDb, from: &str, to: &str) -> Result<OwnWal, sqlx::Error> {
    let rows = sqlx::query(
        r"WITH own AS (
              SELECT record_length, fpi_length,
                     substring(block_ref FROM 'rel [0-9]+/[0-9]+/([0-9]+)')::oid AS filenode
              FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)
              WHERE block_ref ~ ('rel [0-9]+/'
                  || (SELECT oid FROM pg_database WHERE datname = current_database())::text
                  || '/')
          )
          SELECT coalesce(pg_filenode_relation(0, filenode)::text, 'relfilenode ' || filenode),
                 sum(record_length)::int8, sum(fpi_length)::int8, count(*)::int8
          FROM own GROUP BY 1 ORDER BY 2 DESC",
    )
    .bind(from)
    .bind(to)
    .fetch_all(db.control())
    .await?;
    let mut own = OwnWal::default();
    for row in rows {
        let (name, bytes, fpi, records): (String, i64, i64, i64) = (
            row.try_get(0)?,
            row.try_get(1)?,
            row.try_get(2)?,
            row.try_get(3)?,
        );
        let (bytes, fpi) = (
            u64::try_from(bytes).unwrap_or(0),
            u64::try_from(fpi).unwrap_or(0),
        );
        own.bytes += bytes;
        own.fpi_bytes += fpi;
        own.records += u64::try_from(records).unwrap_or(0);
        own.relations.push((
            name.trim_start_matches("idempotency.").to_owned(),
            bytes,
            fpi,
        ));
    }
    Ok(own)
}

/// What sampling `pg_stat_activity` during a reaping measurement saw.
#[derive(Debug, Clone, Default)]
pub(crate) struct LockSamples {
    pub(crate) samples: u64,
    /// Samples in which some non-reaping backend of the database waited on a lock, and the
    /// most such backends at once.
    pub(crate) samples_with_waiters: u64,
    pub(crate) max_waiters: u64,
    /// The lock wait events seen (`transactionid`, `relation`, ...), of anyone.
    pub(crate) wait_events: Vec<String>,
    /// Samples in which the reaper itself waited on a lock.
    pub(crate) reaper_waiting: u64,
    /// Per kind of reaping statement, the longest one was seen running, in seconds.
    pub(crate) longest: Vec<(String, f64)>,
}

impl LockSamples {
    pub(crate) fn describe(&self, every: Duration) -> String {
        let events = if self.wait_events.is_empty() {
            "none".to_owned()
        } else {
            self.wait_events.join(", ")
        };
        let longest = if self.longest.is_empty() {
            "none seen".to_owned()
        } else {
            self.longest
                .iter()
                .map(|(kind, secs)| format!("{kind} {}", format_micros(secs * 1e6)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "`pg_stat_activity` every {} ms ({} samples): live traffic waiting on a lock in {} \
             samples (at most {} backends at once), the reaper waiting on a lock in {}; lock \
             waits seen: {events}; longest reaping statements seen running: {longest}",
            every.as_millis(),
            self.samples,
            self.samples_with_waiters,
            self.max_waiters,
            self.reaper_waiting,
        )
    }
}

/// How often [`sample_locks`] looks.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// Samples the database's backends every [`SAMPLE_EVERY`] until `stop` turns true or
/// `deadline`: who waits on a heavyweight lock, and how long reaping statements run — the row
/// store's batch `DELETE`, and partitioned mode's partition `DETACH`, row count, `DROP` and
/// catalog reads.
pub(crate) async fn sample_locks(
    db: &BenchDb,
    mut stop: watch::Receiver<bool>,
    deadline: Instant,
) -> LockSamples {
    const QUERY: &str = r#"
        WITH backends AS (
            SELECT wait_event_type, wait_event, state, query_start,
                   CASE
                       WHEN query ILIKE '%DELETE FROM idempotency.records%' THEN 'batch DELETE'
                       WHEN query ILIKE '%DETACH PARTITION%' THEN 'DETACH PARTITION'
                       WHEN query ILIKE 'SELECT count(*) FROM idempotency.%' THEN 'count(*) of a partition'
                       WHEN query ILIKE '%DROP TABLE IF EXISTS idempotency.%' THEN 'DROP TABLE'
                       WHEN query ILIKE '%ATTACH PARTITION%' THEN 'ATTACH PARTITION'
                       WHEN query ILIKE '%pg_inherits%' THEN 'partition catalog'
                   END AS reaping
            FROM pg_stat_activity
            WHERE datname = current_database() AND pid <> pg_backend_pid()
        )
        SELECT count(*) FILTER (WHERE wait_event_type = 'Lock' AND reaping IS NULL)::int8,
               count(*) FILTER (WHERE wait_event_type = 'Lock' AND reaping IS NOT NULL)::int8,
               coalesce(string_agg(DISTINCT wait_event, ',')
                   FILTER (WHERE wait_event_type = 'Lock'), ''),
               coalesce(string_agg(reaping || '=' ||
                   extract(epoch FROM clock_timestamp() - query_start)::text, ';')
                   FILTER (WHERE state = 'active' AND reaping IS NOT NULL), '')
        FROM backends
    "#;
    let mut samples = LockSamples::default();
    let mut events = std::collections::BTreeSet::new();
    let mut longest: Vec<(String, f64)> = Vec::new();
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|stopped| *stopped) => break,
            _ = tokio::time::sleep_until(deadline) => break,
        }
        let Ok(row) = sqlx::query(QUERY).fetch_one(db.control()).await else {
            continue;
        };
        let waiting: i64 = row.try_get(0).unwrap_or(0);
        let reaper: i64 = row.try_get(1).unwrap_or(0);
        let seen: String = row.try_get(2).unwrap_or_default();
        let running: String = row.try_get(3).unwrap_or_default();
        samples.samples += 1;
        if waiting > 0 {
            samples.samples_with_waiters += 1;
            samples.max_waiters = samples.max_waiters.max(waiting as u64);
        }
        if reaper > 0 {
            samples.reaper_waiting += 1;
        }
        events.extend(seen.split(',').filter(|e| !e.is_empty()).map(str::to_owned));
        for (kind, secs) in running.split(';').filter_map(|r| r.split_once('=')) {
            let secs: f64 = secs.parse().unwrap_or(0.0);
            match longest.iter_mut().find(|(k, _)| k == kind) {
                Some((_, max)) => *max = max.max(secs),
                None => longest.push((kind.to_owned(), secs)),
            }
        }
    }
    samples.wait_events = events.into_iter().collect();
    samples.longest = longest;
    samples
}

/// The outcome of a duplicate burst: what it did, and what went wrong (nothing, when every
/// key ran once).
#[derive(Debug, Default)]
pub(crate) struct Burst {
    pub(crate) summary: String,
    pub(crate) failures: Vec<String>,
}

/// How long a duplicate keeps retrying a `409` (in flight) before the key counts as failed.
const BURST_RETRY_FOR: Duration = Duration::from_secs(10);
const BURST_RETRY_EVERY: Duration = Duration::from_millis(20);
/// Keys in flight at once.
const BURST_WORKERS: usize = 16;

/// Sends each of `keys` keys to every server at once (one request per server, concurrently),
/// retrying `409 in flight` answers until they are replays, then checks that every key ran
/// exactly once: one `201` without `Idempotent-Replayed` per key, the same body on every
/// server, and exactly one row in `charges` per key (each key is charged to an account of its
/// own, `dup_<run>_<key>`).
pub(crate) async fn duplicate_burst(
    addrs: &[std::net::SocketAddr],
    db: &BenchDb,
    keys: usize,
) -> Result<Burst, BoxError> {
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let account = move |k: usize| format!("dup_{nonce:x}_{k}");
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..BURST_WORKERS.min(keys.max(1)) {
        let addrs = addrs.to_vec();
        tasks.spawn(async move {
            let mut senders = Vec::with_capacity(addrs.len());
            for addr in &addrs {
                senders.push(Some(load::connect(*addr).await?));
            }
            let mut outcomes = Vec::new();
            for k in (worker..keys).step_by(BURST_WORKERS) {
                outcomes.push((k, one_key(&addrs, &mut senders, &account(k), k).await));
            }
            Ok::<_, BoxError>(outcomes)
        });
    }
    let mut failures = Vec::new();
    let mut after_409 = 0_u64;
    let mut answered = 0_u64;
    while let Some(joined) = tasks.join_next().await {
        for (k, outcome) in joined?? {
            match outcome {
                Ok(retried) => {
                    after_409 += retried;
                    answered += addrs.len() as u64;
                }
                Err(error) => failures.push(format!("key {k}: {error}")),
            }
        }
    }
    let took = started.elapsed();

    // The database's word: one charge per key.
    let rows =
        sqlx::query("SELECT account, count(*) FROM charges WHERE account LIKE $1 GROUP BY account")
            .bind(format!("dup\\_{nonce:x}\\_%"))
            .fetch_all(db.control())
            .await?;
    let mut charged: HashMap<String, i64> = HashMap::with_capacity(rows.len());
    for row in rows {
        charged.insert(row.try_get(0)?, row.try_get(1)?);
    }
    let mut executions = 0_i64;
    let (mut never, mut twice) = (0_usize, 0_usize);
    for k in 0..keys {
        let count = charged.get(&account(k)).copied().unwrap_or(0);
        executions += count;
        match count {
            1 => {}
            0 => {
                never += 1;
                if never <= 5 {
                    failures.push(format!("key {k}: no charge in the database"));
                }
            }
            n => {
                twice += 1;
                if twice <= 5 {
                    failures.push(format!("key {k}: charged {n} times"));
                }
            }
        }
    }
    if twice > 0 {
        failures.insert(
            0,
            format!("{twice} of {keys} keys EXECUTED MORE THAN ONCE across instances"),
        );
    }
    if never > 0 {
        failures.push(format!("{never} of {keys} keys never executed"));
    }
    Ok(Burst {
        summary: format!(
            "duplicate burst: {keys} keys, each sent to all {} instances at once ({} requests, \
             {:.1} s): {} charges in the database ({}), {} answers were a `409 in flight` \
             retried into a replay; every key's answers {}",
            addrs.len(),
            format_rate(answered as f64),
            took.as_secs_f64(),
            executions,
            if never == 0 && twice == 0 {
                "one per key".to_owned()
            } else {
                format!("{twice} keys more than once, {never} never")
            },
            after_409,
            if failures.is_empty() {
                "identical (one `201` executed, the others replays of it)"
            } else {
                "checked: see the failures"
            },
        ),
        failures,
    })
}

/// Sends key `k` to every server at once and retries `409`s; checks the answers agree.
/// Returns how many answers needed a retry.
async fn one_key(
    addrs: &[std::net::SocketAddr],
    senders: &mut [Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>],
    account: &str,
    k: usize,
) -> Result<u64, String> {
    let body = BodySize::Small.bytes();
    let request = |addr: std::net::SocketAddr| {
        Request::post(CHARGES_PATH)
            .header(header::HOST, addr.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::AUTHORIZATION, format!("Bearer {account}"))
            .header("idempotency-key", format!("dup-{k}"))
            .body(Full::new(body.clone()))
            .expect("a valid request")
    };
    // Every server at once: each sender moves into a task of its own and comes back with its
    // answer.
    let mut inflight = tokio::task::JoinSet::new();
    for (i, slot) in senders.iter_mut().enumerate() {
        let Some(mut sender) = slot.take() else {
            return Err("connection lost".to_owned());
        };
        let request = request(addrs[i]);
        inflight.spawn(async move {
            let answer = load::exchange(&mut sender, request).await;
            (i, sender, answer)
        });
    }
    let mut answers: Vec<Option<Answer>> = (0..addrs.len()).map(|_| None).collect();
    while let Some(joined) = inflight.join_next().await {
        let (i, sender, answer) = joined.map_err(|e| e.to_string())?;
        senders[i] = Some(sender);
        answers[i] = Some(answer.map_err(|e| format!("server {i}: {e}"))?);
    }
    let mut retried = 0;
    for (i, answer) in answers.iter_mut().enumerate() {
        let deadline = Instant::now() + BURST_RETRY_FOR;
        while answer
            .as_ref()
            .is_some_and(|a| a.status == StatusCode::CONFLICT)
        {
            if Instant::now() > deadline {
                return Err(format!(
                    "server {i}: still in flight after {BURST_RETRY_FOR:?}"
                ));
            }
            retried += 1;
            tokio::time::sleep(BURST_RETRY_EVERY).await;
            let sender = senders[i].as_mut().ok_or("connection lost")?;
            *answer = Some(
                load::exchange(sender, request(addrs[i]))
                    .await
                    .map_err(|e| format!("server {i}: {e}"))?,
            );
        }
    }
    let answers: Vec<Answer> = answers.into_iter().flatten().collect();
    if let Some(bad) = answers.iter().find(|a| a.status != StatusCode::CREATED) {
        return Err(format!(
            "answered {}: {}",
            bad.status,
            String::from_utf8_lossy(&bad.body[..bad.body.len().min(200)])
        ));
    }
    let executed = answers.iter().filter(|a| !a.replayed).count();
    if executed != 1 {
        return Err(format!(
            "{executed} of {} answers were executions, not replays",
            answers.len()
        ));
    }
    if answers.iter().any(|a| a.body != answers[0].body) {
        return Err("the servers' answers differ".to_owned());
    }
    Ok(retried)
}
