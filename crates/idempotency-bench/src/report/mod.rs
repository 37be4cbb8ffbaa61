//! From samples to the tables: medians over rounds, ratios to the baseline round by round, the
//! targets, and the markdown.

mod format;
mod sample;
mod sections;

use std::fmt::Write as _;

use serde_json::{Value, json};

use self::format::{median, with_ratio};
pub(crate) use self::{
    format::{format_bytes, format_micros, format_rate},
    sample::{Cpu, Sample},
};
use crate::scenario::{Scenario, Target};

/// A scenario that fails more than this share of its requests fails its targets.
const MAX_ERROR_RATE: f64 = 0.01;

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
            Target::Throughput(min) | Target::Bounded { min, .. } => s.rps_ratio.map(|r| r >= min),
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let bounded = [Target::Bounded {
            min: 0.28,
            bound: "PostgreSQL's bound",
        }];
        assert_eq!(verdict(&bounded, &summary(0.3, 2.0, 0.0, 0)), "PASS");
        assert_eq!(
            verdict(&bounded, &summary(0.2, 2.0, 0.0, 0)),
            "**FAIL** (req/s ≥ 0.28× (PostgreSQL's bound))"
        );
    }
}
