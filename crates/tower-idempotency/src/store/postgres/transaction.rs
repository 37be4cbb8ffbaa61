//! Transactional claims: the claim's transaction, and what takes its place when it cannot
//! commit although the handler never wrote through it.

use super::*;

/// A transactional claim: its transaction, and what took its place if it could not commit.
#[derive(Debug)]
pub(super) struct TxClaim {
    pub(super) slot: Arc<TxSlot>,
    pub(super) request: ClaimRequest,
    pub(super) fallback: std::sync::Mutex<Fallback>,
}

/// Where a transactional claim stands once its transaction failed to commit although the
/// handler never wrote through it: the response was delivered as in lease mode, and the key is
/// claimed again in lease mode so that it can be stored.
#[derive(Debug, Clone, Copy)]
pub(super) enum Fallback {
    /// The transaction is the claim.
    None,
    /// The transaction is gone and the key not yet claimed again.
    Reclaim,
    /// Claimed again, in lease mode.
    Fence(Fence),
}

impl TxClaim {
    pub(super) fn fallback(&self) -> Fallback {
        *self
            .fallback
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn set_fallback(&self, fallback: Fallback) {
        *self
            .fallback
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fallback;
    }
}

impl PostgresStore {
    /// A transactional claim that could not commit. If the handler wrote through the
    /// transaction, that is the answer (nothing happened). If it did not, its response stands,
    /// as in lease mode, and the claim went with the transaction: the key is claimed again in
    /// lease mode to store it, so no retry runs the handler again meanwhile.
    pub(super) async fn failed_commit(
        &self,
        tx_claim: &TxClaim,
        record: &Record,
        error: PostgresStoreError,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        if tx_claim.slot.was_used() {
            return Err(error);
        }
        tracing::warn!(%error, "committing an unused transaction failed; claiming the key again to store the response");
        tx_claim.set_fallback(Fallback::Reclaim);
        match self.reclaim(tx_claim).await {
            Ok(ClaimStatus::Held) => match tx_claim.fallback() {
                Fallback::Fence(held) => self.complete_lease(&held, record).await,
                // Stored already: the commit reported as failed went through.
                _ => Ok(ClaimStatus::Held),
            },
            Ok(status) => Ok(status),
            Err(_) => Err(error),
        }
    }

    /// Claims a fallen-back transactional claim's key again, in lease mode: `Held` once it holds
    /// it again (or finds its own record stored), `Lost` if another request got there first.
    pub(super) async fn reclaim(
        &self,
        tx_claim: &TxClaim,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        match self.claim_lease(&tx_claim.request).await? {
            KeyState::Acquired { claim, .. } => {
                tx_claim.set_fallback(Fallback::Fence(claim.fence));
                Ok(ClaimStatus::Held)
            }
            KeyState::Completed { .. } => {
                tx_claim.set_fallback(Fallback::None);
                Ok(ClaimStatus::Held)
            }
            KeyState::InFlight { .. } | KeyState::Mismatch => {
                tracing::error!(
                    "another request claimed the key while its response was being stored; \
                     the handler may run twice"
                );
                Ok(ClaimStatus::Lost)
            }
        }
    }
}
