//! From samples to the tables: medians over rounds, ratios to the baseline round by round, the
//! targets, and the markdown.

use std::{fmt::Write as _, time::Duration};

use serde_json::{Value, json};

use crate::{
    reaper::ReaperReport,
    scenario::{Scenario, Target},
    stats::Tally,
    storm::{StormReport, StormSummary},
};

/// A scenario that fails more than this share of its requests fails its targets.
const MAX_ERROR_RATE: f64 = 0.01;

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

    fn rps(&self) -> f64 {
        self.tally.ok as f64 / self.window.as_secs_f64()
    }

    fn quantile(&self, q: f64) -> Option<f64> {
        (self.tally.ok > 0).then(|| self.tally.latency.value_at_quantile(q) as f64)
    }

    fn p50(&self) -> Option<f64> {
        self.quantile(0.5)
    }

    pub(crate) fn p99(&self) -> Option<f64> {
        self.quantile(0.99)
    }

    fn rss(&self) -> Option<f64> {
        self.peak_rss.map(|bytes| bytes as f64)
    }

    /// Microseconds of `cpu` per successful request.
    fn per_request(&self, cpu: Option<Duration>) -> Option<f64> {
        let cpu = cpu?;
        (self.tally.ok > 0).then(|| cpu.as_secs_f64() * 1e6 / self.tally.ok as f64)
    }

    /// `count` events per successful request.
    fn count_per_request(&self, count: Option<u64>) -> Option<f64> {
        let count = count?;
        (self.tally.ok > 0).then(|| count as f64 / self.tally.ok as f64)
    }

    /// The CPU time of every process measured (PostgreSQL is not, when the scenario does not
    /// use it or the server is not local).
    fn total_cpu(&self) -> Option<Duration> {
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

    fn to_json(&self) -> Value {
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

/// Everything a run measured, in table order.
#[derive(Debug)]
pub(crate) struct Results {
    pub(crate) scenarios: Vec<(&'static Scenario, Vec<Sample>)>,
    /// Cores of the machine, for how busy it was.
    pub(crate) cores: usize,
    /// What preparing the databases took (the full store's fill), for the scale section.
    pub(crate) notes: Vec<String>,
}

/// A scenario's medians, and its ratios to its baseline.
struct Summary {
    rps: Option<f64>,
    p50: Option<f64>,
    p99: Option<f64>,
    rss: Option<f64>,
    rps_ratio: Option<f64>,
    p50_ratio: Option<f64>,
    p99_ratio: Option<f64>,
    rss_ratio: Option<f64>,
    connections: Option<usize>,
    ok: u64,
    errors: u64,
    first_error: Option<String>,
    failures: usize,
}

impl Results {
    fn samples(&self, name: &str) -> Option<&[Sample]> {
        self.scenarios
            .iter()
            .find(|(scenario, _)| scenario.name == name)
            .map(|(_, samples)| samples.as_slice())
    }

    fn summarize(&self, scenario: &Scenario, samples: &[Sample]) -> Summary {
        let baseline = scenario.baseline.and_then(|name| self.samples(name));
        let of = |metric: fn(&Sample) -> Option<f64>| median(samples.iter().filter_map(metric));
        let ratio = |metric: fn(&Sample) -> Option<f64>| {
            let baseline = baseline?;
            median(samples.iter().filter_map(|sample| {
                let base = baseline.iter().find(|b| b.round == sample.round)?;
                let (value, base) = (metric(sample)?, metric(base)?);
                (base > 0.0).then(|| value / base)
            }))
        };
        Summary {
            rps: of(|s| Some(s.rps())),
            p50: of(Sample::p50),
            p99: of(Sample::p99),
            rss: of(Sample::rss),
            rps_ratio: ratio(|s| Some(s.rps())),
            p50_ratio: ratio(Sample::p50),
            p99_ratio: ratio(Sample::p99),
            rss_ratio: ratio(Sample::rss),
            connections: samples.first().map(|s| s.connections),
            ok: samples.iter().map(|s| s.tally.ok).sum(),
            errors: samples.iter().map(|s| s.tally.errors).sum(),
            first_error: samples.iter().find_map(|s| s.tally.first_error.clone()),
            failures: samples.iter().map(|s| s.failures.len()).sum(),
        }
    }

    /// The main table: throughput, latency and memory, with the targets.
    pub(crate) fn table(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "| scenario | vs | conns | req/s | p50 | p99 | peak RSS | errors | target | result |\n\
             |---|---|--:|--:|--:|--:|--:|--:|---|---|\n",
        );
        for (scenario, samples) in &self.scenarios {
            let vs = scenario.baseline.unwrap_or("—");
            let targets = targets_text(scenario.targets);
            let s = self.summarize(scenario, samples);
            let _ = writeln!(
                out,
                "| {} | {vs} | {} | {} | {} | {} | {} | {} | {targets} | {} |",
                scenario.name,
                s.connections.map_or("—".to_owned(), |c| c.to_string()),
                with_ratio(s.rps.map(format_rate), s.rps_ratio),
                with_ratio(s.p50.map(format_micros), s.p50_ratio),
                with_ratio(s.p99.map(format_micros), s.p99_ratio),
                with_ratio(s.rss.map(format_bytes), s.rss_ratio),
                s.errors,
                verdict(scenario.targets, &s),
            );
        }
        out
    }

    /// The errors the scenarios met, one line each; empty when there were none.
    pub(crate) fn errors(&self) -> String {
        let mut out = String::new();
        for (scenario, samples) in &self.scenarios {
            let s = self.summarize(scenario, samples);
            if let Some(error) = s.first_error {
                let _ = writeln!(
                    out,
                    "- `{}`: {} of {} requests failed; first: {error}",
                    scenario.name,
                    s.errors,
                    s.ok + s.errors
                );
            }
        }
        out
    }

    /// The correctness failures, one line each with its round; empty when there were none.
    pub(crate) fn failures(&self) -> String {
        let mut out = String::new();
        for (scenario, samples) in &self.scenarios {
            for sample in samples {
                for failure in &sample.failures {
                    let _ = writeln!(
                        out,
                        "- `{}`, round {}: {failure}",
                        scenario.name,
                        sample.round + 1
                    );
                }
            }
        }
        out
    }

    /// The scale scenarios' details, round by round, and the two ways of expiry side by
    /// side; empty when no scale scenario ran.
    pub(crate) fn scale_section(&self) -> String {
        let mut out = String::new();
        let with_details: Vec<_> = self
            .scenarios
            .iter()
            .filter(|(_, samples)| samples.iter().any(|s| !s.details.is_empty()))
            .collect();
        if self.notes.is_empty() && with_details.is_empty() {
            return out;
        }
        out.push_str("\n### Scale scenarios\n\n");
        for note in &self.notes {
            let _ = writeln!(out, "- {note}");
        }
        for (scenario, samples) in with_details {
            let _ = writeln!(out, "\n`{}`:\n", scenario.name);
            for sample in samples {
                for detail in &sample.details {
                    let _ = writeln!(out, "- round {}: {detail}", sample.round + 1);
                }
            }
        }
        out.push_str(&self.expiry_table());
        out
    }

    /// The duplicate storms, round by round, and over all rounds; empty when none ran.
    pub(crate) fn storm_section(&self) -> String {
        let storms: Vec<_> = self
            .scenarios
            .iter()
            .filter(|(_, samples)| samples.iter().any(|s| s.storm.is_some()))
            .collect();
        if storms.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "\n### Duplicate storms\n\n\
             Each key sent by many requests at once, one connection each, to a lease-mode server \
             whose handler takes its time; per key, its executions (its rows in `charges`), \
             replays, `409`s and other answers (a range when keys differ), and when the \
             duplicates were answered, counted from the executing request's answer:\n\n\
             | scenario | waiting | round | keys | executions per key | replays per key | \
             409s per key | other answers | duplicates answered before the first, per key | \
             after it: p50 | p99 | max |\n\
             |---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
        );
        let row = |out: &mut String, name: &str, round: String, report: &[&StormReport]| {
            let Some(summary) = StormSummary::of(report.iter().copied()) else {
                return;
            };
            let waits = report.first().is_some_and(|r| r.waits);
            let [p50, p99, max] = summary.after_first().map(|v| v.unwrap_or("—".to_owned()));
            let _ = writeln!(
                out,
                "| {name} | {} | {round} | {} | {} | {} | {} | {} | {} | {p50} | {p99} | {max} |",
                if waits { "on" } else { "off" },
                summary.keys,
                summary.executions,
                summary.replays,
                summary.conflicts,
                summary.other,
                summary.before_first,
            );
        };
        for (scenario, samples) in &storms {
            for sample in samples.iter() {
                if let Some(report) = &sample.storm {
                    row(
                        &mut out,
                        scenario.name,
                        (sample.round + 1).to_string(),
                        &[report],
                    );
                }
            }
        }
        for (scenario, samples) in &storms {
            let reports: Vec<&StormReport> =
                samples.iter().filter_map(|s| s.storm.as_ref()).collect();
            row(&mut out, scenario.name, "all".to_owned(), &reports);
        }
        out.push('\n');
        for (scenario, samples) in &storms {
            let reports: Vec<&StormReport> =
                samples.iter().filter_map(|s| s.storm.as_ref()).collect();
            let Some(summary) = StormSummary::of(reports.iter().copied()) else {
                continue;
            };
            let waits = reports.first().is_some_and(|r| r.waits);
            let _ = writeln!(
                out,
                "- {}",
                summary.line(scenario.name, waits, reports.len())
            );
        }
        out
    }

    /// Expiring the backlog both ways (each reaping scenario against its idle baseline),
    /// medians over rounds.
    fn expiry_table(&self) -> String {
        let reaping: Vec<_> = self
            .scenarios
            .iter()
            .filter(|(_, samples)| samples.iter().any(|s| s.reaper.is_some()))
            .collect();
        if reaping.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "\nExpiring the backlog, each way (medians over rounds). WAL is the run database's \
             own (`pg_walinspect`) when available. Live traffic is measured while the reaper \
             runs, and over at least `--duration-secs` from its start, each against the same \
             traffic with the backlog present and no reaper:\n\n\
             | way | records | drained in | records/s | calls | longest call | WAL while reaping | WAL/s, no reaper | live req/s while reaping | live p99 while reaping | live p99, whole window |\n\
             |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
        );
        for (scenario, samples) in reaping {
            let s = self.summarize(scenario, samples);
            let baseline = scenario.baseline.and_then(|name| self.samples(name));
            let reaper = |f: fn(&ReaperReport) -> Option<f64>| {
                median(samples.iter().filter_map(|s| s.reaper.as_ref().and_then(f)))
            };
            let wal = median(samples.iter().filter_map(|s| s.wal_bytes.map(|b| b as f64)));
            let idle_wal_rate =
                baseline.and_then(|b| {
                    median(b.iter().filter_map(|s| {
                        Some(s.wal_bytes? as f64 / s.window.as_secs_f64().max(1e-9))
                    }))
                });
            let view_p99 = median(samples.iter().filter_map(|s| s.fixed_view.map(|v| v.1)));
            let view_ratio = baseline.and_then(|baseline| {
                median(samples.iter().filter_map(|sample| {
                    let base = baseline.iter().find(|b| b.round == sample.round)?;
                    let base = base.p99()?;
                    (base > 0.0).then_some(sample.fixed_view?.1 / base)
                }))
            });
            let view_secs = median(samples.iter().filter_map(|s| s.fixed_view.map(|v| v.0)));
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                scenario.name,
                reaper(|r| Some(r.rows as f64)).map_or("—".to_owned(), format_rate),
                reaper(|r| r.drained_after_us.map(|us| us as f64))
                    .map_or("—".to_owned(), format_micros),
                reaper(ReaperReport::rows_per_sec).map_or("—".to_owned(), format_rate),
                reaper(|r| Some(r.calls as f64)).map_or("—".to_owned(), format_rate),
                reaper(|r| Some(r.call_max_us as f64)).map_or("—".to_owned(), format_micros),
                wal.map_or("—".to_owned(), format_bytes),
                idle_wal_rate.map_or("—".to_owned(), |r| format!("{}/s", format_bytes(r))),
                with_ratio(s.rps.map(format_rate), s.rps_ratio),
                with_ratio(s.p99.map(format_micros), s.p99_ratio),
                with_ratio(
                    view_p99.map(|p99| format!(
                        "{} over {:.0} s",
                        format_micros(p99),
                        view_secs.unwrap_or(0.0)
                    )),
                    view_ratio
                ),
            );
        }
        out
    }

    /// Where the CPU went: microseconds per request by process, medians over rounds.
    pub(crate) fn cpu_table(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "| scenario | server | PostgreSQL backends | client (load generator) | total | machine busy \
             | context switches: server | client |\n\
             |---|--:|--:|--:|--:|--:|--:|--:|\n",
        );
        for (scenario, samples) in &self.scenarios {
            if samples.is_empty() {
                continue;
            }
            let per_request = |pick: fn(&Sample) -> Option<Duration>| {
                median(samples.iter().filter_map(|s| s.per_request(pick(s))))
                    .map_or("—".to_owned(), |us| format!("{us:.0} µs"))
            };
            let busy = median(samples.iter().filter_map(|s| {
                let total = s.total_cpu()?;
                Some(total.as_secs_f64() / (s.window.as_secs_f64() * self.cores as f64))
            }))
            .map_or("—".to_owned(), |share| format!("{:.0}%", share * 100.0));
            let switches = |pick: fn(&Sample) -> Option<u64>| {
                median(samples.iter().filter_map(|s| s.count_per_request(pick(s))))
                    .map_or("—".to_owned(), |n| format!("{n:.2}"))
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {busy} | {} | {} |",
                scenario.name,
                per_request(|s| s.cpu.server),
                per_request(|s| s.cpu.postgres),
                per_request(|s| s.cpu.client),
                per_request(Sample::total_cpu),
                switches(|s| s.cpu.server_switches),
                switches(|s| s.cpu.client_switches),
            );
        }
        out
    }

    /// Every sample, and the summaries, as JSON.
    pub(crate) fn to_json(&self) -> Value {
        let scenarios: Vec<Value> = self
            .scenarios
            .iter()
            .map(|(scenario, samples)| {
                let s = self.summarize(scenario, samples);
                json!({
                    "name": scenario.name,
                    "baseline": scenario.baseline,
                    "targets": scenario.targets.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "result": verdict(scenario.targets, &s),
                    "median": {
                        "requests_per_sec": s.rps,
                        "p50_us": s.p50,
                        "p99_us": s.p99,
                        "peak_rss_bytes": s.rss,
                    },
                    "ratio_to_baseline": {
                        "requests_per_sec": s.rps_ratio,
                        "p50": s.p50_ratio,
                        "p99": s.p99_ratio,
                        "peak_rss": s.rss_ratio,
                    },
                    "samples": samples.iter().map(Sample::to_json).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({ "cores": self.cores, "scenarios": scenarios })
    }
}

/// PASS when every target holds, FAIL (with the first that does not) otherwise; `—` without
/// targets, n/a when a target could not be evaluated.
fn verdict(targets: &[Target], s: &Summary) -> String {
    if targets.is_empty() {
        return "—".to_owned();
    }
    if s.failures > 0 {
        return format!("**FAIL** ({} failures, listed below)", s.failures);
    }
    let requests = s.ok + s.errors;
    if requests == 0 {
        return "n/a".to_owned();
    }
    if s.errors as f64 > MAX_ERROR_RATE * requests as f64 {
        return "FAIL (errors)".to_owned();
    }
    for target in targets {
        let holds = match *target {
            Target::Throughput(min) => s.rps_ratio.map(|r| r >= min),
            Target::P99(max) => s.p99_ratio.map(|r| r <= max),
            Target::PeakRss(max) => s.rss.map(|rss| rss <= max as f64),
            // Failures were checked above.
            Target::ExactlyOnce | Target::StormReplayed(_) => Some(true),
        };
        match holds {
            Some(true) => {}
            Some(false) => return format!("**FAIL** ({target})"),
            None => return "n/a".to_owned(),
        }
    }
    "PASS".to_owned()
}

fn targets_text(targets: &[Target]) -> String {
    if targets.is_empty() {
        return "—".to_owned();
    }
    targets
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The median; the mean of the two middle values for an even count.
fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut values: Vec<f64> = values.filter(|v| v.is_finite()).collect();
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    })
}

fn with_ratio(value: Option<String>, ratio: Option<f64>) -> String {
    match (value, ratio) {
        (Some(value), Some(ratio)) => format!("{value} ({ratio:.2}×)"),
        (Some(value), None) => value,
        (None, _) => "—".to_owned(),
    }
}

/// `12,345`.
pub(crate) fn format_rate(rate: f64) -> String {
    let digits = format!("{:.0}", rate.max(0.0));
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// `850 µs`, `4.21 ms`, `12.3 ms`, `1.20 s`.
pub(crate) fn format_micros(micros: f64) -> String {
    if micros < 1_000.0 {
        format!("{micros:.0} µs")
    } else if micros < 10_000.0 {
        format!("{:.2} ms", micros / 1e3)
    } else if micros < 1_000_000.0 {
        format!("{:.1} ms", micros / 1e3)
    } else {
        format!("{:.2} s", micros / 1e6)
    }
}

/// `45.2 MiB`.
pub(crate) fn format_bytes(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), Some(2.0));
        assert_eq!(median([4.0, 1.0, 2.0, 3.0].into_iter()), Some(2.5));
        assert_eq!(median(std::iter::empty()), None);
    }

    #[test]
    fn formats() {
        assert_eq!(format_rate(1_234_567.4), "1,234,567");
        assert_eq!(format_rate(999.0), "999");
        assert_eq!(format_micros(850.0), "850 µs");
        assert_eq!(format_micros(4_210.0), "4.21 ms");
        assert_eq!(format_micros(12_340.0), "12.3 ms");
        assert_eq!(format_bytes(1.5 * 1024.0 * 1024.0), "1.5 MiB");
    }

    fn summary(rps_ratio: f64, p99_ratio: f64, rss: f64, errors: u64) -> Summary {
        Summary {
            rps: Some(1.0),
            p50: Some(1.0),
            p99: Some(1.0),
            rss: Some(rss),
            rps_ratio: Some(rps_ratio),
            p50_ratio: Some(1.0),
            p99_ratio: Some(p99_ratio),
            rss_ratio: Some(1.0),
            connections: Some(1),
            ok: 1000,
            errors,
            first_error: None,
            failures: 0,
        }
    }

    #[test]
    fn verdicts() {
        let replay = [Target::Throughput(1.5), Target::P99(1.0)];
        assert_eq!(verdict(&replay, &summary(1.6, 0.9, 0.0, 0)), "PASS");
        assert_eq!(
            verdict(&replay, &summary(1.6, 1.1, 0.0, 0)),
            "**FAIL** (p99 ≤ 1×)"
        );
        assert_eq!(
            verdict(&replay, &summary(1.6, 0.9, 0.0, 100)),
            "FAIL (errors)"
        );
        let rss = [Target::PeakRss(192 << 20)];
        assert_eq!(
            verdict(&rss, &summary(1.0, 1.0, 100.0 * 1048576.0, 0)),
            "PASS"
        );
        assert_eq!(verdict(&[], &summary(1.0, 1.0, 0.0, 0)), "—");
        let once = [Target::ExactlyOnce];
        assert_eq!(verdict(&once, &summary(1.0, 1.0, 0.0, 0)), "PASS");
        let twice = Summary {
            failures: 2,
            ..summary(1.0, 1.0, 0.0, 0)
        };
        assert!(verdict(&once, &twice).starts_with("**FAIL**"));
    }
}
