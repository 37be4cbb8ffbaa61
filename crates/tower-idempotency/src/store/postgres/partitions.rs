//! Partitioned mode's upkeep: partitions created ahead, expired ones detached and dropped.

use std::time::Duration;

use sqlx::{AssertSqlSafe, Row};

use super::{PostgresStore, PostgresStoreError};

/// Partitioned mode's settings.
#[derive(Clone, Copy, Debug)]
pub(super) struct Partitioning {
    pub(super) width: Duration,
    pub(super) ahead: Duration,
}

impl PostgresStore {
    /// Partitioned mode's upkeep: creates the partitions the next
    /// [`with_partitions_ahead`](Self::with_partitions_ahead) need, and detaches and drops
    /// those whose every record has expired. [`delete_expired`](crate::store::ExpiredDeletion::delete_expired)
    /// runs it, so the expiry loop is all an application needs; a no-op in the other modes.
    ///
    /// Safe to run from many instances at once. It never blocks claims for long: partitions are
    /// attached (not created in place) under a short `lock_timeout`, and detached `CONCURRENTLY`;
    /// a step that cannot get its lock is left for the next run.
    ///
    /// # Errors
    ///
    /// When the catalog cannot be read; failures of single steps are logged and skipped.
    pub async fn maintain_partitions(&self) -> Result<PartitionMaintenance, PostgresStoreError> {
        let mut report = PartitionMaintenance::default();
        let Some(partitioning) = self.partitions else {
            return Ok(report);
        };
        let width = partitioning.width.as_secs().max(1) as i64;
        let existing = self.partitions().await?;
        let now: f64 = self
            .timed(
                "maintain_partitions",
                sqlx::raw_sql("SELECT extract(epoch FROM now())::float8").fetch_one(&self.pool),
            )
            .await?
            .try_get(0)?;
        let now = now as i64;

        // Behind: finish a detach an earlier run started, then detach and drop what expired.
        for partition in existing.iter().filter(|p| p.end <= now) {
            match self.drop_partition(partition).await {
                Ok(rows) => {
                    report.dropped += 1;
                    report.rows_dropped += rows;
                }
                Err(error) => tracing::warn!(
                    partition = %partition.name(),
                    error = %error,
                    "could not drop an expired idempotency partition; retrying next run"
                ),
            }
        }

        // Ahead: whatever is not yet covered up to `ahead` from now.
        let horizon = now + partitioning.ahead.as_secs() as i64;
        for partition in partitions_to_create(&existing, now, horizon, width) {
            match self.create_partition(&partition).await {
                Ok(()) => report.created += 1,
                Err(error) => tracing::warn!(
                    partition = %partition.name(),
                    error = %crate::chain::Chain(&error),
                    "could not create an idempotency partition; retrying next run"
                ),
            }
        }
        Ok(report)
    }

    /// The partitions of `idempotency.partitioned_records`, from their names.
    pub(super) async fn partitions(&self) -> Result<Vec<Partition>, PostgresStoreError> {
        let rows = self
            .timed(
                "maintain_partitions",
                sqlx::raw_sql(
                    "SELECT c.relname, i.inhdetachpending
                     FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                     WHERE i.inhparent = 'idempotency.partitioned_records'::regclass",
                )
                .fetch_all(&self.pool),
            )
            .await?;
        let mut partitions = Vec::with_capacity(rows.len());
        for row in rows {
            let name: String = row.try_get(0)?;
            let detaching: bool = row.try_get(1)?;
            match Partition::parse(&name, detaching) {
                Some(partition) => partitions.push(partition),
                None => {
                    tracing::warn!(partition = %name, "ignoring a partition the store did not name")
                }
            }
        }
        Ok(partitions)
    }

    pub(super) async fn create_partition(
        &self,
        partition: &Partition,
    ) -> Result<(), PostgresStoreError> {
        // Created apart and attached: ATTACH takes a lock that does not block claims, where
        // CREATE TABLE .. PARTITION OF would. Autovacuum first looks at it after 1,000 changes,
        // as at the plain table (see the migration `20261125000002_autovacuum_thresholds.sql`).
        let sql = format!(
            "SET LOCAL lock_timeout = '2s';
             CREATE TABLE IF NOT EXISTS idempotency.{name}
                 (LIKE idempotency.partitioned_records INCLUDING ALL)
                 WITH (autovacuum_analyze_threshold = 1000, autovacuum_vacuum_threshold = 1000);
             ALTER TABLE idempotency.partitioned_records ATTACH PARTITION idempotency.{name}
                 FOR VALUES FROM (to_timestamp({start})) TO (to_timestamp({end}));",
            name = partition.name(),
            start = partition.start,
            end = partition.end,
        );
        // A sqlx transaction, rolled back if a statement fails: a failed `BEGIN; ..; COMMIT;`
        // string would leave its pooled connection inside the aborted transaction.
        let create = async {
            let mut tx = self.pool.begin().await?;
            sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await?;
            tx.commit().await
        };
        match self.timed("maintain_partitions", create).await {
            Ok(()) => Ok(()),
            // 42P17: it overlaps a partition attached since the catalog was read; 23505, 42809:
            // another run created or attached the same table. Done only if the range is covered.
            Err(PostgresStoreError::Database(error))
                if matches!(
                    error.as_database_error().and_then(|e| e.code()).as_deref(),
                    Some("42P17" | "23505" | "42809")
                ) =>
            {
                let partitions = self.partitions().await?;
                if uncovered(&partitions, partition.start, partition.end).is_empty() {
                    Ok(())
                } else {
                    Err(PostgresStoreError::Database(error))
                }
            }
            Err(error) => Err(error),
        }
    }

    /// Detaches (without blocking claims) and drops an expired partition; its row count.
    pub(super) async fn drop_partition(
        &self,
        partition: &Partition,
    ) -> Result<u64, PostgresStoreError> {
        let name = partition.name();
        let detach = if partition.detaching {
            format!(
                "ALTER TABLE idempotency.partitioned_records DETACH PARTITION idempotency.{name} FINALIZE"
            )
        } else {
            format!(
                "ALTER TABLE idempotency.partitioned_records DETACH PARTITION idempotency.{name} CONCURRENTLY"
            )
        };
        self.timed(
            "maintain_partitions",
            sqlx::raw_sql(AssertSqlSafe(detach)).execute(&self.pool),
        )
        .await?;
        // The statistics' row count, not `count(*)`: scanning a partition about to be dropped
        // would read all of it through the buffer cache, at the live traffic's expense.
        let rows: i64 = self
            .timed(
                "maintain_partitions",
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "SELECT GREATEST(c.reltuples::int8, pg_stat_get_live_tuples(c.oid), 0)
                     FROM pg_class c WHERE c.oid = 'idempotency.{name}'::regclass"
                )))
                .fetch_one(&self.pool),
            )
            .await?
            .try_get(0)?;
        self.timed(
            "maintain_partitions",
            sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP TABLE IF EXISTS idempotency.{name}"
            )))
            .execute(&self.pool),
        )
        .await?;
        Ok(rows as u64)
    }
}

/// What one [`PostgresStore::maintain_partitions`] run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionMaintenance {
    /// Partitions created ahead.
    pub created: u32,
    /// Expired partitions dropped.
    pub dropped: u32,
    /// Records in the dropped partitions, as PostgreSQL's statistics count them (`reltuples`
    /// or the live-tuple counter, whichever is higher): an estimate, exact once autovacuum or
    /// `ANALYZE` has seen the partition, and free where a `count(*)` would read it all.
    pub rows_dropped: u64,
}

/// A partition of `idempotency.partitioned_records`: expiry times in `[start, end)` (Unix
/// seconds), named after them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Partition {
    pub(super) start: i64,
    pub(super) end: i64,
    /// A `DETACH CONCURRENTLY` was interrupted and must be finalised.
    pub(super) detaching: bool,
}

impl Partition {
    pub(super) fn name(&self) -> String {
        format!("partitioned_records_{}_{}", self.start, self.end)
    }

    pub(super) fn parse(name: &str, detaching: bool) -> Option<Self> {
        let (start, end) = name.strip_prefix("partitioned_records_")?.split_once('_')?;
        Some(Self {
            start: start.parse().ok()?,
            end: end.parse().ok()?,
            detaching,
        })
    }
}

/// The partitions that cover what `existing` leaves of `[now rounded down to width, horizon)`:
/// each `width`-aligned bucket less the existing ranges, so a partition left by an earlier
/// width (or another instance) cuts a bucket short rather than leaving a gap. Parts that end by
/// `now` are skipped: no claim expires there.
pub(super) fn partitions_to_create(
    existing: &[Partition],
    now: i64,
    horizon: i64,
    width: i64,
) -> Vec<Partition> {
    let mut create = Vec::new();
    let mut start = now.div_euclid(width) * width;
    while start < horizon {
        let parts = uncovered(existing, start, start + width);
        create.extend(parts.into_iter().filter(|p| p.end > now));
        start += width;
    }
    create
}

/// The sub-ranges of `[start, end)` that no partition in `existing` covers, in order.
pub(super) fn uncovered(existing: &[Partition], start: i64, end: i64) -> Vec<Partition> {
    let mut covering: Vec<(i64, i64)> = existing
        .iter()
        .filter(|p| p.start < end && p.end > start)
        .map(|p| (p.start, p.end))
        .collect();
    covering.sort_unstable();
    let mut gaps = Vec::new();
    let mut from = start;
    for (covered_from, covered_to) in covering {
        if covered_from > from {
            gaps.push(Partition {
                start: from,
                end: covered_from,
                detaching: false,
            });
        }
        from = from.max(covered_to);
    }
    if from < end {
        gaps.push(Partition {
            start: from,
            end,
            detaching: false,
        });
    }
    gaps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(partitions: &[Partition]) -> Vec<(i64, i64)> {
        partitions.iter().map(|p| (p.start, p.end)).collect()
    }

    fn partition(start: i64, end: i64) -> Partition {
        Partition {
            start,
            end,
            detaching: false,
        }
    }

    #[test]
    fn a_fresh_table_gets_whole_buckets_from_the_current_one_to_the_horizon() {
        let create = partitions_to_create(&[], 3700, 3700 + 7200, 3600);
        assert_eq!(
            ranges(&create),
            [(3600, 7200), (7200, 10800), (10800, 14400)]
        );
    }

    #[test]
    fn covered_buckets_are_left_alone() {
        let existing = partitions_to_create(&[], 3700, 3700 + 7200, 3600);
        assert!(partitions_to_create(&existing, 3700, 3700 + 7200, 3600).is_empty());
    }

    /// Hourly partitions, then 25 minutes: the bucket that straddles the last hourly partition's
    /// end is cut short at it, and the new grid goes on from there.
    #[test]
    fn a_new_width_fills_the_bucket_the_old_partitions_end_in() {
        let existing = [partition(0, 3600), partition(3600, 7200)];
        let create = partitions_to_create(&existing, 100, 100 + 9000, 1500);
        assert_eq!(ranges(&create), [(7200, 7500), (7500, 9000), (9000, 10500)]);
    }

    #[test]
    fn holes_inside_a_bucket_are_filled_between_the_partitions_around_them() {
        let existing = [partition(300, 400), partition(0, 100), partition(350, 600)];
        assert_eq!(
            ranges(&uncovered(&existing, 0, 1000)),
            [(100, 300), (600, 1000)]
        );
    }

    #[test]
    fn parts_that_end_by_now_are_not_created() {
        let existing = [partition(3600, 7200)];
        let create = partitions_to_create(&existing, 4000, 4000 + 5000, 5000);
        assert_eq!(ranges(&create), [(7200, 10000)]);
    }

    proptest::proptest! {
        /// Whatever widths follow one another, and whenever the changes happen, the horizon is
        /// covered once: no gap for a claim to fall in, no overlap for PostgreSQL to refuse.
        #[test]
        fn width_changes_cover_the_horizon_without_gap_or_overlap(
            runs in proptest::collection::vec((300i64..=172_800, 0i64..=86_400), 1..5),
            start in 0i64..2_000_000_000,
            ahead in 3600i64..=172_800,
        ) {
            let mut existing: Vec<Partition> = Vec::new();
            let mut now = start;
            for (width, elapsed) in runs {
                now += elapsed;
                existing.retain(|p| p.end > now);
                let create = partitions_to_create(&existing, now, now + ahead, width);
                for p in &create {
                    proptest::prop_assert!(p.start < p.end && p.end - p.start <= width, "{p:?}");
                }
                existing.extend(create);
                let mut live = ranges(&existing);
                live.sort_unstable();
                proptest::prop_assert!(live[0].0 <= now, "{live:?} at {now}");
                proptest::prop_assert!(live[live.len() - 1].1 >= now + ahead);
                for pair in live.windows(2) {
                    proptest::prop_assert_eq!(pair[0].1, pair[1].0, "gap or overlap");
                }
            }
        }
    }

    #[test]
    fn partition_names_round_trip_whatever_their_width() {
        for p in [
            partition(1_764_090_000, 1_764_093_600),
            partition(7200, 7500),
        ] {
            assert_eq!(Partition::parse(&p.name(), false), Some(p));
        }
        let detaching = Partition {
            detaching: true,
            ..partition(7200, 7500)
        };
        assert_eq!(Partition::parse(&detaching.name(), true), Some(detaching));
        assert_eq!(Partition::parse("partitioned_records_7200", false), None);
        assert_eq!(Partition::parse("someone_elses_7200_7500", false), None);
    }
}
