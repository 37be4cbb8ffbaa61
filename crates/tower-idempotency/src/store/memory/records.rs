//! A shard's records: each key's entry, and the queue of claims in the order they expire, kept
//! within a constant factor of the records.

use std::{
    collections::{HashMap, VecDeque, hash_map},
    time::Duration,
};

use tokio::time::Instant;

use super::{packed::Packed, steps::StepSet};
use crate::{fingerprint::Fingerprint, scope::ScopeKey};

/// Keys are SHA-256 digests, so a fast hasher spreads them as well as SipHash does; seeded per
/// process, it leaves a client no way to aim keys at one bucket.
type Map = HashMap<ScopeKey, Entry, foldhash::fast::RandomState>;

/// One shard's records, the order they expire in, and the last fencing token it handed out. A
/// key always lives in the same shard, so a count per shard gives every claim of a key a larger
/// token than the key had before, without a counter that every claim of every thread would write
/// to.
#[derive(Debug, Default)]
pub(super) struct Records {
    pub(super) map: Map,
    /// The claims made in this shard, oldest first, with the time their records expire. A
    /// claim's record may since have been released, deleted, claimed again (its token tells) or
    /// renewed past that time; it is looked at when its time comes, or dropped sooner once such
    /// claims outnumber the records ([`Records::bound_expiry`]).
    ///
    /// Claims with one TTL arrive in the order they expire. When layers with different TTLs share
    /// a store, a record behind one that expires later waits for it: it is still expired to every
    /// request, it only stays in memory for up to the difference.
    pub(super) expiry: VecDeque<Expiry>,
    pub(super) last_token: i64,
    /// The finished steps of keys' handlers ([`StepLog`](crate::store::StepLog)): beside the
    /// records, as they outlive a release, and under the same lock, which fences them.
    pub(super) steps: HashMap<ScopeKey, StepSet, foldhash::fast::RandomState>,
}

/// A claim in [`Records::expiry`].
#[derive(Debug)]
pub(super) struct Expiry {
    pub(super) at: Instant,
    pub(super) key: ScopeKey,
    pub(super) token: i64,
}

/// How many expired records each claim deletes (when there are any): more than one, so that the
/// store shrinks back after a burst of claims has expired, not only stops growing.
pub(super) const EXPIRE_PER_CLAIM: usize = 2;

/// How many claims a shard's expiry queue holds at most per record...
pub(super) const QUEUED_PER_RECORD: usize = 2;
/// ...and besides, so that a shard holding few records is not compacted on every claim.
pub(super) const QUEUED_BESIDES: usize = 64;

impl Records {
    /// Drops the queued claims whose record is gone or was claimed again, once the queue holds
    /// more than [`QUEUED_PER_RECORD`] claims per record: a key claimed and released in a loop
    /// would otherwise queue a claim per request until its TTL. Each compaction drops more than
    /// half the queue, so its work is paid for by the claims that filled it.
    pub(super) fn bound_expiry(&mut self) {
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
    pub(super) fn expire_oldest(&mut self, now: Instant, max: usize) -> usize {
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

pub(super) use crate::settings::later;

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) fingerprint: Fingerprint,
    pub(super) token: i64,
    /// The key's generation (see [`Fence::generation`](crate::store::Fence::generation)).
    pub(super) generation: i64,
    /// When the store may delete the entry: the later of its claim's TTL and its lease's end
    /// (which renewals move). [`Entry::ends`] tells when a request sees it end.
    pub(super) expires_at: Instant,
    pub(super) claimed_at: Instant,
    pub(super) state: State,
}

/// What a record costs a bounded store besides its kept response: its key and entry in the map,
/// the map's own overhead per slot, roughly, and the places in the expiry queue it may hold
/// ([`Records::bound_expiry`]).
pub(super) const ENTRY_BYTES: usize =
    size_of::<(ScopeKey, Entry)>() + 16 + QUEUED_PER_RECORD * size_of::<Expiry>();

impl Entry {
    /// When the record ends for a request with `ttl`: at that TTL counted from its claim, or
    /// when the store may delete it, if sooner. A claim in flight under a live lease outlives
    /// both; the caller checks that first.
    pub(super) fn ends(&self, ttl: Duration) -> Instant {
        self.expires_at.min(later(self.claimed_at, ttl))
    }

    /// The bytes this entry counts against a bounded store's limit.
    pub(super) fn bytes(&self) -> usize {
        ENTRY_BYTES
            + match &self.state {
                State::InFlight { .. } => 0,
                State::Completed(packed) => packed.bytes.len(),
            }
    }
}

#[derive(Debug)]
pub(super) enum State {
    InFlight { lease_until: Instant },
    Completed(Packed),
}
