use std::{
    collections::hash_map,
    fmt,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::time::Instant;

use super::{
    Capabilities, ClaimRequest, ClaimStatus, ExpiredDeletion, Fence, InFlightWatch, KeyState,
    Notifier, Store,
};
use crate::{record::Record, scope::ScopeKey};

mod packed;
mod records;
mod steps;

#[cfg(test)]
mod tests;

use packed::Packed;
use records::{ENTRY_BYTES, EXPIRE_PER_CLAIM, Entry, Expiry, Records, State, later};

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

    /// Runs `f` on the entry still held by `fence`, if any, found with one probe of the map.
    fn with_held(
        &self,
        fence: &Fence,
        f: impl FnOnce(hash_map::OccupiedEntry<'_, ScopeKey, Entry>),
    ) -> ClaimStatus {
        let mut records = self.records(&fence.key);
        let status = match records.map.entry(fence.key) {
            hash_map::Entry::Occupied(entry)
                if entry.get().token == fence.token
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
    type Claim = Fence;
    type Error = MemoryStoreError;

    async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<Fence>, MemoryStoreError> {
        let now = Instant::now();
        match self.try_claim(request, now) {
            // Full: make room from the expired records, if that was not just tried, and again.
            Err(MemoryStoreError::Full { .. }) if self.delete_expired_when_full(now) => {
                self.try_claim(request, now)
            }
            outcome => outcome,
        }
    }

    async fn renew(&self, claim: &Fence, lease: Duration) -> Result<ClaimStatus, MemoryStoreError> {
        Ok(self.with_held(claim, |mut held| {
            let entry = held.get_mut();
            let lease_until = later(Instant::now(), lease);
            entry.expires_at = entry.expires_at.max(lease_until);
            entry.state = State::InFlight { lease_until };
        }))
    }

    async fn complete(
        &self,
        claim: &Fence,
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

    async fn abandon(&self, claim: &Fence) -> Result<ClaimStatus, MemoryStoreError> {
        let status = self.with_held(claim, |mut held| {
            held.get_mut().state = State::InFlight {
                lease_until: Instant::now(),
            };
        });
        // Its waiters take it over at once rather than at their next read.
        self.inner.notifier.notify(&claim.key);
        Ok(status)
    }

    async fn release(&self, claim: &Fence) -> Result<ClaimStatus, MemoryStoreError> {
        let status = self.with_held(claim, |held| {
            let (_, entry) = held.remove_entry();
            self.count(0, entry.bytes());
        });
        self.inner.notifier.notify(&claim.key);
        Ok(status)
    }

    /// Waiters are woken in process, as keys settle; steps are kept beside the records.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .with_in_flight_watch(InFlightWatch::Notified(self.inner.notifier.clone()))
            .with_step_log(self.step_log())
    }
}

impl MemoryStore {
    /// [`Store::claim`] at `now`, with one probe of the map whatever the outcome.
    fn try_claim(
        &self,
        request: &ClaimRequest,
        now: Instant,
    ) -> Result<KeyState<Fence>, MemoryStoreError> {
        let mut shard = self.records(&request.key);
        let records = &mut *shard;
        let freed = records.expire_oldest(now, EXPIRE_PER_CLAIM);
        self.count(0, freed);
        // Before this claim queues its own.
        records.bound_expiry();
        // One probe of the map, whatever the outcome.
        let slot = records.map.entry(request.key);
        let (takeover, going_on) = match &slot {
            hash_map::Entry::Vacant(_) => (false, None),
            hash_map::Entry::Occupied(held) => match inspect(held.get(), request, now) {
                // A takeover goes on in the key's generation; a dead record's key starts another.
                Found::Free { takeover } => (takeover, takeover.then(|| held.get().generation)),
                Found::InFlight(remaining) => {
                    return Ok(KeyState::InFlight {
                        lease_remaining: Some(remaining),
                    });
                }
                Found::Mismatch => return Ok(KeyState::Mismatch),
                Found::Completed(packed, expires_in) => {
                    // Rebuilt into a record after the lock is released.
                    drop(shard);
                    return Ok(KeyState::Completed {
                        record: packed.unpack(),
                        expires_in: Some(expires_in),
                    });
                }
            },
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
        // A new key whose payload's steps a release left goes on in their generation.
        let generation = going_on
            .or_else(|| match &slot {
                hash_map::Entry::Vacant(_) => {
                    records.steps.get(&request.key)?.left_for(request, now)
                }
                hash_map::Entry::Occupied(_) => None,
            })
            .unwrap_or(token);
        // A claim in flight outlives its TTL until its lease ends.
        let lease_until = later(now, request.lease);
        let expires_at = later(now, request.ttl).max(lease_until);
        slot.insert_entry(Entry {
            fingerprint: request.fingerprint,
            token,
            generation,
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
        Ok(KeyState::Acquired {
            claim: Fence {
                key: request.key,
                token,
                generation,
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
        // Steps expire with their records (never while their generation's record lives); they
        // are not counted as records deleted.
        let Records { map, steps, .. } = &mut *records;
        let steps: usize = steps
            .extract_if(|key, set| set.expired(now) && !set.kept_by(map.get(key), now))
            .map(|(_, set)| set.bytes())
            .sum();
        self.count(0, bytes + steps);
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

/// What a claim finds in a key's existing entry.
enum Found {
    /// The key is free to claim; `takeover` when its holder's lease lapsed before its TTL.
    Free { takeover: bool },
    /// Another request holds it for this long yet.
    InFlight(Duration),
    /// It belongs to a request with another fingerprint.
    Mismatch,
    /// It completed: a handle on its record, and how long the record has left.
    Completed(Packed, Duration),
}

/// Reads `entry` for `request` at `now`, following the protocol's state table.
fn inspect(entry: &Entry, request: &ClaimRequest, now: Instant) -> Found {
    let ends = entry.ends(request.ttl);
    match &entry.state {
        // Never taken from its holder, even past its TTL.
        State::InFlight { lease_until } if *lease_until > now => {
            if entry.fingerprint != request.fingerprint {
                return Found::Mismatch;
            }
            Found::InFlight(lease_until.saturating_duration_since(now))
        }
        _ if ends <= now => Found::Free { takeover: false },
        _ if entry.fingerprint != request.fingerprint => Found::Mismatch,
        State::Completed(packed) => {
            Found::Completed(packed.clone(), ends.saturating_duration_since(now))
        }
        // Its holder's lease lapsed before its TTL passed.
        State::InFlight { .. } => Found::Free { takeover: true },
    }
}
