//! Transactional claims: the claim's transaction, lent to the handler and taken back to
//! commit, and what takes its place when it cannot commit although the handler never wrote
//! through it.

use std::{
    ops::{Deref, DerefMut},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use sqlx::PgConnection;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::{PostgresStore, PostgresStoreError};
use crate::{
    record::Record,
    store::{ClaimRequest, ClaimStatus, Fence, KeyState},
};

/// The transaction a transactional claim holds.
pub(crate) type PgTransaction = sqlx::Transaction<'static, sqlx::Postgres>;

/// The open transaction of a transactional claim, shared by the claim and the handler: lent to
/// the handler ([`lend`](Self::lend)), then taken back to commit or roll back.
#[derive(Debug)]
pub(crate) struct TxSlot {
    tx: Arc<Mutex<Option<PgTransaction>>>,
    used: AtomicBool,
}

impl TxSlot {
    pub(super) fn new(tx: PgTransaction) -> Self {
        Self {
            tx: Arc::new(Mutex::new(Some(tx))),
            used: AtomicBool::new(false),
        }
    }

    /// Lends the transaction to the handler: `None` while it is lent already, or once the claim
    /// was settled.
    pub(crate) fn lend(&self) -> Option<LentTx> {
        let guard = Arc::clone(&self.tx).try_lock_owned().ok()?;
        guard.as_ref()?;
        self.used.store(true, Ordering::Release);
        Some(LentTx(guard))
    }

    /// Takes the transaction back from the handler to commit or roll it back: `Ok(None)` once
    /// the claim was settled.
    ///
    /// # Errors
    ///
    /// [`PostgresStoreError::TransactionHeld`] while the handler still holds it.
    pub(super) fn take_back(&self) -> Result<Option<PgTransaction>, PostgresStoreError> {
        let mut tx = self
            .tx
            .try_lock()
            .map_err(|_| PostgresStoreError::TransactionHeld)?;
        Ok(tx.take())
    }

    /// Whether the claim was committed or rolled back already.
    pub(super) fn is_settled(&self) -> bool {
        self.tx.try_lock().is_ok_and(|tx| tx.is_none())
    }

    /// Whether the handler was lent the transaction.
    pub(super) fn was_used(&self) -> bool {
        self.used.load(Ordering::Acquire)
    }
}

/// The claim's transaction while the handler holds it; the claim takes it back once it is
/// dropped.
pub(crate) struct LentTx(OwnedMutexGuard<Option<PgTransaction>>);

impl Deref for LentTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        // Present from lending until the claim takes it back, which it can only do once this
        // guard is dropped.
        self.0.as_ref().expect("transaction present while lent")
    }
}

impl DerefMut for LentTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.0.as_mut().expect("transaction present while lent")
    }
}

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
