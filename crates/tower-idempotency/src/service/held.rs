//! A key held by a running request: stored, released, abandoned, or released when dropped; and
//! storing a delivered response the store did not take.

use std::{pin::pin, sync::Arc, time::Duration};

use tracing::Instrument;

use super::run::Heartbeat;
use crate::{
    chain::Chain,
    metrics,
    record::Record,
    settings::MAX_DURATION,
    store::{ClaimHandle, ClaimStatus, Store},
};

/// A held claim that is released if dropped unsettled: a cancelled request (see
/// [`Disconnect::Cancel`]) or a task torn down with its runtime frees its key instead of leaving
/// it to its lease.
pub(crate) struct HeldKey<St: Store> {
    pub(super) store: Arc<St>,
    pub(super) claim: Option<St::Claim>,
}

/// What became of storing a handler's response.
pub(crate) enum Completion {
    /// Stored (or storing goes on in the background while the claim is kept): deliver it.
    Stored,
    /// The handler's effects were to commit with the record and may not have: `503`.
    NotCommitted,
    /// The handler's transaction had failed: nothing committed, nothing stored, key free.
    RolledBack,
}

impl<St: Store> HeldKey<St> {
    pub(crate) fn new(store: Arc<St>, claim: St::Claim) -> Self {
        Self {
            store,
            claim: Some(claim),
        }
    }

    pub(crate) fn claim(&self) -> &St::Claim {
        self.claim.as_ref().expect("claim is present until settled")
    }

    /// Stores the record.
    ///
    /// When the handler's effects are bound to the claim ([`ClaimHandle::commits_effects`](crate::store::ClaimHandle::commits_effects)), a failure
    /// means they did not commit. Otherwise a store failure does not undo what the handler did:
    /// the response is delivered, and storing goes on in the background ([`keep_storing`])
    /// with the claim kept alive meanwhile, so no retry runs the handler again.
    pub(crate) async fn complete(
        mut self,
        record: Record,
        lease: Duration,
        ttl: Duration,
    ) -> Completion {
        let Some(claim) = self.claim.take() else {
            return Completion::Stored;
        };
        let atomic = claim.commits_effects();
        if let Some(body) = record.body() {
            metrics::stored_body(body.len());
        }
        let stored = {
            let storing = pin!(metrics::timed(
                "complete",
                self.store.complete(&claim, &record)
            ));
            if atomic {
                // The open transaction is the claim's hold: nothing to renew.
                storing.await
            } else {
                // An attempt (or the batch it queues for) may outlast the lease: renewed meanwhile.
                let heartbeat = Heartbeat {
                    lease,
                    max_time: MAX_DURATION,
                };
                let stored = heartbeat.run(&*self.store, &claim, storing).await;
                stored.expect("a heartbeat without a time limit runs its future to the end")
            }
        };
        match stored {
            Ok(ClaimStatus::Held) => Completion::Stored,
            Ok(ClaimStatus::RolledBack) => Completion::RolledBack,
            Ok(status) => {
                log_fenced(status, "complete");
                if atomic {
                    Completion::NotCommitted
                } else {
                    Completion::Stored
                }
            }
            Err(error) if atomic => {
                tracing::error!(
                    error = %Chain(&error),
                    "committing the request failed; it was rolled back"
                );
                Completion::NotCommitted
            }
            Err(error) => {
                tracing::error!(error = %Chain(&error), "storing the response failed; retrying in the background");
                let store = Arc::clone(&self.store);
                tokio::spawn(keep_storing(store, claim, record, lease, ttl).in_current_span());
                Completion::Stored
            }
        }
    }

    /// Frees the key for the next request.
    pub(crate) async fn release(mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        match metrics::timed("release", self.store.release(&claim)).await {
            Ok(status) => log_fenced(status, "release"),
            Err(error) => tracing::warn!(
                error = %Chain(&error),
                "releasing the key failed; it frees itself when its lease lapses"
            ),
        }
    }

    /// Gives the claim up without releasing it ([`Store::abandon`]): the next request takes the
    /// key over at once, told that a handler may have run in part.
    pub(crate) async fn abandon(mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        if let Err(error) = self.store.abandon(&claim).await {
            tracing::warn!(
                error = %Chain(&error),
                "giving up a key part-way failed; it is taken over when its lease lapses"
            );
        }
    }
}

impl<St: Store> Drop for HeldKey<St> {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = Arc::clone(&self.store);
        tracing::debug!("request dropped while holding its key; releasing it");
        runtime.spawn(async move {
            if let Err(error) = store.release(&claim).await {
                tracing::warn!(error = %Chain(&error), "releasing a dropped request's key failed");
            }
        });
    }
}

/// Stores a delivered response the store did not take, its lease renewed meanwhile on its own
/// clock (however long an attempt takes), so that no retry takes the key over and runs the
/// handler again: a retry gets `409` until the record is stored, then its replay. Retried with a
/// growing pause; given up once the record would have expired anyway.
pub(super) async fn keep_storing<St: Store>(
    store: Arc<St>,
    claim: St::Claim,
    record: Record,
    lease: Duration,
    ttl: Duration,
) {
    let heartbeat = Heartbeat {
        lease,
        max_time: ttl,
    };
    let attempts = pin!(store_until_answered(&*store, &claim, &record, lease));
    if heartbeat.run(&*store, &claim, attempts).await.is_none() {
        tracing::error!(
            "gave up storing the response: its record would have expired by now, so a retry \
             with this key runs the handler again"
        );
    }
}

/// Completes `claim` until the store answers, pausing longer after each failure (at most a
/// third of the lease, so the record follows soon after an outage ends).
async fn store_until_answered<St: Store>(
    store: &St,
    claim: &St::Claim,
    record: &Record,
    lease: Duration,
) {
    let mut pause = Duration::from_millis(100);
    loop {
        tokio::time::sleep(pause).await;
        match metrics::timed("complete", store.complete(claim, record)).await {
            Ok(status) => return log_fenced(status, "complete"),
            Err(error) => {
                tracing::warn!(error = %Chain(&error), "storing the response failed again")
            }
        }
        pause = (pause * 2).min(lease / 3).min(Duration::from_secs(2));
    }
}

pub(super) fn log_fenced(status: ClaimStatus, operation: &str) {
    if status == ClaimStatus::Lost {
        tracing::warn!(
            operation,
            "the claim was taken over while the handler ran (its lease lapsed); nothing was written"
        );
    }
}
