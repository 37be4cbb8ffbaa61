//! The command line that replays a run's plan, printed at its start.

use clap::{Parser, ValueEnum};

use crate::RunArgs;

/// The options that replay this run's plan: its seed, and every option that shapes the plan
/// and differs from its default (`--keep-logs` does not shape it).
pub(crate) fn args(args: &RunArgs, seed: u64) -> String {
    let defaults = RunArgs::parse_from(["chaos"]);
    let mut line = format!(
        "--duration-secs {} --clients {} --seed {seed}",
        args.duration_secs, args.clients
    );
    let numbers = [
        ("kill-min-ms", args.kill_min_ms, defaults.kill_min_ms),
        ("kill-max-ms", args.kill_max_ms, defaults.kill_max_ms),
        ("delay-min-ms", args.delay_min_ms, defaults.delay_min_ms),
        ("delay-max-ms", args.delay_max_ms, defaults.delay_max_ms),
        (
            "request-timeout-ms",
            args.request_timeout_ms,
            defaults.request_timeout_ms,
        ),
        ("drain-secs", args.drain_secs, defaults.drain_secs),
        (
            "parallel-percent",
            args.parallel_percent.into(),
            defaults.parallel_percent.into(),
        ),
        (
            "hangup-percent",
            args.hangup_percent.into(),
            defaults.hangup_percent.into(),
        ),
        (
            "resend-percent",
            args.resend_percent.into(),
            defaults.resend_percent.into(),
        ),
        (
            "decline-percent",
            args.decline_percent.into(),
            defaults.decline_percent.into(),
        ),
        (
            "refuse-completions-secs",
            args.refuse_completions_secs,
            defaults.refuse_completions_secs,
        ),
        (
            "catch-percent",
            args.catch_percent.into(),
            defaults.catch_percent.into(),
        ),
        (
            "refund-percent",
            args.refund_percent.into(),
            defaults.refund_percent.into(),
        ),
        ("storms", args.storms.into(), defaults.storms.into()),
        (
            "in-flight-wait-ms",
            args.in_flight_wait_ms,
            defaults.in_flight_wait_ms,
        ),
        (
            "wait-hangup-percent",
            args.wait_hangup_percent.into(),
            defaults.wait_hangup_percent.into(),
        ),
        (
            "fail-wait-reads-secs",
            args.fail_wait_reads_secs,
            defaults.fail_wait_reads_secs,
        ),
        (
            "storm-percent",
            args.storm_percent.into(),
            defaults.storm_percent.into(),
        ),
        (
            "abandon-percent",
            args.abandon_percent.into(),
            defaults.abandon_percent.into(),
        ),
        (
            "acquirer-fail-percent",
            args.acquirer_fail_percent.into(),
            defaults.acquirer_fail_percent.into(),
        ),
        (
            "settle-percent",
            args.settle_percent.into(),
            defaults.settle_percent.into(),
        ),
    ];
    for (name, value, default) in numbers {
        if value != default {
            line.push_str(&format!(" --{name} {value}"));
        }
    }
    if let Some(mode) = args.pg_stop_mode
        && let Some(value) = mode.to_possible_value()
    {
        line.push_str(&format!(" --pg-stop-mode {}", value.get_name()));
    }
    if args.mode != defaults.mode {
        line.push_str(&format!(" --mode {}", args.mode.name()));
    }
    if let Some(bug) = args.inject_bug {
        line.push_str(&format!(" --inject-bug {}", bug.name()));
    }
    if args.failover {
        line.push_str(&format!(
            " --failover --replication {} --failovers {} --failover-lag-ms {}",
            args.replication.name(),
            args.failovers,
            args.failover_lag_ms
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::args as replay_args;
    use crate::RunArgs;

    fn parse(line: &str) -> RunArgs {
        RunArgs::parse_from(std::iter::once("chaos").chain(line.split_whitespace()))
    }

    /// The printed command replays the plan: parsed back, it gives the same options, the
    /// seed included, whichever of them were set.
    #[test]
    fn the_replay_command_carries_every_option_that_shapes_the_plan() {
        for given in [
            "",
            "--duration-secs 600 --clients 8",
            "--kill-min-ms 200 --kill-max-ms 500 --pg-stop-mode immediate",
            "--delay-min-ms 0 --delay-max-ms 5 --request-timeout-ms 900 --drain-secs 5 \
             --parallel-percent 0 --hangup-percent 50 --resend-percent 1 --decline-percent 100 \
             --pg-stop-mode fast --keep-logs",
            "--refuse-completions-secs 0 --catch-percent 0 --storms 0",
            "--refuse-completions-secs 9 --catch-percent 100 --storms 7 --storm-percent 100",
            "--in-flight-wait-ms 0 --wait-hangup-percent 0 --fail-wait-reads-secs 0",
            "--in-flight-wait-ms 2500 --wait-hangup-percent 100 --fail-wait-reads-secs 9",
            "--mode transactional --abandon-percent 0 --acquirer-fail-percent 50",
            "--settle-percent 0",
            "--settle-percent 100",
            "--failover --replication async --failovers 5 --failover-lag-ms 800",
        ] {
            let args = parse(given);
            let replayed = parse(&replay_args(&args, 7));
            let expected = RunArgs {
                seed: Some(7),
                keep_logs: false,
                ..args
            };
            let replayed = RunArgs {
                keep_logs: false,
                ..replayed
            };
            assert_eq!(
                format!("{replayed:?}"),
                format!("{expected:?}"),
                "replaying `{given}`"
            );
        }
    }
}
