//! The protocol suite against `PostgresStore`, each test in its own database, plus what only
//! PostgreSQL has: many pools racing, outages, migrations, the reaper.

use idempotency_tests::{db::TestDb, suite::Backend};
use sqlx::Executor;
use tower_idempotency::store::PostgresStore;

struct Postgres {
    db: TestDb,
    store: PostgresStore,
}

impl Backend for Postgres {
    type Store = PostgresStore;

    async fn start() -> Self {
        let db = TestDb::new().await;
        let store = PostgresStore::new(db.pool().clone());
        store.migrate().await.expect("migrate");
        Self { db, store }
    }

    fn store(&self) -> PostgresStore {
        self.store.clone()
    }

    async fn lapse_leases(&self) {
        self.db
            .pool()
            .execute("UPDATE idempotency.records SET lease_until = now() - interval '1 second' WHERE status IS NULL")
            .await
            .expect("lapse leases");
    }

    async fn expire_records(&self) {
        self.db
            .pool()
            .execute("UPDATE idempotency.records SET expires_at = now() - interval '1 second'")
            .await
            .expect("expire records");
    }
}

idempotency_tests::store_suite!(Postgres);

/// The same suite with the store in transactional mode.
mod transactional {
    use idempotency_tests::suite::Backend;
    use tower_idempotency::store::PostgresStore;

    struct PostgresTransactional(super::Postgres);

    impl Backend for PostgresTransactional {
        type Store = PostgresStore;
        const TRANSACTIONAL: bool = true;

        async fn start() -> Self {
            let inner = super::Postgres::start().await;
            Self(super::Postgres {
                store: inner.store.clone().transactional(),
                db: inner.db,
            })
        }

        fn store(&self) -> PostgresStore {
            self.0.store()
        }

        async fn lapse_leases(&self) {
            self.0.lapse_leases().await;
        }

        async fn expire_records(&self) {
            self.0.expire_records().await;
        }
    }

    idempotency_tests::store_suite!(PostgresTransactional);
}
