use std::{
    collections::HashMap,
    fmt,
    future::Future,
    pin::Pin,
    sync::{
        Arc, LazyLock,
        atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use sqlx::{
    AssertSqlSafe, PgPool, Postgres, Row, Transaction, migrate::Migrator, pool::PoolConnection,
    postgres::PgRow, types::Uuid,
};

use super::{
    Begin, ClaimRequest, ClaimStatus, ExpiredDeletion, InFlightWatch, Lease, Notifier, Store,
    batch::Batcher,
};
use crate::{record::Record, scope::ScopeKey, transaction::TxSlot};

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
/// Each key is one row of `idempotency.records`, addressed by the SHA-256 of its scope (its first
/// 128 bits, stored as a `uuid`: half the primary key of the whole hash, and still far from any
/// collision). Claiming
/// is one statement: it reads the key's row and, in the same statement, inserts a new key
/// (`ON CONFLICT DO NOTHING`) or takes over an expired record or a lapsed lease with a conditional
/// `UPDATE`, so two requests racing for a key are ordered by PostgreSQL and exactly one acquires
/// it. (In lease mode a claim first tries the plain `INSERT .. ON CONFLICT DO NOTHING`, shared
/// with other requests' claims, see [group commit](#group-commit); only a key that has a row
/// goes on to the full statement.) Replays and conflicts neither write nor lock. Completing or
/// releasing is one `UPDATE`/`DELETE` fenced by the claim's token. All times are `timestamptz` compared with
/// `now()` in the database, so app servers' clocks never matter.
///
/// # Two modes
///
/// * **Lease mode** (the default): the claim commits at once and is held by a lease that the
///   layer renews while the handler runs; the response is stored when the handler returns.
/// * **Transactional mode** ([`transactional`](Self::transactional)): the claim, the handler's
///   own writes through [`IdempotentTx`](crate::IdempotentTx) and the stored response commit in
///   **one transaction**, or roll back together. See [`transaction`](crate::transaction).
///
/// # Group commit
///
/// In lease mode, concurrent requests share their writes: claims of keys that have no row yet
/// go to PostgreSQL together as one `INSERT .. ON CONFLICT DO NOTHING` over arrays, and
/// responses are stored together by one call of `idempotency.complete_many` (a fenced `UPDATE`
/// by primary key for each), each batch in one round trip and one commit. A request never
/// waits for a batch to fill: it waits only while the previous batch of its kind is being
/// written, and a lone request goes out at once. What a claim or a completion answers is
/// unchanged: a key that already has a row is claimed by the one-key statement above, and each
/// completion is fenced by its own token. Without prepared statements
/// ([`without_prepared_statements`](Self::without_prepared_statements)), in partitioned mode and
/// in transactional mode (one transaction per request), every operation is its own statement.
///
/// Every operation is bounded by [`with_timeout`](Self::with_timeout) (5 s by default), so an
/// exhausted pool or an unreachable server becomes a prompt error (and the layer's `503`) rather
/// than a hung request.
#[derive(Clone, Debug)]
pub struct PostgresStore {
    pool: PgPool,
    timeout: Duration,
    transactional: bool,
    prepared: bool,
    partitions: Option<Partitioning>,
    /// Where the current expiry drain stands: every record expiring before it was deleted or
    /// skipped as locked by this store's earlier batches (microseconds since the Unix epoch;
    /// 0 when no drain is under way). Reset by a short batch, so the next drain starts from
    /// the oldest record again and picks up what was skipped.
    expiry_cursor: Arc<AtomicI64>,
    /// Lease mode's group commit of claims of new keys: the claim of each key claimed, `None`
    /// for a key that has a row already.
    new_claims: Arc<ClaimBatcher>,
    /// Claim attempts being settled in the background (see [`ClaimAttempt`]), bounded by
    /// [`MAX_UNSETTLED`].
    unsettled: Arc<AtomicUsize>,
    /// How duplicates waiting for a key in flight are woken (see
    /// [`watch_in_flight`](Store::watch_in_flight)).
    notifications: Arc<Notifications>,
    /// Waiters poll every so often instead ([`with_in_flight_polling`](Self::with_in_flight_polling)).
    in_flight_polling: Option<Duration>,
    /// Lease mode's group commit of completions.
    completions: Arc<Batcher<(Lease, Record), Batched<ClaimStatus>>>,
}

/// Lease mode's claims of new keys, each with its attempt's claimant, batched.
type ClaimBatcher = Batcher<(ClaimRequest, Uuid), Batched<Option<Lease>>>;

/// The most operations one batch writes.
const MAX_BATCH: usize = 256;

/// Records larger than this (body and headers) are stored by a statement of their own, so a
/// batch stays under `MAX_BATCH` × 64 KiB however large the responses an app keeps.
const MAX_BATCHED_RECORD: usize = 64 * 1024;

/// What became of an operation sent in a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Batched<T> {
    /// Written, with this answer.
    Done(T),
    /// Not written: do it alone (its key was in the batch twice, or PostgreSQL refused the
    /// batch as a whole).
    Alone,
    /// The batch timed out.
    TimedOut,
}

/// Partitioned mode's settings.
#[derive(Clone, Copy, Debug)]
struct Partitioning {
    width: Duration,
    ahead: Duration,
}

/// A claim held in a [`PostgresStore`]: its fencing token and, in transactional mode, the open
/// transaction.
#[derive(Debug)]
pub struct PgClaim {
    lease: Lease,
    tx: Option<Box<TxClaim>>,
}

/// A transactional claim: its transaction, and what took its place if it could not commit.
#[derive(Debug)]
struct TxClaim {
    slot: Arc<TxSlot>,
    request: ClaimRequest,
    fallback: std::sync::Mutex<Fallback>,
}

/// Where a transactional claim stands once its transaction failed to commit although the
/// handler never wrote through it: the response was delivered as in lease mode, and the key is
/// claimed again in lease mode so that it can be stored.
#[derive(Debug, Clone, Copy)]
enum Fallback {
    /// The transaction is the claim.
    None,
    /// The transaction is gone and the key not yet claimed again.
    Reclaim,
    /// Claimed again, in lease mode.
    Lease(Lease),
}

impl TxClaim {
    fn fallback(&self) -> Fallback {
        *self
            .fallback
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_fallback(&self, fallback: Fallback) {
        *self
            .fallback
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fallback;
    }
}

impl PgClaim {
    /// The claimed key and its fencing token.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }
}

static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let embedded = sqlx::migrate!("./migrations");
    let mut migrator = Migrator::with_migrations(embedded.iter().cloned().collect());
    migrator.create_schema("idempotency");
    migrator.dangerous_set_table_name("idempotency._sqlx_migrations");
    migrator
});

// The claim statement, in two variants sharing their text: lease mode claims unconditionally;
// transactional mode first tries a transaction-scoped advisory lock on the key and claims only if
// it got it, so a duplicate never waits on the holder's uncommitted row (it still gets a completed
// record's replay or mismatch, which needs no lock).
//
// The key's row is read first. A key with no row is inserted (`ON CONFLICT DO NOTHING`); a row
// that is dead (past `expires_at`, or past its TTL counted from its claim and not held under a
// live lease), or in flight under a lapsed lease with the same fingerprint, is taken over by a
// conditional `UPDATE` whose row lock orders racing claimers (the loser re-checks the winner's
// version and leaves it). Otherwise the row is returned as it stands: replays and conflicts
// neither write, nor lock, nor take a transaction id. The reads share the statement's snapshot,
// so a row committed by a racing claim after the snapshot was taken can be invisible; the
// statement then returns nothing and the caller runs it again (rare, and safe: nothing was
// claimed). `$5` is the attempt's claimant: a row it finds in flight under that id is its own
// (`mine`), claimed by an earlier try whose answer was lost.
macro_rules! begin_statement {
    (lock: $lock:literal, gate: $gate:literal, existing: $existing:literal, busy: $busy:literal) => {
        concat!(
            "WITH ",
            $lock,
            "existing AS MATERIALIZED (
                SELECT token, takeover, fingerprint, lease_until, expires_at, created_at, claimant,
                       status, header_names, header_values, body
                FROM idempotency.records WHERE scope_key = $1
            ),
            inserted AS (
                INSERT INTO idempotency.records
                    (scope_key, fingerprint, token, expires_at, lease_until, claimant)
                SELECT $1, $2, nextval('idempotency.fencing_tokens'),
                       now() + greatest($4::interval, $3::interval), now() + $3::interval, $5
                WHERE NOT EXISTS (SELECT FROM existing) ",
            $gate,
            " ON CONFLICT (scope_key) DO NOTHING
                RETURNING token, takeover
            ),
            taken AS (
                UPDATE idempotency.records r SET
                    fingerprint   = $2,
                    token         = nextval('idempotency.fencing_tokens'),
                    takeover      = r.status IS NULL AND r.expires_at > now()
                                    AND r.created_at + $4::interval > now(),
                    created_at    = now(),
                    expires_at    = now() + greatest($4::interval, $3::interval),
                    lease_until   = now() + $3::interval,
                    completed_at  = NULL,
                    status        = NULL,
                    header_names  = NULL,
                    header_values = NULL,
                    body          = NULL,
                    claimant      = $5
                WHERE r.scope_key = $1 AND EXISTS (SELECT FROM existing) ",
            $gate,
            " AND (r.expires_at <= now()
                       OR (r.created_at + $4::interval <= now()
                           AND (r.status IS NOT NULL OR r.lease_until <= now()))
                       OR (r.status IS NULL AND r.lease_until <= now() AND r.fingerprint = $2))
                RETURNING r.token, r.takeover
            ),
            claimed AS (SELECT token, takeover FROM inserted UNION ALL SELECT token, takeover FROM taken)
            SELECT 'acquired' AS outcome, token, takeover,
                   NULL::boolean AS same_fingerprint, NULL::float8 AS lease_remaining,
                   NULL::float8 AS expires_in,
                   NULL::int2 AS status, NULL::text[] AS header_names, NULL::bytea[] AS header_values,
                   NULL::bytea AS body, NULL::boolean AS mine
            FROM claimed ",
            $busy,
            " UNION ALL
            SELECT 'existing', e.token, e.takeover,
                   e.fingerprint = $2, extract(epoch FROM e.lease_until - now())::float8,
                   extract(epoch FROM least(e.expires_at, e.created_at + $4::interval) - now())::float8,
                   e.status, e.header_names, e.header_values, e.body,
                   coalesce(e.claimant = $5, false) AND e.status IS NULL
            FROM existing e
            WHERE e.expires_at > now()
              AND NOT (e.created_at + $4::interval <= now()
                       AND (e.status IS NOT NULL OR e.lease_until <= now()))
              AND NOT EXISTS (SELECT FROM claimed) ",
            $existing,
        )
    };
}

const BEGIN_LEASE: &str = begin_statement!(lock: "", gate: "", existing: "", busy: "");

const BEGIN_TRANSACTIONAL: &str = begin_statement!(
    lock: "lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($6) AS held), ",
    gate: "AND (SELECT held FROM lock)",
    // Without the lock, only a completed record is answered: an uncommitted claim is invisible.
    existing: "AND ((SELECT held FROM lock) OR e.status IS NOT NULL)",
    busy: "UNION ALL SELECT 'busy', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
           FROM lock WHERE NOT lock.held AND NOT EXISTS (
               SELECT FROM existing e WHERE e.status IS NOT NULL AND e.expires_at > now()
                 AND e.created_at + $4::interval > now())"
);

// The fenced statements, for the plain table and the partitioned one. `expires_at > now()` costs
// nothing on the plain table (a held claim has not expired) and prunes the partitioned one.
macro_rules! fenced_statements {
    ($table:literal) => {
        Fenced {
            renew: concat!(
                "UPDATE idempotency.",
                $table,
                "
                 SET lease_until = now() + $3::interval,
                     expires_at = greatest(expires_at, now() + $3::interval)
                 WHERE scope_key = $1 AND token = $2 AND status IS NULL AND expires_at > now()"
            ),
            complete: concat!("", complete!($table)),
            complete_notify: concat!(
                "WITH settled AS (",
                complete!($table),
                " RETURNING scope_key) ",
                NOTIFY_SETTLED!()
            ),
            release: concat!("", release!($table)),
            release_notify: concat!(
                "WITH settled AS (",
                release!($table),
                " RETURNING scope_key) ",
                NOTIFY_SETTLED!()
            ),
        }
    };
}

macro_rules! complete {
    ($table:literal) => {
        concat!(
            "UPDATE idempotency.",
            $table,
            "
             SET status = $3, header_names = $4, header_values = $5, body = $6,
                 lease_until = NULL, completed_at = now()
             WHERE scope_key = $1 AND token = $2 AND status IS NULL AND expires_at > now()"
        )
    };
}

macro_rules! release {
    ($table:literal) => {
        concat!(
            "DELETE FROM idempotency.",
            $table,
            "
             WHERE scope_key = $1 AND token = $2 AND status IS NULL AND expires_at > now()"
        )
    };
}

/// Tells the listeners of every instance that the keys of `settled` settled, when the
/// statement's transaction commits (see [`PostgresStore::watch_in_flight`]).
macro_rules! NOTIFY_SETTLED {
    () => {
        "SELECT pg_notify('idempotency_settled', scope_key::text) FROM settled"
    };
}

/// The channel of [`NOTIFY_SETTLED`]: its payload is a record's key.
const SETTLED_CHANNEL: &str = "idempotency_settled";

/// [`NOTIFY_SETTLED`] for one key, on its own (after a rollback, which notifies nothing).
const NOTIFY_ONE: &str = "SELECT pg_notify('idempotency_settled', $1::text)";

/// Lease mode's group commit of claims (see [`PostgresStore`]): inserts the keys that have no
/// row, each with its own fencing token, and returns them. The keys come sorted, so two batches
/// racing for the same keys take them in the same order and cannot deadlock.
const CLAIM_NEW_KEYS: &str = r#"
INSERT INTO idempotency.records (scope_key, fingerprint, token, expires_at, lease_until, claimant)
SELECT c.key, c.fingerprint, nextval('idempotency.fencing_tokens'),
       now() + greatest(c.ttl, c.lease) * interval '1 microsecond',
       now() + c.lease * interval '1 microsecond', c.claimant
FROM unnest($1::uuid[], $2::bytea[], $3::int8[], $4::int8[], $5::uuid[])
    AS c(key, fingerprint, lease, ttl, claimant)
ON CONFLICT (scope_key) DO NOTHING
RETURNING scope_key, token
"#;

/// Lease mode's group commit of completions: `complete` for many claims, each fenced by its
/// token, by the migrations' `idempotency.complete_many` (one primary-key `UPDATE` per record,
/// its plan cached for the session and never a table scan). Header names and values come as
/// two flat arrays, each record's headers being the slice `[first:last]` of them (empty when
/// `last < first`).
const COMPLETE_MANY: &str =
    "SELECT scope_key, token FROM idempotency.complete_many($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// The statements that act on a held claim; `_notify` variants also wake waiting duplicates.
struct Fenced {
    renew: &'static str,
    complete: &'static str,
    complete_notify: &'static str,
    release: &'static str,
    release_notify: &'static str,
}

const FENCED: Fenced = fenced_statements!("records");
const FENCED_PARTITIONED: Fenced = fenced_statements!("partitioned_records");

const BEGIN_PARTITIONED: &str =
    "SELECT * FROM idempotency.claim_partitioned($1, $2, $3, $4, $6, $5)";

/// Deletes what a claim attempt may have claimed, found by its claimant id (see
/// [`ClaimAttempt`]): only a row still in flight under that id, so never another's claim.
macro_rules! release_claimant {
    ($table:literal) => {
        concat!(
            "DELETE FROM idempotency.",
            $table,
            " WHERE scope_key = $1 AND claimant = $2 AND status IS NULL"
        )
    };
}

const RELEASE_CLAIMANT: &str = release_claimant!("records");
const RELEASE_CLAIMANT_PARTITIONED: &str = release_claimant!("partitioned_records");

/// One batch of expiry: the oldest expired records from `$2` (microseconds since the Unix
/// epoch) on. Bounded and non-blocking: rows another transaction has locked are skipped, not
/// waited for. The lower bound lets a drain's batches start where the previous one stopped
/// instead of walking, every time, the index entries of the rows already deleted (they stay in
/// the index until vacuum). The rows are deleted by the physical addresses (`ctid`) the inner
/// query locked, not looked up again by key: a lock pins its row version, so the address still
/// names the row when the `DELETE` reaches it, and the batch costs no probe of the primary key
/// (a batch of 1,000 took 4–8 ms instead of 13–20). Returns the count and the newest
/// `expires_at` deleted.
const DELETE_EXPIRED: &str = r#"
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

/// How many times `begin` runs its statement when a racing commit hides the conflicting row.
const BEGIN_ATTEMPTS: usize = 5;

impl PostgresStore {
    /// A store on `pool`, in lease mode. Call [`migrate`](Self::migrate) once before use.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            timeout: Duration::from_secs(5),
            transactional: false,
            prepared: true,
            partitions: None,
            expiry_cursor: Arc::default(),
            // A claim whose caller stopped waiting before its batch was written is not written.
            new_claims: Arc::new(Batcher::new(MAX_BATCH).skipping_abandoned()),
            completions: Arc::new(Batcher::new(MAX_BATCH)),
            unsettled: Arc::default(),
            notifications: Arc::default(),
            in_flight_polling: None,
        }
    }

    /// Switches to partitioned mode: records are kept in `idempotency.partitioned_records`,
    /// range-partitioned by expiry time into partitions `width` wide, and expiry
    /// ([`ExpiredDeletion::delete_expired`]) detaches and drops whole partitions instead of
    /// deleting rows: no row-by-row work, no table bloat, no vacuum debt, whatever the volume.
    ///
    /// Partitions are created 2 days ahead by default
    /// ([`with_partitions_ahead`](Self::with_partitions_ahead)): at start-up by
    /// [`migrate`](Self::migrate), then by each `delete_expired` (the expiry loop), so keep
    /// the loop running. Choose `width` around a quarter of the TTL: a claim looks the key up in
    /// every live partition (TTL / width of them), and a record outlives its TTL by up to
    /// `width` before its partition goes. `width` may change between deployments: partitions
    /// made at another width stay until they expire, and new ones are cut to fit around them.
    ///
    /// Claims are still one statement, serialised per key by a transaction-scoped advisory lock
    /// (a partitioned table cannot have a unique index on the key alone). Both lease and
    /// transactional mode work on it.
    #[must_use]
    pub fn partitioned(mut self, width: Duration) -> Self {
        let ahead = self
            .partitions
            .map_or(Duration::from_secs(2 * 24 * 3600), |p| p.ahead);
        self.partitions = Some(Partitioning { width, ahead });
        self
    }

    /// How far ahead partitioned mode keeps partitions (default 2 days): longer than the
    /// layer's TTL and lease, or claims fail (`503`) for want of a partition for their expiry.
    #[must_use]
    pub fn with_partitions_ahead(mut self, ahead: Duration) -> Self {
        if let Some(partitions) = &mut self.partitions {
            partitions.ahead = ahead;
        }
        self
    }

    /// Sends each statement as one simple-protocol query instead of a cached prepared statement,
    /// for PgBouncer before 1.21 in transaction pooling mode (which cannot follow prepared
    /// statements from one server connection to the next). Parameters are written into the SQL
    /// as hex-decoded bytes and numbers only, so no value can carry SQL. Costs the server a
    /// parse and plan per statement. With PgBouncer 1.21 or later, set
    /// `max_prepared_statements` in `pgbouncer.ini` instead and keep the default.
    #[must_use]
    pub fn without_prepared_statements(mut self) -> Self {
        self.prepared = false;
        self
    }

    /// Has duplicates that wait for a key in flight
    /// ([`with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait)) read the key again
    /// every `interval` instead of being woken by `LISTEN`/`NOTIFY`: for PgBouncer in
    /// transaction pooling mode, through which `LISTEN` does not work.
    #[must_use]
    pub fn with_in_flight_polling(mut self, interval: Duration) -> Self {
        self.in_flight_polling = Some(interval);
        self
    }

    /// Switches to transactional mode: each claim opens a transaction on a pooled connection,
    /// the handler writes through [`IdempotentTx`](crate::IdempotentTx), and the layer stores
    /// the response in the same transaction and commits. See [`transaction`](crate::transaction)
    /// for when to choose it and what it costs.
    #[must_use]
    pub fn transactional(mut self) -> Self {
        self.transactional = true;
        self
    }

    /// Whether the store is in transactional mode.
    pub fn is_transactional(&self) -> bool {
        self.transactional
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

    /// Applies the store's migrations (idempotent, and safe to run from many instances at once),
    /// and in partitioned mode creates the first partitions. Run it on a direct connection, not
    /// through PgBouncer in transaction pooling: sqlx's migrator holds a session advisory lock.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached or a migration fails.
    pub async fn migrate(&self) -> Result<(), PostgresStoreError> {
        MIGRATOR
            .run(&self.pool)
            .await
            .map_err(PostgresStoreError::Migrate)?;
        if self.partitions.is_some() {
            // Partitions for the first claims; the expiry loop keeps them coming.
            self.maintain_partitions().await?;
        }
        Ok(())
    }

    /// Partitioned mode's upkeep: creates the partitions the next
    /// [`with_partitions_ahead`](Self::with_partitions_ahead) need, and detaches and drops
    /// those whose every record has expired. [`delete_expired`](ExpiredDeletion::delete_expired)
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
                    error = %crate::service::Chain(&error),
                    "could not create an idempotency partition; retrying next run"
                ),
            }
        }
        Ok(report)
    }

    /// The partitions of `idempotency.partitioned_records`, from their names.
    async fn partitions(&self) -> Result<Vec<Partition>, PostgresStoreError> {
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

    async fn create_partition(&self, partition: &Partition) -> Result<(), PostgresStoreError> {
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
    async fn drop_partition(&self, partition: &Partition) -> Result<u64, PostgresStoreError> {
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

    /// `future` under the store's timeout. A plain function rather than an `async fn`, which
    /// would hold `future` twice (argument and awaited copy): sqlx's futures run to kilobytes.
    fn timed<T>(
        &self,
        operation: &'static str,
        future: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> impl Future<Output = Result<T, PostgresStoreError>> {
        tokio::time::timeout(self.timeout, future).map(move |timed| match timed {
            Ok(result) => result.map_err(PostgresStoreError::from),
            Err(_) => Err(self.timeout_error(operation)),
        })
    }

    fn timeout_error(&self, operation: &'static str) -> PostgresStoreError {
        PostgresStoreError::Timeout {
            operation,
            after: self.timeout,
        }
    }

    /// Runs a fenced `UPDATE`/`DELETE` on `conn`: `Held` if it touched the claim's row.
    async fn fenced<'c>(
        &self,
        operation: &'static str,
        statement: Statement<'_>,
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let done = self
            .timed(operation, statement.execute(self.prepared, conn))
            .await?;
        Ok(if done.rows_affected() == 1 {
            ClaimStatus::Held
        } else {
            ClaimStatus::Lost
        })
    }

    /// The claim statement of this store's mode, for the attempt `claimant`.
    fn claim_statement(&self, request: &ClaimRequest, claimant: Uuid) -> Statement<'static> {
        let sql = match (self.partitions.is_some(), self.transactional) {
            (true, _) => BEGIN_PARTITIONED,
            (false, true) => BEGIN_TRANSACTIONAL,
            (false, false) => BEGIN_LEASE,
        };
        let statement = Statement::new(sql)
            .with(Param::Key(stored_key(&request.key)))
            .with(Param::Digest(*request.fingerprint.as_bytes()))
            .with(Param::Interval(request.lease))
            .with(Param::Interval(request.ttl))
            .with(Param::Key(claimant));
        match (self.partitions.is_some(), self.transactional) {
            (true, try_lock) => statement.with(Param::Bool(try_lock)),
            (false, true) => statement.with(Param::Int(advisory_lock_key(request))),
            (false, false) => statement,
        }
    }

    /// The statements on held claims, for this store's table.
    fn fenced_sql(&self) -> &'static Fenced {
        if self.partitions.is_some() {
            &FENCED_PARTITIONED
        } else {
            &FENCED
        }
    }

    /// Whether operations go out in batches (see [`PostgresStore`]'s group commit).
    fn batches(&self) -> bool {
        self.prepared && self.partitions.is_none() && !self.transactional
    }

    /// A claim that commits on its own (lease mode, and partitioned lease mode). Its caller may
    /// never read the answer (a timeout, a lost connection, a cancelled request); the attempt's
    /// [`ClaimAttempt`] then releases whatever it claimed.
    async fn begin_lease(
        &self,
        request: &ClaimRequest,
    ) -> Result<Begin<PgClaim>, PostgresStoreError> {
        let mut attempt = ClaimAttempt::new(self, request.key);
        if self.batches() {
            let (pool, timeout) = (self.pool.clone(), self.timeout);
            let store = self.clone();
            let claimed = tokio::time::timeout(
                self.timeout,
                self.new_claims.run(
                    (request.clone(), attempt.claimant),
                    move |writer, batch| claim_new_keys(pool.clone(), timeout, writer, batch),
                    // Claimed for a request that stopped waiting (it timed out, or was
                    // cancelled): free the key now rather than when its lease lapses.
                    move |claimed| {
                        if let Batched::Done(Some(lease)) = claimed {
                            let store = store.clone();
                            tokio::spawn(async move {
                                let claim = PgClaim { lease, tx: None };
                                if let Err(error) = store.release(&claim).await {
                                    tracing::warn!(%error, "releasing an abandoned claim failed; it frees itself when its lease lapses");
                                }
                            });
                        }
                    },
                ),
            )
            .await;
            match claimed {
                Ok(Some(Batched::Done(Some(lease)))) => {
                    attempt.settle();
                    return Ok(Begin::Acquired {
                        claim: PgClaim { lease, tx: None },
                        takeover: false,
                    });
                }
                Ok(Some(Batched::TimedOut)) | Err(_) => return Err(self.timeout_error("begin")),
                // The key has a row (or the batch could not say whether it wrote ours): the
                // one-key statement decides, and finds our row if the batch did write it.
                Ok(Some(Batched::Done(None) | Batched::Alone) | None) => {}
            }
        }
        for _ in 0..BEGIN_ATTEMPTS {
            let statement = self.claim_statement(request, attempt.claimant);
            if let Some(row) = attempt.run(statement).await? {
                let begin = decode_begin(request, &row)?;
                attempt.settle();
                return Ok(begin.map_claim(|lease| PgClaim { lease, tx: None }));
            }
        }
        // No row in any try: nothing was claimed.
        attempt.settle();
        Err(PostgresStoreError::Contended)
    }

    async fn renew_lease(
        &self,
        held: &Lease,
        lease: Duration,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let statement =
            fenced_statement(self.fenced_sql().renew, held).with(Param::Interval(lease));
        self.fenced("renew", statement, &self.pool).await
    }

    async fn complete_lease(
        &self,
        held: &Lease,
        record: &Record,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        if self.batches() && record.size() <= MAX_BATCHED_RECORD {
            let (pool, timeout) = (self.pool.clone(), self.timeout);
            let notifications = Arc::clone(&self.notifications);
            let completed = self
                .completions
                .run(
                    (*held, record.clone()),
                    move |writer, batch| {
                        let notify = notifications.emit();
                        complete_many(pool.clone(), timeout, notify, writer, batch)
                    },
                    // Stored, whether or not anyone waits to hear it.
                    drop,
                )
                .await;
            match completed {
                Some(Batched::Done(status)) => return Ok(status),
                Some(Batched::TimedOut) => return Err(self.timeout_error("complete")),
                Some(Batched::Alone) | None => {}
            }
        }
        self.fenced(
            "complete",
            complete_statement(self.complete_sql(), held, record),
            &self.pool,
        )
        .await
    }

    async fn release_lease(&self, held: &Lease) -> Result<ClaimStatus, PostgresStoreError> {
        let sql = if self.notifications.emit() {
            self.fenced_sql().release_notify
        } else {
            self.fenced_sql().release
        };
        self.fenced("release", fenced_statement(sql, held), &self.pool)
            .await
    }

    /// The fenced completion, announcing the key to waiting duplicates if any may wait.
    fn complete_sql(&self) -> &'static str {
        if self.notifications.emit() {
            self.fenced_sql().complete_notify
        } else {
            self.fenced_sql().complete
        }
    }

    /// Wakes the duplicates waiting for `key` after a rollback freed it (a rollback notifies
    /// nothing). Best effort: a waiter that misses it reads the key again within a second.
    async fn notify_released(&self, key: &ScopeKey) {
        if !self.notifications.emit() {
            return;
        }
        let statement = Statement::new(NOTIFY_ONE).with(Param::Key(stored_key(key)));
        if let Err(error) = self
            .timed("release", statement.execute(self.prepared, &self.pool))
            .await
        {
            tracing::debug!(%error, "could not announce a released key");
        }
    }

    /// A transactional claim that could not commit. If the handler wrote through the
    /// transaction, that is the answer (nothing happened). If it did not, its response stands,
    /// as in lease mode, and the claim went with the transaction: the key is claimed again in
    /// lease mode to store it, so no retry runs the handler again meanwhile.
    async fn failed_commit(
        &self,
        tx_claim: &TxClaim,
        record: &Record,
        error: PostgresStoreError,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        if tx_claim.slot.was_used() {
            return Err(error);
        }
        tracing::warn!(%error, "committing an unused transaction failed; claiming the key again to store the response");
        tx_claim.set_fallback(Fallback::Reclaim);
        match self.reclaim(tx_claim).await {
            Ok(ClaimStatus::Held) => match tx_claim.fallback() {
                Fallback::Lease(held) => self.complete_lease(&held, record).await,
                // Stored already: the commit reported as failed went through.
                _ => Ok(ClaimStatus::Held),
            },
            Ok(status) => Ok(status),
            Err(_) => Err(error),
        }
    }

    /// Claims a fallen-back transactional claim's key again, in lease mode: `Held` once it holds
    /// it again (or finds its own record stored), `Lost` if another request got there first.
    async fn reclaim(&self, tx_claim: &TxClaim) -> Result<ClaimStatus, PostgresStoreError> {
        match self.begin_lease(&tx_claim.request).await? {
            Begin::Acquired { claim, .. } => {
                tx_claim.set_fallback(Fallback::Lease(claim.lease));
                Ok(ClaimStatus::Held)
            }
            Begin::Completed { .. } => {
                tx_claim.set_fallback(Fallback::None);
                Ok(ClaimStatus::Held)
            }
            Begin::InFlight { .. } | Begin::Mismatch => {
                tracing::error!(
                    "another request claimed the key while its response was being stored; \
                     the handler may run twice"
                );
                Ok(ClaimStatus::Lost)
            }
        }
    }

    /// Deletes what the claim attempt `claimant` may hold on `key`: tried after each of
    /// `delays`, until a try deletes its row, so that a statement the attempt gave up on that
    /// commits late is still undone.
    async fn release_claimant(self, key: ScopeKey, claimant: Uuid, delays: &[Duration]) {
        let sql = if self.partitions.is_some() {
            RELEASE_CLAIMANT_PARTITIONED
        } else {
            RELEASE_CLAIMANT
        };
        for delay in delays {
            tokio::time::sleep(*delay).await;
            let statement = Statement::new(sql)
                .with(Param::Key(stored_key(&key)))
                .with(Param::Key(claimant));
            match self.fenced("release", statement, &self.pool).await {
                Ok(ClaimStatus::Held) => {
                    tracing::debug!("released a claim whose answer was lost");
                    break;
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(
                    %error,
                    "releasing a claim whose answer was lost failed; retrying"
                ),
            }
        }
        self.unsettled.fetch_sub(1, Ordering::Relaxed);
    }

    async fn begin_transactional(
        &self,
        request: &ClaimRequest,
    ) -> Result<Begin<PgClaim>, PostgresStoreError> {
        let mut tx = self
            .timed(
                "begin",
                self.pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED"),
            )
            .await?;
        for _ in 0..BEGIN_ATTEMPTS {
            let row = self
                .timed(
                    "begin",
                    self.claim_statement(request, new_claimant())
                        .fetch_optional(self.prepared, &mut *tx),
                )
                .await?;
            let Some(row) = row else { continue };
            return match decode_begin(request, &row)? {
                Begin::Acquired {
                    claim: lease,
                    takeover,
                } => Ok(Begin::Acquired {
                    claim: PgClaim {
                        lease,
                        tx: Some(Box::new(TxClaim {
                            slot: Arc::new(TxSlot::new(tx)),
                            request: request.clone(),
                            fallback: std::sync::Mutex::new(Fallback::None),
                        })),
                    },
                    takeover,
                }),
                other => {
                    let other = other.map_claim(|lease| PgClaim { lease, tx: None });
                    // Nothing was written; end the transaction (and its lock attempt) now.
                    self.timed("begin", tx.rollback()).await?;
                    Ok(other)
                }
            };
        }
        Err(PostgresStoreError::Contended)
    }
}

/// The key a record is stored under: the first 128 bits of its scope key, as a `uuid` (see
/// the migration `20261123000001_uuid_scope_keys.sql` for why and why that is enough).
fn stored_key(key: &ScopeKey) -> Uuid {
    let mut prefix = [0; 16];
    prefix.copy_from_slice(&key.as_bytes()[..16]);
    Uuid::from_bytes(prefix)
}

/// The advisory lock of a key in transactional mode: the first 64 bits of its hash. Two keys
/// sharing them (a chance of 2⁻⁶⁴ per pair) only make one of them wait its turn with a `409`.
fn advisory_lock_key(request: &ClaimRequest) -> i64 {
    let mut prefix = [0; 8];
    prefix.copy_from_slice(&request.key.as_bytes()[..8]);
    i64::from_be_bytes(prefix)
}

/// Writes a batch of [`CLAIM_NEW_KEYS`]: for each request its new claim, `None` when its key
/// has a row already. Bounded by [`FLUSH_BOUND`], not by the store's timeout: a caller that
/// stops waiting has its claim released when the batch's answer comes (see `begin_lease`).
async fn claim_new_keys(
    pool: PgPool,
    timeout: Duration,
    mut writer: BatchWriter,
    batch: Vec<(ClaimRequest, Uuid)>,
) -> (BatchWriter, Vec<Batched<Option<Lease>>>) {
    crate::metrics::batch("claim", batch.len());
    let keys: Vec<Uuid> = batch.iter().map(|(r, _)| stored_key(&r.key)).collect();
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by_key(|&i| keys[i]);
    // A key twice in one batch: the second one claims alone, after the first.
    let mut alone = vec![false; batch.len()];
    for pair in order.windows(2) {
        if keys[pair[0]] == keys[pair[1]] {
            alone[pair[1]] = true;
        }
    }
    let sent: Vec<usize> = order.into_iter().filter(|&i| !alone[i]).collect();
    let micros = |d: Duration| i64::try_from(interval(d).as_micros()).unwrap_or(i64::MAX);
    let query = sqlx::query(CLAIM_NEW_KEYS)
        .bind(sent.iter().map(|&i| keys[i]).collect::<Vec<_>>())
        .bind(
            sent.iter()
                .map(|&i| &batch[i].0.fingerprint.as_bytes()[..])
                .collect::<Vec<_>>(),
        )
        .bind(
            sent.iter()
                .map(|&i| micros(batch[i].0.lease))
                .collect::<Vec<_>>(),
        )
        .bind(
            sent.iter()
                .map(|&i| micros(batch[i].0.ttl))
                .collect::<Vec<_>>(),
        )
        .bind(sent.iter().map(|&i| batch[i].1).collect::<Vec<_>>());
    let bound = timeout.max(FLUSH_BOUND);
    let tokens = match written(query, &pool, bound, &mut writer).await {
        Ok(tokens) => tokens,
        Err(failed) => return (writer, vec![failed; batch.len()]),
    };
    let claimed = batch
        .iter()
        .zip(keys)
        .zip(alone)
        .map(|(((request, _), key), alone)| {
            if alone {
                Batched::Alone
            } else {
                Batched::Done(tokens.get(&key).map(|&token| Lease {
                    key: request.key,
                    token,
                }))
            }
        })
        .collect();
    (writer, claimed)
}

/// How long a batch of claims may take before the flusher gives up on it. Its callers stop
/// waiting after the store's timeout; the flusher waits longer so that the claims it wrote can
/// be released by their tokens. A batch given up on leaves each caller's [`ClaimAttempt`] to
/// release its claim by claimant.
const FLUSH_BOUND: Duration = Duration::from_secs(30);

/// Writes a batch of [`COMPLETE_MANY`]: for each claim, whether it still held its key.
async fn complete_many(
    pool: PgPool,
    timeout: Duration,
    notify: bool,
    mut writer: BatchWriter,
    batch: Vec<(Lease, Record)>,
) -> (BatchWriter, Vec<Batched<ClaimStatus>>) {
    crate::metrics::batch("complete", batch.len());
    let mut keys = Vec::with_capacity(batch.len());
    let mut tokens = Vec::with_capacity(batch.len());
    let mut statuses = Vec::with_capacity(batch.len());
    let mut bodies = Vec::with_capacity(batch.len());
    let (mut firsts, mut lasts) = (
        Vec::with_capacity(batch.len()),
        Vec::with_capacity(batch.len()),
    );
    let (mut names, mut values) = (Vec::new(), Vec::new());
    for (lease, record) in &batch {
        keys.push(stored_key(&lease.key));
        tokens.push(lease.token);
        statuses.push(record.status().as_u16() as i16);
        bodies.push(record.body().map(|b| &b[..]));
        // 1-based and inclusive, as PostgreSQL's array slices are.
        firsts.push(names.len() as i32 + 1);
        for (name, value) in record.headers() {
            names.push(name.as_str());
            values.push(value.as_bytes());
        }
        lasts.push(names.len() as i32);
    }
    let query = sqlx::query(COMPLETE_MANY)
        .bind(&keys[..])
        .bind(tokens)
        .bind(statuses)
        .bind(bodies)
        .bind(firsts)
        .bind(lasts)
        .bind(names)
        .bind(values)
        .bind(notify);
    let held = match written(query, &pool, timeout, &mut writer).await {
        Ok(held) => held,
        Err(failed) => return (writer, vec![failed; batch.len()]),
    };
    let completed = batch
        .iter()
        .zip(&keys)
        .map(|((lease, _), key)| {
            Batched::Done(if held.get(key) == Some(&lease.token) {
                ClaimStatus::Held
            } else {
                ClaimStatus::Lost
            })
        })
        .collect();
    (writer, completed)
}

/// The connection a batch flusher keeps from one batch to the next while batches keep coming:
/// a pool checkout costs a round trip each way (sqlx pings a connection when it is taken and
/// again when it is given back), which back-to-back batches skip. It goes back to the pool
/// when the queue empties, after [`BATCHES_PER_CHECKOUT`] batches (so the pool's lifetime
/// limits still apply under constant load), and is closed after any failure.
#[derive(Default)]
struct BatchWriter {
    connection: Option<PoolConnection<Postgres>>,
    batches: u32,
}

/// How many batches a flusher writes on one pool connection before giving it back.
const BATCHES_PER_CHECKOUT: u32 = 256;

/// Runs a batch statement returning `(scope_key, token)` rows: each key it wrote, with its
/// token. Otherwise what each of the batch's operations does instead: a timeout is every
/// operation's timeout; any other failure (a deadlock with another instance's batch, a lost
/// connection, a row it cannot read) sends each to do its operation alone, where it succeeds or
/// fails on its own.
async fn written<T>(
    query: sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments>,
    pool: &PgPool,
    timeout: Duration,
    writer: &mut BatchWriter,
) -> Result<HashMap<Uuid, i64>, Batched<T>> {
    // Taken out, so that the writer starts afresh whatever goes wrong below.
    let BatchWriter {
        connection: held,
        batches,
    } = std::mem::take(writer);
    let run = async {
        let mut connection = match held {
            Some(connection) => connection,
            None => pool.acquire().await?,
        };
        match query.fetch_all(&mut *connection).await {
            Ok(rows) => Ok((connection, rows)),
            Err(error) => {
                // The connection's state is unknown: don't hand it to anyone else.
                connection.close_on_drop();
                Err(error)
            }
        }
    };
    let rows = match tokio::time::timeout(timeout, run).await {
        Ok(Ok((connection, rows))) => {
            if batches + 1 < BATCHES_PER_CHECKOUT {
                *writer = BatchWriter {
                    connection: Some(connection),
                    batches: batches + 1,
                };
            }
            rows
        }
        Ok(Err(error)) => {
            tracing::debug!(%error, "a batch of idempotency store operations failed; each goes alone");
            return Err(Batched::Alone);
        }
        Err(_) => return Err(Batched::TimedOut),
    };
    rows.iter()
        .map(|row| {
            Some((
                row.try_get::<Uuid, _>(0).ok()?,
                row.try_get::<i64, _>(1).ok()?,
            ))
        })
        .collect::<Option<_>>()
        .ok_or(Batched::Alone)
}

/// The longest interval the store writes: far beyond any TTL or lease, and far from the
/// bounds of PostgreSQL's `timestamptz`.
const MAX_INTERVAL: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `d` as PostgreSQL can take it: whole microseconds (rounded up, so a positive duration stays
/// positive), at most [`MAX_INTERVAL`].
fn interval(d: Duration) -> Duration {
    let micros = d.as_nanos().div_ceil(1000);
    Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX)).min(MAX_INTERVAL)
}

fn fenced_statement<'a>(sql: &'static str, lease: &'a Lease) -> Statement<'a> {
    Statement::new(sql)
        .with(Param::Key(stored_key(&lease.key)))
        .with(Param::Int(lease.token))
}

fn complete_statement<'a>(
    sql: &'static str,
    lease: &'a Lease,
    record: &'a Record,
) -> Statement<'a> {
    let (names, values) = record
        .headers()
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_bytes()))
        .unzip();
    fenced_statement(sql, lease)
        .with(Param::SmallInt(record.status().as_u16() as i16))
        .with(Param::Texts(names))
        .with(Param::BytesList(values))
        .with(Param::OptionalBytes(record.body().map(|b| b.as_ref())))
}

/// The store's side of [`InFlightWatch::Notified`]: whether its statements announce settled
/// keys, and the listener that wakes this process's waiters.
#[derive(Debug, Default)]
struct Notifications {
    emit: AtomicBool,
    listening: AtomicBool,
    notifier: Notifier,
}

impl Notifications {
    fn emit(&self) -> bool {
        self.emit.load(Ordering::Relaxed)
    }

    /// Starts the listener, once, if there is a runtime to run it on (else at the next call).
    fn listen(self: &Arc<Self>, pool: &PgPool) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.listening.swap(true, Ordering::AcqRel) {
            return;
        }
        // Until it listens, waiters poll.
        self.notifier.set_live(false);
        runtime.spawn(listen(Arc::downgrade(self), pool.clone()));
    }
}

/// Wakes this process's waiters whenever any instance announces a settled key; while it cannot
/// listen (connecting, or reconnecting after a lost connection) waiters poll. Ends once the
/// store is dropped.
async fn listen(notifications: std::sync::Weak<Notifications>, pool: PgPool) {
    let mut pause = Duration::from_millis(100);
    loop {
        let Some(notifier) = notifications.upgrade().map(|n| n.notifier.clone()) else {
            return;
        };
        let listener = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
            listener.listen(SETTLED_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let mut listener = match listener.await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for settled keys; waiters poll meanwhile");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        pause = Duration::from_millis(100);
        notifier.set_live(true);
        loop {
            // Wakes now and then to notice that the store is gone.
            let received = tokio::time::timeout(Duration::from_secs(1), listener.try_recv()).await;
            match received {
                Ok(Ok(Some(notification))) => {
                    if let Ok(key) = notification.payload().parse::<Uuid>() {
                        notifier.notify_prefix(*key.as_bytes());
                    }
                }
                // The connection was lost: what was announced meanwhile is lost too.
                Ok(Ok(None) | Err(_)) => {
                    notifier.set_live(false);
                    break;
                }
                Err(_) if notifications.strong_count() == 0 => return,
                Err(_) => {}
            }
        }
    }
}

/// The most claim attempts settled in the background at once (see [`ClaimAttempt`]); past it,
/// a lost claim is left to lapse with its lease, so an outage cannot pile up tasks.
const MAX_UNSETTLED: usize = 1024;

/// When a claim attempt whose answer was lost deletes its row: at once, then again after the
/// statements it gave up on have had time to commit late.
const SETTLE_DELAYS: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_secs(1),
    Duration::from_secs(10),
];

/// How long a claim statement given up on is left to finish in the background before its
/// claim is released by claimant alone.
const ABANDONED_STATEMENT_BOUND: Duration = Duration::from_secs(60);

/// A fresh claimant id: this process's random half and a count, so two attempts never share one.
fn new_claimant() -> Uuid {
    static PROCESS: LazyLock<u64> = LazyLock::new(|| {
        use std::hash::{BuildHasher, RandomState};
        RandomState::new().hash_one(std::process::id())
    });
    static COUNT: AtomicU64 = AtomicU64::new(0);
    Uuid::from_u64_pair(*PROCESS, COUNT.fetch_add(1, Ordering::Relaxed))
}

/// A statement that runs on a pooled connection of its own, owned so it can outlive its caller.
type PendingStatement = Pin<Box<dyn Future<Output = Result<Option<PgRow>, sqlx::Error>> + Send>>;

/// One lease-mode claim: its claimant id, and what happens if its caller never learns the
/// answer. Unless [`settle`](Self::settle)d, dropping it (an error, a timeout, a cancelled
/// request) finishes the statement it was waiting for in the background and then deletes
/// whatever row the attempt's claimant holds: a claim nobody holds never blocks its key.
struct ClaimAttempt {
    store: Option<PostgresStore>,
    key: ScopeKey,
    claimant: Uuid,
    pending: Option<PendingStatement>,
}

impl ClaimAttempt {
    fn new(store: &PostgresStore, key: ScopeKey) -> Self {
        Self {
            store: Some(store.clone()),
            key,
            claimant: new_claimant(),
            pending: None,
        }
    }

    /// Runs a claim statement under the store's timeout; given up on, it stays pending.
    async fn run(
        &mut self,
        statement: Statement<'static>,
    ) -> Result<Option<PgRow>, PostgresStoreError> {
        let store = self.store.as_ref().expect("unsettled while running");
        let (pool, prepared, timeout) = (store.pool.clone(), store.prepared, store.timeout);
        let pending = self.pending.insert(Box::pin(async move {
            statement.fetch_optional(prepared, &pool).await
        }));
        match tokio::time::timeout(timeout, pending).await {
            Ok(result) => {
                self.pending = None;
                Ok(result?)
            }
            Err(_) => Err(store.timeout_error("begin")),
        }
    }

    /// The caller has the answer: nothing to undo.
    fn settle(&mut self) {
        self.store = None;
    }
}

impl Drop for ClaimAttempt {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if store.unsettled.fetch_add(1, Ordering::Relaxed) >= MAX_UNSETTLED {
            store.unsettled.fetch_sub(1, Ordering::Relaxed);
            tracing::warn!(
                "too many lost claims to release; this one frees itself when its lease lapses"
            );
            return;
        }
        let (key, claimant, pending) = (self.key, self.claimant, self.pending.take());
        runtime.spawn(async move {
            if let Some(pending) = pending {
                let _ = tokio::time::timeout(ABANDONED_STATEMENT_BOUND, pending).await;
            }
            store.release_claimant(key, claimant, &SETTLE_DELAYS).await;
        });
    }
}

/// A store statement with its parameters.
///
/// Run as a cached prepared statement with bound parameters (the default), or as one
/// simple-protocol query with the parameters written in as literals
/// ([`PostgresStore::without_prepared_statements`]). Every literal is a number, a `uuid`'s hex
/// digits and hyphens in quotes, or `decode('<hex>', 'hex')`, so no parameter can change the
/// statement.
struct Statement<'a> {
    sql: &'static str,
    params: Vec<Param<'a>>,
}

enum Param<'a> {
    Key(Uuid),
    Digest([u8; 32]),
    OptionalBytes(Option<&'a [u8]>),
    Int(i64),
    SmallInt(i16),
    Bool(bool),
    Interval(Duration),
    Texts(Vec<&'a str>),
    BytesList(Vec<&'a [u8]>),
}

impl<'a> Statement<'a> {
    fn new(sql: &'static str) -> Self {
        Self {
            sql,
            params: Vec::with_capacity(6),
        }
    }

    fn with(mut self, param: Param<'a>) -> Self {
        self.params.push(param);
        self
    }

    fn prepared(self) -> sqlx::query::Query<'a, Postgres, sqlx::postgres::PgArguments> {
        self.params
            .into_iter()
            .fold(sqlx::query(self.sql), |query, param| match param {
                Param::Key(key) => query.bind(key),
                Param::Digest(digest) => query.bind(digest.to_vec()),
                Param::OptionalBytes(bytes) => query.bind(bytes),
                Param::Int(n) => query.bind(n),
                Param::Bool(b) => query.bind(b),
                Param::SmallInt(n) => query.bind(n),
                Param::Interval(d) => query.bind(interval(d)),
                Param::Texts(texts) => query.bind(texts),
                Param::BytesList(list) => query.bind(list),
            })
    }

    /// The statement with `$n` replaced by literals (last first, so `$1` never eats `$10`).
    fn inlined(&self) -> String {
        fn bytes(out: &mut String, bytes: &[u8]) {
            out.push_str("decode('");
            for b in bytes {
                out.push_str(&format!("{b:02x}"));
            }
            out.push_str("', 'hex')");
        }
        let mut sql = self.sql.to_owned();
        for (i, param) in self.params.iter().enumerate().rev() {
            let mut literal = String::new();
            match param {
                Param::Key(key) => literal.push_str(&format!("'{key}'::uuid")),
                Param::Digest(b) => bytes(&mut literal, b),
                Param::OptionalBytes(Some(b)) => bytes(&mut literal, b),
                Param::OptionalBytes(None) => literal.push_str("NULL::bytea"),
                Param::Int(n) => literal.push_str(&format!("({n})::int8")),
                Param::Bool(b) => literal.push_str(if *b { "true" } else { "false" }),
                Param::SmallInt(n) => literal.push_str(&format!("({n})::int2")),
                Param::Interval(d) => literal.push_str(&format!(
                    "({}::int8 * interval '1 microsecond')",
                    interval(*d).as_micros()
                )),
                Param::Texts(texts) => {
                    literal.push_str("ARRAY[");
                    for (j, text) in texts.iter().enumerate() {
                        literal.push_str(if j == 0 {
                            "convert_from("
                        } else {
                            ", convert_from("
                        });
                        bytes(&mut literal, text.as_bytes());
                        literal.push_str(", 'UTF8')");
                    }
                    literal.push_str("]::text[]");
                }
                Param::BytesList(list) => {
                    literal.push_str("ARRAY[");
                    for (j, b) in list.iter().enumerate() {
                        if j > 0 {
                            literal.push_str(", ");
                        }
                        bytes(&mut literal, b);
                    }
                    literal.push_str("]::bytea[]");
                }
            }
            sql = sql.replace(&format!("${}", i + 1), &literal);
        }
        sql
    }

    async fn fetch_optional<'c>(
        self,
        prepared: bool,
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        if prepared {
            self.prepared().fetch_optional(conn).await
        } else {
            sqlx::raw_sql(AssertSqlSafe(self.inlined()))
                .fetch_optional(conn)
                .await
        }
    }

    async fn execute<'c>(
        self,
        prepared: bool,
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<sqlx::postgres::PgQueryResult, sqlx::Error> {
        if prepared {
            self.prepared().execute(conn).await
        } else {
            sqlx::raw_sql(AssertSqlSafe(self.inlined()))
                .execute(conn)
                .await
        }
    }
}

impl Store for PostgresStore {
    type Claim = PgClaim;
    type Error = PostgresStoreError;

    async fn begin(&self, request: &ClaimRequest) -> Result<Begin<PgClaim>, PostgresStoreError> {
        if self.transactional {
            // Boxed: opening a transaction is a large future, which would otherwise make every
            // lease-mode request's future as large.
            Box::pin(self.begin_transactional(request)).await
        } else {
            self.begin_lease(request).await
        }
    }

    async fn renew(
        &self,
        claim: &PgClaim,
        lease: Duration,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let Some(tx_claim) = &claim.tx else {
            return self.renew_lease(&claim.lease, lease).await;
        };
        match tx_claim.fallback() {
            // The open transaction is the lease: it ends when the holder's connection does.
            Fallback::None if tx_claim.slot.is_settled() => Ok(ClaimStatus::Lost),
            Fallback::None => Ok(ClaimStatus::Held),
            Fallback::Reclaim => self.reclaim(tx_claim).await,
            Fallback::Lease(held) => self.renew_lease(&held, lease).await,
        }
    }

    async fn complete(
        &self,
        claim: &PgClaim,
        record: &Record,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let Some(tx_claim) = &claim.tx else {
            return self.complete_lease(&claim.lease, record).await;
        };
        match tx_claim.fallback() {
            Fallback::None => {}
            Fallback::Reclaim => {
                return match (self.reclaim(tx_claim).await?, tx_claim.fallback()) {
                    (ClaimStatus::Held, Fallback::Lease(held)) => {
                        self.complete_lease(&held, record).await
                    }
                    // Held, with the record found stored; or lost to another request.
                    (status, _) => Ok(status),
                };
            }
            Fallback::Lease(held) => return self.complete_lease(&held, record).await,
        }
        let slot = &tx_claim.slot;
        let Some(mut tx) = slot
            .take()
            .map_err(|_| PostgresStoreError::TransactionHeld)?
        else {
            return Ok(ClaimStatus::Lost);
        };
        let stored = self
            .fenced(
                "complete",
                complete_statement(self.complete_sql(), &claim.lease, record),
                &mut *tx,
            )
            .await;
        let status = match stored {
            Ok(status) => status,
            // 25P02 in_failed_sql_transaction: a statement of the handler failed, and the
            // handler answered anyway. Nothing it wrote can commit; the key is freed.
            Err(error) if error.sqlstate() == Some("25P02") => {
                if let Err(error) = self.timed("complete", tx.rollback()).await {
                    tracing::debug!(%error, "rolling back an aborted transaction failed");
                }
                self.notify_released(&claim.lease.key).await;
                return Ok(ClaimStatus::RolledBack);
            }
            Err(error) => return self.failed_commit(tx_claim, record, error).await,
        };
        let ended = match status {
            ClaimStatus::Held => self.timed("complete", tx.commit()).await,
            _ => self.timed("complete", tx.rollback()).await,
        };
        match ended {
            Ok(()) => Ok(status),
            Err(error) => self.failed_commit(tx_claim, record, error).await,
        }
    }

    async fn release(&self, claim: &PgClaim) -> Result<ClaimStatus, PostgresStoreError> {
        let Some(tx_claim) = &claim.tx else {
            return self.release_lease(&claim.lease).await;
        };
        match tx_claim.fallback() {
            Fallback::None => {}
            Fallback::Reclaim => return Ok(ClaimStatus::Lost),
            Fallback::Lease(held) => return self.release_lease(&held).await,
        }
        // Rolling back undoes the claim and the handler's writes together.
        let Some(tx) = tx_claim
            .slot
            .take()
            .map_err(|_| PostgresStoreError::TransactionHeld)?
        else {
            return Ok(ClaimStatus::Lost);
        };
        self.timed("release", tx.rollback()).await?;
        self.notify_released(&claim.lease.key).await;
        Ok(ClaimStatus::Held)
    }

    fn attach(&self, claim: &PgClaim, extensions: &mut http::Extensions) {
        if let Some(tx_claim) = &claim.tx {
            extensions.insert(Arc::clone(&tx_claim.slot));
        }
    }

    /// `LISTEN`/`NOTIFY`: from now on, every completion and release of this store (and of every
    /// other instance whose layer waits) announces its key on the channel
    /// `idempotency_settled`, and one connection of the pool listens to it, shared by all the
    /// waiters of this process. With
    /// [`with_in_flight_polling`](PostgresStore::with_in_flight_polling), waiters poll instead.
    fn watch_in_flight(&self) -> InFlightWatch {
        if let Some(interval) = self.in_flight_polling {
            return InFlightWatch::Polled(interval);
        }
        self.notifications.emit.store(true, Ordering::Relaxed);
        self.notifications.listen(&self.pool);
        InFlightWatch::Notified(self.notifications.notifier.clone())
    }

    /// Half the pool in transactional mode, where each claim holds a pooled connection.
    fn detached_limit(&self) -> Option<usize> {
        let pool = self.pool.options().get_max_connections() as usize;
        self.transactional.then_some((pool / 2).max(1))
    }

    fn commits_effects(&self, claim: &PgClaim) -> bool {
        claim
            .tx
            .as_ref()
            .is_some_and(|tx_claim| tx_claim.slot.was_used())
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
struct Partition {
    start: i64,
    end: i64,
    /// A `DETACH CONCURRENTLY` was interrupted and must be finalised.
    detaching: bool,
}

impl Partition {
    fn name(&self) -> String {
        format!("partitioned_records_{}_{}", self.start, self.end)
    }

    fn parse(name: &str, detaching: bool) -> Option<Self> {
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
fn partitions_to_create(
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
fn uncovered(existing: &[Partition], start: i64, end: i64) -> Vec<Partition> {
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

impl ExpiredDeletion for PostgresStore {
    /// Deletes at most `batch` expired records; in partitioned mode, runs
    /// [`maintain_partitions`](PostgresStore::maintain_partitions) instead (whole partitions,
    /// whatever their size) and returns the records they held.
    async fn delete_expired(&self, batch: u32) -> Result<u64, PostgresStoreError> {
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

fn decode_begin(request: &ClaimRequest, row: &PgRow) -> Result<Begin<Lease>, PostgresStoreError> {
    match row.try_get::<&str, _>("outcome")? {
        "acquired" => {
            return Ok(Begin::Acquired {
                claim: Lease {
                    key: request.key,
                    token: row.try_get("token")?,
                },
                takeover: row.try_get("takeover")?,
            });
        }
        "busy" => {
            return Ok(Begin::InFlight {
                lease_remaining: None,
            });
        }
        _ => {}
    }
    if !row.try_get::<bool, _>("same_fingerprint")? {
        return Ok(Begin::Mismatch);
    }
    // In flight under this attempt's own claimant: claimed by an earlier try whose answer was
    // lost (a batch that failed after it committed).
    if row.try_get::<Option<bool>, _>("mine")? == Some(true) {
        return Ok(Begin::Acquired {
            claim: Lease {
                key: request.key,
                token: row.try_get("token")?,
            },
            takeover: row.try_get("takeover")?,
        });
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
    let expires_in: Option<f64> = row.try_get("expires_in")?;
    Ok(Begin::Completed {
        record: Record::from_parts(status, headers, body.map(Bytes::from)),
        expires_in: expires_in.and_then(|s| Duration::try_from_secs_f64(s).ok()),
    })
}

/// A [`PostgresStore`] operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum PostgresStoreError {
    /// The database returned an error or could not be reached.
    Database(sqlx::Error),
    /// Applying the migrations failed.
    Migrate(sqlx::migrate::MigrateError),
    /// The store's tables do not exist in this database: run
    /// [`PostgresStore::migrate`] at start-up (or apply [`PostgresStore::migrator`]).
    NotMigrated(sqlx::Error),
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
    /// Transactional mode: the handler still held its [`IdempotentTx`](crate::IdempotentTx)
    /// when it returned (it moved it into a task that outlived it), so the transaction could not
    /// be committed; it is rolled back when that task lets go.
    TransactionHeld,
}

impl fmt::Display for PostgresStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Database(_) => f.write_str("PostgreSQL idempotency store error"),
            Self::Migrate(_) => f.write_str("applying the idempotency store's migrations failed"),
            Self::NotMigrated(_) => f.write_str(
                "the idempotency schema is missing from this database: call \
                 PostgresStore::migrate() at start-up",
            ),
            Self::Timeout { operation, after } => {
                write!(
                    f,
                    "PostgreSQL idempotency store `{operation}` timed out after {after:?}"
                )
            }
            Self::Corrupt(what) => write!(f, "stored idempotency record is corrupt: {what}"),
            Self::Contended => f.write_str("idempotency key kept changing while being claimed"),
            Self::TransactionHeld => f.write_str(
                "the handler still held its IdempotentTx after returning, so its transaction could \
                 not be committed; it is rolled back (and the key freed) when the handler's task \
                 lets go of it",
            ),
        }
    }
}

impl PostgresStoreError {
    /// The SQLSTATE of a database error.
    fn sqlstate(&self) -> Option<&str> {
        match self {
            Self::Database(error) => error.as_database_error()?.code().map(|code| match code {
                std::borrow::Cow::Borrowed(code) => code,
                // sqlx hands PostgreSQL's codes out borrowed.
                std::borrow::Cow::Owned(_) => "",
            }),
            _ => None,
        }
    }
}

impl std::error::Error for PostgresStoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Database(error) | Self::NotMigrated(error) => Some(error),
            Self::Migrate(error) => Some(error),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for PostgresStoreError {
    fn from(error: sqlx::Error) -> Self {
        // 42P01 undefined_table, 3F000 invalid_schema_name: the migrations never ran here.
        let code = error.as_database_error().and_then(|e| e.code());
        if matches!(code.as_deref(), Some("42P01" | "3F000")) {
            return Self::NotMigrated(error);
        }
        Self::Database(error)
    }
}

/// The transaction a transactional claim holds.
pub(crate) type PgTransaction = Transaction<'static, Postgres>;

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
