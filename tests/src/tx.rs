//! The transactional-mode tests' fixture: a database whose `charges` rows are the handler's
//! writes, and the app that makes them in the request's transaction.

use sqlx::{Executor, PgPool};
use tower_idempotency::{IdempotencyLayer, KeySource, store::PostgresStore};

use crate::{
    app::{CHARGES_TABLE, Probe, tx_app},
    db::TestDb,
    init_tracing,
    requests::post,
    server::TestServer,
    store::ObservedStore,
};

/// A database of its own with the `charges` table, a transactional store on it (observed), and
/// the transactional app (`tx_app`, every key required) on a real socket.
pub struct Tx {
    /// The test database.
    pub db: TestDb,
    /// The store the layer uses, observed.
    pub store: ObservedStore<PostgresStore>,
    /// What the handlers did.
    pub probe: Probe,
    /// The server.
    pub server: TestServer,
    /// A keep-alive client.
    pub client: reqwest::Client,
}

impl Tx {
    /// The app on the test database's own pool.
    pub async fn start() -> Self {
        Self::with_pool(|db| db.pool().clone(), |store| store).await
    }

    /// The app on the pool `pool` makes, its store as `configure` makes it.
    pub async fn with_pool(
        pool: impl FnOnce(&TestDb) -> PgPool,
        configure: impl FnOnce(PostgresStore) -> PostgresStore,
    ) -> Self {
        init_tracing();
        let db = TestDb::new().await;
        db.pool()
            .execute(CHARGES_TABLE)
            .await
            .expect("charges table");
        let pool = pool(&db);
        let store = configure(PostgresStore::new(pool.clone()).transactional());
        store.migrate().await.expect("migrate");
        let store = ObservedStore::new(store);
        let probe = Probe::default();
        let layer = IdempotencyLayer::new(store.clone()).with_key(KeySource::default().required());
        let server = TestServer::start(tx_app(layer, probe.clone(), pool)).await;
        Self {
            db,
            store,
            probe,
            server,
            client: reqwest::Client::new(),
        }
    }

    /// `POST /tx/charges` with `key`.
    pub fn post(&self, key: &str) -> reqwest::RequestBuilder {
        post(&self.client, &self.server, "/tx/charges", key)
    }

    /// The handler's `charges` rows.
    pub async fn rows(&self) -> i64 {
        rows(self.db.pool()).await
    }

    /// The store's records.
    pub async fn records(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
            .fetch_one(self.db.pool())
            .await
            .expect("count records")
    }
}

/// The handler's `charges` rows in `pool`'s database.
async fn rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await
        .expect("count charges")
}
