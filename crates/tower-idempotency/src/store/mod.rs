//! Where keys are claimed and responses kept: the [`Store`] protocol, its two backends, and
//! [`CachingStore`], which answers repeated retries from memory in front of either.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::store::{KeyState, ClaimRequest, ClaimStatus, MemoryStore, Store};
//! use tower_idempotency::{Fingerprint, Record, ScopeKey};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = MemoryStore::new();
//! let request = ClaimRequest {
//!     key: ScopeKey::from_bytes([1; 32]),
//!     fingerprint: Fingerprint::from_bytes([2; 32]),
//!     lease: Duration::from_secs(30),
//!     ttl: Duration::from_secs(86_400),
//!     waiting: false,
//!     keeps_request: false,
//! };
//!
//! // The first request acquires the key and runs the handler...
//! let Ok(KeyState::Acquired { claim, .. }) = store.claim(&request).await else { panic!() };
//! // ...a duplicate meanwhile learns it is in flight...
//! assert!(matches!(store.claim(&request).await, Ok(KeyState::InFlight { .. })));
//! // ...the holder stores the response...
//! let record = Record::from_parts(http::StatusCode::OK, Default::default(), Some("ok".into()));
//! assert_eq!(store.complete(&claim, &record).await, Ok(ClaimStatus::Held));
//! // ...and every retry gets it.
//! let Ok(KeyState::Completed { record: replayed, .. }) = store.claim(&request).await else { panic!() };
//! assert_eq!(replayed, record);
//! # }
//! ```
//!
//! # The protocol
//!
//! [`Store::claim`] is one atomic step that answers, for a scoped key and the request's
//! fingerprint:
//!
//! | stored state | same fingerprint | other fingerprint |
//! |---|---|---|
//! | nothing, or a record past its TTL and not held under a live lease | [`Acquired`](KeyState::Acquired) | [`Acquired`](KeyState::Acquired) |
//! | in flight, lease live | [`InFlight`](KeyState::InFlight) | [`Mismatch`](KeyState::Mismatch) |
//! | in flight, lease lapsed (holder crashed) | [`Acquired`](KeyState::Acquired) with `takeover` | [`Mismatch`](KeyState::Mismatch) |
//! | completed | [`Completed`](KeyState::Completed) | [`Mismatch`](KeyState::Mismatch) |
//!
//! Every acquisition hands out a new **fencing token**, larger than any the key had before.
//! [`renew`](Store::renew), [`complete`](Store::complete) and [`release`](Store::release) act only
//! while the claim still holds that token, so a holder that stalled past its lease and was taken
//! over can no longer write: it gets [`ClaimStatus::Lost`].
//!
//! Every acquisition also carries the key's **generation** ([`Fence::generation`]): a takeover
//! keeps it, as does a claim of a key released with steps left for its payload; a claim of a
//! key that was never claimed, or whose record expired, starts a new one, unlike any the key had.
//! [`Steps`](crate::Steps) derive their downstream keys from it, so a key reused after it
//! expired is a new operation to the services its steps call, not a replay of the old one.
//!
//! A third-party store (Redis, DynamoDB...) implements [`Store`] (and [`ExpiredDeletion`] if
//! records do not expire by themselves), and its tests run the checks of [`conformance`]
//! (feature `conformance`), the rules [`MemoryStore`] and [`PostgresStore`] are held to.

use std::{future::Future, time::Duration};

use crate::{fingerprint::Fingerprint, record::Record, scope::ScopeKey};

mod caching;
mod capabilities;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
mod memory;
mod notify;
mod pending;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sealing")]
mod sealing;
mod steps;
mod unopenable;

pub use caching::CachingStore;
pub use capabilities::{Capabilities, ClaimHandle};
pub use memory::{MemoryStore, MemoryStoreError};
pub use notify::{InFlightWatch, Notifier, POLL_WHILE_NOT_LIVE};
pub use pending::{Abandoned, PendingLog, PendingLogError, PendingPick};
#[cfg(feature = "postgres")]
pub use postgres::{
    Durability, DurabilityReport, MAX_PARTITIONS_AHEAD, MIN_IN_FLIGHT_POLLING, MIN_PARTITION_WIDTH,
    PartitionMaintenance, PgClaim, PostgresConfigError, PostgresStore, PostgresStoreError,
};
#[cfg(feature = "sealing")]
pub use sealing::{DuplicateKeyId, SealedClaim, SealingError, SealingKeys, SealingStore};
pub use steps::{StepLog, StepLogError, StepRecord};
pub use unopenable::RecordUnopenable;

/// What the layer asks a store to claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The scoped record key.
    pub key: ScopeKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the claim is held without renewal.
    pub lease: Duration,
    /// How long the record lives, counted from its claim. A claim in flight outlives it while
    /// its lease is live; once completed (or lapsed), a record past its TTL is gone.
    pub ttl: Duration,
    /// Whether the caller is a duplicate waiting for the key to settle, reading it again
    /// ([`with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait)). A store that
    /// announces only the keys someone waits for marks a key it finds in flight as waited for
    /// in the same step (once per claim), so that the claim's settlement wakes the caller.
    /// Other stores ignore it.
    pub waiting: bool,
    /// Whether the caller keeps the request for a [`Completer`](crate::Completer) once it holds
    /// the key ([`with_completion`](crate::IdempotencyLayer::with_completion), failing closed).
    /// A store with a [`PendingLog`] marks the claim so in the claim itself, so that a claim
    /// whose request was never kept (its process died in between) is released by the completer
    /// ([`PendingLog::release_unkept`]) rather than left in flight. Other stores ignore it.
    pub keeps_request: bool,
}

/// What [`Store::claim`] found the key in: free, and now the caller's (`Acquired`); in flight
/// under another request; completed; or another request's (`Mismatch`).
#[derive(Debug, Clone, PartialEq)]
pub enum KeyState<C> {
    /// The caller holds the key and runs the handler.
    Acquired {
        /// The claim, to renew, complete or release.
        claim: C,
        /// `true` when a previous holder's lease lapsed before it finished: its handler may
        /// have run partly (or fully) before it crashed.
        takeover: bool,
    },
    /// Another request holds the key with a live lease.
    InFlight {
        /// How long that lease has left, if the store knows.
        lease_remaining: Option<Duration>,
    },
    /// The key completed; replay its record.
    Completed {
        /// The stored response.
        record: Record,
        /// How long the record has before it expires, if the store knows: a [`CachingStore`]
        /// in front may then keep a copy in process for further retries, never beyond that.
        expires_in: Option<Duration>,
    },
    /// The key belongs to a request with another fingerprint.
    Mismatch,
}

impl<C> KeyState<C> {
    /// Maps the claim of an [`Acquired`](KeyState::Acquired) answer, for stores that wrap others.
    pub fn map_claim<D>(self, f: impl FnOnce(C) -> D) -> KeyState<D> {
        match self {
            Self::Acquired { claim, takeover } => KeyState::Acquired {
                claim: f(claim),
                takeover,
            },
            Self::InFlight { lease_remaining } => KeyState::InFlight { lease_remaining },
            Self::Completed { record, expires_in } => KeyState::Completed { record, expires_in },
            Self::Mismatch => KeyState::Mismatch,
        }
    }
}

/// Whether a claim was still held when it was renewed, completed or released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
#[non_exhaustive]
pub enum ClaimStatus {
    /// The operation took effect.
    Held,
    /// The claim had been taken over (or had expired and been deleted): nothing was written.
    Lost,
    /// [`complete`](Store::complete) only, from a store whose claims carry the handler's
    /// effects ([`ClaimHandle::commits_effects`]): the handler's own work had already failed inside
    /// the claim's transaction (it caught a database error and answered anyway), so nothing it
    /// wrote was kept, no record was stored, and the key is free again.
    RolledBack,
}

/// A claimed key and the fencing token its claim was handed: the claim type of [`MemoryStore`],
/// held inside [`PgClaim`], and ready for other stores to use. A store acts on a claim only while
/// the key still carries its token, which fences out a holder that was taken over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fence {
    /// The claimed key.
    pub key: ScopeKey,
    /// The fencing token handed out with this claim.
    pub token: i64,
    /// The key's generation: chosen by the store at the claim that starts it (a new key, or one
    /// claimed again after it expired), and carried by every later claim until the key expires
    /// (a takeover, a claim after a release that left steps). Downstream keys derive from it.
    pub generation: i64,
}

/// A fence carries nothing of the handler's, and is its own fence.
impl ClaimHandle for Fence {
    fn fence(&self) -> Option<Fence> {
        Some(*self)
    }
}

/// A backend that claims keys atomically and keeps completed responses.
///
/// See the [module documentation](self) for the protocol every implementation follows.
pub trait Store: Send + Sync + 'static {
    /// What [`claim`](Self::claim) hands to the holder of a key.
    type Claim: ClaimHandle;
    /// The error of every operation: the store could not be reached or answered nonsense.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Atomically claims `request.key`, or says why not.
    fn claim(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<KeyState<Self::Claim>, Self::Error>> + Send;

    /// Extends a held claim's lease to `lease` from now.
    fn renew(
        &self,
        claim: &Self::Claim,
        lease: Duration,
    ) -> impl Future<Output = Result<ClaimStatus, Self::Error>> + Send;

    /// Stores the response of a held claim; the key is completed until it expires.
    fn complete(
        &self,
        claim: &Self::Claim,
        record: &Record,
    ) -> impl Future<Output = Result<ClaimStatus, Self::Error>> + Send;

    /// Gives a held claim up without a response: the key is free for the next request.
    fn release(
        &self,
        claim: &Self::Claim,
    ) -> impl Future<Output = Result<ClaimStatus, Self::Error>> + Send;

    /// Gives up a held claim whose handler was stopped part-way (it ran past the layer's
    /// [maximum handler time](crate::Limits::with_max_handler_time)): the next request
    /// for the key takes it over at once, and is told so
    /// ([`KeyState::Acquired`]`{ takeover: true }`) unless the claim's effects were rolled back
    /// with it. The default renews the claim with a lease of zero, which lapses it now.
    fn abandon(
        &self,
        claim: &Self::Claim,
    ) -> impl Future<Output = Result<ClaimStatus, Self::Error>> + Send {
        self.renew(claim, Duration::ZERO)
    }

    /// What the store can do besides the protocol: how many handlers it carries for clients
    /// that hung up, how waiters learn that a key settled. The default, [`Capabilities::new`], declares nothing.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
    }
}

/// Deleting records past their TTL, for stores whose records do not expire by themselves.
///
/// Spawn [`continuously_delete_expired`] once per process (or per cluster, it is safe to run
/// many), or call [`delete_expired`](Self::delete_expired) from your own scheduler. A
/// [`MemoryStore`] also deletes expired records itself as requests come; for it, the loop only
/// frees the memory of a store that has gone quiet.
pub trait ExpiredDeletion: Store {
    /// Deletes at most `batch` expired records and returns how many were deleted.
    fn delete_expired(&self, batch: u32) -> impl Future<Output = Result<u64, Self::Error>> + Send;
}

/// After a full batch, the expiry loop rests this many times as long as the batch took before
/// the next one: a backlog is drained with at most a quarter of one connection's time, so live
/// traffic keeps the database to itself three quarters of the time.
const REST_PER_BATCH: u32 = 3;

/// Deletes expired records forever: a batch every `period`, and while batches come back full,
/// further batches paced to leave the database to live traffic. An error is logged and the
/// loop goes on at the next period.
///
/// In steady state one batch per period is enough (a million keys a day expire at about 700 a
/// minute). A backlog — the loop started on an old table, or after an outage — is drained in
/// full batches, each followed by a rest three times as long as the batch took, so the loop
/// keeps a database connection busy at most a quarter of the time: a backlog of a million
/// records takes a few minutes, during which live latency stays close to normal (the
/// benchmark's `expiry-reap` scenario measures it).
///
/// ```no_run
/// # #[tokio::main] async fn main() {
/// use std::time::Duration;
/// use tower_idempotency::store::{continuously_delete_expired, MemoryStore};
///
/// let store = MemoryStore::new();
/// tokio::spawn(continuously_delete_expired(store.clone(), Duration::from_secs(60), 1_000));
/// # }
/// ```
pub async fn continuously_delete_expired<S: ExpiredDeletion>(
    store: S,
    period: Duration,
    batch: u32,
) {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        loop {
            let started = tokio::time::Instant::now();
            match store.delete_expired(batch).await {
                Ok(deleted) => {
                    crate::metrics::expired_deleted(deleted);
                    if deleted > 0 {
                        tracing::debug!(deleted, "deleted expired idempotency records");
                    }
                    if deleted < u64::from(batch) {
                        break;
                    }
                    // A full batch: more may be waiting. Rest before the next one so live
                    // traffic interleaves.
                    tokio::time::sleep(started.elapsed() * REST_PER_BATCH).await;
                }
                Err(error) => {
                    crate::metrics::expiry_error();
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "deleting expired idempotency records failed; retrying next period"
                    );
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        fmt,
        sync::{
            Arc,
            atomic::{AtomicU32, Ordering},
        },
    };

    use super::*;

    /// A memory store whose first `failures` expiry deletions fail.
    #[derive(Clone)]
    struct Flaky {
        inner: MemoryStore,
        failures: Arc<AtomicU32>,
        calls: Arc<AtomicU32>,
    }

    #[derive(Debug)]
    struct Down;

    impl fmt::Display for Down {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("down")
        }
    }

    impl std::error::Error for Down {}

    /// The inner store's answer; it is unbounded, so it never refuses.
    fn infallible<T>(result: Result<T, MemoryStoreError>) -> Result<T, Down> {
        Ok(result.expect("an unbounded memory store never refuses"))
    }

    impl Store for Flaky {
        type Claim = Fence;
        type Error = Down;

        async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<Fence>, Down> {
            infallible(self.inner.claim(request).await)
        }

        async fn renew(&self, claim: &Fence, lease: Duration) -> Result<ClaimStatus, Down> {
            infallible(self.inner.renew(claim, lease).await)
        }

        async fn complete(&self, claim: &Fence, record: &Record) -> Result<ClaimStatus, Down> {
            infallible(self.inner.complete(claim, record).await)
        }

        async fn release(&self, claim: &Fence) -> Result<ClaimStatus, Down> {
            infallible(self.inner.release(claim).await)
        }
    }

    impl ExpiredDeletion for Flaky {
        async fn delete_expired(&self, batch: u32) -> Result<u64, Down> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let failing = self
                .failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if failing {
                return Err(Down);
            }
            infallible(self.inner.delete_expired(batch).await)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_expiry_loop_survives_errors_and_drains_full_batches() {
        let store = Flaky {
            inner: MemoryStore::new(),
            failures: Arc::new(AtomicU32::new(2)),
            calls: Arc::default(),
        };
        for i in 0..25u8 {
            let request = ClaimRequest {
                key: ScopeKey::from_bytes([i; 32]),
                fingerprint: Fingerprint::from_bytes([0; 32]),
                lease: Duration::from_secs(1),
                ttl: Duration::from_secs(10),
                waiting: false,
                keeps_request: false,
            };
            assert!(matches!(
                store.claim(&request).await,
                Ok(KeyState::Acquired { .. })
            ));
        }
        tokio::time::advance(Duration::from_secs(11)).await;
        let reaper = tokio::spawn(continuously_delete_expired(
            store.clone(),
            Duration::from_secs(60),
            10,
        ));
        // Two failing periods, then one period that drains 25 records in batches of 10.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        assert!(store.inner.is_empty(), "{} records left", store.inner.len());
        // 2 failures, then batches of 10, 10 and 5: the loop waits after a short batch.
        assert_eq!(store.calls.load(Ordering::SeqCst), 5);
        reaper.abort();
    }

    /// A store that implements only the required operations keeps the whole protocol through
    /// the defaults: an abandoned claim is free at once (issue 34.8).
    #[tokio::test(start_paused = true)]
    async fn the_defaults_keep_the_protocol() {
        let store = Flaky {
            inner: MemoryStore::new(),
            failures: Arc::default(),
            calls: Arc::default(),
        };
        conformance::check(&store, Duration::from_secs(1)).await;
    }

    /// A store with a backlog: every deletion takes a second and comes back full.
    #[derive(Clone, Default)]
    struct Backlog {
        inner: MemoryStore,
        starts: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>,
    }

    impl Store for Backlog {
        type Claim = Fence;
        type Error = MemoryStoreError;

        async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<Fence>, Self::Error> {
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

    impl ExpiredDeletion for Backlog {
        async fn delete_expired(&self, batch: u32) -> Result<u64, Self::Error> {
            self.starts
                .lock()
                .expect("not poisoned")
                .push(tokio::time::Instant::now());
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok(u64::from(batch))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_backlog_is_drained_in_paced_batches() {
        let store = Backlog::default();
        let reaper = tokio::spawn(continuously_delete_expired(
            store.clone(),
            Duration::from_secs(3600),
            100,
        ));
        tokio::time::sleep(Duration::from_secs(20)).await;
        reaper.abort();
        let starts = store.starts.lock().expect("not poisoned").clone();
        // A batch of 1 s, then a rest of 3 s: a batch starts every 4 s (at 0, 4, 8, 12, 16).
        assert_eq!(starts.len(), 5, "{starts:?}");
        for pair in starts.windows(2) {
            assert_eq!(pair[1] - pair[0], Duration::from_secs(4));
        }
    }
}
