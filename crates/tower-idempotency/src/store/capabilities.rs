//! What a store's claims carry ([`ClaimHandle`]) and what the store itself can do
//! ([`Capabilities`]): the facts the layer asks of a store besides the protocol.

use std::{fmt, sync::Arc, time::Duration};

use super::{Fence, notify::InFlightWatch, pending::PendingLog, steps::StepLog};

/// How often waiters read a key again when the store cannot wake them.
const DEFAULT_POLLING: Duration = Duration::from_millis(100);

/// What the layer may ask of a claim handed out by [`Store::claim`](super::Store::claim).
///
/// The defaults are right for every claim that carries nothing of the handler's: a key and
/// its fencing token ([`Fence`](super::Fence)).
pub trait ClaimHandle: Send + Sync + 'static {
    /// Called once the key is acquired, before the handler runs, to hand the handler what the
    /// claim holds through the request extensions (PostgreSQL's transactional mode hands it the
    /// transaction). The default adds nothing.
    fn attach(&self, extensions: &mut http::Extensions) {
        let _ = extensions;
    }

    /// Whether the handler's effects commit or roll back together with this claim: then a
    /// failed [`complete`](super::Store::complete) means nothing happened, and the layer
    /// answers `503` instead of the handler's response. The default is `false`.
    fn commits_effects(&self) -> bool {
        false
    }

    /// The key and fencing token this claim holds, for the steps it records
    /// ([`StepLog`]); `None` for a claim under which steps do not apply (PostgreSQL's
    /// transactional mode, whose writes commit with the response). The default is `None`.
    fn fence(&self) -> Option<Fence> {
        None
    }

    /// Whether steps may have been recorded for this claim's key and payload before it was
    /// claimed; `false` only when the store found out in the claim itself that none were, so
    /// that [`Steps`](crate::Steps) does not read them. The default is `true`.
    fn may_have_steps(&self) -> bool {
        true
    }
}

/// What a store can do, as [`Store::capabilities`](super::Store::capabilities) tells the layer.
///
/// [`Capabilities::new`] is what the defaults describe: a store whose claims hold nothing
/// scarce and whose waiters read a key again every 100 ms.
#[derive(Clone)]
#[non_exhaustive]
pub struct Capabilities {
    detached_limit: Option<usize>,
    in_flight_watch: InFlightWatch,
    step_log: Option<Arc<dyn StepLog>>,
    pending_log: Option<Arc<dyn PendingLog>>,
}

impl fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capabilities")
            .field("detached_limit", &self.detached_limit)
            .field("in_flight_watch", &self.in_flight_watch)
            .field("step_log", &self.step_log.is_some())
            .field("pending_log", &self.pending_log.is_some())
            .finish()
    }
}

impl Default for Capabilities {
    fn default() -> Self {
        Self::new()
    }
}

impl Capabilities {
    /// The capabilities of a store with nothing to declare.
    pub fn new() -> Self {
        Self {
            detached_limit: None,
            in_flight_watch: InFlightWatch::Polled(DEFAULT_POLLING),
            step_log: None,
            pending_log: None,
        }
    }

    /// Declares that the store carries at most `limit` handlers for clients that hung up
    /// before new requests would starve, because each claim holds something scarce: PostgreSQL's
    /// transactional mode, where each claim holds a pooled connection, declares half its pool.
    /// The layer refuses new keys past the smaller of this and
    /// [`Limits::with_max_detached`](crate::Limits::with_max_detached). A limit of zero is
    /// taken as one, as every limit is at least one.
    #[must_use]
    pub fn with_detached_limit(mut self, limit: usize) -> Self {
        self.detached_limit = Some(limit.max(1));
        self
    }

    /// Declares how a request that waits for a key in flight
    /// ([`with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait)) learns that the
    /// key may have settled: a store that can wake waiters returns the
    /// [`Notifier`](super::Notifier) it wakes whenever it completes or releases a key.
    #[must_use]
    pub fn with_in_flight_watch(mut self, watch: InFlightWatch) -> Self {
        self.in_flight_watch = watch;
        self
    }

    /// Declares where the store keeps the finished steps of a key's handler, which makes the
    /// [`Steps`](crate::Steps) extractor available on its claims that have a
    /// [fence](ClaimHandle::fence).
    #[must_use]
    pub fn with_step_log(mut self, log: Arc<dyn StepLog>) -> Self {
        self.step_log = Some(log);
        self
    }

    /// Declares where the store keeps the requests of keys in flight, which lets the layer
    /// keep them for a [`Completer`](crate::Completer)
    /// ([`with_completion`](crate::IdempotencyLayer::with_completion)).
    #[must_use]
    pub fn with_pending_log(mut self, log: Arc<dyn PendingLog>) -> Self {
        self.pending_log = Some(log);
        self
    }

    /// See [`with_pending_log`](Self::with_pending_log).
    pub fn pending_log(&self) -> Option<&Arc<dyn PendingLog>> {
        self.pending_log.as_ref()
    }

    /// These capabilities with the pending log replaced by `f` of it (a wrapping store seals it).
    #[must_use]
    pub fn map_pending_log(
        mut self,
        f: impl FnOnce(Arc<dyn PendingLog>) -> Arc<dyn PendingLog>,
    ) -> Self {
        self.pending_log = self.pending_log.map(f);
        self
    }

    /// These capabilities with the step log replaced by `f` of it (a wrapping store seals it).
    #[must_use]
    pub fn map_step_log(mut self, f: impl FnOnce(Arc<dyn StepLog>) -> Arc<dyn StepLog>) -> Self {
        self.step_log = self.step_log.map(f);
        self
    }

    /// See [`with_step_log`](Self::with_step_log).
    pub fn step_log(&self) -> Option<&Arc<dyn StepLog>> {
        self.step_log.as_ref()
    }

    /// See [`with_detached_limit`](Self::with_detached_limit).
    pub fn detached_limit(&self) -> Option<usize> {
        self.detached_limit
    }

    /// See [`with_in_flight_watch`](Self::with_in_flight_watch).
    pub fn in_flight_watch(&self) -> &InFlightWatch {
        &self.in_flight_watch
    }
}
