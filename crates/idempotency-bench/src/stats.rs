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
    /// Every successful request, when traced: when it was sent (µs after the window opened)
    /// and how long it took (µs), so that parts of the window can be looked at apart.
    trace: Option<Vec<(u32, u32)>>,
}

impl Tally {
    pub(crate) fn new() -> Self {
        Self {
            ok: 0,
            errors: 0,
            latency: Histogram::new_with_bounds(1, HIGHEST_MICROS, 3)
                .expect("constant histogram bounds are valid"),
            first_error: None,
            trace: None,
        }
    }

    /// A tally that also keeps every request's time, for [`within`](Self::within).
    pub(crate) fn traced() -> Self {
        Self {
            trace: Some(Vec::new()),
            ..Self::new()
        }
    }

    /// The successful requests of a traced tally sent at least `from` after the window opened
    /// and done by `to` (errors are not traced: all of them are kept).
    pub(crate) fn within(&self, from: Duration, to: Duration) -> Self {
        let mut part = Self::new();
        part.errors = self.errors;
        part.first_error.clone_from(&self.first_error);
        let (from, to) = (from.as_micros(), to.as_micros());
        for &(sent, took) in self.trace.as_deref().unwrap_or_default() {
            let (sent, took) = (u128::from(sent), u128::from(took));
            if sent >= from && sent + took <= to {
                part.ok += 1;
                part.latency.saturating_record(took as u64);
            }
        }
        part
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
                if let Some(trace) = &mut self.trace {
                    let offset = (sent - window.start).as_micros();
                    trace.push((
                        u32::try_from(offset).unwrap_or(u32::MAX),
                        u32::try_from(micros.max(1)).unwrap_or(u32::MAX),
                    ));
                }
            }
            Err(error) => self.error(error),
        }
    }

    /// Records a successful request that took `took`, outside any window (the storms time
    /// every request they send).
    pub(crate) fn record_latency(&mut self, took: Duration) {
        self.ok += 1;
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.latency.saturating_record(micros.max(1));
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
        if let (Some(trace), Some(other)) = (&mut self.trace, other.trace) {
            trace.extend(other);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traced_tallies_split_by_time() {
        let now = Instant::now();
        let window = Window {
            start: now - Duration::from_secs(5),
            end: now + Duration::from_secs(5),
        };
        let mut tally = Tally::traced();
        // Sent 0.1 s into the window, 4.9 s long; sent 4.99 s in, 10 ms long.
        tally.record(&window, now - Duration::from_millis(4_900), Ok(()));
        tally.record(&window, now - Duration::from_millis(10), Ok(()));
        tally.error("one failure".to_owned());
        assert_eq!(tally.ok, 2);
        let secs = Duration::from_secs;
        assert_eq!(tally.within(Duration::ZERO, secs(6)).ok, 2);
        let late = tally.within(secs(1), secs(6));
        assert_eq!(late.ok, 1, "the first was sent before 1 s");
        assert_eq!(late.errors, 1);
        assert!(late.latency.max() < 1_000_000);
        assert_eq!(
            tally.within(Duration::ZERO, secs(4)).ok,
            0,
            "none done by 4 s"
        );
        assert_eq!(Tally::new().within(Duration::ZERO, secs(60)).ok, 0);
    }
}
