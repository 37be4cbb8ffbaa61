//! Deleting expired records in bounded batches (partitioned mode drops whole partitions).

use std::sync::atomic::Ordering;

use sqlx::Row;

use super::{
    PostgresStore, PostgresStoreError,
    statement::{Param, Statement},
};
use crate::store::ExpiredDeletion;

/// One batch of expiry: the oldest expired records from `$2` (microseconds since the Unix
/// epoch) on. Bounded and non-blocking: rows another transaction has locked are skipped, not
/// waited for. The lower bound lets a drain's batches start where the previous one stopped
/// instead of walking, every time, the index entries of the rows already deleted (they stay in
/// the index until vacuum). The rows are deleted by the physical addresses (`ctid`) the inner
/// query locked, not looked up again by key: a lock pins its row version, so the address still
/// names the row when the `DELETE` reaches it, and the batch costs no probe of the primary key.
/// Returns the count and the newest
/// `expires_at` deleted.
pub(super) const DELETE_EXPIRED: &str = r#"
WITH gone AS (
    DELETE FROM idempotency.records
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM idempotency.records
        WHERE expires_at >= timestamptz 'epoch' + $2::int8 * interval '1 microsecond'
          AND expires_at <= now()
        ORDER BY expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING expires_at
)
SELECT count(*)::int8 AS deleted,
       (extract(epoch FROM max(expires_at)) * 1000000)::int8 AS newest
FROM gone
"#;

impl ExpiredDeletion for PostgresStore {
    /// Deletes at most `batch` expired records; in partitioned mode, runs
    /// [`maintain_partitions`](PostgresStore::maintain_partitions) instead (whole partitions,
    /// whatever their size) and returns the records they held. Then deletes at most `batch`
    /// expired steps and at most `batch` kept requests no longer pending, and returns the largest
    /// count, so the loop goes on while any is backlogged.
    async fn delete_expired(&self, batch: u32) -> Result<u64, PostgresStoreError> {
        let records = self.delete_expired_records(batch).await?;
        let steps = self.delete_expired_steps(batch).await?;
        let pending = self.purge_pending(batch).await?;
        Ok(records.max(steps).max(pending))
    }
}

impl PostgresStore {
    /// [`ExpiredDeletion::delete_expired`] for the records alone.
    async fn delete_expired_records(&self, batch: u32) -> Result<u64, PostgresStoreError> {
        if self.partitions.is_some() {
            return Ok(self.maintain_partitions().await?.rows_dropped);
        }
        let from = self.expiry_cursor.load(Ordering::Relaxed);
        let row = self
            .timed(
                "delete_expired",
                Statement::new(DELETE_EXPIRED)
                    .with(Param::Int(i64::from(batch)))
                    .with(Param::Int(from))
                    .fetch_optional(self.prepared, &self.pool),
            )
            .await?
            .ok_or_else(|| PostgresStoreError::Corrupt("expiry returned no row".to_owned()))?;
        let deleted = u64::try_from(row.try_get::<i64, _>("deleted")?).unwrap_or(0);
        let newest: Option<i64> = row.try_get("newest")?;
        // A full batch: the next one starts from the newest record deleted. A short one ends
        // the drain, and the next starts from the beginning.
        let next = match newest {
            Some(newest) if deleted >= u64::from(batch) => newest,
            _ => 0,
        };
        self.expiry_cursor.store(next, Ordering::Relaxed);
        Ok(deleted)
    }
}
