//! One scenario measured once: its tally, CPU, RSS and what the scale scenarios add.

use std::time::Duration;

use serde_json::{Value, json};

use crate::{reaper::ReaperReport, stats::Tally, storm::StormReport};

/// One scenario measured once.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    pub(crate) round: usize,
    pub(crate) connections: usize,
    pub(crate) window: Duration,
    pub(crate) tally: Tally,
    /// The server process's peak RSS (HTTP scenarios; the sum over the instances).
    pub(crate) peak_rss: Option<u64>,
    pub(crate) cpu: Cpu,
    /// What the scale scenarios report beside the table: database preparation, the reaper,
    /// locks, WAL, the duplicate burst. One sentence each.
    pub(crate) details: Vec<String>,
    /// Correctness failures (a key executed twice, a reaper that failed): the scenario fails,
    /// loudly.
    pub(crate) failures: Vec<String>,
    /// The expiry loop's statistics when the backlog was drained (reaping scenarios).
    pub(crate) reaper: Option<ReaperReport>,
    /// WAL written during the window (while reaping, for reaping scenarios): the run
    /// database's own when `pg_walinspect` tells it, else the whole server's.
    pub(crate) wal_bytes: Option<u64>,
    /// Reaping scenarios: the load over at least `--duration-secs` from the reaper's start
    /// (seconds, p99 in µs), beside the table's figures which are those while it ran.
    pub(crate) fixed_view: Option<(f64, f64)>,
    /// Storm scenarios: every key's outcome.
    pub(crate) storm: Option<StormReport>,
}

/// CPU time used during the window, by who.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Cpu {
    /// The server process.
    pub(crate) server: Option<Duration>,
    /// The PostgreSQL backends serving the run's database (local servers only).
    pub(crate) postgres: Option<Duration>,
    /// The benchmark process: the load generator, or the store client of the store scenarios.
    pub(crate) client: Option<Duration>,
    /// Context switches of the server process's threads: each time one went to sleep or was
    /// preempted (and so had to be woken or rescheduled), on a VM often a few microseconds each.
    pub(crate) server_switches: Option<u64>,
    /// The same for the benchmark process.
    pub(crate) client_switches: Option<u64>,
}

impl Sample {
    pub(crate) fn new(
        round: usize,
        connections: usize,
        window: Duration,
        tally: Tally,
        cpu: Cpu,
    ) -> Self {
        Self {
            round,
            connections,
            window,
            tally,
            peak_rss: None,
            cpu,
            details: Vec::new(),
            failures: Vec::new(),
            reaper: None,
            wal_bytes: None,
            fixed_view: None,
            storm: None,
        }
    }

    pub(super) fn rps(&self) -> f64 {
        self.tally.ok as f64 / self.window.as_secs_f64()
    }

    fn quantile(&self, q: f64) -> Option<f64> {
        (self.tally.ok > 0).then(|| self.tally.latency.value_at_quantile(q) as f64)
    }

    pub(super) fn p50(&self) -> Option<f64> {
        self.quantile(0.5)
    }

    pub(crate) fn p99(&self) -> Option<f64> {
        self.quantile(0.99)
    }

    pub(super) fn rss(&self) -> Option<f64> {
        self.peak_rss.map(|bytes| bytes as f64)
    }

    /// Microseconds of `cpu` per successful request.
    pub(super) fn per_request(&self, cpu: Option<Duration>) -> Option<f64> {
        let cpu = cpu?;
        (self.tally.ok > 0).then(|| cpu.as_secs_f64() * 1e6 / self.tally.ok as f64)
    }

    /// `count` events per successful request.
    pub(super) fn count_per_request(&self, count: Option<u64>) -> Option<f64> {
        let count = count?;
        (self.tally.ok > 0).then(|| count as f64 / self.tally.ok as f64)
    }

    /// The CPU time of every process measured (PostgreSQL is not, when the scenario does not
    /// use it or the server is not local).
    pub(super) fn total_cpu(&self) -> Option<Duration> {
        let Cpu {
            server,
            postgres,
            client,
            ..
        } = self.cpu;
        [server, postgres, client]
            .into_iter()
            .flatten()
            .reduce(|a, b| a + b)
    }

    pub(super) fn to_json(&self) -> Value {
        let micros = |d: Option<Duration>| d.map(|d| d.as_micros() as u64);
        json!({
            "round": self.round,
            "connections": self.connections,
            "window_secs": self.window.as_secs_f64(),
            "ok": self.tally.ok,
            "errors": self.tally.errors,
            "first_error": self.tally.first_error,
            "requests_per_sec": self.rps(),
            "latency_us": (self.tally.ok > 0).then(|| json!({
                "p50": self.tally.latency.value_at_quantile(0.5),
                "p90": self.tally.latency.value_at_quantile(0.9),
                "p99": self.tally.latency.value_at_quantile(0.99),
                "p999": self.tally.latency.value_at_quantile(0.999),
                "max": self.tally.latency.max(),
                "mean": self.tally.latency.mean(),
            })),
            "peak_rss_bytes": self.peak_rss,
            "cpu_us": {
                "server": micros(self.cpu.server),
                "postgres": micros(self.cpu.postgres),
                "client": micros(self.cpu.client),
            },
            "context_switches": {
                "server": self.cpu.server_switches,
                "client": self.cpu.client_switches,
            },
            "details": self.details,
            "failures": self.failures,
            "reaper": self.reaper,
            "wal_bytes": self.wal_bytes,
            "storm": self.storm,
        })
    }
}
