use std::{
    collections::{HashMap, hash_map},
    convert::Infallible,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use tokio::time::Instant;

use super::{Begin, ClaimRequest, ClaimStatus, ExpiredDeletion, Lease, Store};
use crate::{fingerprint::Fingerprint, record::Record, scope::ScopeKey};

/// An in-process [`Store`]: for single-process applications, development and unit tests.
///
/// Keys live in this process only: two instances of an app behind a load balancer do not see
/// each other's keys, and a restart forgets them all. Use [`PostgresStore`](super::PostgresStore)
/// when either matters. Expired records are removed when their key is claimed again or by
/// [`continuously_delete_expired`](super::continuously_delete_expired); memory grows with the
/// number of keys claimed within one TTL. Each completed record is kept packed in one
/// allocation (status, headers and body), so a store holding many of them neither fragments the
/// heap nor keeps the response's own buffers alive.
///
/// Time is `tokio::time`, so tests can drive leases and expiry with `tokio::time::pause`.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// The records, split by key over [`SHARDS`] maps with a lock each: requests for different keys
/// rarely wait on each other, and a map that grows rehashes one shard at a time, so no request
/// waits behind a rehash of the whole store.
#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Records>]>,
    tokens: AtomicI64,
}

/// Keys are SHA-256 digests, so a fast hasher spreads them as well as SipHash does; seeded per
/// process, it leaves a client no way to aim keys at one bucket.
type Records = HashMap<ScopeKey, Entry, foldhash::fast::RandomState>;

const SHARDS: usize = 64;

impl Default for Inner {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            tokens: AtomicI64::new(0),
        }
    }
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    token: i64,
    expires_at: Instant,
    state: State,
}

#[derive(Debug)]
enum State {
    InFlight { lease_until: Instant },
    Completed(Packed),
}

/// A completed record as the store keeps it: status, headers and body in one allocation, so
/// that the hundreds of thousands of records a busy store holds for their TTL are one block
/// each rather than the response's four (record, header table and entries, body), scattered
/// among every request's short-lived allocations. Unpacked into a [`Record`] on replay, whose
/// body is a slice of the same buffer.
#[derive(Debug, Clone)]
struct Packed {
    status: http::StatusCode,
    /// Each header as name length, name, value length, value (lengths as 4-byte little-endian);
    /// then the body.
    bytes: bytes::Bytes,
    /// Where the body starts in `bytes`, if it was kept.
    body_at: Option<usize>,
}

impl Packed {
    fn pack(record: &Record) -> Self {
        let headers: usize = record
            .headers()
            .iter()
            .map(|(name, value)| 8 + name.as_str().len() + value.len())
            .sum();
        let body = record.body().map_or(&[][..], |b| &b[..]);
        let mut bytes = Vec::with_capacity(headers + body.len());
        for (name, value) in record.headers() {
            put(&mut bytes, name.as_str().as_bytes());
            put(&mut bytes, value.as_bytes());
        }
        let body_at = record.body().map(|_| bytes.len());
        bytes.extend_from_slice(body);
        Self {
            status: record.status(),
            bytes: bytes.into(),
            body_at,
        }
    }

    fn unpack(&self) -> Record {
        let mut headers = http::HeaderMap::new();
        let mut rest = &self.bytes[..self.body_at.unwrap_or(self.bytes.len())];
        while let Some((name, after)) = take(rest) {
            let Some((value, after)) = take(after) else {
                break;
            };
            // Both were a valid name and value when packed.
            if let (Ok(name), Ok(value)) = (
                http::HeaderName::from_bytes(name),
                http::HeaderValue::from_bytes(value),
            ) {
                headers.append(name, value);
            }
            rest = after;
        }
        let body = self.body_at.map(|at| self.bytes.slice(at..));
        Record::from_parts(self.status, headers, body)
    }
}

/// Appends `field`, prefixed by its length.
fn put(bytes: &mut Vec<u8>, field: &[u8]) {
    bytes.extend_from_slice(&(field.len() as u32).to_le_bytes());
    bytes.extend_from_slice(field);
}

/// The field at the start of `bytes`, and what follows it.
fn take(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_first_chunk::<4>()?;
    let len = u32::from_le_bytes(*len) as usize;
    (rest.len() >= len).then(|| rest.split_at(len))
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of records held, expired ones not yet deleted included.
    pub fn len(&self) -> usize {
        (0..SHARDS).map(|shard| self.shard(shard).len()).sum()
    }

    /// Whether no records are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shard that holds `key`, locked. Keys are SHA-256 digests, so any byte spreads them
    /// evenly.
    fn records(&self, key: &ScopeKey) -> MutexGuard<'_, Records> {
        self.shard(usize::from(key.as_bytes()[0]) % SHARDS)
    }

    fn shard(&self, shard: usize) -> MutexGuard<'_, Records> {
        // Every critical section leaves the map consistent, so a panic elsewhere while the
        // lock was held does not make it unusable.
        self.inner.shards[shard]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on the entry still held by `lease`, if any, found with one probe of the map.
    fn with_held(
        &self,
        lease: &Lease,
        f: impl FnOnce(hash_map::OccupiedEntry<'_, ScopeKey, Entry>),
    ) -> ClaimStatus {
        let mut records = self.records(&lease.key);
        match records.entry(lease.key) {
            hash_map::Entry::Occupied(entry)
                if entry.get().token == lease.token
                    && matches!(entry.get().state, State::InFlight { .. }) =>
            {
                f(entry);
                ClaimStatus::Held
            }
            _ => ClaimStatus::Lost,
        }
    }
}

impl Store for MemoryStore {
    type Claim = Lease;
    type Error = Infallible;

    async fn begin(&self, request: &ClaimRequest) -> Result<Begin<Lease>, Infallible> {
        let now = Instant::now();
        let mut records = self.records(&request.key);
        // One probe of the map, whatever the outcome.
        let slot = records.entry(request.key);
        let takeover = match &slot {
            hash_map::Entry::Vacant(_) => false,
            hash_map::Entry::Occupied(held) => match held.get() {
                entry if entry.expires_at <= now => false,
                entry if entry.fingerprint != request.fingerprint => return Ok(Begin::Mismatch),
                Entry {
                    state: State::Completed(packed),
                    expires_at,
                    ..
                } => {
                    // A handle out of the lock; rebuilt into a record after it is released.
                    let (packed, expires_in) = (packed.clone(), *expires_at - now);
                    drop(records);
                    return Ok(Begin::Completed {
                        record: packed.unpack(),
                        expires_in: Some(expires_in),
                    });
                }
                Entry {
                    state: State::InFlight { lease_until },
                    ..
                } if *lease_until > now => {
                    return Ok(Begin::InFlight {
                        lease_remaining: Some(*lease_until - now),
                    });
                }
                Entry { .. } => true,
            },
        };
        let token = self.inner.tokens.fetch_add(1, Ordering::Relaxed) + 1;
        slot.insert_entry(Entry {
            fingerprint: request.fingerprint,
            token,
            // A claim in flight outlives its TTL until its lease ends.
            expires_at: now + request.ttl.max(request.lease),
            state: State::InFlight {
                lease_until: now + request.lease,
            },
        });
        Ok(Begin::Acquired {
            claim: Lease {
                key: request.key,
                token,
            },
            takeover,
        })
    }

    async fn renew(&self, claim: &Lease, lease: Duration) -> Result<ClaimStatus, Infallible> {
        Ok(self.with_held(claim, |mut held| {
            let entry = held.get_mut();
            let lease_until = Instant::now() + lease;
            entry.expires_at = entry.expires_at.max(lease_until);
            entry.state = State::InFlight { lease_until };
        }))
    }

    async fn complete(&self, claim: &Lease, record: &Record) -> Result<ClaimStatus, Infallible> {
        // Packed outside the lock.
        let packed = Packed::pack(record);
        Ok(self.with_held(claim, |mut held| {
            held.get_mut().state = State::Completed(packed);
        }))
    }

    async fn release(&self, claim: &Lease) -> Result<ClaimStatus, Infallible> {
        Ok(self.with_held(claim, |held| {
            held.remove();
        }))
    }
}

impl ExpiredDeletion for MemoryStore {
    /// Deletes up to `batch` expired records, holding one shard's lock at a time.
    async fn delete_expired(&self, batch: u32) -> Result<u64, Infallible> {
        let now = Instant::now();
        let mut left = batch as usize;
        for shard in 0..SHARDS {
            if left == 0 {
                break;
            }
            // Removes only what it yields, so it stops at the batch's end.
            left -= self
                .shard(shard)
                .extract_if(|_, entry| entry.expires_at <= now)
                .take(left)
                .count();
        }
        Ok((batch as usize - left) as u64)
    }
}

#[cfg(test)]
mod tests {
    use http::StatusCode;

    use super::*;

    fn request(fingerprint: u8) -> ClaimRequest {
        ClaimRequest {
            key: ScopeKey::from_bytes([7; 32]),
            fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        }
    }

    fn record() -> Record {
        Record::from_parts(StatusCode::CREATED, Default::default(), Some("done".into()))
    }

    async fn acquire(store: &MemoryStore, request: &ClaimRequest) -> (Lease, bool) {
        match store.begin(request).await.unwrap() {
            Begin::Acquired { claim, takeover } => (claim, takeover),
            other => panic!("expected to acquire, got {other:?}"),
        }
    }

    #[test]
    fn a_kept_record_comes_back_exactly() {
        let mut headers = http::HeaderMap::new();
        headers.append("link", http::HeaderValue::from_static("<a>; rel=a"));
        headers.append(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        headers.append("link", http::HeaderValue::from_static("<b>; rel=b"));
        headers.append(
            "x-binary",
            http::HeaderValue::from_bytes(&[0x80, 0xff]).unwrap(),
        );
        for body in [None, Some(bytes::Bytes::new()), Some("{\"id\":1}".into())] {
            for headers in [http::HeaderMap::new(), headers.clone()] {
                let record =
                    Record::from_parts(StatusCode::PAYMENT_REQUIRED, headers, body.clone());
                let unpacked = Packed::pack(&record).unpack();
                assert_eq!(unpacked, record);
                let order: Vec<_> = unpacked.headers().iter().collect();
                assert_eq!(order, record.headers().iter().collect::<Vec<_>>());
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lapsed_lease_is_taken_over_and_the_stale_holder_is_fenced_out() {
        let store = MemoryStore::new();
        let (stale, takeover) = acquire(&store, &request(1)).await;
        assert!(!takeover);
        tokio::time::advance(Duration::from_secs(29)).await;
        assert!(matches!(
            store.begin(&request(1)).await,
            Ok(Begin::InFlight { .. })
        ));
        tokio::time::advance(Duration::from_secs(2)).await;
        let (fresh, takeover) = acquire(&store, &request(1)).await;
        assert!(takeover);
        assert!(fresh.token > stale.token);
        assert_eq!(
            store.complete(&stale, &record()).await,
            Ok(ClaimStatus::Lost)
        );
        assert_eq!(store.release(&stale).await, Ok(ClaimStatus::Lost));
        assert_eq!(
            store.renew(&stale, Duration::from_secs(1)).await,
            Ok(ClaimStatus::Lost)
        );
        assert_eq!(
            store.complete(&fresh, &record()).await,
            Ok(ClaimStatus::Held)
        );
        assert_eq!(
            store.begin(&request(1)).await,
            Ok(Begin::Completed {
                record: record(),
                expires_in: Some(Duration::from_secs(3600))
            })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_longer_than_the_ttl_keeps_the_record() {
        let store = MemoryStore::new();
        let mut long_lease = request(1);
        long_lease.ttl = Duration::from_secs(10);
        long_lease.lease = Duration::from_secs(60);
        acquire(&store, &long_lease).await;
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(matches!(
            store.begin(&long_lease).await,
            Ok(Begin::InFlight { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn renewal_keeps_the_lease_alive() {
        let store = MemoryStore::new();
        let (claim, _) = acquire(&store, &request(1)).await;
        for _ in 0..5 {
            tokio::time::advance(Duration::from_secs(20)).await;
            assert_eq!(
                store.renew(&claim, Duration::from_secs(30)).await,
                Ok(ClaimStatus::Held)
            );
        }
        assert!(matches!(
            store.begin(&request(1)).await,
            Ok(Begin::InFlight { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_different_fingerprint_is_a_mismatch_until_expiry() {
        let store = MemoryStore::new();
        let (claim, _) = acquire(&store, &request(1)).await;
        assert_eq!(store.begin(&request(2)).await, Ok(Begin::Mismatch));
        assert_eq!(
            store.complete(&claim, &record()).await,
            Ok(ClaimStatus::Held)
        );
        assert_eq!(store.begin(&request(2)).await, Ok(Begin::Mismatch));
        tokio::time::advance(Duration::from_secs(3600)).await;
        let (_, takeover) = acquire(&store, &request(2)).await;
        assert!(!takeover, "an expired record is new, not a takeover");
    }

    #[tokio::test(start_paused = true)]
    async fn released_keys_are_free_for_any_payload() {
        let store = MemoryStore::new();
        let (claim, _) = acquire(&store, &request(1)).await;
        assert_eq!(store.release(&claim).await, Ok(ClaimStatus::Held));
        let (again, takeover) = acquire(&store, &request(2)).await;
        assert!(!takeover);
        assert!(again.token > claim.token);
    }

    /// The checks every store is held to; `tokio::time` is the memory store's clock, so they
    /// run in no real time.
    #[cfg(feature = "conformance")]
    #[tokio::test(start_paused = true)]
    async fn keeps_the_store_protocol() {
        let store = MemoryStore::new();
        crate::store::conformance::check(&store, Duration::from_secs(1)).await;
        crate::store::conformance::check_expired_deletion(&store, Duration::from_secs(1)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn delete_expired_works_in_batches() {
        let store = MemoryStore::new();
        for i in 0..5u8 {
            let mut req = request(1);
            req.key = ScopeKey::from_bytes([i; 32]);
            acquire(&store, &req).await;
        }
        assert_eq!(store.delete_expired(10).await, Ok(0));
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert_eq!(store.delete_expired(3).await, Ok(3));
        assert_eq!(store.delete_expired(3).await, Ok(2));
        assert!(store.is_empty());
    }
}
