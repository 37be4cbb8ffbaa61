use std::{
    sync::{
        Arc, LazyLock,
        atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use sqlx::{PgPool, migrate::Migrator};

use super::{
    Capabilities, ClaimHandle, ClaimRequest, ClaimStatus, Fence, InFlightWatch, KeyState, Store,
};
use crate::record::Record;

mod attempt;
mod batch;
mod claim;
mod durability;
mod error;
mod expiry;
mod fenced;
mod group_commit;
mod notify;
mod partitions;
mod pending;
mod settings;
mod sql;
mod statement;
mod steps;
mod transaction;

use batch::Batcher;
use durability::DurabilityWatch;
use fenced::{complete_statement, fenced_statement};
use group_commit::{Batched, ClaimBatcher, MAX_BATCH};
use notify::Notifications;
use partitions::Partitioning;
use sql::{FENCED, FENCED_PARTITIONED, Fenced};
use transaction::{Fallback, TxClaim};

pub use durability::{Durability, DurabilityReport};
pub use error::PostgresStoreError;
pub use partitions::PartitionMaintenance;
pub use settings::{
    MAX_PARTITIONS_AHEAD, MIN_IN_FLIGHT_POLLING, MIN_PARTITION_WIDTH, PostgresConfigError,
};
pub(crate) use transaction::{LentTx, TxSlot};

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
///   **one transaction**, or roll back together. See the [modes guide](crate::guide::modes).
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
    /// How far ahead partitioned mode keeps partitions, whether set before or after
    /// [`partitioned`](Self::partitioned).
    partitions_ahead: Duration,
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
    /// [`capabilities`](Store::capabilities)).
    notifications: Arc<Notifications>,
    /// Waiters poll every so often instead ([`with_in_flight_polling`](Self::with_in_flight_polling)).
    in_flight_polling: Option<Duration>,
    /// Lease mode's group commit of completions.
    completions: Arc<Batcher<(Fence, Record), Batched<ClaimStatus>>>,
    /// Whether a handler on this store recorded or read steps: from then on, a claim of a new
    /// key says whether it has any, a check that apps without steps do not pay for.
    steps_used: Arc<AtomicBool>,
    /// What the store requires of the cluster, and its last reading of what it promises.
    durability: Durability,
    durability_watch: Arc<DurabilityWatch>,
}

/// A claim held in a [`PostgresStore`]: its fencing token and, in transactional mode, the open
/// transaction.
#[derive(Debug)]
pub struct PgClaim {
    fence: Fence,
    tx: Option<Box<TxClaim>>,
    /// The claim inserted its key's row and found no steps for its payload.
    stepless: bool,
}

impl PgClaim {
    /// A lease-mode claim of `fence`; `stepless` when it found no steps of its key.
    fn lease(fence: Fence, stepless: bool) -> Self {
        Self {
            fence,
            tx: None,
            stepless,
        }
    }

    /// The claimed key and its fencing token.
    pub fn fence(&self) -> &Fence {
        &self.fence
    }
}

static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let embedded = sqlx::migrate!("./migrations");
    let mut migrator = Migrator::with_migrations(embedded.iter().cloned().collect());
    migrator.create_schema("idempotency");
    migrator.dangerous_set_table_name("idempotency._sqlx_migrations");
    migrator
});

impl PostgresStore {
    /// A store on `pool`, in lease mode. Call [`migrate`](Self::migrate) once before use.
    pub fn new(pool: PgPool) -> Self {
        let notifications = Arc::new(Notifications::default());
        // Building a layer starts nothing: the first waiter starts the listener.
        let (weak, listen_on) = (Arc::downgrade(&notifications), pool.clone());
        notifications.notifier.start_on_wait(move || {
            if let Some(notifications) = weak.upgrade() {
                notifications.listen(&listen_on);
            }
        });
        Self {
            pool,
            timeout: Duration::from_secs(5),
            transactional: false,
            prepared: true,
            partitions: None,
            partitions_ahead: Duration::from_secs(2 * 24 * 3600),
            expiry_cursor: Arc::default(),
            // A claim whose caller stopped waiting before its batch was written is not written.
            new_claims: Arc::new(Batcher::new(MAX_BATCH).skipping_abandoned()),
            completions: Arc::new(Batcher::new(MAX_BATCH)),
            unsettled: Arc::default(),
            notifications,
            in_flight_polling: None,
            steps_used: Arc::default(),
            durability: Durability::default(),
            durability_watch: Arc::default(),
        }
    }

    /// Switches to partitioned mode: records are kept in `idempotency.partitioned_records`,
    /// range-partitioned by expiry time into partitions `width` wide, and expiry
    /// ([`ExpiredDeletion::delete_expired`](crate::store::ExpiredDeletion::delete_expired)) detaches and drops whole partitions instead of
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
    ///
    /// # Errors
    ///
    /// [`PostgresConfigError::Zero`] for a zero width, [`PostgresConfigError::TooShort`] for one
    /// under [`MIN_PARTITION_WIDTH`], [`PostgresConfigError::TooManyPartitions`] when more than
    /// [`MAX_PARTITIONS_AHEAD`] would be kept ahead. A width over [`MAX_DURATION`] is taken as it.
    ///
    /// [`MAX_DURATION`]: crate::MAX_DURATION
    pub fn partitioned(mut self, width: Duration) -> Result<Self, PostgresConfigError> {
        let width = settings::duration("partition_width", width, MIN_PARTITION_WIDTH)?;
        settings::partitions_fit(width, self.partitions_ahead)?;
        self.partitions = Some(Partitioning {
            width,
            ahead: self.partitions_ahead,
        });
        Ok(self)
    }

    /// How far ahead partitioned mode keeps partitions (default 2 days): longer than the
    /// layer's TTL and lease, or claims fail (`503`) for want of a partition for their expiry.
    /// It may be set before or after [`partitioned`](Self::partitioned).
    ///
    /// # Errors
    ///
    /// [`PostgresConfigError::Zero`] for zero, [`PostgresConfigError::TooManyPartitions`] when
    /// more than [`MAX_PARTITIONS_AHEAD`] partitions would be kept ahead. A window over
    /// [`MAX_DURATION`](crate::MAX_DURATION) is taken as it.
    pub fn with_partitions_ahead(mut self, ahead: Duration) -> Result<Self, PostgresConfigError> {
        let ahead = settings::duration("partitions_ahead", ahead, Duration::ZERO)?;
        if let Some(partitions) = &mut self.partitions {
            settings::partitions_fit(partitions.width, ahead)?;
            partitions.ahead = ahead;
        }
        self.partitions_ahead = ahead;
        Ok(self)
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
    ///
    /// # Errors
    ///
    /// [`PostgresConfigError::Zero`] for zero, [`PostgresConfigError::TooShort`] for an interval
    /// under [`MIN_IN_FLIGHT_POLLING`]. One over [`MAX_DURATION`](crate::MAX_DURATION) is taken
    /// as it.
    pub fn with_in_flight_polling(
        mut self,
        interval: Duration,
    ) -> Result<Self, PostgresConfigError> {
        let interval = settings::duration("in_flight_polling", interval, MIN_IN_FLIGHT_POLLING)?;
        self.in_flight_polling = Some(interval);
        Ok(self)
    }

    /// Switches to transactional mode: each claim opens a transaction on a pooled connection,
    /// the handler writes through [`IdempotentTx`](crate::IdempotentTx), and the layer stores
    /// the response in the same transaction and commits. See the [modes guide](crate::guide::modes)
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
    /// in partitioned mode creates the first partitions, and reports what the server promises
    /// of an acknowledged record ([`durability`](Self::durability)). Run it on a direct
    /// connection, not through PgBouncer in transaction pooling: sqlx's migrator holds a session
    /// advisory lock.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached or a migration fails;
    /// [`PostgresStoreError::NotDurable`] when the store requires a promise the server does not
    /// make ([`with_durability`](Self::with_durability)).
    pub async fn migrate(&self) -> Result<(), PostgresStoreError> {
        MIGRATOR
            .run(&self.pool)
            .await
            .map_err(PostgresStoreError::Migrate)?;
        if self.partitions.is_some() {
            // Partitions for the first claims; the expiry loop keeps them coming.
            self.maintain_partitions().await?;
        }
        self.check_durability().await
    }

    /// The statements on held claims, for this store's table.
    fn fenced_sql(&self) -> &'static Fenced {
        if self.partitions.is_some() {
            &FENCED_PARTITIONED
        } else {
            &FENCED
        }
    }

    /// Whether a handler on this store used steps (see `steps_used`).
    fn uses_steps(&self) -> bool {
        self.steps_used.load(Ordering::Relaxed)
    }

    /// Whether operations go out in batches (see [`PostgresStore`]'s group commit).
    fn batches(&self) -> bool {
        self.prepared && self.partitions.is_none() && !self.transactional
    }
}

impl Store for PostgresStore {
    type Claim = PgClaim;
    type Error = PostgresStoreError;

    async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<PgClaim>, PostgresStoreError> {
        if self.durability != Durability::Reported {
            // Boxed: its read of the server's settings would otherwise make every request's
            // future larger (see the service module).
            Box::pin(self.durable_enough()).await?;
        }
        if self.transactional {
            // Boxed: opening a transaction is a large future, which would otherwise make every
            // lease-mode request's future as large.
            Box::pin(self.claim_transactional(request)).await
        } else {
            self.claim_lease(request).await
        }
    }

    async fn renew(
        &self,
        claim: &PgClaim,
        lease: Duration,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let Some(tx_claim) = &claim.tx else {
            return self.renew_lease(&claim.fence, lease).await;
        };
        match tx_claim.fallback() {
            // The open transaction is the lease: it ends when the holder's connection does.
            Fallback::None if tx_claim.slot.is_settled() => Ok(ClaimStatus::Lost),
            Fallback::None => Ok(ClaimStatus::Held),
            Fallback::Reclaim => self.reclaim(tx_claim).await,
            Fallback::Fence(held) => self.renew_lease(&held, lease).await,
        }
    }

    async fn complete(
        &self,
        claim: &PgClaim,
        record: &Record,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let Some(tx_claim) = &claim.tx else {
            return self.complete_lease(&claim.fence, record).await;
        };
        match tx_claim.fallback() {
            Fallback::None => {}
            Fallback::Reclaim => {
                return match (self.reclaim(tx_claim).await?, tx_claim.fallback()) {
                    (ClaimStatus::Held, Fallback::Fence(held)) => {
                        self.complete_lease(&held, record).await
                    }
                    // Held, with the record found stored; or lost to another request.
                    (status, _) => Ok(status),
                };
            }
            Fallback::Fence(held) => return self.complete_lease(&held, record).await,
        }
        let Some(mut tx) = tx_claim.slot.take_back()? else {
            return Ok(ClaimStatus::Lost);
        };
        let stored = self
            .fenced(
                "complete",
                complete_statement(self.complete_sql(true), &claim.fence, record),
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
                self.notify_released(&claim.fence.key).await;
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

    /// A transactional claim is rolled back with its handler's writes (nothing happened); a
    /// lease-mode claim's lease ends now.
    async fn abandon(&self, claim: &PgClaim) -> Result<ClaimStatus, PostgresStoreError> {
        if claim.tx.is_some() {
            return self.release(claim).await;
        }
        let sql = if self.notifications.emit() {
            self.fenced_sql().abandon_notify
        } else {
            self.fenced_sql().abandon
        };
        let statement = fenced_statement(sql, &claim.fence);
        self.fenced_pooled("abandon", statement).await
    }

    async fn release(&self, claim: &PgClaim) -> Result<ClaimStatus, PostgresStoreError> {
        let Some(tx_claim) = &claim.tx else {
            return self.release_lease(&claim.fence).await;
        };
        match tx_claim.fallback() {
            Fallback::None => {}
            Fallback::Reclaim => return Ok(ClaimStatus::Lost),
            Fallback::Fence(held) => return self.release_lease(&held).await,
        }
        // Rolling back undoes the claim and the handler's writes together.
        let Some(tx) = tx_claim.slot.take_back()? else {
            return Ok(ClaimStatus::Lost);
        };
        self.timed("release", tx.rollback()).await?;
        self.notify_released(&claim.fence.key).await;
        Ok(ClaimStatus::Held)
    }

    /// In transactional mode each claim holds a pooled connection: half the pool may be
    /// detached. Steps are kept in `idempotency.steps` (lease mode's claims only record them).
    /// Waiters are woken through `LISTEN`/`NOTIFY`: once a layer that waits is built
    /// on the store, each completion and release of this store (and of every other instance
    /// whose layer waits) of a key a waiter marked ([`ClaimRequest::waiting`]), and each of
    /// transactional mode, announces its key on the channel `idempotency_settled`. One
    /// connection listens to it for all the waiters of this process, opened beside the pool
    /// (with its options) so as not to take one of the requests'. With
    /// [`with_in_flight_polling`](PostgresStore::with_in_flight_polling), waiters poll instead.
    fn capabilities(&self) -> Capabilities {
        let watch = match self.in_flight_polling {
            Some(interval) => InFlightWatch::Polled(interval),
            None => InFlightWatch::Notified(self.notifications.notifier.clone()),
        };
        let capabilities = Capabilities::new()
            .with_in_flight_watch(watch)
            .with_step_log(self.step_log());
        if self.transactional {
            // Its claims commit with the handler's work: a crash leaves nothing to complete.
            let pool = self.pool.options().get_max_connections() as usize;
            return capabilities.with_detached_limit((pool / 2).max(1));
        }
        capabilities.with_pending_log(self.pending_log())
    }
}

impl ClaimHandle for PgClaim {
    /// In transactional mode, hands the handler the claim's transaction.
    fn attach(&self, extensions: &mut http::Extensions) {
        if let Some(tx_claim) = &self.tx {
            extensions.insert(Arc::clone(&tx_claim.slot));
        }
    }

    /// In transactional mode, once the handler used the claim's transaction.
    fn commits_effects(&self) -> bool {
        self.tx
            .as_ref()
            .is_some_and(|tx_claim| tx_claim.slot.was_used())
    }

    /// In lease mode only: a transactional claim's writes commit with its response, so its
    /// handler has no steps to record.
    fn fence(&self) -> Option<Fence> {
        self.tx.is_none().then_some(self.fence)
    }

    /// `false` when the claim inserted its key's row and found no steps in the same statement.
    fn may_have_steps(&self) -> bool {
        !self.stepless
    }
}
