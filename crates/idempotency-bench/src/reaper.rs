//! The expiry loop of the expiry scenarios, timed: `continuously_delete_expired` from the crate,
//! run in the server process on the server's own pool (as an application runs it), over a store
//! wrapper that times every `delete_expired` call — the only way to see each reaping
//! statement's duration from outside without `pg_stat_statements` or statement logging.
//!
//! The server starts the loop when the benchmark writes `reap` on its stdin (when the
//! measurement window opens), prints `drained <json>` on stdout when a call first comes back
//! with less than a full batch (the backlog is gone), and `reaper <json>` when it exits.

use std::{
    io::Write as _,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tower_idempotency::{
    Record,
    store::{Capabilities, ClaimRequest, ClaimStatus, ExpiredDeletion, KeyState, Store},
};

/// The prefix of the line a server prints when the backlog is gone.
pub(crate) const DRAINED: &str = "drained";
/// The prefix of the line a server prints on exit, with the whole loop's statistics.
pub(crate) const FINAL: &str = "reaper";

/// What the expiry loop did, as the server reports it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ReaperReport {
    /// The batch size given to `continuously_delete_expired`.
    pub(crate) batch: u32,
    /// `delete_expired` calls, and how many of them deleted something.
    pub(crate) calls: u64,
    pub(crate) calls_deleting: u64,
    /// Records deleted.
    pub(crate) rows: u64,
    /// The most records one call deleted.
    pub(crate) max_rows_per_call: u64,
    /// Time spent inside `delete_expired`, in all, and per call until the backlog was drained
    /// (the draining call included): median, 99th percentile and maximum, in microseconds.
    pub(crate) busy_us: u64,
    pub(crate) call_p50_us: u64,
    pub(crate) call_p99_us: u64,
    pub(crate) call_max_us: u64,
    /// The median call of the first and of the last tenth of those calls: whether calls slow
    /// down as the backlog is worked through.
    pub(crate) first_tenth_p50_us: u64,
    pub(crate) last_tenth_p50_us: u64,
    /// From the start of the loop to the end of the first call that found less than a batch:
    /// how long draining the backlog took.
    pub(crate) drained_after_us: Option<u64>,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
}

impl ReaperReport {
    /// Rows per second of draining.
    pub(crate) fn rows_per_sec(&self) -> Option<f64> {
        let drained = self.drained_after_us?;
        (drained > 0).then(|| self.rows as f64 / (drained as f64 / 1e6))
    }
}

/// Statistics shared between the timed store and the server's exit path.
#[derive(Debug)]
pub(crate) struct ReaperStats {
    batch: u32,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    started: Option<Instant>,
    calls: u64,
    rows: u64,
    max_rows: u64,
    busy: Duration,
    /// Durations of the calls until the backlog was drained, in microseconds, in order.
    durations: Vec<u64>,
    /// Calls that deleted something.
    deleting: u64,
    drained_after: Option<Duration>,
    errors: u64,
    first_error: Option<String>,
}

impl ReaperStats {
    pub(crate) fn new(batch: u32) -> Arc<Self> {
        Arc::new(Self {
            batch,
            inner: Mutex::new(Inner::default()),
        })
    }

    /// Marks the start of the loop.
    pub(crate) fn start(&self) {
        self.lock().started = Some(Instant::now());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records one call; returns the report if this call drained the backlog.
    fn record(&self, took: Duration, outcome: Result<u64, String>) -> Option<ReaperReport> {
        let mut inner = self.lock();
        inner.calls += 1;
        inner.busy += took;
        match outcome {
            Ok(rows) => {
                inner.rows += rows;
                inner.max_rows = inner.max_rows.max(rows);
                if rows > 0 {
                    inner.deleting += 1;
                }
                if inner.drained_after.is_none() {
                    inner
                        .durations
                        .push(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
                }
                if rows < u64::from(self.batch) && inner.drained_after.is_none() {
                    let started = inner.started.unwrap_or_else(Instant::now);
                    inner.drained_after = Some(started.elapsed());
                    drop(inner);
                    return Some(self.report());
                }
            }
            Err(error) => {
                inner.errors += 1;
                inner.first_error.get_or_insert(error);
            }
        }
        None
    }

    /// Everything so far.
    pub(crate) fn report(&self) -> ReaperReport {
        let inner = self.lock();
        let tenth = inner.durations.len().div_ceil(10);
        let first = median_of(&inner.durations[..tenth]);
        let last = median_of(&inner.durations[inner.durations.len() - tenth..]);
        let mut sorted = inner.durations.clone();
        sorted.sort_unstable();
        let quantile = |q: f64| {
            if sorted.is_empty() {
                return 0;
            }
            let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
            sorted[rank - 1]
        };
        ReaperReport {
            batch: self.batch,
            calls: inner.calls,
            calls_deleting: inner.deleting,
            rows: inner.rows,
            max_rows_per_call: inner.max_rows,
            busy_us: u64::try_from(inner.busy.as_micros()).unwrap_or(u64::MAX),
            call_p50_us: quantile(0.5),
            call_p99_us: quantile(0.99),
            call_max_us: sorted.last().copied().unwrap_or(0),
            first_tenth_p50_us: first,
            last_tenth_p50_us: last,
            drained_after_us: inner
                .drained_after
                .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
            errors: inner.errors,
            first_error: inner.first_error.clone(),
        }
    }

    /// Prints `<prefix> <json>` on stdout, for the benchmark.
    pub(crate) fn print(prefix: &str, report: &ReaperReport) {
        let json = serde_json::to_string(report).unwrap_or_else(|_| "{}".to_owned());
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{prefix} {json}");
        let _ = stdout.flush();
    }
}

/// The median of `values` (the lower middle one), 0 for none.
fn median_of(values: &[u64]) -> u64 {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted
        .get(sorted.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(0)
}

/// A store whose `delete_expired` calls are timed into [`ReaperStats`]; everything else is the
/// inner store's.
pub(crate) struct TimedReaper<S> {
    pub(crate) inner: S,
    pub(crate) stats: Arc<ReaperStats>,
}

impl<S: Store> Store for TimedReaper<S> {
    type Claim = S::Claim;
    type Error = S::Error;

    fn claim(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<KeyState<Self::Claim>, Self::Error>> + Send {
        self.inner.claim(request)
    }

    fn renew(
        &self,
        claim: &Self::Claim,
        lease: Duration,
    ) -> impl Future<Output = Result<ClaimStatus, Self::Error>> + Send {
        self.inner.renew(claim, lease)
    }

    fn complete(
        &self,
        claim: &Self::Claim,
        record: &Record,
    ) -> impl Future<Output = Result<ClaimStatus, Self::Error>> + Send {
        self.inner.complete(claim, record)
    }

    fn release(
        &self,
        claim: &Self::Claim,
    ) -> impl Future<Output = Result<ClaimStatus, Self::Error>> + Send {
        self.inner.release(claim)
    }

    fn abandon(
        &self,
        claim: &Self::Claim,
    ) -> impl Future<Output = Result<ClaimStatus, Self::Error>> + Send {
        self.inner.abandon(claim)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

impl<S: ExpiredDeletion> ExpiredDeletion for TimedReaper<S> {
    async fn delete_expired(&self, batch: u32) -> Result<u64, S::Error> {
        let started = Instant::now();
        let result = self.inner.delete_expired(batch).await;
        let outcome = match &result {
            Ok(rows) => Ok(*rows),
            Err(error) => Err(error.to_string()),
        };
        if let Some(report) = self.stats.record(started.elapsed(), outcome) {
            ReaperStats::print(DRAINED, &report);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drains_once_and_reports_quantiles() {
        let stats = ReaperStats::new(10);
        stats.start();
        for ms in 1..=100 {
            assert!(stats.record(Duration::from_millis(ms), Ok(10)).is_none());
        }
        let drained = stats.record(Duration::from_millis(101), Ok(3)).unwrap();
        assert_eq!(drained.rows, 1003);
        assert_eq!(drained.max_rows_per_call, 10);
        assert_eq!(drained.call_p50_us, 51_000);
        assert_eq!(drained.call_p99_us, 100_000);
        assert_eq!(drained.call_max_us, 101_000);
        assert_eq!(drained.first_tenth_p50_us, 6_000);
        assert_eq!(drained.last_tenth_p50_us, 96_000);
        assert!(drained.drained_after_us.is_some());
        assert!(stats.record(Duration::from_millis(1), Ok(0)).is_none());
        assert_eq!(stats.report().calls, 102);
    }
}
