//! Recovery points inside a handler: [`Steps`] runs each named step once per idempotency key,
//! records its result with the key's claim, and hands it back to a request that takes the key
//! over after a crash, which goes on at the first unfinished step.
//!
//! The module is private: [`Steps`] and its errors are re-exported at the crate root, and
//! the example is on [`Steps`], where docs.rs shows it.

use std::{
    fmt,
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU8, Ordering},
    },
};

use bytes::Bytes;
use serde::{Serialize, de::DeserializeOwned};
use tokio::sync::OnceCell;

use crate::{
    fingerprint::Fingerprint,
    settings::StepSecret,
    store::{ClaimHandle, ClaimStatus, Fence, StepLog, StepLogError, StepRecord, Store},
};

mod error;
mod key;
#[cfg(feature = "postgres")]
mod transaction;

pub use error::{MissingSteps, StepError};
pub use key::DownstreamKey;

use error::Reason;

/// The steps of the handler running under a claimed key: each named step runs once per
/// idempotency key, its result recorded with the key's claim.
///
/// The layer hands it to the handler through the request extensions
/// ([`IdempotencyContext::steps`](crate::IdempotencyContext::steps); with the `axum` feature,
/// it is an extractor). Clones share the request's steps.
///
/// ```
/// # #[cfg(feature = "axum")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
/// use tower::ServiceExt;
/// use tower_idempotency::{IdempotencyLayer, KeySource, Principal, StepError, Steps};
///
/// async fn create_charge(steps: Steps) -> Result<String, StepError<StatusCode>> {
///     // Once per idempotency key: a retry after a crash gets the recorded id back.
///     let authorization: String = steps
///         .run("authorize", |key| async move {
///             // Send `key` as the card processor's idempotency key: a call interrupted and
///             // sent again carries the same one.
///             Ok(format!("auth_{}", &key.to_string()[..8]))
///         })
///         .await?;
///     let entry: u64 = steps.run("ledger", |_key| async { Ok(42) }).await?;
///     Ok(format!("{authorization} {entry}"))
/// }
///
/// // In production, the same secret on every instance, from your secret store.
/// let secret = b"an example secret, 32 bytes long".to_vec();
/// let layer = IdempotencyLayer::memory()
///     .with_key(KeySource::default().required())
///     .with_step_secret(secret)?;
/// let app = Router::new().route("/v1/charges", post(create_charge)).layer(layer);
///
/// let mut request = Request::post("/v1/charges")
///     .header("idempotency-key", "k1")
///     .body(Body::empty())?;
/// request.extensions_mut().insert(Principal::new("acct_1")?);
/// assert_eq!(app.oneshot(request).await?.status(), StatusCode::OK);
/// # Ok(()) }
/// # #[cfg(not(feature = "axum"))]
/// # fn main() {}
/// ```
///
/// Steps apply in lease mode ([`MemoryStore`](crate::store::MemoryStore),
/// [`PostgresStore`](crate::store::PostgresStore) without `transactional`), on a layer with a
/// [step secret](crate::IdempotencyLayer::with_step_secret). See the
/// [modes guide](crate::guide::modes#steps) for when to use them.
#[derive(Clone)]
pub struct Steps {
    shared: Arc<Shared>,
}

struct Shared {
    log: Arc<dyn StepLog>,
    fence: Fence,
    fingerprint: Fingerprint,
    secret: StepSecret,
    /// The finished steps: those recorded before this request, loaded by its first `run` (one
    /// round trip, saved when the claim found none), and those it recorded since.
    finished: OnceCell<Mutex<Vec<StepRecord>>>,
    /// What the layer must know when the handler is done: [`HANDED_OUT`], [`LOST`].
    flags: AtomicU8,
}

/// A downstream key was handed out, by this request or (a step found recorded) an earlier
/// holder's: a call with it may have gone through.
const HANDED_OUT: u8 = 1;
/// Recording a step found the claim lost.
const LOST: u8 = 2;

impl Steps {
    /// Runs step `name` once per idempotency key: its recorded result if it finished before
    /// (`step` is not called), else `step`'s, recorded before it is returned.
    ///
    /// `step` is handed the step's [`DownstreamKey`] to send to the service it calls.
    ///
    /// # Errors
    ///
    /// [`StepError::Failed`] with `step`'s error (nothing recorded); [`StepError::Lost`] when
    /// another request took the key over (the handler must stop); [`StepError::Store`] and
    /// [`StepError::Output`] when the step could not be read or recorded.
    pub async fn run<T, E, F, Fut>(&self, name: &str, step: F) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(DownstreamKey) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        if let Some(value) = self.recorded_output(name).await? {
            return Ok(value);
        }
        let value = step(self.downstream_key(name))
            .await
            .map_err(StepError::Failed)?;
        let step = step_record(name, &value)?;
        let status = self
            .shared
            .log
            .record(&self.shared.fence, &self.shared.fingerprint, &step);
        self.recorded(step, status.await)?;
        Ok(value)
    }

    /// The key step `name` sends downstream: the same for every attempt of this request's
    /// step in the key's generation (until the key expires), on any instance that shares the
    /// layer's step secret.
    pub fn downstream_key(&self, name: &str) -> DownstreamKey {
        let shared = &self.shared;
        shared.flags.fetch_or(HANDED_OUT, Ordering::Relaxed);
        let fence = &shared.fence;
        DownstreamKey::derive(
            &shared.secret,
            &fence.key,
            &shared.fingerprint,
            fence.generation,
            name,
        )
    }

    /// Step `name`'s recorded output, read back as `T`, if it finished: what `run` and
    /// `run_in_transaction` return instead of running the step.
    async fn recorded_output<T: DeserializeOwned, E>(
        &self,
        name: &str,
    ) -> Result<Option<T>, StepError<E>> {
        match self.finished(name).await.map_err(StepError::Store)? {
            Some(output) => {
                // Its downstream key went out with the earlier run: the key's work has begun.
                self.shared.flags.fetch_or(HANDED_OUT, Ordering::Relaxed);
                serde_json::from_slice(&output)
                    .map(Some)
                    .map_err(StepError::Output)
            }
            None => Ok(None),
        }
    }

    /// Step `name`'s recorded output, if it finished.
    async fn finished(&self, name: &str) -> Result<Option<Bytes>, StepLogError> {
        let shared = &self.shared;
        let finished = shared
            .finished
            .get_or_try_init(|| async {
                let recorded = shared.log.recorded(&shared.fence, &shared.fingerprint);
                recorded.await.map(Mutex::new)
            })
            .await?;
        let finished = finished
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let found = finished.iter().rev().find(|step| step.name == name);
        Ok(found.map(|step| step.output.clone()))
    }

    /// What became of recording `step`: remembered for this request when it was recorded.
    fn recorded<E>(
        &self,
        step: StepRecord,
        status: Result<ClaimStatus, StepLogError>,
    ) -> Result<(), StepError<E>> {
        match status.map_err(StepError::Store)? {
            ClaimStatus::Held => {
                if let Some(finished) = self.shared.finished.get() {
                    let mut finished = finished
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    finished.push(step);
                }
                Ok(())
            }
            _ => {
                self.shared.flags.fetch_or(LOST, Ordering::Relaxed);
                Err(StepError::Lost)
            }
        }
    }

    /// Whether a downstream key of this request's steps went out, now or in an earlier run (a
    /// call with it may have gone through).
    pub(crate) fn handed_out(&self) -> bool {
        self.shared.flags.load(Ordering::Relaxed) & HANDED_OUT != 0
    }

    /// Whether recording a step found the claim lost.
    pub(crate) fn lost(&self) -> bool {
        self.shared.flags.load(Ordering::Relaxed) & LOST != 0
    }
}

impl fmt::Debug for Steps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Steps")
            .field("key", &self.shared.fence.key)
            .field("token", &self.shared.fence.token)
            .finish_non_exhaustive()
    }
}

/// The [`Steps`] for a handler running under `claim`, or why it gets none: the layer's
/// `secret`, the claim's fence and `store`'s step log are all needed.
pub(crate) fn offer<St: Store>(
    secret: Option<&StepSecret>,
    store: &St,
    claim: &St::Claim,
    fingerprint: Fingerprint,
) -> Result<Steps, MissingSteps> {
    let secret = secret.ok_or(MissingSteps(Reason::SecretUnset))?;
    let fence = claim.fence().ok_or(MissingSteps(Reason::Unfenced))?;
    let capabilities = store.capabilities();
    let log = capabilities
        .step_log()
        .ok_or(MissingSteps(Reason::NoLogInStore))?;
    // A claim that found no steps of its key has none to read: no later holder's can appear
    // without taking the key over, which fences this one out.
    let finished = if claim.may_have_steps() {
        OnceCell::new()
    } else {
        OnceCell::new_with(Some(Mutex::new(Vec::new())))
    };
    Ok(Steps {
        shared: Arc::new(Shared {
            log: Arc::clone(log),
            fence,
            fingerprint,
            secret: secret.clone(),
            finished,
            flags: AtomicU8::new(0),
        }),
    })
}

/// Step `name`'s finished `value`, as it is recorded.
fn step_record<T: Serialize, E>(name: &str, value: &T) -> Result<StepRecord, StepError<E>> {
    let output = serde_json::to_vec(value).map_err(StepError::Output)?;
    Ok(StepRecord {
        name: name.to_owned(),
        output: output.into(),
    })
}

/// Why a request run without a key has no [`Steps`].
pub(crate) const NO_KEY: MissingSteps = MissingSteps(Reason::Unkeyed);

#[cfg(feature = "axum")]
mod axum_impl {
    use axum_core::extract::FromRequestParts;
    use http::request::Parts;

    use super::{MissingSteps, NO_KEY, Steps};
    use crate::context::IdempotencyContext;

    impl<S: Send + Sync> FromRequestParts<S> for Steps {
        type Rejection = MissingSteps;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            let context = parts.extensions.get::<IdempotencyContext>().ok_or(NO_KEY)?;
            context.steps.clone()
        }
    }
}
