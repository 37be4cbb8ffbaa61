use http::StatusCode;

use super::*;
use crate::fingerprint::Fingerprint;

fn request(fingerprint: u8) -> ClaimRequest {
    ClaimRequest {
        key: ScopeKey::from_bytes([7; 32]),
        fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        waiting: false,
        keeps_request: false,
    }
}

fn record() -> Record {
    Record::from_parts(StatusCode::CREATED, Default::default(), Some("done".into()))
}

async fn acquire(store: &MemoryStore, request: &ClaimRequest) -> (Fence, bool) {
    match store.claim(request).await.unwrap() {
        KeyState::Acquired { claim, takeover } => (claim, takeover),
        other => panic!("expected to acquire, got {other:?}"),
    }
}

/// A TTL shorter than the lease.
fn short_ttl(fingerprint: u8) -> ClaimRequest {
    ClaimRequest {
        ttl: Duration::from_secs(2),
        waiting: false,
        keeps_request: false,
        ..request(fingerprint)
    }
}

/// The TTL counts from the claim, and a completed record outlives it under no lease. Not a
/// conformance rule: `examples/redis-store` keeps a completed record as long as its lease.
#[tokio::test(start_paused = true)]
async fn a_completed_record_expires_at_its_ttl_though_the_lease_is_longer() {
    let store = MemoryStore::new();
    let (claim, _) = acquire(&store, &short_ttl(1)).await;
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        store.complete(&claim, &record()).await,
        Ok(ClaimStatus::Held)
    );
    assert_eq!(
        store.claim(&short_ttl(1)).await,
        Ok(KeyState::Completed {
            record: record(),
            expires_in: Some(Duration::from_secs(1))
        }),
        "a record is kept for its TTL from its claim"
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    let (again, takeover) = acquire(&store, &short_ttl(1)).await;
    assert!(!takeover, "an expired record is new, not a takeover");
    assert!(again.token > claim.token);
}

fn keyed(key: u8) -> ClaimRequest {
    ClaimRequest {
        key: ScopeKey::from_bytes([key; 32]),
        ..request(1)
    }
}

#[tokio::test(start_paused = true)]
async fn a_bounded_store_refuses_new_keys_when_full_and_drops_nothing_it_holds() {
    // Room for three claims in flight; a kept response costs its bytes besides.
    let limit = 3 * ENTRY_BYTES;
    let full = Err(MemoryStoreError::Full { limit });
    let store = MemoryStore::with_max_bytes(limit);
    let (a, _) = acquire(&store, &keyed(1)).await;
    let (b, _) = acquire(&store, &keyed(2)).await;
    let (c, _) = acquire(&store, &keyed(3)).await;
    assert_eq!(store.claim(&keyed(4)).await, full);

    // What it holds goes on as before: a held claim completes (past the limit), its record
    // replays, a claim in flight is a conflict, another payload a mismatch, and a lapsed
    // claim is taken over in place.
    assert_eq!(store.complete(&a, &record()).await, Ok(ClaimStatus::Held));
    assert!(matches!(
        store.claim(&keyed(1)).await,
        Ok(KeyState::Completed { .. })
    ));
    assert!(matches!(
        store.claim(&keyed(2)).await,
        Ok(KeyState::InFlight { .. })
    ));
    assert_eq!(
        store
            .claim(&ClaimRequest {
                fingerprint: Fingerprint::from_bytes([9; 32]),
                ..keyed(2)
            })
            .await,
        Ok(KeyState::Mismatch)
    );
    tokio::time::advance(Duration::from_secs(31)).await;
    let (b2, takeover) = acquire(&store, &keyed(2)).await;
    assert!(takeover);
    assert_eq!(store.release(&b).await, Ok(ClaimStatus::Lost));

    // A released claim gives its room back, but the kept response ("done") still counts.
    assert_eq!(store.release(&c).await, Ok(ClaimStatus::Held));
    assert_eq!(store.claim(&keyed(4)).await, full);
    assert_eq!(store.release(&b2).await, Ok(ClaimStatus::Held));
    let (d, _) = acquire(&store, &keyed(4)).await;
    assert_eq!(store.claim(&keyed(5)).await, full);

    // Once records expire, a full store deletes them itself to make room (at most once a
    // second, so a flood of new keys does not walk the store on every request).
    tokio::time::advance(Duration::from_secs(3600)).await;
    acquire(&store, &keyed(5)).await;
    assert_eq!(
        store.len(),
        1,
        "the expired records of keys 1 and 4 were deleted"
    );
    acquire(&store, &keyed(6)).await;
    acquire(&store, &keyed(7)).await;
    assert_eq!(store.claim(&keyed(8)).await, full);
    assert_eq!(store.complete(&d, &record()).await, Ok(ClaimStatus::Lost));

    // Everything counted is given back: drained, the store takes three claims again.
    tokio::time::advance(Duration::from_secs(3600)).await;
    assert_eq!(store.delete_expired(100).await, Ok(3));
    for key in 10..13 {
        acquire(&store, &keyed(key)).await;
    }
    assert_eq!(store.claim(&keyed(13)).await, full);
}

/// A claim of key `n` of period `period`, in shard `n` (0..64: one key per shard).
fn periodic(n: u8, period: u8, ttl: Duration) -> ClaimRequest {
    let mut key = [0; 32];
    key[0] = n;
    key[1] = period;
    ClaimRequest {
        key: ScopeKey::from_bytes(key),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        lease: Duration::from_secs(1),
        ttl,
        waiting: false,
        keeps_request: false,
    }
}

#[tokio::test(start_paused = true)]
async fn an_unbounded_store_holds_about_one_ttl_of_keys_without_a_reaper() {
    let store = MemoryStore::new();
    let ttl = Duration::from_secs(10);
    let period = Duration::from_secs(5);
    for p in 0..20 {
        for n in 0..SHARDS as u8 {
            let (claim, _) = acquire(&store, &periodic(n, p, ttl)).await;
            if n % 2 == 0 {
                assert_eq!(
                    store.complete(&claim, &record()).await,
                    Ok(ClaimStatus::Held)
                );
            }
        }
        // This period's keys and the last one's: the one before expired as this one's
        // claims came, shard by shard.
        let held = store.len();
        assert!(
            held <= 2 * SHARDS,
            "period {p}: {held} records held, more than two periods' claims"
        );
        tokio::time::advance(period).await;
    }
    // Within their TTL, records are kept as before.
    assert!(matches!(
        store.claim(&periodic(0, 19, ttl)).await,
        Ok(KeyState::Completed { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_claim_renewed_past_its_ttl_is_kept_until_its_new_expiry() {
    let store = MemoryStore::new();
    let ttl = Duration::from_secs(10);
    let renewed = ClaimRequest {
        lease: Duration::from_secs(12),
        ..periodic(5, 0, ttl)
    };
    let (claim, _) = acquire(&store, &renewed).await;
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(
        store.renew(&claim, Duration::from_secs(12)).await,
        Ok(ClaimStatus::Held)
    );
    // Past the claim's first expiry (12 s), before its renewed one (22 s): a claim in the
    // same shard finds it first in line, and must leave it.
    tokio::time::advance(Duration::from_secs(5)).await;
    acquire(&store, &periodic(5, 1, ttl)).await;
    assert!(matches!(
        store.claim(&renewed).await,
        Ok(KeyState::InFlight { .. })
    ));
    assert_eq!(
        store.complete(&claim, &record()).await,
        Ok(ClaimStatus::Held)
    );
    // Once both have expired, the next claim in the shard deletes them.
    tokio::time::advance(Duration::from_secs(25)).await;
    acquire(&store, &periodic(5, 2, ttl)).await;
    assert_eq!(store.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn compacting_the_queue_keeps_the_claims_of_held_records() {
    let store = MemoryStore::new();
    let ttl = Duration::from_secs(10);
    for p in 0..10 {
        acquire(&store, &periodic(5, p, ttl)).await;
    }
    // Enough released claims in the same shard to compact its queue many times over.
    for _ in 0..1000 {
        let (claim, _) = acquire(&store, &periodic(5, 100, ttl)).await;
        assert_eq!(store.release(&claim).await, Ok(ClaimStatus::Held));
    }
    // The held records are still queued: once expired, new claims delete them, two each.
    tokio::time::advance(ttl).await;
    for p in 0..5 {
        acquire(&store, &periodic(5, 200 + p, ttl)).await;
    }
    assert_eq!(store.len(), 5);
}

/// Any TTL, lease and renewal, `Duration::MAX` included: the store saturates its clock
/// arithmetic rather than panic on a request.
mod properties {
    use proptest::prelude::*;

    use super::*;

    /// Any duration, with zero, the largest and short ones made common.
    fn duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            Just(Duration::ZERO),
            Just(Duration::MAX),
            (0..100u64).prop_map(Duration::from_secs),
            (any::<u64>(), 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
        ]
    }

    /// Claims, renews, completes, releases and deletes with `ttl` and `lease`, the clock
    /// moving `step` between the calls.
    async fn serve(
        store: &MemoryStore,
        ttl: Duration,
        lease: Duration,
        renewal: Duration,
        step: Duration,
    ) -> Result<(), TestCaseError> {
        let request = ClaimRequest {
            lease,
            ttl,
            waiting: false,
            keeps_request: false,
            ..request(1)
        };
        let released = ClaimRequest {
            key: ScopeKey::from_bytes([8; 32]),
            ..request.clone()
        };
        for _ in 0..3 {
            if let Ok(KeyState::Acquired { claim, .. }) = store.claim(&released).await {
                let _ = store.renew(&claim, renewal).await;
                let _ = store.release(&claim).await;
            }
            match store.claim(&request).await {
                Ok(KeyState::Acquired { claim, .. }) => {
                    let _ = store.claim(&request).await;
                    let _ = store.renew(&claim, renewal).await;
                    tokio::time::advance(step).await;
                    let _ = store.complete(&claim, &record()).await;
                }
                Ok(KeyState::Completed {
                    expires_in: Some(expires_in),
                    ..
                }) => prop_assert!(expires_in <= ttl, "{expires_in:?} left of {ttl:?}"),
                _ => {}
            }
            tokio::time::advance(step).await;
            let _ = store.delete_expired(10).await;
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn any_ttl_lease_or_renewal_is_served_without_panic(
            ttl in duration(),
            lease in duration(),
            renewal in duration(),
            step in (0..40u64).prop_map(Duration::from_secs),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()?;
            for store in [MemoryStore::new(), MemoryStore::with_max_bytes(1 << 20)] {
                runtime.block_on(serve(&store, ttl, lease, renewal, step))?;
            }
        }
    }
}

/// The checks every store is held to; `tokio::time` is the memory store's clock, so they
/// run in no real time.
#[tokio::test(start_paused = true)]
async fn keeps_the_store_protocol() {
    for store in [MemoryStore::new(), MemoryStore::with_max_bytes(1 << 30)] {
        crate::store::conformance::check(&store, Duration::from_secs(1)).await;
        crate::store::conformance::check_expired_deletion(&store, Duration::from_secs(1)).await;
    }
}
