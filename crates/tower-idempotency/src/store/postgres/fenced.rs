//! The operations on a held claim in lease mode, each fenced by the claim's token.

use std::{sync::Arc, time::Duration};

use super::{
    PostgresStore, PostgresStoreError,
    group_commit::{Batched, MAX_BATCHED_RECORD, complete_many},
    statement::{Param, Statement, stored_key},
};
use crate::{
    record::Record,
    store::{ClaimStatus, Fence},
};

impl PostgresStore {
    pub(super) async fn renew_lease(
        &self,
        held: &Fence,
        lease: Duration,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let statement =
            fenced_statement(self.fenced_sql().renew, held).with(Param::Interval(lease));
        self.fenced_pooled("renew", statement).await
    }

    /// Stores `record` under `held`; `Held` also when an earlier attempt of this completion
    /// committed although its caller saw an error (the claim's token is on a completed row).
    pub(super) async fn complete_lease(
        &self,
        held: &Fence,
        record: &Record,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        match self.complete_once(held, record).await? {
            // Boxed: rare, and kept out of the request's future.
            ClaimStatus::Lost if Box::pin(self.completed_under(held, record)).await? => {
                Ok(ClaimStatus::Held)
            }
            status => Ok(status),
        }
    }

    /// Whether `held`'s key is completed under its token with `record`'s status and body: read
    /// only after a completion found nothing to complete, which is rare (a takeover, a retry).
    async fn completed_under(
        &self,
        held: &Fence,
        record: &Record,
    ) -> Result<bool, PostgresStoreError> {
        let sql = if self.partitions.is_some() {
            COMPLETED_UNDER_PARTITIONED
        } else {
            COMPLETED_UNDER
        };
        let row = self
            .timed(
                "complete",
                fenced_statement(sql, held)
                    .with(Param::SmallInt(record.status().as_u16() as i16))
                    .with(Param::OptionalBytes(record.body().map(|b| b.as_ref())))
                    .fetch_optional_pooled(self.prepared, &self.pool),
            )
            .await?;
        Ok(row.is_some())
    }

    async fn complete_once(
        &self,
        held: &Fence,
        record: &Record,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        if self.batches() && record.size() <= MAX_BATCHED_RECORD {
            let (pool, timeout) = (self.pool.clone(), self.timeout);
            let notifications = Arc::clone(&self.notifications);
            let completed = self
                .completions
                .run(
                    (*held, record.clone()),
                    move |writer, batch| {
                        let notify = notifications.emit();
                        complete_many(pool.clone(), timeout, notify, writer, batch)
                    },
                    // Stored, whether or not anyone waits to hear it.
                    drop,
                )
                .await;
            match completed {
                Some(Batched::Done(status)) => return Ok(status),
                Some(Batched::TimedOut) => return Err(self.timeout_error("complete")),
                Some(Batched::Alone) | None => {}
            }
        }
        // Transactional mode's waiters mark nothing (see `complete_sql`): a claim of its taken
        // again in lease mode after a failed commit announces its key all the same.
        let statement = complete_statement(self.complete_sql(self.transactional), held, record);
        self.fenced_pooled("complete", statement).await
    }

    pub(super) async fn release_lease(
        &self,
        held: &Fence,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let sql = match (self.notifications.emit(), self.transactional) {
            (false, _) => self.fenced_sql().release,
            (true, false) => self.fenced_sql().release_notify,
            (true, true) => self.fenced_sql().release_notify_all,
        };
        self.fenced_pooled("release", fenced_statement(sql, held))
            .await
    }

    /// The fenced completion, announcing the key if any request may wait for it: only when a
    /// waiter marked it, unless `every` (a transactional claim, which no waiter can see to mark).
    pub(super) fn complete_sql(&self, every: bool) -> &'static str {
        let sql = self.fenced_sql();
        match (self.notifications.emit(), every) {
            (false, _) => sql.complete,
            (true, false) => sql.complete_notify,
            (true, true) => sql.complete_notify_all,
        }
    }
}

/// A row completed under the claim's token with the record's status and body: what a retry of
/// that completion would have written.
const COMPLETED_UNDER: &str = "SELECT 1 FROM idempotency.records
     WHERE scope_key = $1 AND token = $2 AND status = $3 AND body IS NOT DISTINCT FROM $4
       AND expires_at > now()";
const COMPLETED_UNDER_PARTITIONED: &str = "SELECT 1 FROM idempotency.partitioned_records
     WHERE scope_key = $1 AND token = $2 AND status = $3 AND body IS NOT DISTINCT FROM $4
       AND expires_at > now()";

pub(super) fn fenced_statement<'a>(sql: &'static str, lease: &'a Fence) -> Statement<'a> {
    Statement::new(sql)
        .with(Param::Key(stored_key(&lease.key)))
        .with(Param::Int(lease.token))
}

pub(super) fn complete_statement<'a>(
    sql: &'static str,
    lease: &'a Fence,
    record: &'a Record,
) -> Statement<'a> {
    let (names, values) = record
        .headers()
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_bytes()))
        .unzip();
    fenced_statement(sql, lease)
        .with(Param::SmallInt(record.status().as_u16() as i16))
        .with(Param::Texts(names))
        .with(Param::BytesList(values))
        .with(Param::OptionalBytes(record.body().map(|b| b.as_ref())))
}
