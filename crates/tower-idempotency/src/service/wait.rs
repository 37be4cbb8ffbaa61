//! A duplicate of a key in flight waiting for it to settle
//! ([`with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait)).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use super::{
    Shared,
    held::HeldKey,
    reads::{Found, Role, SharedReads, followed},
    run::later,
};
use crate::{
    chain::Chain,
    fingerprint::Fingerprint,
    future::HangUp,
    metrics,
    scope::ScopeKey,
    store::{InFlightWatch, KeyState, Store},
};

/// The requests waiting for keys in flight, and how the store wakes them.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    pub(super) watch: Option<InFlightWatch>,
    pub(super) count: AtomicUsize,
    reads: Arc<SharedReads>,
}

impl Waiting {
    pub(crate) fn new(watch: InFlightWatch) -> Self {
        Self {
            watch: Some(watch),
            count: AtomicUsize::new(0),
            reads: Arc::default(),
        }
    }

    /// A place among the waiters, unless `max` already wait.
    pub(super) fn enter(&self, max: usize) -> Option<WaitingSlot<'_>> {
        self.count
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| WaitingSlot(self))
    }
}

pub(super) struct WaitingSlot<'a>(&'a Waiting);

impl Drop for WaitingSlot<'_> {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a waiting duplicate's read of its key came to.
enum Reread<C> {
    /// The key's state.
    Found(KeyState<C>),
    /// The store failed: the key was last seen in flight.
    Failed,
    /// The client hung up during the read.
    Left,
    /// The key is to be read again at once: another waiter of this process took it, or the one
    /// that read it for the others went away.
    Again,
}

impl<St: Store> Shared<St> {
    /// Waits, up to the layer's in-flight wait, for a key found in flight to settle: its replay
    /// once it completed, the claim if it was released, or still `InFlight` when the wait is
    /// over, too many wait already, or a re-read fails (the key was last seen in flight: a `409`,
    /// never the handler a second time). `None` when the client hung up during a read: the
    /// request then stops, holding nothing (see [`HangUp`]).
    pub(crate) async fn wait_while_in_flight(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
        hang_up: Option<&HangUp>,
    ) -> Option<KeyState<St::Claim>> {
        let in_flight = || KeyState::InFlight {
            lease_remaining: None,
        };
        let Some(wait) = self.config.in_flight_wait else {
            return Some(in_flight());
        };
        let Some(_slot) = self.waiting.enter(wait.max_waiting) else {
            metrics::waited("full");
            return Some(in_flight());
        };
        let deadline = later(tokio::time::Instant::now(), wait.wait);
        let (mut subscription, notifier, poll) = match &self.waiting.watch {
            Some(InFlightWatch::Notified(notifier)) => (
                Some(notifier.subscribe(&key)),
                Some(notifier),
                Duration::ZERO,
            ),
            Some(InFlightWatch::Polled(every)) => (None, None, *every),
            None => (None, None, Duration::from_millis(100)),
        };
        loop {
            // Read after subscribing: a settlement in between still wakes the next wait. As a
            // waiter: a store that announces only waited keys marks this one as it reads it.
            let state = match self.reread(key, fingerprint, hang_up).await {
                Reread::Found(state) => state,
                Reread::Failed => return Some(in_flight()),
                Reread::Left => return None,
                Reread::Again => continue,
            };
            let now = tokio::time::Instant::now();
            if !matches!(state, KeyState::InFlight { .. }) || now >= deadline {
                metrics::waited(match &state {
                    KeyState::InFlight { .. } => "timed_out",
                    KeyState::Acquired { .. } => "acquired",
                    KeyState::Completed { .. } => "replayed",
                    KeyState::Mismatch => "mismatch",
                });
                return Some(state);
            }
            // Between reads the request holds nothing: a hang-up ends it there and then.
            if let Some(hang_up) = hang_up {
                hang_up.waiting();
            }
            let poll = notifier.map_or(poll, |notifier| notifier.poll_interval());
            let next = later(now, poll).min(deadline);
            match &mut subscription {
                Some(subscription) => {
                    tokio::select! {
                        () = subscription.notified() => {}
                        () = tokio::time::sleep_until(next) => {}
                    }
                }
                None => tokio::time::sleep_until(next).await,
            }
        }
    }

    /// A waiting duplicate's read of its key, shared with the other waiters of this process
    /// (see [`SharedReads`]).
    async fn reread(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
        hang_up: Option<&HangUp>,
    ) -> Reread<St::Claim> {
        // Until its own read starts, it holds nothing: a hang-up ends it there and then.
        if let Some(hang_up) = hang_up {
            hang_up.waiting();
        }
        let mut reader = match self.waiting.reads.join(key, fingerprint) {
            Role::Reader(reader) => reader,
            Role::Follower(found) => {
                return match followed(found).await {
                    Some(Found::InFlight) => Reread::Found(KeyState::InFlight {
                        lease_remaining: None,
                    }),
                    Some(Found::Completed(record, expires_in)) => {
                        Reread::Found(KeyState::Completed { record, expires_in })
                    }
                    Some(Found::Mismatch) => Reread::Found(KeyState::Mismatch),
                    Some(Found::Failed) => {
                        metrics::waited("store_error");
                        Reread::Failed
                    }
                    Some(Found::Taken) | None => Reread::Again,
                };
            }
        };
        reader.start().await;
        if let Some(hang_up) = hang_up {
            hang_up.reading();
        }
        let read = self.claim_as(key, fingerprint, true).await;
        reader.publish(Found::of(&read));
        self.settle_read(read, hang_up).await
    }

    /// The reader's own answer; a claim it took for a client that left meanwhile is given back
    /// (released, or abandoned if it was a takeover).
    async fn settle_read(
        &self,
        read: Result<KeyState<St::Claim>, St::Error>,
        hang_up: Option<&HangUp>,
    ) -> Reread<St::Claim> {
        if hang_up.is_some_and(HangUp::client_left) {
            metrics::waited("hung_up");
            if let Ok(KeyState::Acquired { claim, takeover }) = read {
                let held = HeldKey::new(Arc::clone(&self.store), claim);
                // A takeover is handed on as one: the next request must hear that a handler may
                // have run in part.
                if takeover {
                    held.abandon().await;
                } else {
                    held.release().await;
                }
            }
            return Reread::Left;
        }
        if let Some(hang_up) = hang_up {
            hang_up.working();
        }
        match read {
            Ok(state) => Reread::Found(state),
            Err(error) => {
                metrics::waited("store_error");
                tracing::warn!(
                    error = %Chain(&error),
                    "reading a key in flight again failed; answering that it is in flight"
                );
                Reread::Failed
            }
        }
    }
}
