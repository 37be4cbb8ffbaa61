//! The memory store's own bookkeeping stays within a bound set by the records it holds: a
//! client that claims and releases keys in a loop (a body the handler refuses, say) leaves no
//! memory behind, however long it goes on.
//!
//! One test per binary: the heap count is process-global.

use std::{alloc::System, time::Duration};

use cap::Cap;
use tower_idempotency::{
    Fingerprint, ScopeKey,
    store::{ClaimRequest, ClaimStatus, KeyState, MemoryStore, Store},
};

/// Counts the bytes this process holds on the heap.
#[global_allocator]
static HEAP: Cap<System> = Cap::new(System, usize::MAX);

const CLAIMS: usize = 1_000_000;

/// What the loop may leave allocated: the shards' maps and queues at their bounded sizes, far
/// below what a million queued claims would hold.
const MAX_GROWTH: usize = 1 << 20;

/// Claims of `keys` keys (each in a shard of its own) with one fingerprint and a day's TTL.
fn requests(keys: u8) -> Vec<ClaimRequest> {
    (0..keys)
        .map(|n| {
            let mut key = [7; 32];
            key[0] = n;
            ClaimRequest {
                key: ScopeKey::from_bytes(key),
                fingerprint: Fingerprint::from_bytes([1; 32]),
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(24 * 3600),
                waiting: false,
                keeps_request: false,
            }
        })
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn a_million_released_claims_leave_the_store_no_bigger() {
    for keys in [1, 8] {
        let requests = requests(keys);
        let store = MemoryStore::new();
        let before = HEAP.allocated();
        for request in requests.iter().cycle().take(CLAIMS) {
            let Ok(KeyState::Acquired { claim, takeover }) = store.claim(request).await else {
                panic!("a released key must be acquired again");
            };
            assert!(!takeover);
            assert_eq!(store.release(&claim).await, Ok(ClaimStatus::Held));
        }
        let growth = HEAP.allocated().saturating_sub(before);
        assert!(
            growth < MAX_GROWTH,
            "{CLAIMS} claims of {keys} key(s), each released, left {growth} bytes allocated"
        );
        assert!(store.is_empty());
    }
}
