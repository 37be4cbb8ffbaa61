//! What a run prints besides the tables: a progress line per measurement, the report's
//! header, and `--list`.

use std::{fmt::Write as _, time::Duration};

use crate::{
    cli::BenchArgs,
    procfs::Machine,
    report::{self, Sample},
    scale,
    scenario::{Database, Http, Instances, Runner, SCENARIOS, Scenario},
    storm,
};

pub(super) fn progress(sample: &Sample) -> String {
    let tally = &sample.tally;
    let rps = tally.ok as f64 / sample.window.as_secs_f64();
    let mut line = format!("{rps:>10.0} req/s");
    if tally.ok > 0 {
        let _ = write!(
            line,
            "  p50 {:>9}  p99 {:>9}",
            report::format_micros(tally.latency.value_at_quantile(0.5) as f64),
            report::format_micros(tally.latency.value_at_quantile(0.99) as f64),
        );
    }
    if let Some(rss) = sample.peak_rss {
        let _ = write!(line, "  RSS {:>10}", report::format_bytes(rss as f64));
    }
    if let Some(summary) = sample
        .storm
        .as_ref()
        .and_then(|r| storm::StormSummary::of([r]))
    {
        let _ = write!(
            line,
            "  per key: executions {}, replays {}, 409s {}, other {}",
            summary.executions, summary.replays, summary.conflicts, summary.other
        );
    }
    if tally.errors > 0 {
        let _ = write!(line, "  {} errors", tally.errors);
    }
    line
}

pub(super) fn header(
    args: &BenchArgs,
    selected: &[&Scenario],
    machine: &Machine,
    server: &str,
    wall: Duration,
) -> String {
    let mut out = String::from("## idempotency-bench\n\n");
    let _ = writeln!(
        out,
        "- machine: {} cores{}{}{}; load average at start {}",
        machine.cores,
        machine
            .cpu_model
            .as_deref()
            .map(|m| format!(", {m}"))
            .unwrap_or_default(),
        machine
            .memory_bytes
            .map(|b| format!(", {:.1} GiB", b as f64 / (1u64 << 30) as f64))
            .unwrap_or_default(),
        machine
            .kernel
            .as_deref()
            .map(|k| format!(", Linux {k}"))
            .unwrap_or_default(),
        machine.load_average.as_deref().unwrap_or("unknown"),
    );
    let _ = writeln!(out, "- database: {server}, on the same machine");
    let _ = writeln!(out, "- command: `{}`", command_line());
    let fixed: Vec<String> = SCENARIOS
        .iter()
        .filter_map(|s| match s.runner {
            Runner::Http(Http {
                connections: Some(c),
                ..
            }) => Some(format!("{}: {c}", s.name)),
            _ => None,
        })
        .collect();
    let _ = writeln!(
        out,
        "- each scenario, each round: a fresh server process, {} s warm-up, {} s measured; {} \
         connections{}; server pools of {} PostgreSQL connections",
        args.warmup_secs,
        args.duration_secs.max(1),
        args.connections,
        if fixed.is_empty() {
            String::new()
        } else {
            format!(" ({})", fixed.join(", "))
        },
        args.pool_size,
    );
    let _ = writeln!(
        out,
        "- {} rounds, scenarios alternating (odd rounds in reverse order); wall time {}",
        args.rounds,
        format_wall(wall),
    );
    let uses = |database: Database| {
        selected
            .iter()
            .any(|s| matches!(&s.runner, Runner::Http(http) if http.database == database))
    };
    let mut scale = Vec::new();
    if uses(Database::Full) {
        scale.push(format!(
            "full store {} completed records (empty store {})",
            report::format_rate(args.full_store_rows as f64),
            report::format_rate(scale::EMPTY_STORE_ROWS as f64)
        ));
    }
    if uses(Database::Expired) || uses(Database::ExpiredPartitions) {
        scale.push(format!(
            "{} expired records put back before each expiry measurement; reaper batch {}, in \
             the server process",
            report::format_rate(args.expired_rows as f64),
            args.reaper_batch
        ));
    }
    if selected
        .iter()
        .any(|s| matches!(&s.runner, Runner::Http(http) if http.instances == Instances::Many))
    {
        scale.push(format!(
            "many-instances: {} server processes with a pool of {} each; duplicate burst of {} \
             keys",
            args.instances, args.pool_size, args.duplicate_keys
        ));
    }
    if !scale.is_empty() {
        let _ = writeln!(out, "- scale scenarios: {}", scale.join("; "));
    }
    let storms: Vec<String> = selected
        .iter()
        .filter_map(|s| match s.runner {
            Runner::Storm(storm) => Some(format!("{}: {}", s.name, storm.size)),
            _ => None,
        })
        .collect();
    if !storms.is_empty() {
        let _ = writeln!(
            out,
            "- duplicate storms: {} keys a round after one warm-up key, each sent by that many \
             requests at once ({}), to a fresh server whose handler takes {} ms",
            args.storm_keys,
            storms.join(", "),
            crate::app::SLOW_HANDLER.as_millis(),
        );
    }
    if !args.db_settings.is_empty() {
        let _ = writeln!(
            out,
            "- set on the run's databases (`ALTER DATABASE ... SET`): {}",
            args.db_settings.join(", ")
        );
    }
    out.push_str(
        "- figures are medians over the rounds; a ratio (in parentheses) is the median of the \
         per-round ratios to the baseline (`vs`) measured in the same round; latencies are \
         per request, client side\n\n",
    );
    out
}

/// The command line, as it would be typed, with the database URL (which may hold a password)
/// left out.
fn command_line() -> String {
    let mut words = vec!["cargo run --release -p idempotency-bench --".to_owned()];
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--database-url" {
            args.next();
            words.push("--database-url <URL>".to_owned());
        } else if arg.starts_with("--database-url=") {
            words.push("--database-url=<URL>".to_owned());
        } else if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || c == '\'') {
            words.push(format!("'{}'", arg.replace('\'', r"'\''")));
        } else {
            words.push(arg);
        }
    }
    words.join(" ")
}

fn format_wall(wall: Duration) -> String {
    let secs = wall.as_secs();
    if secs >= 60 {
        format!("{} min {} s", secs / 60, secs % 60)
    } else {
        format!("{secs} s")
    }
}

/// `--list`: the scenarios, their baselines and targets.
pub(super) fn list() -> String {
    let mut out = String::from("| scenario | vs | target | runs | what |\n|---|---|---|---|---|\n");
    for scenario in SCENARIOS {
        let targets: Vec<String> = scenario.targets.iter().map(ToString::to_string).collect();
        let runs = if scenario.scale {
            "when named (scale)"
        } else {
            "by default"
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {runs} | {} |",
            scenario.name,
            scenario.baseline.unwrap_or("—"),
            if targets.is_empty() {
                "—".to_owned()
            } else {
                targets.join(", ")
            },
            scenario.about,
        );
    }
    out.push_str(
        "\nGroups for --scenarios: `scale` (every scale scenario), `full-store`, `expiry`.\n",
    );
    out
}
