//! The sections beside the main table: the scale scenarios' details, the storms, expiry and
//! where the CPU went.

use std::{fmt::Write as _, time::Duration};

use super::{
    Results, Sample,
    format::{format_bytes, format_micros, format_rate, median, with_ratio},
};
use crate::{
    reaper::ReaperReport,
    storm::{StormReport, StormSummary},
};

impl Results {
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
        for (scenario, samples) in &storms {
            for sample in samples.iter() {
                if let Some(report) = &sample.storm {
                    storm_row(
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
            storm_row(&mut out, scenario.name, "all".to_owned(), &reports);
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
}

/// One row of the storms' table: `report`'s keys, over one round or all.
fn storm_row(out: &mut String, name: &str, round: String, report: &[&StormReport]) {
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
}
