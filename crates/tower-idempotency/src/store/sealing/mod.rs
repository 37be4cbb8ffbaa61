//! Stored responses sealed at rest: see [`SealingStore`].

use std::{error::Error as StdError, fmt, sync::Arc, time::Duration};

use super::{
    Capabilities, ClaimHandle, ClaimRequest, ClaimStatus, ExpiredDeletion, Fence, KeyState,
    RecordUnopenable, Store,
};
use crate::{record::Record, scope::ScopeKey};

mod derive;
mod envelope;
mod keys;
mod pending;
mod steps;
mod v1;

pub use keys::{DuplicateKeyId, SealingKeys};

use derive::Binding;
use envelope::Unsealable;

/// A store that seals each record's headers and body with AES-256-GCM before the store it
/// wraps sees them.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::store::{
///     ClaimRequest, KeyState, MemoryStore, SealingKeys, SealingStore, Store,
/// };
/// use tower_idempotency::{Fingerprint, Record, ScopeKey};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let inner = MemoryStore::new();
/// // In production the key comes from a secret store, never from the code.
/// let store = SealingStore::new(inner.clone(), SealingKeys::new(1, [7; 32]));
/// let request = ClaimRequest {
///     key: ScopeKey::from_bytes([1; 32]),
///     fingerprint: Fingerprint::from_bytes([2; 32]),
///     lease: Duration::from_secs(30),
///     ttl: Duration::from_secs(86_400),
///     waiting: false,
///     keeps_request: false,
/// };
/// let Ok(KeyState::Acquired { claim, .. }) = store.claim(&request).await else { panic!() };
/// let record = Record::from_parts(http::StatusCode::CREATED, Default::default(), Some("card 4242".into()));
/// store.complete(&claim, &record).await.unwrap();
///
/// // The wrapped store holds the status and an envelope; the retry gets the record back.
/// let Ok(KeyState::Completed { record: kept, .. }) = inner.claim(&request).await else { panic!() };
/// assert_eq!(kept.status(), 201);
/// assert!(!kept.body().unwrap().windows(4).any(|w| w == b"4242"));
/// let Ok(KeyState::Completed { record: replayed, .. }) = store.claim(&request).await else { panic!() };
/// assert_eq!(replayed, record);
/// # }
/// ```
///
/// Use it as any store: `IdempotencyLayer::new(SealingStore::new(store, keys))`.
///
/// # What is sealed
///
/// The stored response's headers and body, together ([`Record::to_bytes`]), in the envelope
/// described in `envelope.rs`: a version byte, the key id, a random 96-bit salt, a random
/// 96-bit nonce, the ciphertext and its tag. Each envelope has a key of its own, derived with
/// HKDF-SHA256 from the sealing key for what it holds, its scope key and its salt, so a record
/// copied under another key does not open. What stays clear, because stores and operators need
/// it: the **status** (checked against the sealed one when opened), the scope key's hash, the
/// request fingerprint, the fencing token and the timestamps.
///
/// The same envelope seals the outputs of [`Steps`](crate::Steps) (bound to the step's name)
/// and the requests kept for the [`Completer`](crate::Completer); a step output that does not
/// open is an error of its step, never a step to run again.
///
/// # The nonce budget
///
/// AES-GCM under random 96-bit nonces is safe for about 2^32 seals per key, a count a busy API
/// sealing responses, steps and kept requests under one key would reach. So every envelope has
/// a key of its own, derived from the sealing key, the envelope's purpose (response, step
/// output or kept request), its scope key (and step name) and 96 random bits of its own. Two
/// seals share a key only if those bits repeat for the same record and purpose, and they would
/// still need the same random nonce: the budget holds however many records a sealing key seals,
/// with nothing to count and no seal refused. Envelopes sealed under the sealing key itself
/// (version 1, before per-record keys) still open until they expire; every new seal is
/// version 2.
///
/// # When a record does not open
///
/// A record sealed under a key id the store was not given, changed bytes, a record moved under
/// another scope key, or a record that is not sealed at all (stored before sealing was turned
/// on) is an error carrying [`RecordUnopenable`]. The layer answers it `500`
/// ([`RejectionKind::RecordUnopenable`](crate::RejectionKind::RecordUnopenable)) and counts it,
/// whatever its [`StoreFailure`](crate::StoreFailure): it neither replays nor runs the handler
/// again, since the original request did run. Turning sealing on therefore makes the keys
/// completed before it answer `500` until they expire: turn it on with a fresh table, or
/// after one TTL without traffic.
///
/// # Rotating keys
///
/// 1. Add the new key under a new id as the sealing key and keep the old one:
///    `SealingKeys::new(2, new).with_old_key(1, old)?`; deploy everywhere.
/// 2. Wait one TTL (plus its retention grace): records sealed under key 1 have expired.
/// 3. Drop the old key: `SealingKeys::new(2, new)`.
///
/// During a rolling deploy an instance that does not know key 2 yet answers `500` for records
/// sealed under it: deploy step 1 with key 2 as an old key first when that matters.
#[derive(Debug, Clone)]
pub struct SealingStore<S> {
    inner: S,
    keys: Arc<SealingKeys>,
}

impl<S> SealingStore<S> {
    /// Seals the records `inner` keeps with `keys`.
    pub fn new(inner: S, keys: SealingKeys) -> Self {
        Self {
            inner,
            keys: Arc::new(keys),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

/// The claim of a [`SealingStore`]: the wrapped store's claim and the scope key it seals for.
#[derive(Debug, Clone)]
pub struct SealedClaim<C> {
    inner: C,
    key: ScopeKey,
}

impl<C> SealedClaim<C> {
    /// The wrapped store's claim.
    pub fn inner(&self) -> &C {
        &self.inner
    }
}

impl<C: ClaimHandle> ClaimHandle for SealedClaim<C> {
    fn attach(&self, extensions: &mut http::Extensions) {
        self.inner.attach(extensions);
    }

    fn commits_effects(&self) -> bool {
        self.inner.commits_effects()
    }

    fn fence(&self) -> Option<Fence> {
        self.inner.fence()
    }

    fn may_have_steps(&self) -> bool {
        self.inner.may_have_steps()
    }
}

/// The error of a [`SealingStore`]: the wrapped store's, or a record it cannot seal or open.
#[derive(Debug)]
#[non_exhaustive]
pub enum SealingError<E> {
    /// The wrapped store failed.
    Store(E),
    /// A stored record could not be opened; its source is the [`RecordUnopenable`].
    Unopenable(RecordUnopenable),
    /// A record could not be sealed: the system gave no random nonce, or it was over 64 GiB.
    Unsealable,
}

impl<E: fmt::Display> fmt::Display for SealingError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Store(error) => error.fmt(f),
            Self::Unopenable(_) => f.write_str("a sealed idempotency record could not be opened"),
            Self::Unsealable => f.write_str("an idempotency record could not be sealed"),
        }
    }
}

impl<E: StdError + 'static> StdError for SealingError<E> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::Store(error) => Some(error),
            Self::Unopenable(why) => Some(why),
            Self::Unsealable => None,
        }
    }
}

impl<E> From<Unsealable> for SealingError<E> {
    fn from(_: Unsealable) -> Self {
        Self::Unsealable
    }
}

impl<S: Store> Store for SealingStore<S> {
    type Claim = SealedClaim<S::Claim>;
    type Error = SealingError<S::Error>;

    async fn claim(&self, request: &ClaimRequest) -> Result<KeyState<Self::Claim>, Self::Error> {
        let state = self
            .inner
            .claim(request)
            .await
            .map_err(SealingError::Store)?;
        let key = request.key;
        Ok(match state {
            KeyState::Completed { record, expires_in } => KeyState::Completed {
                record: envelope::open(&self.keys, &Binding::response(&key), &record)
                    .map_err(SealingError::Unopenable)?,
                expires_in,
            },
            state => state.map_claim(|inner| SealedClaim { inner, key }),
        })
    }

    async fn renew(
        &self,
        claim: &Self::Claim,
        lease: Duration,
    ) -> Result<ClaimStatus, Self::Error> {
        self.inner
            .renew(&claim.inner, lease)
            .await
            .map_err(SealingError::Store)
    }

    async fn complete(
        &self,
        claim: &Self::Claim,
        record: &Record,
    ) -> Result<ClaimStatus, Self::Error> {
        let sealed = envelope::seal(&self.keys, &Binding::response(&claim.key), record)?;
        self.inner
            .complete(&claim.inner, &sealed)
            .await
            .map_err(SealingError::Store)
    }

    async fn release(&self, claim: &Self::Claim) -> Result<ClaimStatus, Self::Error> {
        self.inner
            .release(&claim.inner)
            .await
            .map_err(SealingError::Store)
    }

    async fn abandon(&self, claim: &Self::Claim) -> Result<ClaimStatus, Self::Error> {
        self.inner
            .abandon(&claim.inner)
            .await
            .map_err(SealingError::Store)
    }

    /// The wrapped store's, its pending log and step log sealing what they keep.
    fn capabilities(&self) -> Capabilities {
        let (for_pending, for_steps) = (Arc::clone(&self.keys), Arc::clone(&self.keys));
        self.inner
            .capabilities()
            .map_pending_log(|inner| {
                let keys = for_pending;
                Arc::new(pending::SealedPendingLog { inner, keys }) as Arc<dyn super::PendingLog>
            })
            .map_step_log(|inner| {
                let keys = for_steps;
                Arc::new(steps::SealedStepLog { inner, keys }) as Arc<dyn super::StepLog>
            })
    }
}

impl<S: ExpiredDeletion> ExpiredDeletion for SealingStore<S> {
    async fn delete_expired(&self, batch: u32) -> Result<u64, Self::Error> {
        self.inner
            .delete_expired(batch)
            .await
            .map_err(SealingError::Store)
    }
}

#[cfg(test)]
mod tests;
