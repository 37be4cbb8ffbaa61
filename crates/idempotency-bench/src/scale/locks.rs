//! Lock waits and reaping statements, sampled from `pg_stat_activity` while the reaper runs.

use std::time::Duration;

use sqlx::Row;
use tokio::{sync::watch, time::Instant};

use crate::{db::BenchDb, report::format_micros};

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
