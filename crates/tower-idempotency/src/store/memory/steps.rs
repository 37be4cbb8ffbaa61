//! The memory store's [`StepLog`]: each key's finished steps beside its record in the key's
//! shard, fenced under the shard's lock by the record's token and lease.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::{
    MemoryStore,
    records::{Records, State},
};
use crate::{
    fingerprint::Fingerprint,
    store::{ClaimStatus, Fence, StepLog, StepLogError, StepRecord},
};

/// A key's finished steps, for the payload whose fingerprint recorded them, until they expire
/// with the key's record.
#[derive(Debug)]
pub(super) struct StepSet {
    fingerprint: Fingerprint,
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
}

impl Records {
    /// Records `step` for `fence`'s key if the fence holds it under a live lease; the bytes
    /// added and removed.
    fn record_step(
        &mut self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        step: &StepRecord,
        now: Instant,
    ) -> Option<(usize, usize)> {
        let entry = self.map.get(&fence.key)?;
        let live = matches!(entry.state, State::InFlight { lease_until } if lease_until > now);
        if entry.token != fence.token || !live {
            return None;
        }
        let expires_at = entry.expires_at;
        let set = self.steps.entry(fence.key).or_insert_with(|| StepSet {
            fingerprint: *fingerprint,
            expires_at,
            steps: Vec::new(),
        });
        let before = set.bytes();
        // Another payload's steps (the key was released and claimed again) are not this one's.
        if set.fingerprint != *fingerprint || set.expired(now) {
            set.fingerprint = *fingerprint;
            set.steps.clear();
        }
        set.expires_at = expires_at;
        match set.steps.iter_mut().find(|kept| kept.name == step.name) {
            Some(kept) => kept.output = step.output.clone(),
            None => set.steps.push(step.clone()),
        }
        Some((set.bytes(), before))
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
        let now = Instant::now();
        let mut records = self.records(&fence.key);
        let found = match records.steps.get(&fence.key) {
            Some(set) if set.expired(now) => {
                let freed = set.bytes();
                records.steps.remove(&fence.key);
                self.count(0, freed);
                Vec::new()
            }
            Some(set) if set.fingerprint == *fingerprint => set.steps.clone(),
            _ => Vec::new(),
        };
        Box::pin(std::future::ready(Ok(found)))
    }

    fn record(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        step: &StepRecord,
    ) -> BoxFuture<'_, Result<ClaimStatus, StepLogError>> {
        let mut records = self.records(&fence.key);
        let status = match records.record_step(fence, fingerprint, step, Instant::now()) {
            Some((added, removed)) => {
                self.count(added, removed);
                ClaimStatus::Held
            }
            None => ClaimStatus::Lost,
        };
        Box::pin(std::future::ready(Ok(status)))
    }
}
