use std::{fmt, future::Future, sync::LazyLock, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use sqlx::{PgPool, Row, migrate::Migrator, postgres::PgRow};

use super::{Begin, ClaimRequest, ClaimStatus, ExpiredDeletion, Lease, Store};
use crate::record::Record;

/// The [`Store`] for production: PostgreSQL, shared by every instance of the application.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::{IdempotencyLayer, store::PostgresStore};
///
/// let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
/// let store = PostgresStore::new(pool);
/// // Creates the `idempotency` schema, its table and its own migrations table
/// // (`idempotency._sqlx_migrations`, apart from the application's).
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store);
/// # Ok(()) }
/// ```
///
/// Each key is one row of `idempotency.records`, addressed by the SHA-256 of its scope. Claiming
/// is one `INSERT ... ON CONFLICT DO UPDATE ... WHERE <claimable>` statement, so two requests
/// racing for a key are ordered by PostgreSQL's row lock and exactly one acquires it; replays and
/// conflicts write nothing. Completing or releasing is one `UPDATE`/`DELETE` fenced by the claim's
/// token. All times are `timestamptz` compared with `now()` in the database, so app servers'
/// clocks never matter.
///
/// Every operation is bounded by [`with_timeout`](Self::with_timeout) (5 s by default), so an
/// exhausted pool or an unreachable server becomes a prompt error (and the layer's `503`) rather
/// than a hung request.
#[derive(Clone, Debug)]
pub struct PostgresStore {
    pool: PgPool,
    timeout: Duration,
}

static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let embedded = sqlx::migrate!("./migrations");
    let mut migrator = Migrator::with_migrations(embedded.iter().cloned().collect());
    migrator.create_schema("idempotency");
    migrator.dangerous_set_table_name("idempotency._sqlx_migrations");
    migrator
});

/// One statement: acquire the key if it is free, expired, or held by a lapsed lease of the same
/// fingerprint; otherwise return the row as it stands. The fallback `SELECT` shares the
/// statement's snapshot, so a row committed by a racing claim after the snapshot was taken can
/// be invisible to it; the caller then runs the statement again (rare, and safe: nothing was
/// claimed).
const BEGIN: &str = r#"
WITH claimed AS (
    INSERT INTO idempotency.records AS r
        (scope_key, fingerprint, token, expires_at, lease_until)
    VALUES ($1, $2, nextval('idempotency.fencing_tokens'), now() + $4::interval, now() + $3::interval)
    ON CONFLICT (scope_key) DO UPDATE SET
        fingerprint   = excluded.fingerprint,
        token         = excluded.token,
        takeover      = r.expires_at > now(),
        created_at    = now(),
        expires_at    = excluded.expires_at,
        lease_until   = excluded.lease_until,
        completed_at  = NULL,
        status        = NULL,
        header_names  = NULL,
        header_values = NULL,
        body          = NULL
    WHERE r.expires_at <= now()
       OR (r.status IS NULL AND r.lease_until <= now() AND r.fingerprint = excluded.fingerprint)
    RETURNING r.token, r.takeover
)
SELECT true AS acquired, token, takeover,
       NULL::boolean AS same_fingerprint, NULL::float8 AS lease_remaining,
       NULL::int2 AS status, NULL::text[] AS header_names, NULL::bytea[] AS header_values,
       NULL::bytea AS body
FROM claimed
UNION ALL
SELECT false, r.token, r.takeover,
       r.fingerprint = $2, extract(epoch FROM r.lease_until - now())::float8,
       r.status, r.header_names, r.header_values, r.body
FROM idempotency.records r
WHERE r.scope_key = $1 AND r.expires_at > now() AND NOT EXISTS (SELECT FROM claimed)
"#;

const RENEW: &str = r#"
UPDATE idempotency.records
SET lease_until = now() + $3::interval,
    expires_at = greatest(expires_at, now() + $3::interval)
WHERE scope_key = $1 AND token = $2 AND status IS NULL
"#;

const COMPLETE: &str = r#"
UPDATE idempotency.records
SET status = $3, header_names = $4, header_values = $5, body = $6,
    lease_until = NULL, completed_at = now()
WHERE scope_key = $1 AND token = $2 AND status IS NULL
"#;

const RELEASE: &str = r#"
DELETE FROM idempotency.records
WHERE scope_key = $1 AND token = $2 AND status IS NULL
"#;

/// Bounded and non-blocking: rows another transaction has locked are skipped, not waited for.
const DELETE_EXPIRED: &str = r#"
DELETE FROM idempotency.records
WHERE scope_key IN (
    SELECT scope_key FROM idempotency.records
    WHERE expires_at <= now()
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
"#;

/// How many times `begin` runs its statement when a racing commit hides the conflicting row.
const BEGIN_ATTEMPTS: usize = 5;

impl PostgresStore {
    /// A store on `pool`. Call [`migrate`](Self::migrate) once before use.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            timeout: Duration::from_secs(5),
        }
    }

    /// Bounds every store operation, waiting for a pooled connection included (default 5 s).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The store's migrations: schema `idempotency`, tracked in `idempotency._sqlx_migrations`.
    /// For deployments that apply migrations with their own tooling.
    pub fn migrator() -> &'static Migrator {
        &MIGRATOR
    }

    /// Applies the store's migrations (idempotent, and safe to run from many instances at once).
    ///
    /// # Errors
    ///
    /// When the database cannot be reached or a migration fails.
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        MIGRATOR.run(&self.pool).await
    }

    async fn timed<T>(
        &self,
        operation: &'static str,
        future: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, PostgresStoreError> {
        match tokio::time::timeout(self.timeout, future).await {
            Ok(result) => result.map_err(PostgresStoreError::Database),
            Err(_) => Err(PostgresStoreError::Timeout {
                operation,
                after: self.timeout,
            }),
        }
    }

    async fn fenced(
        &self,
        sql: &'static str,
        operation: &'static str,
        claim: &Lease,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let done = self
            .timed(
                operation,
                sqlx::query(sql)
                    .bind(claim.key.as_bytes().as_slice())
                    .bind(claim.token)
                    .execute(&self.pool),
            )
            .await?;
        Ok(claim_status(done.rows_affected()))
    }
}

fn claim_status(rows_affected: u64) -> ClaimStatus {
    if rows_affected == 1 {
        ClaimStatus::Held
    } else {
        ClaimStatus::Lost
    }
}

impl Store for PostgresStore {
    type Claim = Lease;
    type Error = PostgresStoreError;

    async fn begin(&self, request: &ClaimRequest) -> Result<Begin<Lease>, PostgresStoreError> {
        for _ in 0..BEGIN_ATTEMPTS {
            let row = self
                .timed(
                    "begin",
                    sqlx::query(BEGIN)
                        .bind(request.key.as_bytes().as_slice())
                        .bind(request.fingerprint.as_bytes().as_slice())
                        .bind(request.lease)
                        .bind(request.ttl)
                        .fetch_optional(&self.pool),
                )
                .await?;
            if let Some(row) = row {
                return decode_begin(request, &row);
            }
        }
        Err(PostgresStoreError::Contended)
    }

    async fn renew(
        &self,
        claim: &Lease,
        lease: Duration,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let done = self
            .timed(
                "renew",
                sqlx::query(RENEW)
                    .bind(claim.key.as_bytes().as_slice())
                    .bind(claim.token)
                    .bind(lease)
                    .execute(&self.pool),
            )
            .await?;
        Ok(claim_status(done.rows_affected()))
    }

    async fn complete(
        &self,
        claim: &Lease,
        record: &Record,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let (names, values): (Vec<&str>, Vec<&[u8]>) = record
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes()))
            .unzip();
        let done = self
            .timed(
                "complete",
                sqlx::query(COMPLETE)
                    .bind(claim.key.as_bytes().as_slice())
                    .bind(claim.token)
                    .bind(record.status().as_u16() as i16)
                    .bind(names)
                    .bind(values)
                    .bind(record.body().map(|b| b.as_ref()))
                    .execute(&self.pool),
            )
            .await?;
        Ok(claim_status(done.rows_affected()))
    }

    async fn release(&self, claim: &Lease) -> Result<ClaimStatus, PostgresStoreError> {
        self.fenced(RELEASE, "release", claim).await
    }
}

impl ExpiredDeletion for PostgresStore {
    async fn delete_expired(&self, batch: u32) -> Result<u64, PostgresStoreError> {
        let done = self
            .timed(
                "delete_expired",
                sqlx::query(DELETE_EXPIRED)
                    .bind(i64::from(batch))
                    .execute(&self.pool),
            )
            .await?;
        Ok(done.rows_affected())
    }
}

fn decode_begin(request: &ClaimRequest, row: &PgRow) -> Result<Begin<Lease>, PostgresStoreError> {
    if row.try_get::<bool, _>("acquired")? {
        return Ok(Begin::Acquired {
            claim: Lease {
                key: request.key,
                token: row.try_get("token")?,
            },
            takeover: row.try_get("takeover")?,
        });
    }
    if !row.try_get::<bool, _>("same_fingerprint")? {
        return Ok(Begin::Mismatch);
    }
    let Some(status) = row.try_get::<Option<i16>, _>("status")? else {
        let remaining: Option<f64> = row.try_get("lease_remaining")?;
        return Ok(Begin::InFlight {
            lease_remaining: remaining.and_then(|s| Duration::try_from_secs_f64(s).ok()),
        });
    };
    let status = u16::try_from(status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| PostgresStoreError::Corrupt(format!("status {status}")))?;
    let names: Vec<String> = row.try_get("header_names")?;
    let values: Vec<Vec<u8>> = row.try_get("header_values")?;
    if names.len() != values.len() {
        return Err(PostgresStoreError::Corrupt(
            "header names and values differ in length".to_owned(),
        ));
    }
    let mut headers = HeaderMap::with_capacity(names.len());
    for (name, value) in names.into_iter().zip(values) {
        let name = HeaderName::try_from(name)
            .map_err(|e| PostgresStoreError::Corrupt(format!("header name: {e}")))?;
        let value = HeaderValue::try_from(value)
            .map_err(|e| PostgresStoreError::Corrupt(format!("header value: {e}")))?;
        headers.append(name, value);
    }
    let body: Option<Vec<u8>> = row.try_get("body")?;
    Ok(Begin::Completed(Record::from_parts(
        status,
        headers,
        body.map(Bytes::from),
    )))
}

/// A [`PostgresStore`] operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum PostgresStoreError {
    /// The database returned an error or could not be reached.
    Database(sqlx::Error),
    /// The operation did not finish within the store's timeout (see
    /// [`PostgresStore::with_timeout`]), waiting for a pooled connection included.
    Timeout {
        /// Which operation: `begin`, `renew`, `complete`, `release` or `delete_expired`.
        operation: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// A stored row could not be read back as a response.
    Corrupt(String),
    /// Claim attempts kept racing with concurrent changes to the same key.
    Contended,
}

impl fmt::Display for PostgresStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Database(_) => f.write_str("PostgreSQL idempotency store error"),
            Self::Timeout { operation, after } => {
                write!(
                    f,
                    "PostgreSQL idempotency store `{operation}` timed out after {after:?}"
                )
            }
            Self::Corrupt(what) => write!(f, "stored idempotency record is corrupt: {what}"),
            Self::Contended => f.write_str("idempotency key kept changing while being claimed"),
        }
    }
}

impl std::error::Error for PostgresStoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Database(error) => Some(error),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for PostgresStoreError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}
