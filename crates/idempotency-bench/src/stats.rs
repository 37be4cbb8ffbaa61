//! What a closed-loop client records: latencies in a histogram, successes, errors — only inside
//! the measurement [`Window`].

use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;

/// Latencies are recorded in microseconds, from 1 µs to 60 s, to 3 significant figures.
const HIGHEST_MICROS: u64 = 60_000_000;

/// When the measurement runs: load before `start` is warm-up, and no request starts after
/// `end`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    pub(crate) start: Instant,
    pub(crate) end: Instant,
}

impl Window {
    /// A window opening after `warmup` from now and lasting `duration`.
    pub(crate) fn after(warmup: Duration, duration: Duration) -> Self {
        let start = Instant::now() + warmup;
        Self {
            start,
            end: start + duration,
        }
    }

    /// Its length.
    pub(crate) fn duration(&self) -> Duration {
        self.end - self.start
    }
}

/// One client's (or all clients') record of a window.
#[derive(Debug, Clone)]
pub(crate) struct Tally {
    /// Successful requests that started and finished inside the window.
    pub(crate) ok: u64,
    /// Failed requests (transport errors, unexpected answers) inside the window.
    pub(crate) errors: u64,
    /// Latencies of the successful requests, in microseconds.
    pub(crate) latency: Histogram<u64>,
    /// The first failure seen, for the report.
    pub(crate) first_error: Option<String>,
}

impl Tally {
    pub(crate) fn new() -> Self {
        Self {
            ok: 0,
            errors: 0,
            latency: Histogram::new_with_bounds(1, HIGHEST_MICROS, 3)
                .expect("constant histogram bounds are valid"),
            first_error: None,
        }
    }

    /// Records a request sent at `sent` that ended now with `outcome`, if it lies in `window`.
    pub(crate) fn record(&mut self, window: &Window, sent: Instant, outcome: Result<(), String>) {
        let done = Instant::now();
        if sent < window.start || done > window.end {
            return;
        }
        match outcome {
            Ok(()) => {
                self.ok += 1;
                let micros = u64::try_from((done - sent).as_micros()).unwrap_or(u64::MAX);
                self.latency.saturating_record(micros.max(1));
            }
            Err(error) => self.error(error),
        }
    }

    /// Counts a failure that is not tied to a request's timing (a connection that failed).
    pub(crate) fn error(&mut self, error: String) {
        self.errors += 1;
        self.first_error.get_or_insert(error);
    }

    /// Adds `other` into this one.
    pub(crate) fn merge(&mut self, other: Tally) {
        self.ok += other.ok;
        self.errors += other.errors;
        // Both histograms have the same bounds, so adding cannot fail.
        let _ = self.latency.add(&other.latency);
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}
