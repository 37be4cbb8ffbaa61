//! What PostgreSQL promises of a record it acknowledged: whether a failover to a standby keeps
//! it ([`DurabilityReport`]), read at start-up and while claims go on, and what the store
//! requires of it ([`Durability`]).

use std::{
    fmt,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU8, Ordering},
    },
    time::{Duration, Instant},
};

use sqlx::Row;

use super::{PostgresStore, PostgresStoreError};
use crate::metrics;

/// What a [`PostgresStore`] requires of the cluster before it claims a key; set with
/// [`with_durability`](PostgresStore::with_durability). See the
/// [operating guide](crate::guide::operating#high-availability).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// Whatever the server promises (the default): read and reported, never refused.
    #[default]
    Reported,
    /// Every acknowledged record is on a synchronous standby as well, so a failover keeps it:
    /// [`migrate`](PostgresStore::migrate) fails, and claims are refused (the layer's `503`),
    /// while the server does not promise it.
    SynchronousStandby,
}

/// The settings that decide whether an acknowledged record survives a failover, as the
/// store's own session reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DurabilityReport {
    /// `pg_is_in_recovery()`: the server is a standby, and takes no writes.
    pub in_recovery: bool,
    /// `synchronous_commit`.
    pub synchronous_commit: String,
    /// `synchronous_standby_names` (Patroni's synchronous mode sets and clears it).
    pub synchronous_standby_names: String,
}

impl DurabilityReport {
    /// Whether a commit acknowledged now is on a synchronous standby too: a writable server
    /// that names synchronous standbys and waits for them at commit.
    pub fn survives_failover(&self) -> bool {
        !self.in_recovery
            && !self.synchronous_standby_names.trim().is_empty()
            && matches!(
                self.synchronous_commit.as_str(),
                "on" | "remote_write" | "remote_apply"
            )
    }
}

impl fmt::Display for DurabilityReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "in recovery: {}, synchronous_commit: {}, synchronous_standby_names: '{}'",
            self.in_recovery, self.synchronous_commit, self.synchronous_standby_names
        )
    }
}

const READ: &str = "SELECT pg_is_in_recovery() AS in_recovery,
        current_setting('synchronous_commit') AS synchronous_commit,
        current_setting('synchronous_standby_names') AS synchronous_standby_names";

/// How stale the store's reading may grow while claims go on before it reads again.
const REREAD_AFTER: Duration = Duration::from_secs(1);

const UNKNOWN: u8 = 0;
const PROMISED: u8 = 1;
const NOT_PROMISED: u8 = 2;

/// The store's last reading, shared by its clones.
#[derive(Debug, Default)]
pub(super) struct DurabilityWatch {
    state: AtomicU8,
    last: Mutex<Option<(Instant, DurabilityReport)>>,
    reading: AtomicBool,
}

impl DurabilityWatch {
    /// Notes a reading; warns when the promise changed since the last.
    fn note(&self, report: &DurabilityReport) {
        let survives = report.survives_failover();
        let state = if survives { PROMISED } else { NOT_PROMISED };
        let before = self.state.swap(state, Ordering::Relaxed);
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now(), report.clone()));
        metrics::survives_failover(survives);
        if before != UNKNOWN && before != state {
            tracing::warn!(%report, survives, "PostgreSQL's durability promise changed");
        }
    }

    fn stale(&self) -> bool {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.as_ref()
            .is_none_or(|(at, _)| at.elapsed() >= REREAD_AFTER)
    }

    /// The last reading, for a refusal.
    fn last(&self) -> Option<DurabilityReport> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.as_ref().map(|(_, report)| report.clone())
    }
}

impl PostgresStore {
    /// Requires `durability` of the cluster (default [`Durability::Reported`]).
    #[must_use]
    pub fn with_durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Reads what the server promises of a record it acknowledges now, reports it (a log line
    /// and the `idempotency_store_survives_failover` gauge) and returns it.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub async fn durability(&self) -> Result<DurabilityReport, PostgresStoreError> {
        let row = self
            .timed("durability", sqlx::query(READ).fetch_one(&self.pool))
            .await?;
        let report = DurabilityReport {
            in_recovery: row.try_get("in_recovery")?,
            synchronous_commit: row.try_get("synchronous_commit")?,
            synchronous_standby_names: row.try_get("synchronous_standby_names")?,
        };
        self.durability_watch.note(&report);
        Ok(report)
    }

    /// At start-up: reports the server's promise, and fails when the store requires one the
    /// server does not make.
    pub(super) async fn check_durability(&self) -> Result<(), PostgresStoreError> {
        let report = self.durability().await?;
        let survives = report.survives_failover();
        tracing::info!(%report, survives_failover = survives, "PostgreSQL durability");
        match self.durability {
            Durability::SynchronousStandby if !survives => {
                Err(PostgresStoreError::NotDurable(report))
            }
            _ => Ok(()),
        }
    }

    /// Before a claim: `Err` while the store requires a promise the server did not make when
    /// last read. Reads again, beside the claims, once the reading is a second old.
    pub(super) async fn durable_enough(&self) -> Result<(), PostgresStoreError> {
        let watch = &self.durability_watch;
        match watch.state.load(Ordering::Relaxed) {
            UNKNOWN => {
                self.durability().await?;
            }
            _ if watch.stale() && !watch.reading.swap(true, Ordering::AcqRel) => {
                let store = self.clone();
                tokio::spawn(async move {
                    if let Err(error) = store.durability().await {
                        tracing::warn!(%error, "reading PostgreSQL's durability failed");
                    }
                    store
                        .durability_watch
                        .reading
                        .store(false, Ordering::Release);
                });
            }
            _ => {}
        }
        match watch.last() {
            Some(report) if !report.survives_failover() => {
                Err(PostgresStoreError::NotDurable(report))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(recovery: bool, commit: &str, names: &str) -> DurabilityReport {
        DurabilityReport {
            in_recovery: recovery,
            synchronous_commit: commit.into(),
            synchronous_standby_names: names.into(),
        }
    }

    #[test]
    fn only_a_writable_server_waiting_for_a_named_standby_promises() {
        assert!(report(false, "on", "*").survives_failover());
        assert!(report(false, "remote_apply", "\"node2\"").survives_failover());
        assert!(!report(false, "on", "").survives_failover(), "asynchronous");
        assert!(!report(false, "local", "*").survives_failover());
        assert!(!report(false, "off", "*").survives_failover());
        assert!(!report(true, "on", "*").survives_failover(), "a standby");
    }
}
