use std::{
    collections::{HashMap, VecDeque, hash_map},
    fmt,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::time::Instant;

use super::{
    Begin, ClaimRequest, ClaimStatus, ExpiredDeletion, InFlightWatch, Lease, Notifier, Store,
};
use crate::{fingerprint::Fingerprint, record::Record, scope::ScopeKey};

/// An in-process [`Store`]: for single-process applications, development and unit tests.
///
/// Keys live in this process only: two instances of an app behind a load balancer do not see
/// each other's keys, and a restart forgets them all. Use [`PostgresStore`](super::PostgresStore)
/// when either matters. Expired records are deleted by the store itself: each request for a key
/// first deletes up to two expired records of the key's shard, oldest claim first, so a store
/// that keeps taking requests holds about one TTL's worth of keys with no task running beside
/// it. A store that stops taking requests keeps what it holds until they come again (or
/// [`continuously_delete_expired`](super::continuously_delete_expired) runs); an expired record
/// is never replayed either way. Each completed record is kept packed in one allocation (status,
/// headers and body), so a store holding many of them neither fragments the heap nor keeps the
/// response's own buffers alive.
///
/// Memory grows with the records held (the keys claimed within one TTL and not released: a key
/// claimed and released in a loop holds one record at most), and a client can claim as many keys
/// as it likes. [`MemoryStore::new`] sets no bound; [`MemoryStore::with_max_bytes`] refuses new
/// keys once its records hold that much, which the layer answers with `503` and `Retry-After`
/// (its [`StoreFailure`](crate::StoreFailure) policy), rather than let the process run out of
/// memory or forget a kept response early (a retry would then run again):
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::with_max_bytes(256 << 20));
/// ```
///
/// Time is `tokio::time`, so tests can drive leases and expiry with `tokio::time::pause`.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// Why a [`MemoryStore`] refused a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryStoreError {
    /// The store's records hold its limit ([`MemoryStore::with_max_bytes`]), even after its
    /// expired records were deleted: the claim of a new key is refused until records expire or
    /// claims are released. Retries of kept records are still replayed, and claims already
    /// made still complete.
    Full {
        /// The store's limit, in bytes.
        limit: usize,
    },
}

impl fmt::Display for MemoryStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full { limit } => write!(
                f,
                "the memory store is full: its records hold its limit of {limit} bytes, so new \
                 keys are refused until records expire"
            ),
        }
    }
}

impl std::error::Error for MemoryStoreError {}

/// The records, split by key over [`SHARDS`] maps with a lock each: requests for different keys
/// rarely wait on each other, and a map that grows rehashes one shard at a time, so no request
/// waits behind a rehash of the whole store.
#[derive(Debug)]
struct Inner {
    shards: Box<[Shard]>,
    /// Set by [`MemoryStore::with_max_bytes`]; without it nothing is counted.
    budget: Option<Budget>,
    /// Requests waiting for a key in flight, woken when it is completed or released.
    notifier: Notifier,
}

/// What a bounded store counts. `used` changes under the lock of the shard whose records it
/// counts, so it is exact once no call is running; between two shards' calls, a claim may pass
/// the limit by one record.
#[derive(Debug)]
struct Budget {
    limit: usize,
    used: AtomicUsize,
    /// When a full store last deleted its expired records (at most once per [`SWEEP_EVERY`]).
    swept: Mutex<Option<Instant>>,
}

/// How often a full store may walk all its records for expired ones before refusing a claim.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A shard, on cache lines of its own: two threads working on neighbouring shards never contend
/// for one line (a lock word, or a map's length, shared with the shard beside it).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard(Mutex<Records>);

/// One shard's records, the order they expire in, and the last fencing token it handed out. A
/// key always lives in the same shard, so a count per shard gives every claim of a key a larger
/// token than the key had before, without a counter that every claim of every thread would write
/// to.
#[derive(Debug, Default)]
struct Records {
    map: Map,
    /// The claims made in this shard, oldest first, with the time their records expire. A
    /// claim's record may since have been released, deleted, claimed again (its token tells) or
    /// renewed past that time; it is looked at when its time comes, or dropped sooner once such
    /// claims outnumber the records ([`Records::bound_expiry`]).
    ///
    /// Claims with one TTL arrive in the order they expire. When layers with different TTLs share
    /// a store, a record behind one that expires later waits for it: it is still expired to every
    /// request, it only stays in memory for up to the difference.
    expiry: VecDeque<Expiry>,
    last_token: i64,
}

/// A claim in [`Records::expiry`].
#[derive(Debug)]
struct Expiry {
    at: Instant,
    key: ScopeKey,
    token: i64,
}

/// How many expired records each claim deletes (when there are any): more than one, so that the
/// store shrinks back after a burst of claims has expired, not only stops growing.
const EXPIRE_PER_CLAIM: usize = 2;

/// How many claims a shard's expiry queue holds at most per record...
const QUEUED_PER_RECORD: usize = 2;
/// ...and besides, so that a shard holding few records is not compacted on every claim.
const QUEUED_BESIDES: usize = 64;

impl Records {
    /// Drops the queued claims whose record is gone or was claimed again, once the queue holds
    /// more than [`QUEUED_PER_RECORD`] claims per record: a key claimed and released in a loop
    /// would otherwise queue a claim per request until its TTL. Each compaction drops more than
    /// half the queue, so its work is paid for by the claims that filled it.
    fn bound_expiry(&mut self) {
        let bound = QUEUED_PER_RECORD * self.map.len() + QUEUED_BESIDES;
        if self.expiry.len() <= bound {
            return;
        }
        let map = &self.map;
        self.expiry.retain(|queued| {
            map.get(&queued.key)
                .is_some_and(|entry| entry.token == queued.token)
        });
        // A queue that once held many more claims gives the memory back.
        if self.expiry.capacity() > 2 * bound {
            self.expiry.shrink_to(bound);
        }
    }

    /// Deletes up to `max` records expired at `now`, oldest claim first; the bytes they held.
    fn expire_oldest(&mut self, now: Instant, max: usize) -> usize {
        let mut freed = 0;
        for _ in 0..max {
            if self.expiry.front().is_none_or(|oldest| oldest.at > now) {
                break;
            }
            let Some(oldest) = self.expiry.pop_front() else {
                break;
            };
            let hash_map::Entry::Occupied(entry) = self.map.entry(oldest.key) else {
                continue;
            };
            if entry.get().token != oldest.token {
                // Claimed again since: that claim is further back in the queue.
                continue;
            }
            if entry.get().expires_at <= now {
                freed += entry.remove().bytes();
            } else {
                // Renewed past its TTL (a lease longer than the TTL): look again then.
                let at = entry.get().expires_at;
                self.expiry.push_back(Expiry { at, ..oldest });
            }
        }
        freed
    }
}

/// `at + span`, or a century after `at` when that is past what an [`Instant`] holds: a TTL or
/// lease of `Duration::MAX` means never, and no request panics on it. (`at` itself only if a
/// century overflows too, which a monotonic clock never comes near.)
fn later(at: Instant, span: Duration) -> Instant {
    at.checked_add(span)
        .or_else(|| at.checked_add(CENTURY))
        .unwrap_or(at)
}

const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Keys are SHA-256 digests, so a fast hasher spreads them as well as SipHash does; seeded per
/// process, it leaves a client no way to aim keys at one bucket.
type Map = HashMap<ScopeKey, Entry, foldhash::fast::RandomState>;

const SHARDS: usize = 64;

impl Default for Inner {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            budget: None,
            notifier: Notifier::new(),
        }
    }
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    token: i64,
    /// When the store may delete the entry: the later of its claim's TTL and its lease's end
    /// (which renewals move). [`Entry::ends`] tells when a request sees it end.
    expires_at: Instant,
    claimed_at: Instant,
    state: State,
}

/// What a record costs a bounded store besides its kept response: its key and entry in the map,
/// the map's own overhead per slot, roughly, and the places in the expiry queue it may hold
/// ([`Records::bound_expiry`]).
const ENTRY_BYTES: usize =
    size_of::<(ScopeKey, Entry)>() + 16 + QUEUED_PER_RECORD * size_of::<Expiry>();

impl Entry {
    /// When the record ends for a request with `ttl`: at that TTL counted from its claim, or
    /// when the store may delete it, if sooner. A claim in flight under a live lease outlives
    /// both; the caller checks that first.
    fn ends(&self, ttl: Duration) -> Instant {
        self.expires_at.min(later(self.claimed_at, ttl))
    }

    /// The bytes this entry counts against a bounded store's limit.
    fn bytes(&self) -> usize {
        ENTRY_BYTES
            + match &self.state {
                State::InFlight { .. } => 0,
                State::Completed(packed) => packed.bytes.len(),
            }
    }
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
    /// An empty store, unbounded: it holds every record until it expires.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that holds at most about `limit` bytes of records: each costs its kept
    /// response (headers and body) and about 290 bytes for its key, its state and its places in
    /// the expiry queue.
    ///
    /// When a new key would take the store past `limit`, the store first deletes its expired
    /// records (at most once a second; run
    /// [`continuously_delete_expired`](super::continuously_delete_expired) to keep ahead of
    /// them), and if that is not enough it refuses the claim with [`MemoryStoreError::Full`].
    /// Nothing already stored is evicted to make room: a kept response is replayed until it
    /// expires, and a claim already made completes (its response may take the store past
    /// `limit`, by at most the responses in flight, each bounded by the layer's
    /// `max_response_bytes`).
    pub fn with_max_bytes(limit: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                budget: Some(Budget {
                    limit,
                    used: AtomicUsize::new(0),
                    swept: Mutex::new(None),
                }),
                ..Inner::default()
            }),
        }
    }

    /// The number of records held, expired ones not yet deleted included.
    pub fn len(&self) -> usize {
        (0..SHARDS).map(|shard| self.shard(shard).map.len()).sum()
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
            .0
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
        let status = match records.map.entry(lease.key) {
            hash_map::Entry::Occupied(entry)
                if entry.get().token == lease.token
                    && matches!(entry.get().state, State::InFlight { .. }) =>
            {
                f(entry);
                ClaimStatus::Held
            }
            _ => ClaimStatus::Lost,
        };
        // A release removes the record but leaves its claim queued.
        records.bound_expiry();
        status
    }
}

impl Store for MemoryStore {
    type Claim = Lease;
    type Error = MemoryStoreError;

    async fn begin(&self, request: &ClaimRequest) -> Result<Begin<Lease>, MemoryStoreError> {
        let now = Instant::now();
        match self.try_begin(request, now) {
            // Full: make room from the expired records, if that was not just tried, and again.
            Err(MemoryStoreError::Full { .. }) if self.delete_expired_when_full(now) => {
                self.try_begin(request, now)
            }
            outcome => outcome,
        }
    }

    async fn renew(&self, claim: &Lease, lease: Duration) -> Result<ClaimStatus, MemoryStoreError> {
        Ok(self.with_held(claim, |mut held| {
            let entry = held.get_mut();
            let lease_until = later(Instant::now(), lease);
            entry.expires_at = entry.expires_at.max(lease_until);
            entry.state = State::InFlight { lease_until };
        }))
    }

    async fn complete(
        &self,
        claim: &Lease,
        record: &Record,
    ) -> Result<ClaimStatus, MemoryStoreError> {
        // Packed outside the lock.
        let packed = Packed::pack(record);
        let status = self.with_held(claim, |mut held| {
            self.count(packed.bytes.len(), 0);
            held.get_mut().state = State::Completed(packed);
        });
        self.inner.notifier.notify(&claim.key);
        Ok(status)
    }

    async fn release(&self, claim: &Lease) -> Result<ClaimStatus, MemoryStoreError> {
        let status = self.with_held(claim, |held| {
            let (_, entry) = held.remove_entry();
            self.count(0, entry.bytes());
        });
        self.inner.notifier.notify(&claim.key);
        Ok(status)
    }

    /// `true`: a replay is read from this process's memory, so the layer's replay cache would
    /// only hold a second copy (and, for a [bounded](MemoryStore::with_max_bytes) store, memory
    /// beyond its limit).
    fn in_process(&self) -> bool {
        true
    }

    /// Waiters are woken in process, as keys are completed or released.
    fn watch_in_flight(&self) -> InFlightWatch {
        InFlightWatch::Notified(self.inner.notifier.clone())
    }
}

impl MemoryStore {
    /// [`Store::begin`] at `now`, with one probe of the map whatever the outcome.
    fn try_begin(
        &self,
        request: &ClaimRequest,
        now: Instant,
    ) -> Result<Begin<Lease>, MemoryStoreError> {
        let mut shard = self.records(&request.key);
        let records = &mut *shard;
        let freed = records.expire_oldest(now, EXPIRE_PER_CLAIM);
        self.count(0, freed);
        // Before this claim queues its own.
        records.bound_expiry();
        // One probe of the map, whatever the outcome.
        let slot = records.map.entry(request.key);
        let takeover = match &slot {
            hash_map::Entry::Vacant(_) => false,
            hash_map::Entry::Occupied(held) => {
                let entry = held.get();
                let ends = entry.ends(request.ttl);
                match &entry.state {
                    // Never taken from its holder, even past its TTL.
                    State::InFlight { lease_until } if *lease_until > now => {
                        if entry.fingerprint != request.fingerprint {
                            return Ok(Begin::Mismatch);
                        }
                        return Ok(Begin::InFlight {
                            lease_remaining: Some(lease_until.saturating_duration_since(now)),
                        });
                    }
                    _ if ends <= now => false,
                    _ if entry.fingerprint != request.fingerprint => return Ok(Begin::Mismatch),
                    State::Completed(packed) => {
                        // A handle out of the lock; rebuilt into a record after it is released.
                        let (packed, expires_in) =
                            (packed.clone(), ends.saturating_duration_since(now));
                        drop(shard);
                        return Ok(Begin::Completed {
                            record: packed.unpack(),
                            expires_in: Some(expires_in),
                        });
                    }
                    // Its holder's lease lapsed before its TTL passed.
                    State::InFlight { .. } => true,
                }
            }
        };
        // A new key is what grows the store; an expired record or a lapsed claim it replaces
        // gives back what it held.
        let replaced = match &slot {
            hash_map::Entry::Vacant(_) => 0,
            hash_map::Entry::Occupied(held) => held.get().bytes(),
        };
        if let Some(budget) = &self.inner.budget
            && replaced == 0
            && budget.used.load(Ordering::Relaxed) + ENTRY_BYTES > budget.limit
        {
            return Err(MemoryStoreError::Full {
                limit: budget.limit,
            });
        }
        records.last_token += 1;
        let token = records.last_token;
        // A claim in flight outlives its TTL until its lease ends.
        let lease_until = later(now, request.lease);
        let expires_at = later(now, request.ttl).max(lease_until);
        slot.insert_entry(Entry {
            fingerprint: request.fingerprint,
            token,
            expires_at,
            claimed_at: now,
            state: State::InFlight { lease_until },
        });
        records.expiry.push_back(Expiry {
            at: expires_at,
            key: request.key,
            token,
        });
        self.count(ENTRY_BYTES, replaced);
        Ok(Begin::Acquired {
            claim: Lease {
                key: request.key,
                token,
            },
            takeover,
        })
    }

    /// Counts `added` bytes in and `removed` out of a bounded store's records. Called under
    /// the lock of the shard that changed.
    fn count(&self, added: usize, removed: usize) {
        if let Some(budget) = &self.inner.budget {
            if added > removed {
                budget.used.fetch_add(added - removed, Ordering::Relaxed);
            } else {
                budget.used.fetch_sub(removed - added, Ordering::Relaxed);
            }
        }
    }

    /// Deletes every expired record, unless a full store did so within [`SWEEP_EVERY`] (or is
    /// doing so now); whether it did. Holds one shard's lock at a time.
    fn delete_expired_when_full(&self, now: Instant) -> bool {
        let Some(budget) = &self.inner.budget else {
            return false;
        };
        let Ok(mut swept) = budget.swept.try_lock() else {
            return false;
        };
        if swept.is_some_and(|at| now < at + SWEEP_EVERY) {
            return false;
        }
        *swept = Some(now);
        for shard in 0..SHARDS {
            self.delete_expired_from(shard, now, usize::MAX);
        }
        true
    }

    /// Deletes up to `max` records of `shard` expired at `now`; how many it deleted.
    fn delete_expired_from(&self, shard: usize, now: Instant, max: usize) -> usize {
        let mut records = self.shard(shard);
        // Removes only what it yields, so it stops at `max`.
        let (count, bytes) = records
            .map
            .extract_if(|_, entry| entry.expires_at <= now)
            .take(max)
            .fold((0, 0), |(count, bytes), (_, entry)| {
                (count + 1, bytes + entry.bytes())
            });
        self.count(0, bytes);
        records.bound_expiry();
        count
    }
}

impl ExpiredDeletion for MemoryStore {
    /// Deletes up to `batch` expired records, holding one shard's lock at a time.
    async fn delete_expired(&self, batch: u32) -> Result<u64, MemoryStoreError> {
        let now = Instant::now();
        let mut left = batch as usize;
        for shard in 0..SHARDS {
            if left == 0 {
                break;
            }
            left -= self.delete_expired_from(shard, now, left);
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

    /// A TTL shorter than the lease.
    fn short_ttl(fingerprint: u8) -> ClaimRequest {
        ClaimRequest {
            ttl: Duration::from_secs(2),
            ..request(fingerprint)
        }
    }

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
            store.begin(&short_ttl(1)).await,
            Ok(Begin::Completed {
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

    #[tokio::test(start_paused = true)]
    async fn a_claim_past_its_ttl_is_in_flight_until_its_lease_lapses() {
        let store = MemoryStore::new();
        let (claim, _) = acquire(&store, &short_ttl(1)).await;
        tokio::time::advance(Duration::from_secs(29)).await;
        assert_eq!(
            store.begin(&short_ttl(1)).await,
            Ok(Begin::InFlight {
                lease_remaining: Some(Duration::from_secs(1))
            })
        );
        assert_eq!(store.begin(&short_ttl(2)).await, Ok(Begin::Mismatch));
        assert_eq!(store.delete_expired(10).await, Ok(0));
        assert_eq!(
            store.renew(&claim, Duration::from_secs(30)).await,
            Ok(ClaimStatus::Held)
        );
        tokio::time::advance(Duration::from_secs(29)).await;
        assert!(matches!(
            store.begin(&short_ttl(2)).await,
            Ok(Begin::Mismatch)
        ));
        // Lapsed, and past its TTL: dead, so the next claim is new.
        tokio::time::advance(Duration::from_secs(1)).await;
        let (_, takeover) = acquire(&store, &short_ttl(2)).await;
        assert!(!takeover);
        assert_eq!(
            store.complete(&claim, &record()).await,
            Ok(ClaimStatus::Lost)
        );
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
        assert_eq!(store.begin(&keyed(4)).await, full);

        // What it holds goes on as before: a held claim completes (past the limit), its record
        // replays, a claim in flight is a conflict, another payload a mismatch, and a lapsed
        // claim is taken over in place.
        assert_eq!(store.complete(&a, &record()).await, Ok(ClaimStatus::Held));
        assert!(matches!(
            store.begin(&keyed(1)).await,
            Ok(Begin::Completed { .. })
        ));
        assert!(matches!(
            store.begin(&keyed(2)).await,
            Ok(Begin::InFlight { .. })
        ));
        assert_eq!(
            store
                .begin(&ClaimRequest {
                    fingerprint: Fingerprint::from_bytes([9; 32]),
                    ..keyed(2)
                })
                .await,
            Ok(Begin::Mismatch)
        );
        tokio::time::advance(Duration::from_secs(31)).await;
        let (b2, takeover) = acquire(&store, &keyed(2)).await;
        assert!(takeover);
        assert_eq!(store.release(&b).await, Ok(ClaimStatus::Lost));

        // A released claim gives its room back, but the kept response ("done") still counts.
        assert_eq!(store.release(&c).await, Ok(ClaimStatus::Held));
        assert_eq!(store.begin(&keyed(4)).await, full);
        assert_eq!(store.release(&b2).await, Ok(ClaimStatus::Held));
        let (d, _) = acquire(&store, &keyed(4)).await;
        assert_eq!(store.begin(&keyed(5)).await, full);

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
        assert_eq!(store.begin(&keyed(8)).await, full);
        assert_eq!(store.complete(&d, &record()).await, Ok(ClaimStatus::Lost));

        // Everything counted is given back: drained, the store takes three claims again.
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert_eq!(store.delete_expired(100).await, Ok(3));
        for key in 10..13 {
            acquire(&store, &keyed(key)).await;
        }
        assert_eq!(store.begin(&keyed(13)).await, full);
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
            store.begin(&periodic(0, 19, ttl)).await,
            Ok(Begin::Completed { .. })
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
            store.begin(&renewed).await,
            Ok(Begin::InFlight { .. })
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
                ..request(1)
            };
            let released = ClaimRequest {
                key: ScopeKey::from_bytes([8; 32]),
                ..request.clone()
            };
            for _ in 0..3 {
                if let Ok(Begin::Acquired { claim, .. }) = store.begin(&released).await {
                    let _ = store.renew(&claim, renewal).await;
                    let _ = store.release(&claim).await;
                }
                match store.begin(&request).await {
                    Ok(Begin::Acquired { claim, .. }) => {
                        let _ = store.begin(&request).await;
                        let _ = store.renew(&claim, renewal).await;
                        tokio::time::advance(step).await;
                        let _ = store.complete(&claim, &record()).await;
                    }
                    Ok(Begin::Completed {
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
    #[cfg(feature = "conformance")]
    #[tokio::test(start_paused = true)]
    async fn keeps_the_store_protocol() {
        for store in [MemoryStore::new(), MemoryStore::with_max_bytes(1 << 30)] {
            crate::store::conformance::check(&store, Duration::from_secs(1)).await;
            crate::store::conformance::check_expired_deletion(&store, Duration::from_secs(1)).await;
        }
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
