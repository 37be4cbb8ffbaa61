//! The expired records put back before each expiry measurement, in the plain table or in
//! expired partitions, so every measurement starts from the same table.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use sqlx::AssertSqlSafe;
use tokio::time::Instant;
use tower_idempotency::store::PostgresStore;

use super::{
    Table, db_now,
    fill::{FillSpec, fill},
    settle,
};
use crate::{BoxError, db::BenchDb, report::format_rate};

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
    let store = PostgresStore::new(db.control().clone()).partitioned(width)?;
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
