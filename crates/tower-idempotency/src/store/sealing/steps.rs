//! A [`SealingStore`](super::SealingStore)'s step log: the wrapped store's, with each step's
//! output sealed as a record is (an authorization answer holds what a response holds), under a
//! key derived for the step's name.

use std::{convert::Infallible, sync::Arc};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, StatusCode};

use super::{SealingError, derive::Binding, envelope, keys::SealingKeys};
use crate::{
    fingerprint::Fingerprint,
    record::Record,
    scope::ScopeKey,
    store::{ClaimStatus, Fence, StepLog, StepLogError, StepRecord},
};

/// Seals the outputs `inner` keeps.
pub(super) struct SealedStepLog {
    pub(super) inner: Arc<dyn StepLog>,
    pub(super) keys: Arc<SealingKeys>,
}

impl SealedStepLog {
    fn seal(&self, key: &ScopeKey, step: &StepRecord) -> Result<StepRecord, StepLogError> {
        let plain = Record::from_parts(StatusCode::OK, HeaderMap::new(), Some(step.output.clone()));
        let sealed = envelope::seal(&self.keys, &Binding::step(key, &step.name), &plain)
            .map_err(|why| Box::new(SealingError::<Infallible>::from(why)) as StepLogError)?;
        Ok(StepRecord {
            name: step.name.clone(),
            output: sealed.body().cloned().unwrap_or_default(),
        })
    }

    /// A step that does not open is an error, never a step to run again.
    fn open(&self, key: &ScopeKey, step: StepRecord) -> Result<StepRecord, StepLogError> {
        let stored = Record::from_parts(StatusCode::OK, HeaderMap::new(), Some(step.output));
        let opened = envelope::open(&self.keys, &Binding::step(key, &step.name), &stored)
            .map_err(|why| Box::new(why) as StepLogError)?;
        Ok(StepRecord {
            name: step.name,
            output: opened.body().cloned().unwrap_or_else(Bytes::new),
        })
    }
}

impl StepLog for SealedStepLog {
    fn recorded(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
    ) -> BoxFuture<'_, Result<Vec<StepRecord>, StepLogError>> {
        let (fence, fingerprint) = (*fence, *fingerprint);
        Box::pin(async move {
            let stored = self.inner.recorded(&fence, &fingerprint).await?;
            stored
                .into_iter()
                .map(|step| self.open(&fence.key, step))
                .collect()
        })
    }

    fn record(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        step: &StepRecord,
    ) -> BoxFuture<'_, Result<ClaimStatus, StepLogError>> {
        let sealed = self.seal(&fence.key, step);
        let (fence, fingerprint) = (*fence, *fingerprint);
        Box::pin(async move { self.inner.record(&fence, &fingerprint, &sealed?).await })
    }

    #[cfg(feature = "postgres")]
    fn pool(&self) -> Option<&sqlx::PgPool> {
        self.inner.pool()
    }

    #[cfg(feature = "postgres")]
    fn record_in<'a>(
        &'a self,
        tx: &'a mut sqlx::PgConnection,
        fence: &'a Fence,
        fingerprint: &'a Fingerprint,
        step: &'a StepRecord,
    ) -> BoxFuture<'a, Result<ClaimStatus, StepLogError>> {
        let sealed = self.seal(&fence.key, step);
        Box::pin(async move { self.inner.record_in(tx, fence, fingerprint, &sealed?).await })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::{
        ClaimHandle, ClaimRequest, KeyState, MemoryStore, Store, sealing::SealingStore,
    };

    async fn held(store: &SealingStore<MemoryStore>) -> (Fence, Fingerprint) {
        let request = ClaimRequest {
            key: ScopeKey::from_bytes([7; 32]),
            fingerprint: Fingerprint::from_bytes([6; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(600),
            waiting: false,
            keeps_request: false,
        };
        let KeyState::Acquired { claim, .. } = store.claim(&request).await.unwrap() else {
            panic!("a new key is acquired");
        };
        (claim.fence().unwrap(), request.fingerprint)
    }

    fn step(name: &str, output: &'static str) -> StepRecord {
        StepRecord {
            name: name.to_owned(),
            output: Bytes::from_static(output.as_bytes()),
        }
    }

    /// The wrapped store keeps no output in clear, and one moved to another step does not open
    /// (before, a `SealingStore` handed out its inner store's step log as it was).
    #[tokio::test]
    async fn step_outputs_are_sealed_and_bound_to_their_step() {
        let inner = MemoryStore::new();
        let store = SealingStore::new(inner.clone(), SealingKeys::new(1, [5; 32]));
        let (fence, fingerprint) = held(&store).await;
        let sealed = store.capabilities().step_log().cloned().unwrap();
        let card = step("authorize", "\"card 4242, auth_1\"");
        let status = sealed.record(&fence, &fingerprint, &card).await.unwrap();
        assert_eq!(status, ClaimStatus::Held);
        assert_eq!(sealed.recorded(&fence, &fingerprint).await.unwrap(), [card]);

        let plain = inner.capabilities().step_log().cloned().unwrap();
        let kept = plain.recorded(&fence, &fingerprint).await.unwrap();
        assert!(!kept[0].output.windows(4).any(|w| w == b"4242"), "in clear");

        let moved = StepRecord {
            name: "ledger".to_owned(),
            output: kept[0].output.clone(),
        };
        let status = plain.record(&fence, &fingerprint, &moved).await.unwrap();
        assert_eq!(status, ClaimStatus::Held);
        let opened = sealed.recorded(&fence, &fingerprint).await;
        assert!(opened.is_err(), "an output moved to another step opened");
    }
}
