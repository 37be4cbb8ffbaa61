//! The suite against `PostgresStore`: a test database of its own as a [`PostgresFixture`], run
//! in both of the store's modes.

use std::{future::Future, time::Duration};

use sqlx::Executor;
use tower_idempotency::store::{CachingStore, PostgresStore};

use super::Backend;
use crate::{db::TestDb, store::ObservedStore};

/// A `PostgresStore` on a test database of its own, which the suite runs in both of the
/// store's modes: as [`InLeaseMode`] and as [`InTransactionalMode`]. Leases and expiry act on
/// `idempotency.records` unless the fixture keeps its records elsewhere.
pub trait PostgresFixture: Send + Sync + Sized + 'static {
    /// A fresh fixture.
    fn start() -> impl Future<Output = Self> + Send;

    /// The test database (a direct connection, whatever the store goes through).
    fn db(&self) -> &TestDb;

    /// The store, in lease mode (the suite switches it to transactional mode where it runs
    /// that).
    fn store(&self) -> PostgresStore;

    /// As [`Backend::lapse_leases`].
    fn lapse_leases(&self) -> impl Future<Output = ()> + Send {
        async {
            self.db()
                .pool()
                .execute(
                    "UPDATE idempotency.records SET lease_until = now() - interval '1 second' \
                     WHERE status IS NULL",
                )
                .await
                .expect("lapse leases");
        }
    }

    /// As [`Backend::expire_records`].
    fn expire_records(&self) -> impl Future<Output = ()> + Send {
        async {
            self.db()
                .pool()
                .execute("UPDATE idempotency.records SET expires_at = now() - interval '1 second'")
                .await
                .expect("expire records");
        }
    }

    /// The table the fixture's store keeps its records in.
    const TABLE: &'static str = "records";

    /// As [`Backend::pass_time`], on `table` (`records` or `partitioned_records`).
    fn pass_time_in(&self, table: &str, by: Duration) -> impl Future<Output = ()> + Send {
        let sql = format!(
            "UPDATE idempotency.{table} SET created_at = created_at - $1,
                 expires_at = expires_at - $1, lease_until = lease_until - $1,
                 completed_at = completed_at - $1"
        );
        async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(by)
                .execute(self.db().pool())
                .await
                .expect("pass time");
        }
    }
}

/// A [`PostgresFixture`] as a [`Backend`], its store in transactional mode when `TRANSACTIONAL`.
pub struct InMode<F, const TRANSACTIONAL: bool>(pub F);

/// The suite against a fixture's store in lease mode.
pub type InLeaseMode<F> = InMode<F, false>;

/// The suite against a fixture's store in transactional mode.
pub type InTransactionalMode<F> = InMode<F, true>;

impl<F: PostgresFixture, const TRANSACTIONAL: bool> Backend for InMode<F, TRANSACTIONAL> {
    type Store = PostgresStore;
    const TRANSACTIONAL: bool = TRANSACTIONAL;
    // Cached in transactional mode too, which keeps the cache's forwarding of claims that
    // carry a transaction under test.
    type Layered = CachingStore<ObservedStore<PostgresStore>>;

    fn layered(store: ObservedStore<PostgresStore>) -> Self::Layered {
        CachingStore::new(store)
    }

    async fn start() -> Self {
        Self(F::start().await)
    }

    fn store(&self) -> PostgresStore {
        let store = self.0.store();
        if TRANSACTIONAL {
            store.transactional()
        } else {
            store
        }
    }

    async fn lapse_leases(&self) {
        self.0.lapse_leases().await;
    }

    async fn expire_records(&self) {
        self.0.expire_records().await;
    }

    async fn pass_time(&self, by: Duration) {
        self.0.pass_time_in(F::TABLE, by).await;
    }
}
