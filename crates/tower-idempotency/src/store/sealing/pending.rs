//! A [`SealingStore`](super::SealingStore)'s pending log: the wrapped store's, with each kept
//! request sealed as a record is (it may hold card details), under a key derived for it.

use std::{convert::Infallible, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, StatusCode};

use super::{SealingError, derive::Binding, envelope, keys::SealingKeys};
use crate::{
    chain::Chain,
    fingerprint::Fingerprint,
    record::Record,
    scope::ScopeKey,
    store::{Abandoned, ClaimStatus, Fence, PendingLog, PendingLogError, PendingPick},
};

/// Seals the requests `inner` keeps.
pub(super) struct SealedPendingLog {
    pub(super) inner: Arc<dyn PendingLog>,
    pub(super) keys: Arc<SealingKeys>,
}

impl PendingLog for SealedPendingLog {
    fn keep(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        request: Bytes,
    ) -> BoxFuture<'_, Result<ClaimStatus, PendingLogError>> {
        let plain = Record::from_parts(StatusCode::OK, HeaderMap::new(), Some(request));
        let sealed = envelope::seal(&self.keys, &Binding::kept_request(&fence.key), &plain);
        let (fence, fingerprint) = (*fence, *fingerprint);
        Box::pin(async move {
            let sealed = sealed
                .map_err(|_| Box::new(SealingError::<Infallible>::Unsealable) as PendingLogError)?;
            let body = sealed.body().cloned().unwrap_or_default();
            self.inner.keep(&fence, &fingerprint, body).await
        })
    }

    /// A request that does not open is left out (its attempt counted) and logged.
    fn pick(&self, pick: PendingPick) -> BoxFuture<'_, Result<Vec<Abandoned>, PendingLogError>> {
        Box::pin(async move {
            let picked = self.inner.pick(pick).await?;
            Ok(picked
                .into_iter()
                .filter_map(|abandoned| self.open(abandoned))
                .collect())
        })
    }

    fn finish(&self, key: &ScopeKey) -> BoxFuture<'_, Result<bool, PendingLogError>> {
        self.inner.finish(key)
    }

    fn purge(&self, batch: u32) -> BoxFuture<'_, Result<u64, PendingLogError>> {
        self.inner.purge(batch)
    }

    fn release_unkept(
        &self,
        limit: u32,
        grace: Duration,
    ) -> BoxFuture<'_, Result<u64, PendingLogError>> {
        self.inner.release_unkept(limit, grace)
    }
}

impl SealedPendingLog {
    fn open(&self, mut abandoned: Abandoned) -> Option<Abandoned> {
        let stored = Record::from_parts(StatusCode::OK, HeaderMap::new(), Some(abandoned.request));
        match envelope::open(&self.keys, &Binding::kept_request(&abandoned.key), &stored) {
            Ok(record) => {
                abandoned.request = record.body().cloned().unwrap_or_default();
                Some(abandoned)
            }
            Err(why) => {
                tracing::error!(
                    key = %abandoned.key,
                    why = %Chain(&why),
                    "a request kept for completion does not open; it is not completed"
                );
                None
            }
        }
    }
}
