//! The inbox on PostgreSQL: a delivery's writes commit with its record.

use futures_util::future::BoxFuture;
use serde::{Serialize, de::DeserializeOwned};
use sqlx::PgConnection;

use super::{VerifiedWebhook, WebhookReceiver};
use crate::{once::OnceError, store::PostgresStore};

impl WebhookReceiver<PostgresStore> {
    /// [`run`](Self::run) with `f`'s writes in the claim's transaction, as
    /// [`Once::run_in_transaction`](crate::Once::run_in_transaction): the effect and the
    /// record that the `webhook-id` was handled commit together, or neither does.
    ///
    /// # Errors
    ///
    /// As [`Once::run_in_transaction`](crate::Once::run_in_transaction).
    pub async fn run_in_transaction<T, E, F>(
        &self,
        webhook: &VerifiedWebhook,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, E>>,
    {
        self.once
            .run_in_transaction(&self.scope, webhook.id(), webhook.text(), f)
            .await
    }
}
