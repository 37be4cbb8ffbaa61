//! Claiming a key: the one-key statement in either mode, and reading its answer.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use sqlx::{Row, postgres::PgRow, types::Uuid};

use super::{
    PgClaim, PostgresStore, PostgresStoreError,
    attempt::{ClaimAttempt, new_claimant},
    group_commit::{Batched, claim_new_keys},
    sql::{
        CLAIM_LEASE, CLAIM_LEASE_STEPS, CLAIM_LEASE_WAITING, CLAIM_PARTITIONED, CLAIM_TRANSACTIONAL,
    },
    statement::{Param, Statement, stored_key},
    transaction::{Fallback, TxClaim, TxSlot},
};
use crate::{
    record::Record,
    store::{ClaimRequest, Fence, KeyState, Store},
};

/// How many times `claim` runs its statement when a racing commit hides the conflicting row.
pub(super) const CLAIM_ATTEMPTS: usize = 5;

impl PostgresStore {
    /// The claim statement of this store's mode, for the attempt `claimant`.
    pub(super) fn claim_statement(
        &self,
        request: &ClaimRequest,
        claimant: Uuid,
    ) -> Statement<'static> {
        let sql = match (self.partitions.is_some(), self.transactional) {
            (true, _) => CLAIM_PARTITIONED,
            (false, true) => CLAIM_TRANSACTIONAL,
            (false, false) if self.marks(request) => CLAIM_LEASE_WAITING,
            (false, false) if self.uses_steps() => CLAIM_LEASE_STEPS,
            (false, false) => CLAIM_LEASE,
        };
        let statement = Statement::new(sql)
            .with(Param::Key(stored_key(&request.key)))
            .with(Param::Digest(*request.fingerprint.as_bytes()))
            .with(Param::Interval(request.lease))
            .with(Param::Interval(request.ttl))
            .with(Param::Key(claimant));
        match (self.partitions.is_some(), self.transactional) {
            (true, try_lock) => statement
                .with(Param::Bool(try_lock))
                .with(Param::Bool(self.uses_steps()))
                .with(Param::Bool(request.keeps_request)),
            (false, true) => statement.with(Param::Int(advisory_lock_key(request))),
            (false, false) => statement.with(Param::Bool(request.keeps_request)),
        }
    }

    /// A claim that commits on its own (lease mode, and partitioned lease mode). Its caller may
    /// never read the answer (a timeout, a lost connection, a cancelled request); the attempt's
    /// [`ClaimAttempt`] then releases whatever it claimed.
    pub(super) async fn claim_lease(
        &self,
        request: &ClaimRequest,
    ) -> Result<KeyState<PgClaim>, PostgresStoreError> {
        let mut attempt = ClaimAttempt::new(self, request.key);
        // A waiter's key has a row: the batch of new keys would only cost it a round trip.
        if self.batches() && !request.waiting {
            let (pool, timeout, steps) = (self.pool.clone(), self.timeout, self.uses_steps());
            let store = self.clone();
            let claimed = tokio::time::timeout(
                self.timeout,
                self.new_claims.run(
                    (request.clone(), attempt.claimant),
                    move |writer, batch| claim_new_keys(pool.clone(), timeout, steps, writer, batch),
                    // Claimed for a request that stopped waiting (it timed out, or was
                    // cancelled): free the key now rather than when its lease lapses.
                    move |claimed| {
                        if let Batched::Done(Some(claimed)) = claimed {
                            let store = store.clone();
                            tokio::spawn(async move {
                                let claim = PgClaim::lease(claimed.fence, false);
                                if let Err(error) = store.release(&claim).await {
                                    tracing::warn!(%error, "releasing an abandoned claim failed; it frees itself when its lease lapses");
                                }
                            });
                        }
                    },
                ),
            )
            .await;
            match claimed {
                Ok(Some(Batched::Done(Some(claimed)))) => {
                    attempt.settle();
                    return Ok(KeyState::Acquired {
                        claim: PgClaim::lease(claimed.fence, claimed.stepless),
                        takeover: false,
                    });
                }
                Ok(Some(Batched::TimedOut)) | Err(_) => return Err(self.timeout_error("claim")),
                // The key has a row (or the batch could not say whether it wrote ours): the
                // one-key statement decides, and finds our row if the batch did write it.
                Ok(Some(Batched::Done(None) | Batched::Alone) | None) => {}
            }
        }
        for tries_left in (0..CLAIM_ATTEMPTS).rev() {
            let statement = self.claim_statement(request, attempt.claimant);
            if let Some(row) = attempt.run(statement).await? {
                let state = decode_claim(request, &row)?;
                // Settled unannounced since the read: read it again rather than wait for news.
                if tries_left > 0 && !self.waiter_marked(request, &state, &row).await? {
                    continue;
                }
                attempt.settle();
                let stepless = self.stepless(&row)?;
                return Ok(state.map_claim(|fence| PgClaim::lease(fence, stepless)));
            }
        }
        // No row in any try: nothing was claimed.
        attempt.settle();
        Err(PostgresStoreError::Contended)
    }

    /// Whether the claim statement's answer `row` says its key had no steps: only the plain
    /// table's statement says (partitioned mode's reads them).
    fn stepless(&self, row: &PgRow) -> Result<bool, PostgresStoreError> {
        if self.partitions.is_some() {
            return Ok(false);
        }
        Ok(row.try_get::<Option<bool>, _>("stepless")?.unwrap_or(false))
    }

    /// Whether `request` is a waiter whose key this store marks (see [`ClaimRequest::waiting`]):
    /// in lease mode, when settlements are announced. Transactional mode announces every key.
    pub(super) fn marks(&self, request: &ClaimRequest) -> bool {
        request.waiting && !self.transactional && self.notifications.emit()
    }

    /// Whether the claim a waiter found in flight is marked as waited for, so that its settlement
    /// wakes the waiter; `true` for every other answer. The plain table's claim statement marks
    /// it and says so; partitioned mode's marks it with a statement of its own.
    async fn waiter_marked(
        &self,
        request: &ClaimRequest,
        state: &KeyState<Fence>,
        row: &PgRow,
    ) -> Result<bool, PostgresStoreError> {
        if !self.marks(request) || !matches!(state, KeyState::InFlight { .. }) {
            return Ok(true);
        }
        if self.partitions.is_none() {
            return Ok(row.try_get::<Option<bool>, _>("marked")?.unwrap_or(false));
        }
        // A failed mark leaves the waiter to its periodic read, as a lost announcement would.
        Ok(self
            .mark_key_waited(&request.key)
            .await
            .unwrap_or_else(|error| {
                tracing::debug!(%error, "could not mark a key as waited for");
                true
            }))
    }

    pub(super) async fn claim_transactional(
        &self,
        request: &ClaimRequest,
    ) -> Result<KeyState<PgClaim>, PostgresStoreError> {
        let mut tx = self
            .timed(
                "claim",
                self.pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED"),
            )
            .await?;
        for _ in 0..CLAIM_ATTEMPTS {
            let row = self
                .timed(
                    "claim",
                    self.claim_statement(request, new_claimant())
                        .fetch_optional(self.prepared, &mut *tx),
                )
                .await?;
            let Some(row) = row else { continue };
            return match decode_claim(request, &row)? {
                KeyState::Acquired {
                    claim: fence,
                    takeover,
                } => Ok(KeyState::Acquired {
                    claim: PgClaim {
                        fence,
                        tx: Some(Box::new(TxClaim {
                            slot: Arc::new(TxSlot::new(tx)),
                            request: request.clone(),
                            fallback: std::sync::Mutex::new(Fallback::None),
                        })),
                        stepless: false,
                    },
                    takeover,
                }),
                other => {
                    let other = other.map_claim(|fence| PgClaim::lease(fence, false));
                    // Nothing was written; end the transaction (and its lock attempt) now.
                    self.timed("claim", tx.rollback()).await?;
                    Ok(other)
                }
            };
        }
        Err(PostgresStoreError::Contended)
    }
}

/// The advisory lock of a key in transactional mode: the first 64 bits of its hash. Two keys
/// sharing them (a chance of 2⁻⁶⁴ per pair) only make one of them wait its turn with a `409`.
pub(super) fn advisory_lock_key(request: &ClaimRequest) -> i64 {
    let mut prefix = [0; 8];
    prefix.copy_from_slice(&request.key.as_bytes()[..8]);
    i64::from_be_bytes(prefix)
}

pub(super) fn decode_claim(
    request: &ClaimRequest,
    row: &PgRow,
) -> Result<KeyState<Fence>, PostgresStoreError> {
    let fence = || -> Result<Fence, PostgresStoreError> {
        Ok(Fence {
            key: request.key,
            token: row.try_get("token")?,
            // Rows written before generations were stored are of generation 0.
            generation: row.try_get::<Option<i64>, _>("generation")?.unwrap_or(0),
        })
    };
    match row.try_get::<&str, _>("outcome")? {
        "acquired" => {
            return Ok(KeyState::Acquired {
                claim: fence()?,
                takeover: row.try_get("takeover")?,
            });
        }
        "busy" => {
            return Ok(KeyState::InFlight {
                lease_remaining: None,
            });
        }
        _ => {}
    }
    if !row.try_get::<bool, _>("same_fingerprint")? {
        return Ok(KeyState::Mismatch);
    }
    // In flight under this attempt's own claimant: claimed by an earlier try whose answer was
    // lost (a batch that failed after it committed).
    if row.try_get::<Option<bool>, _>("mine")? == Some(true) {
        return Ok(KeyState::Acquired {
            claim: fence()?,
            takeover: row.try_get("takeover")?,
        });
    }
    let Some(status) = row.try_get::<Option<i16>, _>("status")? else {
        let remaining: Option<f64> = row.try_get("lease_remaining")?;
        return Ok(KeyState::InFlight {
            lease_remaining: remaining.and_then(|s| Duration::try_from_secs_f64(s).ok()),
        });
    };
    let status = u16::try_from(status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| PostgresStoreError::Corrupt(format!("status {status}")))?;
    let names: Vec<String> = row.try_get("header_names")?;
    let values: Vec<Vec<u8>> = row.try_get("header_values")?;
    if names.len() != values.len() {
        return Err(PostgresStoreError::Corrupt(
            "header names and values differ in length".to_owned(),
        ));
    }
    let mut headers = HeaderMap::with_capacity(names.len());
    for (name, value) in names.into_iter().zip(values) {
        let name = HeaderName::try_from(name)
            .map_err(|e| PostgresStoreError::Corrupt(format!("header name: {e}")))?;
        let value = HeaderValue::try_from(value)
            .map_err(|e| PostgresStoreError::Corrupt(format!("header value: {e}")))?;
        headers.append(name, value);
    }
    let body: Option<Vec<u8>> = row.try_get("body")?;
    let expires_in: Option<f64> = row.try_get("expires_in")?;
    Ok(KeyState::Completed {
        record: Record::from_parts(status, headers, body.map(Bytes::from)),
        expires_in: expires_in.and_then(|s| Duration::try_from_secs_f64(s).ok()),
    })
}
