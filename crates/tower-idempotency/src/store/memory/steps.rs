//! The memory store's [`StepLog`]: each key's finished steps beside its record in the key's
//! shard, fenced under the shard's lock by the record's token.

use std::{collections::hash_map, sync::Arc};

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::{
    MemoryStore,
    records::{Entry, Records, State},
};
use crate::{
    fingerprint::Fingerprint,
    store::{ClaimRequest, ClaimStatus, Fence, StepLog, StepLogError, StepRecord},
};

/// A key's finished steps, for the payload whose fingerprint recorded them in the key's
/// generation, until they expire with the key's record.
#[derive(Debug)]
pub(super) struct StepSet {
    fingerprint: Fingerprint,
    generation: i64,
    expires_at: Instant,
    steps: Vec<StepRecord>,
}

/// What a key's steps cost a bounded store besides their names and outputs.
const SET_BYTES: usize = size_of::<StepSet>() + 48;

impl StepSet {
    /// The bytes this set counts against a bounded store's limit.
    pub(super) fn bytes(&self) -> usize {
        SET_BYTES
            + self
                .steps
                .iter()
                .map(|step| size_of::<StepRecord>() + step.name.len() + step.output.len())
                .sum::<usize>()
    }

    pub(super) fn expired(&self, now: Instant) -> bool {
        self.expires_at <= now
    }

    /// Whether `record` (the key's) keeps these steps from expiring: it is of their generation
    /// and has not expired itself (a takeover's record outlives the claim that recorded them).
    pub(super) fn kept_by(&self, record: Option<&Entry>, now: Instant) -> bool {
        record.is_some_and(|entry| entry.generation == self.generation && entry.expires_at > now)
    }

    /// The generation a new claim of the key for `request` goes on in: these steps', if a
    /// release left them for its payload and they have not expired.
    pub(super) fn left_for(&self, request: &ClaimRequest, now: Instant) -> Option<i64> {
        let left = self.fingerprint == request.fingerprint && !self.expired(now);
        left.then_some(self.generation)
    }
}

impl Records {
    /// Records `step` for `fence`'s key if the fence holds it, as completing requires (a lapsed
    /// lease nobody took over included); the bytes added and removed.
    fn record_step(
        &mut self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        step: &StepRecord,
    ) -> Option<(usize, usize)> {
        let entry = self.map.get(&fence.key)?;
        let in_flight = matches!(entry.state, State::InFlight { .. });
        if entry.token != fence.token || !in_flight {
            return None;
        }
        let (expires_at, generation) = (entry.expires_at, entry.generation);
        let (set, before) = match self.steps.entry(fence.key) {
            hash_map::Entry::Occupied(kept) => {
                let set = kept.into_mut();
                let before = set.bytes();
                (set, before)
            }
            hash_map::Entry::Vacant(slot) => {
                let set = slot.insert(StepSet {
                    fingerprint: *fingerprint,
                    generation,
                    expires_at,
                    steps: Vec::new(),
                });
                (set, 0)
            }
        };
        // Another generation's steps (the key expired, or was released and claimed again with
        // another payload) are not this one's.
        if set.generation != generation || set.fingerprint != *fingerprint {
            set.fingerprint = *fingerprint;
            set.generation = generation;
            set.expires_at = expires_at;
            set.steps.clear();
        }
        set.expires_at = set.expires_at.max(expires_at);
        match set.steps.iter_mut().find(|kept| kept.name == step.name) {
            Some(kept) => kept.output = step.output.clone(),
            None => set.steps.push(step.clone()),
        }
        Some((set.bytes(), before))
    }
}

impl Records {
    /// `fingerprint`'s steps of `fence`'s key in the fence's generation: the holder's record
    /// lives, so they do (whatever their own expiry says). The holder's record may outlive the
    /// claim that recorded them (a release, then a claim with a longer TTL): they are kept as
    /// long as it, or a claim after its release would not find them.
    fn recorded_steps(&mut self, fence: &Fence, fingerprint: &Fingerprint) -> Vec<StepRecord> {
        let holder = self
            .map
            .get(&fence.key)
            .filter(|entry| entry.token == fence.token)
            .map(|entry| entry.expires_at);
        let Some(set) = self.steps.get_mut(&fence.key) else {
            return Vec::new();
        };
        if set.generation != fence.generation || set.fingerprint != *fingerprint {
            return Vec::new();
        }
        if let Some(expires_at) = holder {
            set.expires_at = set.expires_at.max(expires_at);
        }
        set.steps.clone()
    }
}

impl MemoryStore {
    /// This store as a step log, for its capabilities.
    pub(super) fn step_log(&self) -> Arc<dyn StepLog> {
        Arc::new(self.clone())
    }
}

impl StepLog for MemoryStore {
    fn recorded(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
    ) -> BoxFuture<'_, Result<Vec<StepRecord>, StepLogError>> {
        let found = self.records(&fence.key).recorded_steps(fence, fingerprint);
        Box::pin(std::future::ready(Ok(found)))
    }

    fn record(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        step: &StepRecord,
    ) -> BoxFuture<'_, Result<ClaimStatus, StepLogError>> {
        let mut records = self.records(&fence.key);
        let status = match records.record_step(fence, fingerprint, step) {
            Some((added, removed)) => {
                self.count(added, removed);
                ClaimStatus::Held
            }
            None => ClaimStatus::Lost,
        };
        Box::pin(std::future::ready(Ok(status)))
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::atomic::Ordering, time::Duration};

    use super::*;
    use crate::{
        scope::ScopeKey,
        store::{ClaimRequest, ExpiredDeletion, KeyState, Store},
    };

    fn used(store: &MemoryStore) -> usize {
        let budget = store.inner.budget.as_ref().expect("bounded");
        budget.used.load(Ordering::Relaxed)
    }

    /// A key's steps count against a bounded store's limit, outlive the key's release, and
    /// go (their bytes with them) when `delete_expired` finds them expired.
    #[tokio::test(start_paused = true)]
    async fn steps_are_counted_and_deleted_with_expiry() {
        let store = MemoryStore::with_max_bytes(1 << 20);
        let fingerprint = Fingerprint::from_bytes([2; 32]);
        let request = ClaimRequest {
            key: ScopeKey::from_bytes([1; 32]),
            fingerprint,
            lease: Duration::from_secs(1),
            ttl: Duration::from_secs(10),
            waiting: false,
            keeps_request: false,
        };
        let Ok(KeyState::Acquired { claim, .. }) = store.claim(&request).await else {
            panic!("a new key is acquired");
        };
        let before = used(&store);
        let step = StepRecord {
            name: "authorize".to_owned(),
            output: vec![b'1'; 1000].into(),
        };
        let status = store.record(&claim, &fingerprint, &step).await.unwrap();
        assert_eq!(status, ClaimStatus::Held);
        assert!(used(&store) >= before + 1000);
        assert_eq!(store.release(&claim).await, Ok(ClaimStatus::Held));
        let kept = store.recorded(&claim, &fingerprint).await.unwrap();
        assert_eq!(kept, [step]);
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(store.delete_expired(10).await, Ok(0));
        assert_eq!(used(&store), 0);
        assert!(
            store
                .recorded(&claim, &fingerprint)
                .await
                .unwrap()
                .is_empty()
        );
    }
}
