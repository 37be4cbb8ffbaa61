//! [`CachingStore`]: completed records kept in process in front of any store, so that a retry
//! coming back to the same instance is answered without a store round trip.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::store::{CachingStore, ClaimRequest, KeyState, MemoryStore, Store};
//! use tower_idempotency::{Fingerprint, Record, ScopeKey};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = CachingStore::new(MemoryStore::new());
//! let request = ClaimRequest {
//!     key: ScopeKey::from_bytes([1; 32]),
//!     fingerprint: Fingerprint::from_bytes([2; 32]),
//!     lease: Duration::from_secs(30),
//!     ttl: Duration::from_secs(86_400),
//!     waiting: false,
//!     keeps_request: false,
//! };
//! let Ok(KeyState::Acquired { claim, .. }) = store.claim(&request).await else { panic!() };
//! let record = Record::from_parts(http::StatusCode::OK, Default::default(), Some("ok".into()));
//! let _ = store.complete(&claim, &record).await;
//! // The first retry reads the inner store and keeps a copy; later ones are answered from it.
//! for _ in 0..3 {
//!     let Ok(KeyState::Completed { record: replayed, .. }) = store.claim(&request).await
//!     else { panic!() };
//!     assert_eq!(replayed, record);
//! }
//! # }
//! ```

use std::{fmt, sync::Arc, time::Duration};

use quick_cache::{Weighter, sync::Cache};
use tokio::time::Instant;

use super::{Capabilities, ClaimRequest, ClaimStatus, ExpiredDeletion, KeyState, Store};
use crate::{
    fingerprint::Fingerprint,
    record::Record,
    scope::ScopeKey,
    settings::{ConfigError, later},
};

/// The size of [`CachingStore::new`]'s cache.
const DEFAULT_MAX_BYTES: usize = 16 * 1024 * 1024;

/// A [`Store`] that answers retries of completed keys from a copy kept in this process, and
/// forwards everything else to the store it wraps.
///
/// A completed record never changes until it expires, so a copy is exact; each copy expires
/// when its record does (the inner store says when), and the cache is bounded in bytes,
/// evicting the least recently useful copies. It is filled when the store answers a retry with
/// a replay, so requests that are never retried cost it nothing. Clones share the cache.
///
/// [`IdempotencyLayer::postgres`](crate::IdempotencyLayer::postgres) puts one of 16 MiB in front
/// of its [`PostgresStore`](super::PostgresStore); wrap any other store yourself. A
/// [`MemoryStore`](super::MemoryStore) needs none: its records are in process already.
///
/// ```no_run
/// # #[cfg(feature = "postgres")] {
/// use tower_idempotency::{IdempotencyLayer, KeySource, sqlx::PgPool};
/// use tower_idempotency::store::{CachingStore, PostgresStore};
///
/// let pool = PgPool::connect_lazy("postgres://localhost/app").expect("a valid URL");
/// // Transactional mode, with repeated retries answered from memory.
/// let store = CachingStore::new(PostgresStore::new(pool).transactional());
/// let layer = IdempotencyLayer::new(store).with_key(KeySource::default().required());
/// # }
/// ```
pub struct CachingStore<S> {
    inner: S,
    cache: Arc<ReplayCache>,
}

impl<S> CachingStore<S> {
    /// `store` behind a cache of at most 16 MiB of records.
    pub fn new(store: S) -> Self {
        Self {
            inner: store,
            cache: Arc::new(ReplayCache::new(DEFAULT_MAX_BYTES)),
        }
    }

    /// `store` behind a cache of at most `max_bytes` of records.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for zero: a store without a cache is `store` itself.
    pub fn with_max_bytes(store: S, max_bytes: usize) -> Result<Self, ConfigError> {
        if max_bytes == 0 {
            return Err(ConfigError::Zero("max_bytes"));
        }
        Ok(Self {
            inner: store,
            cache: Arc::new(ReplayCache::new(max_bytes)),
        })
    }

    /// The wrapped store, for what only it offers
    /// ([`PostgresStore::migrate`](super::PostgresStore::migrate)).
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The wrapped store, the cache dropped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone> Clone for CachingStore<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            cache: Arc::clone(&self.cache),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for CachingStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingStore")
            .field("inner", &self.inner)
            .field("cached_bytes", &self.cache.entries.weight())
            .field("max_bytes", &self.cache.entries.capacity())
            .finish()
    }
}

/// The protocol, forwarded; only [`claim`](Store::claim) looks at the cache first.
impl<S: Store> Store for CachingStore<S> {
    type Claim = S::Claim;
    type Error = S::Error;

    async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<S::Claim>, S::Error> {
        if let Some(state) = self.cache.get(&request.key, &request.fingerprint) {
            return Ok(state);
        }
        let state = self.inner.claim(request).await?;
        if let KeyState::Completed {
            record,
            expires_in: Some(expires_in),
        } = &state
        {
            let (key, fingerprint) = (request.key, request.fingerprint);
            self.cache.insert(key, fingerprint, record, *expires_in);
        }
        Ok(state)
    }

    async fn renew(&self, claim: &S::Claim, lease: Duration) -> Result<ClaimStatus, S::Error> {
        self.inner.renew(claim, lease).await
    }

    async fn complete(&self, claim: &S::Claim, record: &Record) -> Result<ClaimStatus, S::Error> {
        self.inner.complete(claim, record).await
    }

    async fn release(&self, claim: &S::Claim) -> Result<ClaimStatus, S::Error> {
        self.inner.release(claim).await
    }

    async fn abandon(&self, claim: &S::Claim) -> Result<ClaimStatus, S::Error> {
        self.inner.abandon(claim).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// Copies expire with their records, so deleting expired records leaves the cache alone.
impl<S: ExpiredDeletion> ExpiredDeletion for CachingStore<S> {
    async fn delete_expired(&self, batch: u32) -> Result<u64, S::Error> {
        self.inner.delete_expired(batch).await
    }
}

/// A bounded, expiring map of completed records.
struct ReplayCache {
    entries: Cache<ScopeKey, Arc<Cached>, ByRecordSize>,
}

struct Cached {
    fingerprint: Fingerprint,
    record: Record,
    expires_at: Instant,
}

#[derive(Clone)]
struct ByRecordSize;

impl Weighter<ScopeKey, Arc<Cached>> for ByRecordSize {
    fn weight(&self, _: &ScopeKey, cached: &Arc<Cached>) -> u64 {
        // The record plus the entry's own bookkeeping.
        cached.record.size() as u64 + 256
    }
}

impl ReplayCache {
    /// A cache of at most `max_bytes` of records.
    fn new(max_bytes: usize) -> Self {
        let estimated_items = (max_bytes / 2048).max(16);
        Self {
            entries: Cache::with_weighter(estimated_items, max_bytes as u64, ByRecordSize),
        }
    }

    /// The claim's answer for `key` from a live copy, if one is held: the replay for the same
    /// fingerprint, a mismatch for another.
    fn get<C>(&self, key: &ScopeKey, fingerprint: &Fingerprint) -> Option<KeyState<C>> {
        let cached = self.entries.get(key)?;
        let now = Instant::now();
        if cached.expires_at <= now {
            self.entries.remove(key);
            return None;
        }
        Some(if cached.fingerprint == *fingerprint {
            KeyState::Completed {
                record: cached.record.clone(),
                expires_in: Some(cached.expires_at - now),
            }
        } else {
            KeyState::Mismatch
        })
    }

    /// Keeps a copy of `key`'s completed record, made by `fingerprint`, until it expires in
    /// `expires_in`.
    fn insert(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
        record: &Record,
        expires_in: Duration,
    ) {
        let cached = Cached {
            fingerprint,
            record: record.clone(),
            // The inner store's answer may be any duration: saturate, never panic.
            expires_at: later(Instant::now(), expires_in),
        };
        self.entries.insert(key, Arc::new(cached));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::StatusCode;

    use super::*;
    use crate::store::{Fence, MemoryStore, MemoryStoreError};

    fn record(body: &'static str) -> Record {
        Record::from_parts(StatusCode::OK, Default::default(), Some(body.into()))
    }

    /// A memory store that counts the claims it is asked.
    #[derive(Clone, Default)]
    struct Counted {
        inner: MemoryStore,
        claims: Arc<AtomicUsize>,
    }

    impl Counted {
        fn claims(&self) -> usize {
            self.claims.load(Ordering::SeqCst)
        }
    }

    impl Store for Counted {
        type Claim = Fence;
        type Error = MemoryStoreError;

        async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<Fence>, Self::Error> {
            self.claims.fetch_add(1, Ordering::SeqCst);
            self.inner.claim(request).await
        }

        async fn renew(&self, claim: &Fence, lease: Duration) -> Result<ClaimStatus, Self::Error> {
            self.inner.renew(claim, lease).await
        }

        async fn complete(
            &self,
            claim: &Fence,
            record: &Record,
        ) -> Result<ClaimStatus, Self::Error> {
            self.inner.complete(claim, record).await
        }

        async fn release(&self, claim: &Fence) -> Result<ClaimStatus, Self::Error> {
            self.inner.release(claim).await
        }
    }

    /// A memory store that says its completed records live for `Duration::MAX`, as a store
    /// with a corrupt or far-future expiry might.
    #[derive(Clone, Default)]
    struct Forever(MemoryStore);

    impl Store for Forever {
        type Claim = Fence;
        type Error = MemoryStoreError;

        async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<Fence>, Self::Error> {
            Ok(match self.0.claim(request).await? {
                KeyState::Completed { record, .. } => KeyState::Completed {
                    record,
                    expires_in: Some(Duration::MAX),
                },
                other => other,
            })
        }

        async fn renew(&self, claim: &Fence, lease: Duration) -> Result<ClaimStatus, Self::Error> {
            self.0.renew(claim, lease).await
        }

        async fn complete(
            &self,
            claim: &Fence,
            record: &Record,
        ) -> Result<ClaimStatus, Self::Error> {
            self.0.complete(claim, record).await
        }

        async fn release(&self, claim: &Fence) -> Result<ClaimStatus, Self::Error> {
            self.0.release(claim).await
        }
    }

    /// An expiry past what the clock holds is kept as "never", not a panic (issue 44).
    #[tokio::test]
    async fn a_huge_expiry_from_the_inner_store_is_kept_without_overflow() {
        let store = CachingStore::new(Forever::default());
        let same = request(2, Duration::from_secs(60));
        let Ok(KeyState::Acquired { claim, .. }) = store.claim(&same).await else {
            panic!("a new key is acquired");
        };
        let _ = store.complete(&claim, &record("a")).await;
        for _ in 0..2 {
            let Ok(KeyState::Completed {
                record: replayed,
                expires_in,
            }) = store.claim(&same).await
            else {
                panic!("a completed key replays");
            };
            assert_eq!(replayed, record("a"));
            assert!(expires_in.is_some_and(|left| left > Duration::from_secs(60)));
        }
    }

    fn request(fingerprint: u8, ttl: Duration) -> ClaimRequest {
        ClaimRequest {
            key: ScopeKey::from_bytes([1; 32]),
            fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
            lease: Duration::from_secs(30),
            ttl,
            waiting: false,
            keeps_request: false,
        }
    }

    /// After the inner store answered one retry, later retries (and mismatches) are answered
    /// from the copy until the record expires; then the inner store is asked again.
    #[tokio::test(start_paused = true)]
    async fn retries_skip_the_inner_store_until_the_record_expires() {
        let store = CachingStore::new(Counted::default());
        let ttl = Duration::from_secs(60);
        let same = request(2, ttl);
        let Ok(KeyState::Acquired { claim, .. }) = store.claim(&same).await else {
            panic!("a new key is acquired");
        };
        assert_eq!(
            store.complete(&claim, &record("a")).await,
            Ok(ClaimStatus::Held)
        );
        for _ in 0..3 {
            let Ok(KeyState::Completed {
                record: replayed,
                expires_in,
            }) = store.claim(&same).await
            else {
                panic!("a completed key replays");
            };
            assert_eq!(replayed, record("a"));
            assert!(expires_in.is_some_and(|left| left <= ttl));
        }
        assert_eq!(store.claim(&request(3, ttl)).await, Ok(KeyState::Mismatch));
        assert_eq!(
            store.inner().claims(),
            2,
            "the acquisition and the first retry"
        );

        tokio::time::advance(ttl).await;
        let Ok(KeyState::Acquired { takeover, .. }) = store.claim(&request(3, ttl)).await else {
            panic!("an expired record's key is new");
        };
        assert!(!takeover);
        assert_eq!(store.inner().claims(), 3);
    }

    /// The cache forwards the whole protocol, so it keeps it (issue 35.1).
    #[cfg(feature = "conformance")]
    #[tokio::test(start_paused = true)]
    async fn a_caching_store_keeps_the_protocol() {
        let store = CachingStore::new(MemoryStore::new());
        crate::store::conformance::check(&store, Duration::from_secs(1)).await;
        crate::store::conformance::check_expired_deletion(&store, Duration::from_secs(1)).await;
    }

    #[test]
    fn zero_bytes_are_refused() {
        assert_eq!(
            CachingStore::with_max_bytes(MemoryStore::new(), 0).err(),
            Some(ConfigError::Zero("max_bytes"))
        );
        let store = CachingStore::with_max_bytes(MemoryStore::new(), 1 << 20).expect("valid");
        assert!(store.into_inner().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn copies_expire_with_their_records() {
        let cache = ReplayCache::new(1 << 20);
        let (key, fp) = (
            ScopeKey::from_bytes([1; 32]),
            Fingerprint::from_bytes([2; 32]),
        );
        cache.insert(key, fp, &record("a"), Duration::from_secs(10));
        assert!(matches!(
            cache.get::<Fence>(&key, &fp),
            Some(KeyState::Completed { record: r, .. }) if r == record("a")
        ));
        assert!(matches!(
            cache.get::<Fence>(&key, &Fingerprint::from_bytes([3; 32])),
            Some(KeyState::Mismatch)
        ));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(cache.get::<Fence>(&key, &fp).is_none());
    }

    #[test]
    fn the_cache_is_bounded_in_bytes() {
        let cache = ReplayCache::new(64 * 1024);
        let big = Record::from_parts(
            StatusCode::OK,
            Default::default(),
            Some(vec![0u8; 1024].into()),
        );
        for i in 0..1000u32 {
            let mut key = [0u8; 32];
            key[..4].copy_from_slice(&i.to_be_bytes());
            cache.insert(
                ScopeKey::from_bytes(key),
                Fingerprint::from_bytes([0; 32]),
                &big,
                Duration::from_secs(60),
            );
        }
        let entries = &cache.entries;
        assert!(
            entries.weight() <= 64 * 1024,
            "{} bytes held",
            entries.weight()
        );
        assert!(entries.len() < 1000);
    }
}
