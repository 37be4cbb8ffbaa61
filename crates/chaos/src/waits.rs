//! How the duplicates' waits for their keys in flight ended, counted across the instances.
//!
//! The layer counts each end of a wait in the metric [`IN_FLIGHT_WAITS`], by `result`. An instance
//! ([`install`], in `chaos serve`) logs each increment as a line, [`ENDED`] and the result, at
//! once, so that the count outlives a `SIGKILL`; the run counts those lines ([`WaitCounts`]).
//! A line per increment is what no exporter does: they keep totals to be scraped.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use tower_idempotency::metrics::IN_FLIGHT_WAITS;

/// The message of an instance's line for one wait that ended.
pub(crate) const ENDED: &str = "in-flight wait ended";

/// Installs the recorder of this process (an instance): a line per wait that ends, and nothing
/// for the other metrics.
pub(crate) fn install() {
    if metrics::set_global_recorder(WaitLog).is_err() {
        tracing::warn!("a metrics recorder is already installed: waits are not counted");
    }
}

struct WaitLog;

impl Recorder for WaitLog {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() != IN_FLIGHT_WAITS {
            return Counter::noop();
        }
        let result = key
            .labels()
            .find(|label| label.key() == "result")
            .map_or_else(String::new, |label| label.value().to_owned());
        Counter::from_arc(Arc::new(Ended(result)))
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// One wait's result, logged at each increment.
struct Ended(String);

impl CounterFn for Ended {
    fn increment(&self, value: u64) {
        for _ in 0..value {
            tracing::info!(result = %self.0, "{ENDED}");
        }
    }

    fn absolute(&self, _: u64) {}
}

/// The waits that ended, by result, as the instances logged them.
#[derive(Debug, Default)]
pub(crate) struct WaitCounts {
    /// The key completed: its response replayed.
    pub(crate) replayed: AtomicU64,
    /// The key was released (the holder rolled back or died): the duplicate claimed it and ran.
    pub(crate) acquired: AtomicU64,
    /// Still in flight when the wait was over: `409`.
    pub(crate) timed_out: AtomicU64,
    /// Too many waited already: `409` at once.
    pub(crate) full: AtomicU64,
    /// The client left while its duplicate waited: it stopped, holding nothing.
    pub(crate) hung_up: AtomicU64,
    /// A read while waiting failed: `409` (the key was last seen in flight).
    pub(crate) store_error: AtomicU64,
    /// Any other result (a mismatch, or one this run does not know).
    pub(crate) other: AtomicU64,
}

impl WaitCounts {
    /// Counts `line` if it is an instance's [`ENDED`] line.
    pub(crate) fn ingest(&self, line: &str) {
        let Some((_, rest)) = line.split_once(ENDED) else {
            return;
        };
        let result = rest.split_once("result=").map_or("", |(_, value)| {
            value.split_whitespace().next().unwrap_or("")
        });
        let counter = match result {
            "replayed" => &self.replayed,
            "acquired" => &self.acquired,
            "timed_out" => &self.timed_out,
            "full" => &self.full,
            "hung_up" => &self.hung_up,
            "store_error" => &self.store_error,
            _ => &self.other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Every wait that ended.
    pub(crate) fn total(&self) -> u64 {
        [
            &self.replayed,
            &self.acquired,
            &self.timed_out,
            &self.full,
            &self.hung_up,
            &self.store_error,
            &self.other,
        ]
        .iter()
        .map(|counter| counter.load(Ordering::Relaxed))
        .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines an instance's tracing subscriber writes are counted by their result; other
    /// lines are not.
    #[test]
    fn an_instances_lines_are_counted_by_result() {
        let counts = WaitCounts::default();
        for line in [
            "2026-11-26T15:00:00.000001Z  INFO chaos::waits: in-flight wait ended result=hung_up",
            "2026-11-26T15:00:00.000002Z  INFO chaos::waits: in-flight wait ended result=replayed",
            "2026-11-26T15:00:00.000003Z  INFO chaos::waits: in-flight wait ended result=hung_up",
            "2026-11-26T15:00:00.000004Z  INFO chaos::waits: in-flight wait ended result=mismatch",
            "2026-11-26T15:00:00.000005Z  WARN tower_idempotency: reading a key in flight again",
        ] {
            counts.ingest(line);
        }
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        assert_eq!(get(&counts.hung_up), 2);
        assert_eq!(get(&counts.replayed), 1);
        assert_eq!(get(&counts.other), 1);
        assert_eq!(counts.total(), 4);
    }

    /// What an instance logs is what the run counts: each increment of the layer's metric is a
    /// line with its result, formatted as `chaos serve` formats its logs; other metrics log
    /// nothing.
    #[test]
    fn the_recorders_lines_are_what_the_counts_read() {
        let written = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = Arc::clone(&written);
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Sink(Arc::clone(&sink)))
            .finish();
        let metadata = Metadata::new("test", metrics::Level::INFO, None);
        let wait = |result: &'static str| {
            Key::from_parts(IN_FLIGHT_WAITS, vec![metrics::Label::new("result", result)])
        };
        tracing::subscriber::with_default(subscriber, || {
            WaitLog
                .register_counter(&wait("hung_up"), &metadata)
                .increment(2);
            WaitLog
                .register_counter(&wait("store_error"), &metadata)
                .increment(1);
            let requests = Key::from_name(tower_idempotency::metrics::REQUESTS);
            WaitLog.register_counter(&requests, &metadata).increment(1);
        });
        let counts = WaitCounts::default();
        let text = String::from_utf8(written.lock().unwrap().clone()).unwrap();
        for line in text.lines() {
            counts.ingest(line);
        }
        assert_eq!(text.lines().count(), 3, "{text}");
        assert_eq!(counts.hung_up.load(Ordering::Relaxed), 2);
        assert_eq!(counts.store_error.load(Ordering::Relaxed), 1);
    }

    struct Sink(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
