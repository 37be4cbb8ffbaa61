//! The scale scenarios' work on the database (issue 7), by concern:
//!
//! - [`fill`]: a store filled with completed records by SQL, never through HTTP;
//! - [`sizes`]: a record table's size on disk, and the bytes a record takes by body size;
//! - [`expired`]: the expired records (or partitions) put back before each expiry measurement;
//! - [`activity`]: the database's WAL, blocks and updates over a window;
//! - [`locks`]: lock waits sampled while the reaper runs;
//! - [`burst`]: the cross-instance duplicate burst.

mod activity;
mod burst;
mod expired;
mod fill;
mod locks;
mod sizes;

use std::time::Duration;

use sqlx::AssertSqlSafe;
use tokio::time::Instant;

use crate::{BoxError, db::BenchDb};

pub(crate) use self::{
    activity::{DbDelta, enable_wal_inspection, finish, snapshot, watch},
    burst::duplicate_burst,
    expired::{expired_left, restore_expired, restore_expired_partitions},
    fill::{EMPTY_STORE_ROWS, fill_completed},
    locks::{LockSamples, SAMPLE_EVERY, sample_locks},
    sizes::record_sizes,
};

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
