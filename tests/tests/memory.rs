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

/// A copy kept for replays expires with its record: the same key then runs again.
#[tokio::test(flavor = "current_thread")]
async fn cached_replays_expire_with_their_records() {
    use idempotency_tests::suite::{Harness, Reply};

    idempotency_tests::init_tracing();
    let h = Harness::<Memory>::start().await;
    let post = || h.post("/charges", Some("k-cached")).body("{}");
    let first = Reply::of(post()).await;
    assert!(
        Reply::of(post()).await.replayed(),
        "from the store, now cached"
    );
    assert!(Reply::of(post()).await.replayed(), "from the cache");
    h.backend.expire_records().await;
    let again = Reply::of(post()).await;
    assert!(!again.replayed());
    assert_ne!(again.body, first.body);
    assert_eq!(h.probe.executions(), 2);
}
