//! Where a store keeps the finished steps of a key's handler ([`StepLog`]), for the
//! [`Steps`](crate::Steps) extractor: one place beside the [`Store`](super::Store) protocol,
//! offered through [`Capabilities::with_step_log`](super::Capabilities::with_step_log).
//!
//! ```
//! use tower_idempotency::store::{MemoryStore, Store};
//!
//! // The bundled stores offer one (PostgreSQL in lease mode).
//! assert!(MemoryStore::new().capabilities().step_log().is_some());
//! ```

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::{ClaimStatus, Fence};
use crate::fingerprint::Fingerprint;

/// The error a [`StepLog`] answers with: the store could not be reached or answered nonsense.
pub type StepLogError = Box<dyn std::error::Error + Send + Sync>;

/// A finished step of a handler: its name and its result as `serde_json` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRecord {
    /// The step's name, unique within its handler.
    pub name: String,
    /// The step's result, serialized with `serde_json`.
    pub output: Bytes,
}

/// Keeps the finished steps of a key's handler, fenced by the key's claim, so that a request
/// that takes the key over (or retries it after a release) skips what already ran.
///
/// Steps are bound to the request's fingerprint (a key reclaimed with another payload finds
/// none) and to the key's [generation](super::Fence::generation) (a key claimed again after it
/// expired finds none), survive a release and a takeover, and expire with the key's record.
pub trait StepLog: Send + Sync + 'static {
    /// The finished steps recorded for `fence`'s key in its generation under `fingerprint`,
    /// oldest first.
    fn recorded(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
    ) -> BoxFuture<'_, Result<Vec<StepRecord>, StepLogError>>;

    /// Records a finished step in the key's generation while `fence` still holds the key, as
    /// [`complete`](super::Store::complete) would (a lapsed lease nobody took over included);
    /// `Lost` when it does not (a stale holder's step is refused, never recorded).
    fn record(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        step: &StepRecord,
    ) -> BoxFuture<'_, Result<ClaimStatus, StepLogError>>;

    /// The pool whose transactions can carry a step's own writes
    /// ([`Steps::run_in_transaction`](crate::Steps::run_in_transaction)); `None` by default.
    #[cfg(feature = "postgres")]
    fn pool(&self) -> Option<&sqlx::PgPool> {
        None
    }

    /// [`record`](Self::record) inside `tx`, a transaction on [`pool`](Self::pool), so that
    /// the step's writes and its record commit together. The default refuses.
    #[cfg(feature = "postgres")]
    fn record_in<'a>(
        &'a self,
        tx: &'a mut sqlx::PgConnection,
        fence: &'a Fence,
        fingerprint: &'a Fingerprint,
        step: &'a StepRecord,
    ) -> BoxFuture<'a, Result<ClaimStatus, StepLogError>> {
        let _ = (tx, fence, fingerprint, step);
        Box::pin(async { Err("this step log records no steps in transactions".into()) })
    }
}
