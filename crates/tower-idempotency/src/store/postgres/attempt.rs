//! A lease-mode claim whose answer its caller may never read, and how what it claimed is found
//! again by its claimant id or released.

use std::{
    pin::Pin,
    sync::{
        LazyLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use sqlx::{postgres::PgRow, types::Uuid};

use super::{
    PostgresStore, PostgresStoreError,
    sql::{RELEASE_CLAIMANT, RELEASE_CLAIMANT_PARTITIONED},
    statement::{Param, Statement, stored_key},
};
use crate::{scope::ScopeKey, store::ClaimStatus};

/// The most claim attempts settled in the background at once (see [`ClaimAttempt`]); past it,
/// a lost claim is left to lapse with its lease, so an outage cannot pile up tasks.
pub(super) const MAX_UNSETTLED: usize = 1024;

/// When a claim attempt whose answer was lost deletes its row: at once, then again after the
/// statements it gave up on have had time to commit late.
pub(super) const SETTLE_DELAYS: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_secs(1),
    Duration::from_secs(10),
];

/// How long a claim statement given up on is left to finish in the background before its
/// claim is released by claimant alone.
pub(super) const ABANDONED_STATEMENT_BOUND: Duration = Duration::from_secs(60);

/// A fresh claimant id: this process's random half and a count, so two attempts never share one.
pub(super) fn new_claimant() -> Uuid {
    static PROCESS: LazyLock<u64> = LazyLock::new(|| {
        use std::hash::{BuildHasher, RandomState};
        RandomState::new().hash_one(std::process::id())
    });
    static COUNT: AtomicU64 = AtomicU64::new(0);
    Uuid::from_u64_pair(*PROCESS, COUNT.fetch_add(1, Ordering::Relaxed))
}

/// A statement that runs on a pooled connection of its own, owned so it can outlive its caller.
pub(super) type PendingStatement =
    Pin<Box<dyn Future<Output = Result<Option<PgRow>, sqlx::Error>> + Send>>;

/// One lease-mode claim: its claimant id, and what happens if its caller never learns the
/// answer. Unless [`settle`](Self::settle)d, dropping it (an error, a timeout, a cancelled
/// request) finishes the statement it was waiting for in the background and then undoes
/// whatever the attempt's claimant holds (see `RELEASE_CLAIMANT`): a claim nobody holds never
/// blocks its key.
pub(super) struct ClaimAttempt {
    pub(super) store: Option<PostgresStore>,
    pub(super) key: ScopeKey,
    pub(super) claimant: Uuid,
    pub(super) pending: Option<PendingStatement>,
}

impl ClaimAttempt {
    pub(super) fn new(store: &PostgresStore, key: ScopeKey) -> Self {
        Self {
            store: Some(store.clone()),
            key,
            claimant: new_claimant(),
            pending: None,
        }
    }

    /// Runs a claim statement under the store's timeout; given up on, it stays pending.
    pub(super) async fn run(
        &mut self,
        statement: Statement<'static>,
    ) -> Result<Option<PgRow>, PostgresStoreError> {
        let store = self.store.as_ref().expect("unsettled while running");
        let (pool, prepared, timeout) = (store.pool.clone(), store.prepared, store.timeout);
        let pending = self.pending.insert(Box::pin(async move {
            statement.fetch_optional_pooled(prepared, &pool).await
        }));
        match tokio::time::timeout(timeout, pending).await {
            Ok(result) => {
                self.pending = None;
                Ok(result?)
            }
            Err(_) => Err(store.timeout_error("claim")),
        }
    }

    /// The caller has the answer: nothing to undo.
    pub(super) fn settle(&mut self) {
        self.store = None;
    }
}

impl Drop for ClaimAttempt {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if store.unsettled.fetch_add(1, Ordering::Relaxed) >= MAX_UNSETTLED {
            store.unsettled.fetch_sub(1, Ordering::Relaxed);
            tracing::warn!(
                "too many lost claims to release; this one frees itself when its lease lapses"
            );
            return;
        }
        let (key, claimant, pending) = (self.key, self.claimant, self.pending.take());
        runtime.spawn(async move {
            if let Some(pending) = pending {
                let _ = tokio::time::timeout(ABANDONED_STATEMENT_BOUND, pending).await;
            }
            store.release_claimant(key, claimant, &SETTLE_DELAYS).await;
        });
    }
}

impl PostgresStore {
    /// Undoes what the claim attempt `claimant` may hold on `key`: tried after each of
    /// `delays`, until a try finds its row, so that a statement the attempt gave up on that
    /// commits late is still undone.
    pub(super) async fn release_claimant(self, key: ScopeKey, claimant: Uuid, delays: &[Duration]) {
        let sql = if self.partitions.is_some() {
            RELEASE_CLAIMANT_PARTITIONED
        } else {
            RELEASE_CLAIMANT
        };
        for delay in delays {
            tokio::time::sleep(*delay).await;
            let statement = Statement::new(sql)
                .with(Param::Key(stored_key(&key)))
                .with(Param::Key(claimant));
            match self.fenced_pooled("release", statement).await {
                Ok(ClaimStatus::Held) => {
                    tracing::debug!("released a claim whose answer was lost");
                    break;
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(
                    %error,
                    "releasing a claim whose answer was lost failed; retrying"
                ),
            }
        }
        self.unsettled.fetch_sub(1, Ordering::Relaxed);
    }
}
