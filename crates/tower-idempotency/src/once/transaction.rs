//! The inbox pattern: a call's own writes and its result commit in one PostgreSQL transaction.

use std::future::Future;

use futures_util::future::BoxFuture;
use serde::{Serialize, de::DeserializeOwned};
use sqlx::PgConnection;

use super::{Claimed, Once, OnceError};
use crate::{
    store::{ClaimHandle, PgClaim, PostgresStore},
    transaction::IdempotentTx,
};

impl Once<PostgresStore> {
    /// [`run`](Self::run) with `f`'s writes in the claim's own transaction, on a store in
    /// [transactional mode](crate::guide::modes): its writes and the stored result commit
    /// together, or roll back together and free the key. A second call of the key meanwhile is
    /// told it is in flight (or waits, as with [`run`](Self::run)), so the writes happen once.
    ///
    /// ```no_run
    /// use tower_idempotency::{Once, store::PostgresStore};
    ///
    /// # async fn consume(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let once = Once::new(PostgresStore::new(pool).transactional());
    /// let payload = serde_json::json!({ "account": "acct_1", "amount": 100 });
    /// let balance: i64 = once
    ///     .run_in_transaction("ledger-consumer", "evt_1", &payload, |tx: &mut sqlx::PgConnection| {
    ///         Box::pin(async move {
    ///             sqlx::query_scalar(
    ///                 "UPDATE accounts SET balance = balance + 100 WHERE id = 'acct_1' RETURNING balance",
    ///             )
    ///             .fetch_one(tx)
    ///             .await
    ///         })
    ///     })
    ///     .await?;
    /// # let _ = balance; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`run`](Self::run); [`OnceError::NotTransactional`] on a store in lease mode;
    /// [`OnceError::NotCommitted`] when the transaction could not commit;
    /// [`OnceError::RolledBack`] when `f` returned `Ok` over a failed transaction.
    ///
    /// # Panics
    ///
    /// When `f` panics, after its transaction is rolled back.
    pub async fn run_in_transaction<T, E, P, F>(
        &self,
        scope: &str,
        key: &str,
        payload: &P,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        T: Serialize + DeserializeOwned,
        P: Serialize + ?Sized,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, E>>,
    {
        if !self.store().is_transactional() {
            return Err(OnceError::NotTransactional);
        }
        match self.claim(scope, key, payload).await? {
            Claimed::Done(value) => Ok(value),
            Claimed::Run(claim) => self.execute(claim, |claim| in_transaction(claim, f)).await,
        }
    }
}

/// `f` on the claim's transaction, lent to it for as long as it runs (taken from the claim
/// here, so the work does not borrow the claim).
fn in_transaction<T, E, F>(
    claim: &PgClaim,
    f: F,
) -> impl Future<Output = Result<T, OnceError<E>>> + use<T, E, F>
where
    F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, E>>,
{
    let mut extensions = http::Extensions::new();
    claim.attach(&mut extensions);
    let tx = IdempotentTx::from_extensions(&extensions);
    async move {
        // A transactional claim always lends its transaction once.
        let Ok(mut tx) = tx else {
            return Err(OnceError::NotTransactional);
        };
        f(&mut tx).await.map_err(OnceError::Failed)
    }
}
