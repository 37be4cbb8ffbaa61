//! A duplicate of a key in flight waiting for it to settle
//! ([`with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait)).

use super::*;

/// The requests waiting for keys in flight, and how the store wakes them.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    pub(super) watch: Option<InFlightWatch>,
    pub(super) count: AtomicUsize,
}

impl Waiting {
    pub(crate) fn new(watch: InFlightWatch) -> Self {
        Self {
            watch: Some(watch),
            count: AtomicUsize::new(0),
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

impl<St: Store> Shared<St> {
    /// Waits, up to the layer's in-flight wait, for a key in flight to settle: its replay once
    /// it completed, the claim if it was released, or still `InFlight` when the wait is over or
    /// too many wait already.
    pub(super) async fn wait_while_in_flight(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
    ) -> Result<KeyState<St::Claim>, St::Error> {
        let in_flight = KeyState::InFlight {
            lease_remaining: None,
        };
        let Some(_slot) = self.waiting.enter(self.config.max_waiting) else {
            metrics::waited("full");
            return Ok(in_flight);
        };
        let deadline = later(tokio::time::Instant::now(), self.config.in_flight_wait);
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
            let begin = self.claim_as(key, fingerprint, true).await?;
            let now = tokio::time::Instant::now();
            if !matches!(begin, KeyState::InFlight { .. }) || now >= deadline {
                metrics::waited(match &begin {
                    KeyState::InFlight { .. } => "timed_out",
                    KeyState::Acquired { .. } => "acquired",
                    KeyState::Completed { .. } => "replayed",
                    KeyState::Mismatch => "mismatch",
                });
                return Ok(begin);
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
}
