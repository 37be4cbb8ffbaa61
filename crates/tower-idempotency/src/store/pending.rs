//! Where a store keeps the requests of keys in flight for the [`Completer`](crate::Completer)
//! ([`PendingLog`]): one place beside the [`Store`](super::Store) protocol, offered through
//! [`Capabilities::with_pending_log`](super::Capabilities::with_pending_log).
//!
//! ```
//! use tower_idempotency::store::{MemoryStore, Store};
//!
//! // The memory store keeps no requests for completion; PostgreSQL (lease mode) does.
//! assert!(MemoryStore::new().capabilities().pending_log().is_none());
//! ```

use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::{ClaimStatus, Fence};
use crate::{fingerprint::Fingerprint, scope::ScopeKey};

/// The error a [`PendingLog`] answers with: the store could not be reached or answered nonsense.
pub type PendingLogError = Box<dyn std::error::Error + Send + Sync>;

/// Which abandoned keys [`PendingLog::pick`] hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingPick {
    /// At most this many keys.
    pub limit: u32,
    /// How long after a key's lease lapsed its client has to come back before it is picked; also
    /// how long a picked key waits before it is picked again.
    pub grace: Duration,
    /// Keys picked this many times already are left alone.
    pub max_attempts: u32,
}

/// A key whose client left it unfinished, handed to the completer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandoned {
    /// The key.
    pub key: ScopeKey,
    /// The fingerprint the request was kept under: the completer's request must have it.
    pub fingerprint: Fingerprint,
    /// The request as the layer kept it (opaque bytes).
    pub request: Bytes,
    /// Which attempt this is, counting from 1.
    pub attempt: u32,
}

/// Keeps the request of each key in flight, fenced by its claim, and hands out the keys whose
/// holder's lease lapsed and whose client did not come back, so that a
/// [`Completer`](crate::Completer) drives them to completion.
///
/// A key is *abandoned* when it is in flight with a lease that lapsed more than
/// [`grace`](PendingPick::grace) ago, under the fingerprint its request was kept with; or when
/// the completer already tried it and its attempt gave the key up (the key is free again). A
/// kept request whose key completed, was released by its client's own request, or expired is
/// not abandoned, and [`purge`](Self::purge) deletes it.
pub trait PendingLog: Send + Sync + 'static {
    /// Keeps `request` for `fence`'s key while the claim holds it; `Lost` when it does not.
    /// A request kept again for the key under the same fingerprint keeps its attempt count.
    fn keep(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        request: Bytes,
    ) -> BoxFuture<'_, Result<ClaimStatus, PendingLogError>>;

    /// Hands out at most `pick.limit` abandoned keys and counts an attempt for each, in one
    /// atomic step: two completers (on two instances) never get one key from the same pick,
    /// and a key picked is not picked again for `pick.grace`.
    fn pick(&self, pick: PendingPick) -> BoxFuture<'_, Result<Vec<Abandoned>, PendingLogError>>;

    /// Whether `key` is completed; if so its kept request is deleted.
    fn finish(&self, key: &ScopeKey) -> BoxFuture<'_, Result<bool, PendingLogError>>;

    /// Deletes at most `batch` kept requests that are no longer pending (completed, released by
    /// their client, or expired); how many.
    fn purge(&self, batch: u32) -> BoxFuture<'_, Result<u64, PendingLogError>>;

    /// Releases at most `limit` claims made to keep their request
    /// ([`ClaimRequest::keeps_request`](super::ClaimRequest::keeps_request)) whose request was
    /// never kept, once their lease lapsed more than `grace` ago: their handler never ran (the
    /// layer runs it only once the request is kept), and nothing else would finish them. Each
    /// release is fenced by the claim's token, so a claim taken over or kept meanwhile stays.
    /// How many were released. The default releases none.
    fn release_unkept(
        &self,
        limit: u32,
        grace: Duration,
    ) -> BoxFuture<'_, Result<u64, PendingLogError>> {
        let _ = (limit, grace);
        Box::pin(async { Ok(0) })
    }
}
