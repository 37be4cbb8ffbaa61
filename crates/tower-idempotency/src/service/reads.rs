//! One read at a time of a key in flight for all the duplicates of this process that wait for
//! it, so that a storm of waiters costs the store what one waiter costs: waiters that come while
//! a read is under way share the next one, which starts when it ends (as group commit batches
//! writes, without a timer).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use tokio::sync::watch;

use crate::{fingerprint::Fingerprint, record::Record, scope::ScopeKey, store::KeyState};

/// What a shared read found, in the form every waiter of the key can take.
#[derive(Debug, Clone)]
pub(super) enum Found {
    /// Still in flight.
    InFlight,
    /// Completed: its record, and how long it has left.
    Completed(Record, Option<Duration>),
    /// Another request's payload.
    Mismatch,
    /// The reader took the key (it was released): the others read again, and the read after
    /// that marks the new claim as waited for.
    Taken,
    /// The store failed.
    Failed,
}

impl Found {
    /// What `read` found, as the followers take it.
    pub(super) fn of<C, E>(read: &Result<KeyState<C>, E>) -> Self {
        match read {
            Ok(KeyState::InFlight { .. }) => Self::InFlight,
            Ok(KeyState::Completed { record, expires_in }) => {
                Self::Completed(record.clone(), *expires_in)
            }
            Ok(KeyState::Mismatch) => Self::Mismatch,
            Ok(KeyState::Acquired { .. }) => Self::Taken,
            Err(_) => Self::Failed,
        }
    }
}

type Id = (ScopeKey, Fingerprint);

/// The reads of keys in flight in this process, by key and fingerprint (waiters with another
/// payload are answered `Mismatch` by a read of their own).
#[derive(Debug, Default)]
pub(super) struct SharedReads {
    keys: Mutex<HashMap<Id, Reads>>,
}

/// A key's read under way, and the one its next waiters share.
#[derive(Debug, Default)]
struct Reads {
    current: Option<Arc<Group>>,
    next: Option<Arc<Group>>,
}

/// The waiters of one read, and what it found.
#[derive(Debug)]
struct Group(watch::Sender<Option<Found>>);

/// A waiter's part in a shared read.
pub(super) enum Role {
    /// Reads the key for everyone, once [`Reader::start`] lets it.
    Reader(Reader),
    /// Waits for the reader's answer ([`followed`]).
    Follower(watch::Receiver<Option<Found>>),
}

/// The waiter that reads the key for its group.
pub(super) struct Reader {
    reads: Arc<SharedReads>,
    id: Id,
    group: Arc<Group>,
    /// The read under way when this group formed: this one starts when it ends, so every
    /// answer comes from a read begun after each of its waiters subscribed to the key.
    after: Option<watch::Receiver<Option<Found>>>,
}

impl SharedReads {
    /// Joins the next read of the key, or starts it.
    pub(super) fn join(self: &Arc<Self>, key: ScopeKey, fingerprint: Fingerprint) -> Role {
        let id = (key, fingerprint);
        let mut keys = self.keys();
        let reads = keys.entry(id).or_default();
        if let Some(next) = &reads.next {
            return Role::Follower(next.0.subscribe());
        }
        let group = Arc::new(Group(watch::Sender::new(None)));
        let after = match &reads.current {
            Some(current) => {
                reads.next = Some(Arc::clone(&group));
                Some(current.0.subscribe())
            }
            None => {
                reads.current = Some(Arc::clone(&group));
                None
            }
        };
        Role::Reader(Reader {
            reads: Arc::clone(self),
            id,
            group,
            after,
        })
    }

    fn keys(&self) -> MutexGuard<'_, HashMap<Id, Reads>> {
        // No critical section here can panic half-way.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.keys().is_empty()
    }
}

impl Reader {
    /// Waits for the read under way to end, then closes the group: later waiters share the
    /// read after this one.
    pub(super) async fn start(&mut self) {
        if let Some(mut after) = self.after.take() {
            // Published, or its reader gone: either way it has ended.
            let _ = after.wait_for(Option::is_some).await;
            let mut keys = self.reads.keys();
            let reads = keys.entry(self.id).or_default();
            if reads
                .next
                .as_ref()
                .is_some_and(|next| Arc::ptr_eq(next, &self.group))
            {
                reads.next = None;
            }
            reads.current = Some(Arc::clone(&self.group));
        }
    }

    /// Hands what the read found to the group's followers.
    pub(super) fn publish(self, found: Found) {
        self.group.0.send_replace(Some(found));
    }
}

impl Drop for Reader {
    /// Forgets the group; followers of a reader gone unpublished see the channel close.
    fn drop(&mut self) {
        let mut keys = self.reads.keys();
        let Some(reads) = keys.get_mut(&self.id) else {
            return;
        };
        for slot in [&mut reads.current, &mut reads.next] {
            if slot
                .as_ref()
                .is_some_and(|group| Arc::ptr_eq(group, &self.group))
            {
                *slot = None;
            }
        }
        if reads.current.is_none() && reads.next.is_none() {
            keys.remove(&self.id);
        }
    }
}

/// Waits for the reader's answer: `None` if it went away without one.
pub(super) async fn followed(mut found: watch::Receiver<Option<Found>>) -> Option<Found> {
    let found = found.wait_for(Option::is_some).await.ok()?;
    found.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> Id {
        (
            ScopeKey::from_bytes([n; 32]),
            Fingerprint::from_bytes([n; 32]),
        )
    }

    fn reader(role: Role) -> Reader {
        match role {
            Role::Reader(reader) => reader,
            Role::Follower(_) => panic!("expected to read"),
        }
    }

    fn follower(role: Role) -> watch::Receiver<Option<Found>> {
        match role {
            Role::Follower(found) => found,
            Role::Reader(_) => panic!("expected to follow"),
        }
    }

    #[tokio::test]
    async fn waiters_during_a_read_share_the_next_one() {
        let reads = Arc::new(SharedReads::default());
        let (key, fingerprint) = id(1);
        let mut first = reader(reads.join(key, fingerprint));
        first.start().await;
        let mut second = reader(reads.join(key, fingerprint));
        let third = follower(reads.join(key, fingerprint));
        let starting = tokio::spawn(async move {
            second.start().await;
            second
        });
        tokio::task::yield_now().await;
        assert!(
            !starting.is_finished(),
            "the next read waits for the one under way"
        );
        first.publish(Found::InFlight);
        let second = starting.await.expect("task");
        let fourth = reader(reads.join(key, fingerprint));
        second.publish(Found::Mismatch);
        assert!(matches!(followed(third).await, Some(Found::Mismatch)));
        drop(fourth);
        assert!(reads.is_empty());
    }

    #[tokio::test]
    async fn followers_of_a_reader_gone_unpublished_read_again() {
        let reads = Arc::new(SharedReads::default());
        let (key, fingerprint) = id(2);
        let mut first = reader(reads.join(key, fingerprint));
        first.start().await;
        let second = reader(reads.join(key, fingerprint));
        let waiting = follower(reads.join(key, fingerprint));
        drop(second);
        assert!(followed(waiting).await.is_none());
        drop(first);
        assert!(reads.is_empty());
        let (other, fingerprint) = id(3);
        reader(reads.join(other, fingerprint));
    }
}
