//! The protocol suite against `MemoryStore`.

use std::time::Duration;

use idempotency_tests::{store::ObservedStore, suite::Backend};
use tower_idempotency::{InFlightWait, store::MemoryStore};

/// A memory store holding at most `MAX_BYTES` of records (`0`: unbounded, `MemoryStore::new`).
struct Memory<const MAX_BYTES: usize>(MemoryStore);

/// Moves the (tokio) clock: the memory store reads `tokio::time::Instant`. Runs on the
/// current-thread runtime, where the clock can be paused.
async fn advance(by: Duration) {
    tokio::time::pause();
    tokio::time::advance(by).await;
    tokio::time::resume();
}

impl<const MAX_BYTES: usize> Backend for Memory<MAX_BYTES> {
    type Store = MemoryStore;
    // In process already: a cache would only hold a second copy of its records.
    type Layered = ObservedStore<MemoryStore>;

    fn layered(store: ObservedStore<MemoryStore>) -> Self::Layered {
        store
    }

    async fn start() -> Self {
        Self(match MAX_BYTES {
            0 => MemoryStore::new(),
            limit => MemoryStore::with_max_bytes(limit),
        })
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

    async fn pass_time(&self, by: Duration) {
        advance(by).await;
    }
}

type Unbounded = Memory<0>;

idempotency_tests::store_suite!(Unbounded);

/// A copy a `CachingStore` keeps for replays expires with its record (both on the tokio
/// clock): the same key then runs again.
#[tokio::test(flavor = "current_thread")]
async fn cached_replays_expire_with_their_records() {
    use idempotency_tests::suite::{Harness, Reply};
    use tower_idempotency::{IdempotencyLayer, store::CachingStore};

    idempotency_tests::init_tracing();
    let h = Harness::<Unbounded>::serving(|store| IdempotencyLayer::new(CachingStore::new(store)))
        .await;
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

/// A full store refuses new keys with `503` and runs nothing for them, while what it holds is
/// replayed as before; once its records expire, it takes new keys again by itself.
#[tokio::test(flavor = "current_thread")]
async fn a_full_memory_store_refuses_new_keys_and_keeps_replaying() {
    use idempotency_tests::suite::{Harness, Reply};

    idempotency_tests::init_tracing();
    // No more than 4 KiB of records, and no CachingStore in front keeping copies.
    let h = Harness::<Memory<4096>>::start().await;
    let charge = |key: String| h.post("/charges", Some(&key)).body(r#"{"amount":100}"#);
    let mut kept = Vec::new();
    let refused = loop {
        let reply = Reply::of(charge(format!("k-{}", kept.len()))).await;
        if reply.status != http::StatusCode::CREATED {
            break reply;
        }
        kept.push(reply);
        assert!(kept.len() < 100, "4 KiB of records never filled");
    };
    assert!(kept.len() >= 2, "4 KiB holds a few records: {}", kept.len());
    refused.assert_problem(503, "StoreUnavailable");
    assert_eq!(refused.headers["retry-after"], "1");
    assert_eq!(
        h.probe.executions(),
        kept.len(),
        "the refused key ran nothing"
    );

    // Every kept response is still replayed, from the store.
    for (i, first) in kept.iter().enumerate() {
        let retry = Reply::of(charge(format!("k-{i}"))).await;
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(h.probe.executions(), kept.len());

    // The records expire; the next new key makes room by deleting them, and runs.
    h.backend.expire_records().await;
    let after = Reply::of(charge(format!("k-{}", kept.len()))).await;
    assert_eq!(after.status, http::StatusCode::CREATED);
    assert!(!after.replayed());
    assert_eq!(h.probe.executions(), kept.len() + 1);
}

/// Issue 29.3: waiting is bounded: past `InFlightWait::with_max_waiting` waiters, a duplicate gets its `409`
/// at once instead of waiting.
#[tokio::test(flavor = "current_thread")]
async fn past_the_most_waiters_a_duplicate_is_409_at_once() {
    use idempotency_tests::suite::{Harness, Reply};

    idempotency_tests::init_tracing();
    let h = Harness::<Unbounded>::with(|layer| {
        layer
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(30)).with_max_waiting(1))
            .expect("a wait")
    })
    .await;
    let post = || h.post("/charges", Some("k-crowd")).body("{}");
    let first = tokio::spawn(Reply::of(post().header("x-test-gate", "1")));
    h.probe.started(1).await;
    h.store.begun(1).await;
    let waiting = tokio::spawn(Reply::of(post()));
    h.store.begun(2).await;
    let started = tokio::time::Instant::now();
    Reply::of(post()).await.assert_problem(409, "InFlight");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused at once"
    );
    h.probe.open_gate(1);
    let first = first.await.expect("task");
    let waited = waiting.await.expect("task");
    assert!(waited.replayed());
    assert_eq!(waited.body, first.body);
}
