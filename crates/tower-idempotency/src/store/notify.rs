//! Waking requests that wait for a key in flight
//! ([`with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait)) when it settles.

use std::{
    collections::HashMap,
    fmt,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::sync::watch;

use crate::scope::ScopeKey;

/// How a store tells waiting requests that a key in flight may have settled; see
/// [`Capabilities::with_in_flight_watch`](super::Capabilities::with_in_flight_watch).
#[derive(Debug, Clone)]
pub enum InFlightWatch {
    /// The store wakes waiters through this notifier when a key is completed or released.
    Notified(Notifier),
    /// Waiters read the key again every so often.
    Polled(Duration),
}

/// The requests of this process waiting for keys to settle, woken by the store.
///
/// A store wakes them with [`notify`](Self::notify) whenever it completes or releases a key (the
/// memory store as it does so; the PostgreSQL store when its database says another instance
/// did). Wake-ups may be spurious: a woken request reads its key again. While the store cannot
/// vouch for its notifications ([`set_live`](Self::set_live)`(false)`: the PostgreSQL listener is
/// reconnecting), waiters read their keys every [`POLL_WHILE_NOT_LIVE`] as well.
#[derive(Clone, Default)]
pub struct Notifier(Arc<Inner>);

#[derive(Default)]
struct Inner {
    /// Keys being waited for, by the first 128 bits of their scope (all a database says).
    keys: Mutex<HashMap<[u8; 16], watch::Sender<()>>>,
    waiting: AtomicUsize,
    not_live: AtomicBool,
    /// Called as each request starts waiting (see [`Notifier::start_on_wait`]).
    on_wait: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Set once a layer that waits is built on the store.
    waiters_expected: AtomicBool,
}

/// How often a waiter reads its key while notifications cannot be relied on.
pub const POLL_WHILE_NOT_LIVE: Duration = Duration::from_millis(100);

/// How often a waiter reads its key even when notified: a safety net for a notification lost
/// with a connection.
pub(crate) const POLL_WHILE_LIVE: Duration = Duration::from_secs(1);

impl Notifier {
    /// A notifier with nobody waiting.
    pub fn new() -> Self {
        Self::default()
    }

    /// Wakes the requests waiting for `key`.
    pub fn notify(&self, key: &ScopeKey) {
        self.notify_prefix(prefix(key));
    }

    /// Wakes the requests waiting for any key whose scope hash starts with `prefix`.
    pub(crate) fn notify_prefix(&self, prefix: [u8; 16]) {
        if self.0.waiting.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Some(sender) = self.keys().get(&prefix) {
            sender.send_replace(());
        }
    }

    /// Wakes every waiting request (notifications may have been missed).
    pub fn notify_all(&self) {
        for sender in self.keys().values() {
            sender.send_replace(());
        }
    }

    /// Whether the store's notifications can be relied on; while not, waiters also poll.
    pub fn set_live(&self, live: bool) {
        self.0.not_live.store(!live, Ordering::Relaxed);
        if !live {
            self.notify_all();
        }
    }

    /// How long a waiter may wait for a notification before reading its key anyway.
    pub(crate) fn poll_interval(&self) -> Duration {
        if self.0.not_live.load(Ordering::Relaxed) {
            POLL_WHILE_NOT_LIVE
        } else {
            POLL_WHILE_LIVE
        }
    }

    /// Whether anyone waits, for a store that would otherwise do work to notify.
    pub fn has_waiters(&self) -> bool {
        self.0.waiting.load(Ordering::Relaxed) > 0
    }

    /// Has `start` called as each request starts waiting, for a store that wakes waiters from a
    /// task of its own: building a layer starts nothing, so the first waiter starts it.
    /// `start` returns at once once it has started.
    #[cfg(feature = "postgres")]
    pub(crate) fn start_on_wait(&self, start: impl Fn() + Send + Sync + 'static) {
        // Set once, by the store that owns this notifier.
        let _ = self.0.on_wait.set(Box::new(start));
    }

    /// Runs the store's `start` hook, if it set one ([`start_on_wait`](Self::start_on_wait)).
    fn start(&self) {
        if let Some(start) = self.0.on_wait.get() {
            start();
        }
    }

    /// Tells the store a layer that waits is built on it, so it announces what it settles for
    /// waiters anywhere: a flag, no task (see [`start_on_wait`](Self::start_on_wait)).
    pub(crate) fn expect_waiters(&self) {
        self.0.waiters_expected.store(true, Ordering::Relaxed);
    }

    /// Whether a layer that waits is built on the store.
    #[cfg(feature = "postgres")]
    pub(crate) fn waiters_expected(&self) -> bool {
        self.0.waiters_expected.load(Ordering::Relaxed)
    }

    /// Starts waiting for `key`: every notification from now on wakes the subscription.
    pub(crate) fn subscribe(&self, key: &ScopeKey) -> Subscription {
        self.start();
        let prefix = prefix(key);
        let receiver = self
            .keys()
            .entry(prefix)
            .or_insert_with(|| watch::channel(()).0)
            .subscribe();
        self.0.waiting.fetch_add(1, Ordering::Relaxed);
        Subscription {
            notifier: self.clone(),
            prefix,
            receiver,
        }
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 16], watch::Sender<()>>> {
        // No critical section can panic half-way.
        self.0
            .keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl fmt::Debug for Notifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notifier")
            .field("waiting", &self.0.waiting.load(Ordering::Relaxed))
            .finish()
    }
}

fn prefix(key: &ScopeKey) -> [u8; 16] {
    let mut prefix = [0; 16];
    prefix.copy_from_slice(&key.as_bytes()[..16]);
    prefix
}

/// One request waiting for its key.
pub(crate) struct Subscription {
    notifier: Notifier,
    prefix: [u8; 16],
    receiver: watch::Receiver<()>,
}

impl Subscription {
    /// Resolves at the next notification for the key (at once if one came since the last).
    pub(crate) async fn notified(&mut self) {
        if self.receiver.changed().await.is_err() {
            // The sender is only dropped with the entry, which outlives its subscriptions.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.notifier.0.waiting.fetch_sub(1, Ordering::Relaxed);
        let mut keys = self.notifier.keys();
        // This subscription's receiver is the last: the key is no longer waited for.
        if keys
            .get(&self.prefix)
            .is_some_and(|sender| sender.receiver_count() <= 1)
        {
            keys.remove(&self.prefix);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> ScopeKey {
        ScopeKey::from_bytes([n; 32])
    }

    #[tokio::test]
    async fn a_notification_after_subscribing_is_never_missed() {
        let notifier = Notifier::new();
        let mut waiting = notifier.subscribe(&key(1));
        // Notified before the waiter polls: the wake-up is kept for it.
        notifier.notify(&key(1));
        tokio::time::timeout(Duration::from_secs(5), waiting.notified())
            .await
            .expect("woken");
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_keys_waiters_are_woken() {
        let notifier = Notifier::new();
        let mut one = notifier.subscribe(&key(1));
        let mut two = notifier.subscribe(&key(2));
        notifier.notify(&key(2));
        assert!(
            tokio::time::timeout(Duration::from_secs(1), one.notified())
                .await
                .is_err()
        );
        tokio::time::timeout(Duration::from_secs(1), two.notified())
            .await
            .expect("woken");
    }

    #[test]
    fn keys_no_one_waits_for_are_forgotten() {
        let notifier = Notifier::new();
        let a = notifier.subscribe(&key(1));
        let b = notifier.subscribe(&key(1));
        assert!(notifier.has_waiters());
        drop(a);
        assert_eq!(notifier.keys().len(), 1);
        drop(b);
        assert!(notifier.keys().is_empty());
        assert!(!notifier.has_waiters());
    }
}
