//! The PostgreSQL store's [`StepLog`]: `idempotency.steps`, each step recorded by one
//! statement fenced by the claim, in the key's generation (see the migrations
//! `20261126000001_steps.sql` and `20261128000001_generations.sql`).

use std::sync::{Arc, atomic::Ordering};

use futures_util::future::BoxFuture;
use sqlx::Row;

use super::{
    PostgresStore, PostgresStoreError,
    statement::{Param, Statement, stored_key},
};
use crate::{
    fingerprint::Fingerprint,
    store::{ClaimStatus, Fence, StepLog, StepLogError, StepRecord},
};

/// Records a step while the claim holds its key, fenced as completing is, by the token alone (a
/// lapsed lease nobody took over still completes, so it still records): the `FOR SHARE` lock
/// orders it against a takeover's `UPDATE`, after which the token no longer matches.
macro_rules! record_step {
    ($table:literal) => {
        concat!(
            "INSERT INTO idempotency.steps
                 (scope_key, fingerprint, name, output, expires_at, generation)
             SELECT $1, $3, $4, $5, r.expires_at, r.generation FROM idempotency.",
            $table,
            " r
             WHERE r.scope_key = $1 AND r.token = $2 AND r.status IS NULL
               AND r.expires_at > now()
             FOR SHARE
             ON CONFLICT (scope_key, name) DO UPDATE SET
                 fingerprint = EXCLUDED.fingerprint, output = EXCLUDED.output,
                 expires_at = EXCLUDED.expires_at, recorded_at = now(),
                 generation = EXCLUDED.generation"
        )
    };
}

const RECORD_STEP: &str = record_step!("records");
const RECORD_STEP_PARTITIONED: &str = record_step!("partitioned_records");

/// Reads the steps of a key's generation `$4` for its holder, and keeps them as long as the
/// holder's record: after a release, a claim with a longer TTL must not lose them to the old
/// claim's expiry. The holder's record lives, so its generation's steps do, whatever their own
/// expiry says; those of generation 0 (written before generations) are judged by it, as they were.
macro_rules! recorded_steps {
    ($table:literal) => {
        concat!(
            "WITH kept AS (
                 UPDATE idempotency.steps s SET expires_at = r.expires_at
                 FROM idempotency.",
            $table,
            " r
                 WHERE s.scope_key = $1 AND s.fingerprint = $2 AND ",
            GENERATION!(),
            " AND s.expires_at < r.expires_at AND r.scope_key = $1 AND r.token = $3
             )
             SELECT name, output FROM idempotency.steps s
             WHERE s.scope_key = $1 AND s.fingerprint = $2 AND ",
            GENERATION!(),
            " ORDER BY s.recorded_at, s.name"
        )
    };
}

/// Whether step `s` is of generation `$4` (and, for generation 0, has not expired).
macro_rules! GENERATION {
    () => {
        "coalesce(s.generation, 0) = $4 AND (s.generation IS NOT NULL OR s.expires_at > now())"
    };
}

const RECORDED_STEPS: &str = recorded_steps!("records");
const RECORDED_STEPS_PARTITIONED: &str = recorded_steps!("partitioned_records");

/// One batch of expired steps, as [`DELETE_EXPIRED`](super::expiry::DELETE_EXPIRED) deletes
/// records: bounded, skipping rows another transaction has locked. Steps expire with their
/// record: never while a record of their generation lives (a takeover's, past their own expiry).
macro_rules! delete_expired_steps {
    ($table:literal) => {
        concat!(
            "DELETE FROM idempotency.steps
             WHERE ctid = ANY(ARRAY(
                 SELECT s.ctid FROM idempotency.steps s
                 WHERE s.expires_at <= now()
                   AND NOT EXISTS (
                       SELECT FROM idempotency.",
            $table,
            " r
                       WHERE r.scope_key = s.scope_key AND r.expires_at > now()
                         AND coalesce(r.generation, 0) = coalesce(s.generation, 0))
                 ORDER BY s.expires_at LIMIT $1 FOR UPDATE SKIP LOCKED
             ))"
        )
    };
}

const DELETE_EXPIRED_STEPS: &str = delete_expired_steps!("records");
const DELETE_EXPIRED_STEPS_PARTITIONED: &str = delete_expired_steps!("partitioned_records");

/// A [`PostgresStore`] as a step log.
struct PgStepLog(PostgresStore);

impl PostgresStore {
    /// This store as a step log, for its capabilities.
    pub(super) fn step_log(&self) -> Arc<dyn StepLog> {
        Arc::new(PgStepLog(self.clone()))
    }

    /// Notes that a handler uses steps: claims of new keys now say whether they have any.
    fn steps_in_use(&self) {
        self.steps_used.store(true, Ordering::Relaxed);
    }

    /// Deletes at most `batch` expired steps; how many.
    pub(super) async fn delete_expired_steps(&self, batch: u32) -> Result<u64, PostgresStoreError> {
        let sql = if self.partitions.is_some() {
            DELETE_EXPIRED_STEPS_PARTITIONED
        } else {
            DELETE_EXPIRED_STEPS
        };
        let statement = Statement::new(sql).with(Param::Int(i64::from(batch)));
        let done = self
            .timed(
                "delete_expired",
                statement.execute(self.prepared, &self.pool),
            )
            .await?;
        Ok(done.rows_affected())
    }

    fn record_step_statement<'a>(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        step: &'a StepRecord,
    ) -> Statement<'a> {
        let sql = if self.partitions.is_some() {
            RECORD_STEP_PARTITIONED
        } else {
            RECORD_STEP
        };
        Statement::new(sql)
            .with(Param::Key(stored_key(&fence.key)))
            .with(Param::Int(fence.token))
            .with(Param::Digest(*fingerprint.as_bytes()))
            .with(Param::Text(&step.name))
            .with(Param::OptionalBytes(Some(&step.output)))
    }
}

impl StepLog for PgStepLog {
    fn recorded(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
    ) -> BoxFuture<'_, Result<Vec<StepRecord>, StepLogError>> {
        let store = &self.0;
        store.steps_in_use();
        let sql = if store.partitions.is_some() {
            RECORDED_STEPS_PARTITIONED
        } else {
            RECORDED_STEPS
        };
        let statement = Statement::new(sql)
            .with(Param::Key(stored_key(&fence.key)))
            .with(Param::Digest(*fingerprint.as_bytes()))
            .with(Param::Int(fence.token))
            .with(Param::Int(fence.generation));
        Box::pin(async move {
            let rows = store
                .timed(
                    "recorded_steps",
                    statement.fetch_all(store.prepared, &store.pool),
                )
                .await?;
            let steps = rows
                .iter()
                .map(|row| {
                    Ok(StepRecord {
                        name: row.try_get("name")?,
                        output: row.try_get::<Vec<u8>, _>("output")?.into(),
                    })
                })
                .collect::<Result<_, sqlx::Error>>()?;
            Ok(steps)
        })
    }

    fn record(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        step: &StepRecord,
    ) -> BoxFuture<'_, Result<ClaimStatus, StepLogError>> {
        let store = &self.0;
        store.steps_in_use();
        let (fence, fingerprint, step) = (*fence, *fingerprint, step.clone());
        Box::pin(async move {
            let statement = store.record_step_statement(&fence, &fingerprint, &step);
            Ok(store.fenced("record_step", statement, &store.pool).await?)
        })
    }

    fn pool(&self) -> Option<&sqlx::PgPool> {
        Some(&self.0.pool)
    }

    fn record_in<'a>(
        &'a self,
        tx: &'a mut sqlx::PgConnection,
        fence: &'a Fence,
        fingerprint: &'a Fingerprint,
        step: &'a StepRecord,
    ) -> BoxFuture<'a, Result<ClaimStatus, StepLogError>> {
        let store = &self.0;
        store.steps_in_use();
        let statement = store.record_step_statement(fence, fingerprint, step);
        Box::pin(async move { Ok(store.fenced("record_step", statement, tx).await?) })
    }
}
