//! What the database did during a window: the WAL the server wrote (and, with
//! `pg_walinspect`, the run database's own share of it), the blocks read, the record updates
//! and how many were HOT, and the machine's disk reads.

use std::time::Duration;

use sqlx::Row;

use crate::{
    db::BenchDb,
    procfs,
    report::{format_bytes, format_rate},
};

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
