//! Completed records kept in process, so that a retry coming back to the same instance is
//! answered without a store round trip.
//!
//! A completed record never changes until it expires, so a copy is exact; each copy expires
//! when its record does (the store says when), and the cache is bounded in bytes, evicting the
//! least recently useful copies. It is filled when the store answers a retry with a replay, so
//! requests that are never retried cost it nothing.

use std::sync::Arc;

use quick_cache::{Weighter, sync::Cache};
use tokio::time::{Duration, Instant};

use crate::{fingerprint::Fingerprint, record::Record, scope::ScopeKey};

/// A bounded, expiring map of completed records.
pub(crate) struct ReplayCache {
    entries: Option<Cache<ScopeKey, Arc<Cached>, ByRecordSize>>,
}

struct Cached {
    fingerprint: Fingerprint,
    record: Record,
    expires_at: Instant,
}

/// What the cache knows of a key.
pub(crate) enum Hit {
    /// The key completed with this request's fingerprint: replay.
    Replay(Record),
    /// The key completed with another fingerprint.
    Mismatch,
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
    /// A cache of at most `max_bytes` of records; `0` caches nothing.
    pub(crate) fn new(max_bytes: usize) -> Self {
        let entries = (max_bytes > 0).then(|| {
            let estimated_items = (max_bytes / 2048).max(16);
            Cache::with_weighter(estimated_items, max_bytes as u64, ByRecordSize)
        });
        Self { entries }
    }

    /// The cached answer for `key`, if a live copy is held.
    pub(crate) fn get(&self, key: &ScopeKey, fingerprint: &Fingerprint) -> Option<Hit> {
        let entries = self.entries.as_ref()?;
        let cached = entries.get(key)?;
        if cached.expires_at <= Instant::now() {
            entries.remove(key);
            return None;
        }
        Some(if cached.fingerprint == *fingerprint {
            Hit::Replay(cached.record.clone())
        } else {
            Hit::Mismatch
        })
    }

    /// Keeps a copy of `key`'s completed record until it expires in `expires_in`.
    pub(crate) fn insert(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
        record: &Record,
        expires_in: Duration,
    ) {
        let Some(entries) = &self.entries else {
            return;
        };
        let cached = Cached {
            fingerprint,
            record: record.clone(),
            expires_at: Instant::now() + expires_in,
        };
        entries.insert(key, Arc::new(cached));
    }
}

#[cfg(test)]
mod tests {
    use http::StatusCode;

    use super::*;

    fn record(body: &'static str) -> Record {
        Record::from_parts(StatusCode::OK, Default::default(), Some(body.into()))
    }

    #[tokio::test(start_paused = true)]
    async fn copies_expire_with_their_records() {
        let cache = ReplayCache::new(1 << 20);
        let (key, fp) = (
            ScopeKey::from_bytes([1; 32]),
            Fingerprint::from_bytes([2; 32]),
        );
        cache.insert(key, fp, &record("a"), Duration::from_secs(10));
        assert!(matches!(cache.get(&key, &fp), Some(Hit::Replay(r)) if r == record("a")));
        assert!(matches!(
            cache.get(&key, &Fingerprint::from_bytes([3; 32])),
            Some(Hit::Mismatch)
        ));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(cache.get(&key, &fp).is_none());
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
        let entries = cache.entries.as_ref().unwrap();
        assert!(
            entries.weight() <= 64 * 1024,
            "{} bytes held",
            entries.weight()
        );
        assert!(entries.len() < 1000);
    }

    #[test]
    fn a_zero_sized_cache_holds_nothing() {
        let cache = ReplayCache::new(0);
        let (key, fp) = (
            ScopeKey::from_bytes([1; 32]),
            Fingerprint::from_bytes([2; 32]),
        );
        cache.insert(key, fp, &record("a"), Duration::from_secs(10));
        assert!(cache.get(&key, &fp).is_none());
    }
}
