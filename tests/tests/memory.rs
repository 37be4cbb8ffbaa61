//! The protocol suite against `MemoryStore`.

use std::time::Duration;

use idempotency_tests::suite::Backend;
use tower_idempotency::store::MemoryStore;

struct Memory(MemoryStore);

/// Moves the (tokio) clock: the memory store reads `tokio::time::Instant`. Runs on the
/// current-thread runtime, where the clock can be paused.
async fn advance(by: Duration) {
    tokio::time::pause();
    tokio::time::advance(by).await;
    tokio::time::resume();
}

impl Backend for Memory {
    type Store = MemoryStore;

    async fn start() -> Self {
        Self(MemoryStore::new())
    }

    fn store(&self) -> MemoryStore {
        self.0.clone()
    }

    async fn lapse_leases(&self) {
        advance(Duration::from_secs(31)).await;
    }

    async fn expire_records(&self) {
        advance(Duration::from_secs(24 * 3600 + 1)).await;
    }
}

idempotency_tests::store_suite!(Memory);
