//! A key held by a running request: stored, released, abandoned, or released when dropped; and
//! storing a delivered response the store did not take.

use super::*;

/// A held claim that is released if dropped unsettled: a cancelled request (see
/// [`Disconnect::Cancel`]) or a task torn down with its runtime frees its key instead of leaving
/// it to its lease.
pub(super) struct HeldKey<St: Store> {
    pub(super) store: Arc<St>,
    pub(super) claim: Option<St::Claim>,
}

/// What became of storing a handler's response.
pub(super) enum Completion {
    /// Stored (or storing goes on in the background while the claim is kept): deliver it.
    Stored,
    /// The handler's effects were to commit with the record and may not have: `503`.
    NotCommitted,
    /// The handler's transaction had failed: nothing committed, nothing stored, key free.
    RolledBack,
}

impl<St: Store> HeldKey<St> {
    pub(super) fn new(store: Arc<St>, claim: St::Claim) -> Self {
        Self {
            store,
            claim: Some(claim),
        }
    }

    pub(super) fn claim(&self) -> &St::Claim {
        self.claim.as_ref().expect("claim is present until settled")
    }

    /// Stores the record.
    ///
    /// When the handler's effects are bound to the claim ([`Store::commits_effects`]), a failure
    /// means they did not commit. Otherwise a store failure does not undo what the handler did:
    /// the response is delivered, and storing goes on in the background ([`keep_storing`])
    /// with the claim kept alive meanwhile, so no retry runs the handler again.
    pub(super) async fn complete(
        mut self,
        record: Record,
        lease: Duration,
        ttl: Duration,
    ) -> Completion {
        let Some(claim) = self.claim.take() else {
            return Completion::Stored;
        };
        let atomic = self.store.commits_effects(&claim);
        if let Some(body) = record.body() {
            metrics::stored_body(body.len());
        }
        match metrics::timed("complete", self.store.complete(&claim, &record)).await {
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
    pub(super) async fn release(mut self) {
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

    /// Lets the claim go without releasing it: it lapses with its lease.
    pub(super) async fn abandon(mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        if let Err(error) = self.store.abandon(&claim).await {
            tracing::warn!(
                error = %Chain(&error),
                "giving up a stopped handler's key failed; it frees itself when its lease lapses"
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

/// Stores a delivered response the store did not take, keeping its claim alive meanwhile so that
/// no retry takes the key over and runs the handler again: a retry gets `409` until the record is
/// stored, then its replay. Retried promptly while the store is unreachable, with a growing
/// pause while it answers but refuses; given up once the record would have expired anyway.
pub(super) async fn keep_storing<St: Store>(
    store: Arc<St>,
    claim: St::Claim,
    record: Record,
    lease: Duration,
    ttl: Duration,
) {
    let started = tokio::time::Instant::now();
    let renew_every = lease / 3;
    let mut renewed: Option<tokio::time::Instant> = None;
    let mut pause = Duration::from_millis(100);
    loop {
        tokio::time::sleep(pause).await;
        match metrics::timed("complete", store.complete(&claim, &record)).await {
            Ok(status) => {
                log_fenced(status, "complete");
                return;
            }
            Err(error) => {
                tracing::warn!(error = %Chain(&error), "storing the response failed again")
            }
        }
        if started.elapsed() >= ttl {
            tracing::error!(
                "gave up storing the response: its record would have expired by now, so a retry \
                 with this key runs the handler again"
            );
            return;
        }
        let due = renewed.is_none_or(|at| at.elapsed() >= renew_every);
        let reachable = if due {
            match metrics::timed("renew", store.renew(&claim, lease)).await {
                Ok(ClaimStatus::Held) => {
                    renewed = Some(tokio::time::Instant::now());
                    true
                }
                Ok(_) => {
                    tracing::error!(
                        "the key was taken over while its delivered response waited to be stored; \
                         the handler may run twice"
                    );
                    return;
                }
                Err(_) => false,
            }
        } else {
            true
        };
        pause = if reachable {
            (pause * 3).min(renew_every).min(Duration::from_secs(10))
        } else {
            RETRY_WHILE_UNREACHABLE
        };
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
