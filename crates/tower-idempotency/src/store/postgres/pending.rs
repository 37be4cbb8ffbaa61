//! The PostgreSQL store's [`PendingLog`]: `idempotency.pending_requests`, each request kept by one
//! statement fenced by the claim, picked by one `UPDATE` over rows locked with `SKIP LOCKED`
//! (see the migration `20261127000001_pending_requests.sql`).

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use sqlx::Row;

use super::{
    PostgresStore, PostgresStoreError,
    statement::{Param, Statement, stored_key},
};
use crate::{
    fingerprint::Fingerprint,
    scope::ScopeKey,
    store::{Abandoned, ClaimStatus, Fence, PendingLog, PendingLogError, PendingPick},
};

/// Keeps a request while the claim holds its key under a live lease, ordered against a
/// takeover by the `FOR SHARE` lock as a step is. A request kept under another fingerprint
/// (the key reused after it expired) starts its attempts again.
macro_rules! keep_request {
    ($table:literal) => {
        concat!(
            "INSERT INTO idempotency.pending_requests
                 (scope_key, scope, fingerprint, request, expires_at)
             SELECT $1, $3, $4, $5, r.expires_at FROM idempotency.",
            $table,
            " r
             WHERE r.scope_key = $1 AND r.token = $2 AND r.status IS NULL
               AND r.lease_until > now() AND r.expires_at > now()
             FOR SHARE
             ON CONFLICT (scope_key) DO UPDATE SET
                 attempts = CASE WHEN pending_requests.fingerprint = EXCLUDED.fingerprint
                            THEN pending_requests.attempts ELSE 0 END,
                 scope = EXCLUDED.scope, fingerprint = EXCLUDED.fingerprint,
                 request = EXCLUDED.request, expires_at = EXCLUDED.expires_at, kept_at = now()"
        )
    };
}

/// Picks abandoned keys and counts an attempt for each in one statement. A key is abandoned
/// when its record is in flight under the kept fingerprint with a lease that lapsed `$3` ago,
/// or when the completer tried it before (`attempts > 0`) and its key is free again. Locked
/// rows are skipped, and a row picked by a statement that committed meanwhile is re-checked
/// against its new `next_attempt_at`, so concurrent picks never share a key.
macro_rules! pick_pending {
    ($table:literal) => {
        concat!(
            "UPDATE idempotency.pending_requests p
             SET attempts = p.attempts + 1, next_attempt_at = now() + $3
             WHERE p.scope_key = ANY(ARRAY(
                 SELECT q.scope_key FROM idempotency.pending_requests q
                 WHERE q.next_attempt_at <= now() AND q.attempts < $2 AND q.expires_at > now()
                   AND (EXISTS (
                           SELECT 1 FROM idempotency.",
            $table,
            " r
                           WHERE r.scope_key = q.scope_key AND r.fingerprint = q.fingerprint
                             AND r.status IS NULL AND r.expires_at > now()
                             AND r.lease_until + $3 <= now())
                        OR (q.attempts > 0 AND NOT EXISTS (
                           SELECT 1 FROM idempotency.",
            $table,
            " r
                           WHERE r.scope_key = q.scope_key AND r.expires_at > now())))
                 ORDER BY q.next_attempt_at
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED
             ))
               AND p.next_attempt_at <= now() AND p.attempts < $2
             RETURNING p.scope, p.fingerprint, p.request, p.attempts"
        )
    };
}

/// Whether a key is completed, deleting its kept request if so. The answer is the record's,
/// not whether a row was deleted: another completer's purge may have deleted it first.
macro_rules! finish_pending {
    ($table:literal) => {
        concat!(
            "WITH done AS (
                 SELECT EXISTS (SELECT 1 FROM idempotency.",
            $table,
            " r
                     WHERE r.scope_key = $1 AND r.status IS NOT NULL AND r.expires_at > now()
                 ) AS completed
             ), gone AS (
                 DELETE FROM idempotency.pending_requests p
                 WHERE p.scope_key = $1 AND (SELECT completed FROM done)
             )
             SELECT completed FROM done"
        )
    };
}

/// One batch of kept requests that are no longer pending: expired, completed, or released by
/// their client's own request before the completer ever tried them.
macro_rules! purge_pending {
    ($table:literal) => {
        concat!(
            "DELETE FROM idempotency.pending_requests
             WHERE ctid = ANY(ARRAY(
                 SELECT q.ctid FROM idempotency.pending_requests q
                 WHERE q.expires_at <= now()
                    OR EXISTS (SELECT 1 FROM idempotency.",
            $table,
            " r WHERE r.scope_key = q.scope_key AND r.status IS NOT NULL
                                 AND r.expires_at > now())
                    OR (q.attempts = 0 AND NOT EXISTS (SELECT 1 FROM idempotency.",
            $table,
            " r WHERE r.scope_key = q.scope_key AND r.expires_at > now()))
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED
             ))"
        )
    };
}

/// Releases claims made to keep their request (`keeps_request`) that never kept it, once their
/// lease lapsed `$2` ago: each fenced by its token, locked with `SKIP LOCKED` (a keep or a
/// takeover under way holds the row) and checked again on its latest version. A waiter that
/// marked the key is woken, as by a release. One row per key released.
macro_rules! release_unkept {
    ($table:literal) => {
        concat!(
            "WITH released AS (
                 DELETE FROM idempotency.",
            $table,
            " r
                 WHERE (r.scope_key, r.token) IN (
                     SELECT q.scope_key, q.token FROM idempotency.",
            $table,
            " q
                     WHERE q.keeps_request AND q.status IS NULL AND q.expires_at > now()
                       AND q.created_at + $2 <= now() AND q.lease_until + $2 <= now()
                       AND NOT EXISTS (
                           SELECT 1 FROM idempotency.pending_requests p
                           WHERE p.scope_key = q.scope_key AND p.fingerprint = q.fingerprint)
                     ORDER BY q.created_at
                     LIMIT $1
                     FOR UPDATE SKIP LOCKED)
                   AND r.keeps_request AND r.status IS NULL AND r.lease_until + $2 <= now()
                 RETURNING r.scope_key, r.waited
             )
             SELECT CASE WHEN waited THEN pg_notify('idempotency_settled', scope_key::text) END
             FROM released"
        )
    };
}

/// The statements of one table: plain or partitioned records.
struct PendingSql {
    keep: &'static str,
    pick: &'static str,
    finish: &'static str,
    purge: &'static str,
    release_unkept: &'static str,
}

const PENDING: PendingSql = PendingSql {
    keep: keep_request!("records"),
    pick: pick_pending!("records"),
    finish: finish_pending!("records"),
    purge: purge_pending!("records"),
    release_unkept: release_unkept!("records"),
};

const PENDING_PARTITIONED: PendingSql = PendingSql {
    keep: keep_request!("partitioned_records"),
    pick: pick_pending!("partitioned_records"),
    finish: finish_pending!("partitioned_records"),
    purge: purge_pending!("partitioned_records"),
    release_unkept: release_unkept!("partitioned_records"),
};

/// A [`PostgresStore`] as a pending log.
struct PgPendingLog(PostgresStore);

impl PostgresStore {
    /// This store as a pending log, for its capabilities.
    pub(super) fn pending_log(&self) -> Arc<dyn PendingLog> {
        Arc::new(PgPendingLog(self.clone()))
    }

    fn pending_sql(&self) -> &'static PendingSql {
        if self.partitions.is_some() {
            &PENDING_PARTITIONED
        } else {
            &PENDING
        }
    }

    /// Deletes at most `batch` kept requests no longer pending; how many.
    pub(super) async fn purge_pending(&self, batch: u32) -> Result<u64, PostgresStoreError> {
        let statement = Statement::new(self.pending_sql().purge).with(Param::Int(i64::from(batch)));
        let done = self
            .timed(
                "purge_pending",
                statement.execute(self.prepared, &self.pool),
            )
            .await?;
        Ok(done.rows_affected())
    }
}

impl PendingLog for PgPendingLog {
    fn keep(
        &self,
        fence: &Fence,
        fingerprint: &Fingerprint,
        request: Bytes,
    ) -> BoxFuture<'_, Result<ClaimStatus, PendingLogError>> {
        let store = &self.0;
        let (fence, fingerprint) = (*fence, *fingerprint);
        Box::pin(async move {
            let statement = Statement::new(store.pending_sql().keep)
                .with(Param::Key(stored_key(&fence.key)))
                .with(Param::Int(fence.token))
                .with(Param::Digest(*fence.key.as_bytes()))
                .with(Param::Digest(*fingerprint.as_bytes()))
                .with(Param::OptionalBytes(Some(&request)));
            Ok(store.fenced("keep_request", statement, &store.pool).await?)
        })
    }

    fn pick(&self, pick: PendingPick) -> BoxFuture<'_, Result<Vec<Abandoned>, PendingLogError>> {
        let store = &self.0;
        let statement = Statement::new(store.pending_sql().pick)
            .with(Param::Int(i64::from(pick.limit)))
            .with(Param::Int(i64::from(pick.max_attempts)))
            .with(Param::Interval(pick.grace));
        Box::pin(async move {
            let rows = store
                .timed(
                    "pick_pending",
                    statement.fetch_all(store.prepared, &store.pool),
                )
                .await?;
            let picked = rows
                .iter()
                .map(abandoned)
                .collect::<Result<_, PostgresStoreError>>()?;
            Ok(picked)
        })
    }

    fn finish(&self, key: &ScopeKey) -> BoxFuture<'_, Result<bool, PendingLogError>> {
        let store = &self.0;
        let statement =
            Statement::new(store.pending_sql().finish).with(Param::Key(stored_key(key)));
        Box::pin(async move {
            let row = store
                .timed(
                    "finish_pending",
                    statement.fetch_optional(store.prepared, &store.pool),
                )
                .await?
                .ok_or_else(|| PostgresStoreError::Corrupt("finishing returned no row".into()))?;
            Ok(row.try_get::<bool, _>("completed")?)
        })
    }

    fn purge(&self, batch: u32) -> BoxFuture<'_, Result<u64, PendingLogError>> {
        Box::pin(async move { Ok(self.0.purge_pending(batch).await?) })
    }

    fn release_unkept(
        &self,
        limit: u32,
        grace: Duration,
    ) -> BoxFuture<'_, Result<u64, PendingLogError>> {
        let store = &self.0;
        let statement = Statement::new(store.pending_sql().release_unkept)
            .with(Param::Int(i64::from(limit)))
            .with(Param::Interval(grace));
        Box::pin(async move {
            let done = store
                .timed(
                    "release_unkept",
                    statement.execute(store.prepared, &store.pool),
                )
                .await?;
            Ok(done.rows_affected())
        })
    }
}

/// A picked row as the completer takes it.
fn abandoned(row: &sqlx::postgres::PgRow) -> Result<Abandoned, PostgresStoreError> {
    let scope: Vec<u8> = row.try_get("scope")?;
    let scope: [u8; 32] = scope.try_into().map_err(|_| {
        PostgresStoreError::Corrupt("a kept request's scope is not 32 bytes".into())
    })?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
    let fingerprint: [u8; 32] = fingerprint.try_into().map_err(|_| {
        PostgresStoreError::Corrupt("a kept request's fingerprint is not 32 bytes".into())
    })?;
    let attempts: i32 = row.try_get("attempts")?;
    Ok(Abandoned {
        key: ScopeKey::from_bytes(scope),
        fingerprint: Fingerprint::from_bytes(fingerprint),
        request: Bytes::from(row.try_get::<Vec<u8>, _>("request")?),
        attempt: u32::try_from(attempts).unwrap_or(0),
    })
}
