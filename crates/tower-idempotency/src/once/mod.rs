//! Idempotency off the request path: [`Once`] runs a function once per scoped key over any
//! [`Store`], with the layer's protocol, for queue consumers, webhooks and jobs.
//!
//! ```
//! use tower_idempotency::{Once, OnceError, store::MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), OnceError<std::io::Error>> {
//! let once = Once::new(MemoryStore::new());
//! let payload = serde_json::json!({ "account": "acct_1", "amount": 100 });
//!
//! let first: u64 = once
//!     .run("payments-consumer", "evt_1", &payload, || async { Ok(42) })
//!     .await?;
//! // The same key again: the stored result, and the closure does not run.
//! let again: u64 = once
//!     .run("payments-consumer", "evt_1", &payload, || async { unreachable!() })
//!     .await?;
//! assert_eq!((first, again), (42, 42));
//!
//! // The same key with another payload is refused.
//! let other = serde_json::json!({ "account": "acct_1", "amount": 999 });
//! let refused = once
//!     .run("payments-consumer", "evt_1", &other, || async { Ok::<u64, std::io::Error>(0) })
//!     .await;
//! assert!(matches!(refused, Err(OnceError::Mismatch)));
//! # Ok(()) }
//! ```
//!
//! See the [guide](crate::guide::off_request) for the protocol and the transactional variant.

use std::{future::Future, panic::AssertUnwindSafe, pin::pin, sync::Arc, time::Duration};

use futures_util::FutureExt;
use serde::{Serialize, de::DeserializeOwned};

use crate::{
    key::IdempotencyKey,
    layer::IdempotencyLayer,
    scope::ScopeKey,
    service::{Completion, Heartbeat, HeldKey, Shared},
    settings::{ConfigError, InFlightWait, MAX_DURATION},
    store::{KeyState, Store},
};

mod error;
mod output;
#[cfg(feature = "postgres")]
mod transaction;

pub use error::{MAX_SCOPE_LEN, OnceError, ScopeError};

/// Runs a function once per scoped key, with the layer's protocol; cheap to clone. See the
/// [module documentation](self).
///
/// The first call for a key runs its closure under a claim whose lease is renewed while it
/// runs, and stores its result; a call meanwhile waits (with
/// [`with_in_flight_wait`](Self::with_in_flight_wait)) or gets [`OnceError::InFlight`]; later
/// calls get the stored result; a call with another payload gets [`OnceError::Mismatch`]. A
/// closure that fails, panics or is cancelled (its future dropped) releases the key, so the next
/// call runs it again.
pub struct Once<St> {
    shared: Shared<St>,
}

impl<St> Clone for Once<St> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<St> std::fmt::Debug for Once<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Once")
            .field("store", &std::any::type_name::<St>())
            .field("ttl", &self.shared.config.ttl)
            .field("lease", &self.shared.config.lease)
            .field("in_flight_wait", &self.shared.config.in_flight_wait)
            .finish()
    }
}

/// What claiming a key came to: run the closure under the claim, or the stored result.
enum Claimed<C, T> {
    Run(C),
    Done(T),
}

impl<St: Store> Once<St> {
    /// Runs functions once per key kept in `store`, with the layer's defaults: records kept
    /// 24 hours, a 30 second lease, and no wait for a key in flight.
    pub fn new(store: St) -> Self {
        Self {
            shared: IdempotencyLayer::new(store).shared,
        }
    }

    /// How long a result is kept, as [`IdempotencyLayer::with_ttl`].
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for zero.
    pub fn with_ttl(self, ttl: Duration) -> Result<Self, ConfigError> {
        self.configured(|layer| layer.with_ttl(ttl))
    }

    /// The lease of a running call, renewed every third of itself, as
    /// [`IdempotencyLayer::with_lease`]: a process that dies mid-call holds its key this long.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for zero, [`ConfigError::TooShort`] under [`MIN_LEASE`](crate::MIN_LEASE).
    pub fn with_lease(self, lease: Duration) -> Result<Self, ConfigError> {
        self.configured(|layer| layer.with_lease(lease))
    }

    /// How long a call waits for another call of its key to finish, as
    /// [`IdempotencyLayer::with_in_flight_wait`]; by default it gets [`OnceError::InFlight`]
    /// at once.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero wait or limit.
    pub fn with_in_flight_wait(self, wait: InFlightWait) -> Result<Self, ConfigError> {
        self.configured(|layer| layer.with_in_flight_wait(wait))
    }

    /// The store, for spawning its expiry loop
    /// ([`continuously_delete_expired`](crate::store::continuously_delete_expired)).
    pub fn store(&self) -> &St {
        &self.shared.store
    }

    /// The settings as the layer validates them.
    fn configured(
        self,
        set: impl FnOnce(IdempotencyLayer<St>) -> Result<IdempotencyLayer<St>, ConfigError>,
    ) -> Result<Self, ConfigError> {
        let layer = set(IdempotencyLayer {
            shared: self.shared,
        })?;
        Ok(Self {
            shared: layer.shared,
        })
    }

    /// Runs `f` once for `key` under `scope` (a consumer, a producer, a tenant: keys of two
    /// scopes never meet): the stored result if the key completed, else `f`'s, stored before it
    /// is returned. `payload` is what the key stands for, compared by its canonical JSON.
    ///
    /// # Errors
    ///
    /// See [`OnceError`]: [`Failed`](OnceError::Failed) with `f`'s error, the key released;
    /// [`InFlight`](OnceError::InFlight), [`Mismatch`](OnceError::Mismatch) and
    /// [`Output`](OnceError::Output) without running `f`; a bad scope, key or payload before
    /// anything is claimed; [`Store`](OnceError::Store) when the key could not be claimed.
    ///
    /// # Panics
    ///
    /// When `f` panics, after its key is released.
    pub async fn run<T, E, P, F, Fut>(
        &self,
        scope: &str,
        key: &str,
        payload: &P,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        T: Serialize + DeserializeOwned,
        P: Serialize + ?Sized,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        match self.claim(scope, key, payload).await? {
            Claimed::Done(value) => Ok(value),
            Claimed::Run(claim) => {
                let work = |_: &St::Claim| async { f().await.map_err(OnceError::Failed) };
                self.execute(claim, work).await
            }
        }
    }

    /// Claims the key, waiting for it while it is in flight if so configured.
    async fn claim<T, E, P>(
        &self,
        scope: &str,
        key: &str,
        payload: &P,
    ) -> Result<Claimed<St::Claim, T>, OnceError<E>>
    where
        T: DeserializeOwned,
        P: Serialize + ?Sized,
    {
        let scope = ScopeError::check(scope).map_err(OnceError::InvalidScope)?;
        let key = IdempotencyKey::new(key).map_err(OnceError::InvalidKey)?;
        let fingerprint = output::fingerprint(payload)?;
        let scope_key = ScopeKey::off_request(scope, &key);
        let shared = &self.shared;
        let mut state = shared
            .claim_as(scope_key, fingerprint, false)
            .await
            .map_err(|error| OnceError::Store(Box::new(error)))?;
        if matches!(state, KeyState::InFlight { .. }) && shared.config.in_flight_wait.is_some() {
            let waited = shared.wait_while_in_flight(scope_key, fingerprint, None);
            state = waited.await.unwrap_or(KeyState::InFlight {
                lease_remaining: None,
            });
        }
        match state {
            KeyState::Acquired { claim, takeover } => {
                if takeover {
                    tracing::warn!(
                        key = %scope_key,
                        "took over an idempotency key whose holder's lease lapsed; its call \
                         may have run in part"
                    );
                }
                Ok(Claimed::Run(claim))
            }
            KeyState::Completed { record, .. } => output::read(&record).map(Claimed::Done),
            KeyState::InFlight { .. } => Err(OnceError::InFlight),
            KeyState::Mismatch => Err(OnceError::Mismatch),
        }
    }

    /// Runs the work `make` builds under `claim`, its lease renewed meanwhile; then stores
    /// its result, or releases the key. A cancelled call releases it when dropped
    /// ([`HeldKey`]).
    async fn execute<T, E, Fut>(
        &self,
        claim: St::Claim,
        make: impl FnOnce(&St::Claim) -> Fut,
    ) -> Result<T, OnceError<E>>
    where
        T: Serialize,
        Fut: Future<Output = Result<T, OnceError<E>>>,
    {
        let config = &self.shared.config;
        let work = make(&claim);
        let guard = HeldKey::new(Arc::clone(&self.shared.store), claim);
        let heartbeat = Heartbeat {
            lease: config.lease,
            max_time: MAX_DURATION,
        };
        let handled = {
            let work = pin!(AssertUnwindSafe(work).catch_unwind());
            heartbeat
                .run(&*self.shared.store, guard.claim(), work)
                .await
        };
        let value = match handled {
            Some(Ok(Ok(value))) => value,
            Some(Ok(Err(error))) => {
                guard.release().await;
                return Err(error);
            }
            Some(Err(panic)) => {
                guard.release().await;
                std::panic::resume_unwind(panic);
            }
            None => unreachable!("a heartbeat without a time limit runs its future to the end"),
        };
        let (record, unencodable) = output::record(&value);
        match guard.complete(record, config.lease, config.ttl).await {
            Completion::Stored => unencodable.map_or(Ok(value), |e| Err(OnceError::Output(e))),
            Completion::NotCommitted => Err(OnceError::NotCommitted),
            Completion::RolledBack => Err(OnceError::RolledBack),
        }
    }
}
