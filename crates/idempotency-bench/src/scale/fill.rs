//! Filling a store with completed records.
//!
//! Records are written by one `INSERT ... SELECT ... FROM generate_series` per chunk, never
//! through HTTP. They look like the layer's own: the scope key is the SHA-256 that
//! `ScopeKey::new` computes, stored as the store does (its first 128 bits as a `uuid`;
//! recomputed in SQL, and checked against the crate after the fill),
//! the fingerprint is the one of the benchmark's small charge body, status `201`, two headers
//! (`content-type`, `request-id`) and a charge as the JSON body (about 190 to 400 bytes).
//! Record `n` is key `fill-<n>` of account `acct_<n % 16>`, so replays can pick any of them.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use http::{HeaderValue, Method, Uri};
use sqlx::AssertSqlSafe;
use tokio::time::Instant;
use tower_idempotency::{Fingerprint, FingerprintMode, IdempotencyKey, Principal, ScopeKey};

use super::{
    Table, db_now, settle,
    sizes::{Sizes, sizes},
};
use crate::{
    BoxError,
    app::CHARGES_PATH,
    db::BenchDb,
    load::{self, ACCOUNTS, BodySize, FILLED_KEY_PREFIX},
    report::format_rate,
};

/// Records in the "empty" store: a handful for the replay scenarios to find.
pub(crate) const EMPTY_STORE_ROWS: u64 = 1_000;

/// The layer's default TTL: a filled record was created this long before it expires.
const TTL_SECS: f64 = 24.0 * 60.0 * 60.0;

/// Completed records expire between 1 h and 24 h from the fill: spread over the next day, and
/// none during a run, so every record a replay picks is still there.
const COMPLETED_FROM_SECS: f64 = 60.0 * 60.0;

/// Which records a fill writes. Record `n` of `rows` expires at `from + spread × (n + jitter) /
/// rows`: as with a fixed TTL, records expire in the order they were written, so those that
/// expire together sit together in the heap (two workers write interleaved chunks).
pub(super) struct FillSpec<'a> {
    pub(super) table: Table,
    /// Keys are this prefix followed by the record's number.
    pub(super) key_prefix: &'a str,
    /// Record numbers `0..rows`.
    pub(super) rows: u64,
    /// `expires_at` is uniformly spread over `from .. from + spread` (Unix seconds).
    pub(super) expires_from: f64,
    pub(super) expires_spread: f64,
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
pub(super) async fn fill(
    db: &BenchDb,
    spec: &FillSpec<'_>,
    label: Option<&str>,
) -> Result<(), BoxError> {
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
