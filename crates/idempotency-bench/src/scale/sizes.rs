//! The size on disk of a record table, and of one record by response body size.

use sqlx::Row;

use super::Table;
use crate::{
    BoxError,
    db::BenchDb,
    report::{format_bytes, format_rate},
};

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
