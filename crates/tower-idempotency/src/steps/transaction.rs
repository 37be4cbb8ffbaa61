//! A step whose own writes commit with its record, in one PostgreSQL transaction.

use futures_util::future::BoxFuture;
use serde::{Serialize, de::DeserializeOwned};

use super::{DownstreamKey, StepError, Steps, step_record};
use crate::store::StepLogError;

impl Steps {
    /// [`run`](Self::run) with the step's own writes in a transaction on the store's pool,
    /// committed together with the step's record, or rolled back with it when another request
    /// took the key over (a stale holder's writes never commit).
    ///
    /// ```no_run
    /// # async fn charge(steps: tower_idempotency::Steps) -> Result<(), Box<dyn std::error::Error>> {
    /// let entry: i64 = steps
    ///     .run_in_transaction("ledger", |tx: &mut sqlx::PgConnection, _key| {
    ///         Box::pin(async move {
    ///             sqlx::query_scalar("INSERT INTO ledger (amount) VALUES (100) RETURNING id")
    ///                 .fetch_one(tx)
    ///                 .await
    ///         })
    ///     })
    ///     .await?;
    /// # let _ = entry; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`run`](Self::run); [`StepError::Store`] also when the store has no PostgreSQL
    /// pool, or the transaction could not begin or commit.
    pub async fn run_in_transaction<T, E, F>(&self, name: &str, step: F) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut sqlx::PgConnection, DownstreamKey) -> BoxFuture<'c, Result<T, E>>,
    {
        if let Some(value) = self.recorded_output(name).await? {
            return Ok(value);
        }
        let shared = &self.shared;
        let pool = shared.log.pool().ok_or_else(|| {
            StepError::Store("the store has no PostgreSQL pool for step transactions".into())
        })?;
        let mut tx = pool.begin().await.map_err(store_error)?;
        let value = step(&mut tx, self.downstream_key(name))
            .await
            .map_err(StepError::Failed)?;
        let step = step_record(name, &value)?;
        let status = shared
            .log
            .record_in(&mut tx, &shared.fence, &shared.fingerprint, &step)
            .await;
        // Dropped unfinished, the transaction rolls back with the step's writes.
        if matches!(status, Ok(crate::store::ClaimStatus::Held)) {
            tx.commit().await.map_err(store_error)?;
        }
        self.recorded(step, status)?;
        Ok(value)
    }
}

fn store_error<E>(error: sqlx::Error) -> StepError<E> {
    StepError::Store(StepLogError::from(Box::new(error)))
}
