//! The figures of a run and their printout (see the crate documentation, "Reading the
//! output").

use std::{
    path::Path,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use crate::{
    Mode, RunArgs,
    client::Stats,
    database::Database,
    failover::Failovers,
    faults::{DatabaseFaults, DatabaseRestart, Refusal, RefusalFaults, Storm, StormFaults},
    instance::{DemoLog, Fleet, LEASE},
    serve::Bug,
    verify::Verdict,
    wait_reads::{WaitReadFault, WaitReadFaults},
};

mod failover;
mod sections;

use self::{failover::FailoverFigures, sections::print_webhooks};

/// How long each phase took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Phases {
    pub(crate) setup: Duration,
    pub(crate) chaos: Duration,
    pub(crate) drain: Duration,
    pub(crate) verify: Duration,
}

/// The database's and the clients' faults: each as planned, and what it did.
#[derive(Debug)]
pub(crate) struct Faults<'a> {
    pub(crate) restart: DatabaseRestart,
    pub(crate) database: &'a DatabaseFaults,
    pub(crate) refusal: Option<Refusal>,
    pub(crate) refused: &'a RefusalFaults,
    pub(crate) storms: &'a [Storm],
    pub(crate) stormed: &'a StormFaults,
    pub(crate) wait_read_fault: Option<WaitReadFault>,
    pub(crate) wait_reads_failed: &'a WaitReadFaults,
    pub(crate) failovers: &'a Failovers,
}

/// How the duplicates' waits ended, as the instances logged them, and the clients' hang-ups of
/// waiting duplicates.
#[derive(Debug)]
struct Waits {
    wait_ms: u64,
    ended: u64,
    replayed: u64,
    acquired: u64,
    timed_out: u64,
    full: u64,
    hung_up: u64,
    store_error: u64,
    other: u64,
    planned_hangups: u64,
    storm_pair_hangups: u64,
}

/// Everything the printout shows.
#[derive(Debug)]
pub(crate) struct Report {
    seed: u64,
    duration_secs: u64,
    drain_secs: u64,
    clients: u16,
    inject_bug: Option<Bug>,
    postgres: String,
    // Traffic, as the clients saw it.
    requests: u64,
    retries: u64,
    replays: u64,
    conflicts: u64,
    server_errors: u64,
    unavailable: u64,
    overloaded: u64,
    connection_errors: u64,
    timeouts: u64,
    hangups: u64,
    // Faults.
    kills: u64,
    killed_in_flight: u64,
    starts: u64,
    failed_starts: u64,
    pg_restarts: u64,
    pg_in_flight: u64,
    restart: DatabaseRestart,
    failover: Option<FailoverFigures>,
    refusal: Option<Refusal>,
    refusal_windows: u64,
    refused: u64,
    refusal_held: Duration,
    catch_percent: u8,
    storms_planned: Vec<(Duration, usize)>,
    storms: u64,
    storm_hangups: u64,
    storm_charges: u64,
    waits: Waits,
    wait_read_fault: Option<WaitReadFault>,
    wait_read_windows: u64,
    wait_reads_failed: u64,
    wait_reads_held: Duration,
    // The demo's logs.
    log_path: String,
    charges_created: u64,
    refunds_created: u64,
    commit_failures: u64,
    unstored_answers: u64,
    aborted_successes: u64,
    background_stores: u64,
    layer_takeovers: u64,
    handler_takeovers: u64,
    log_errors: u64,
    log_warnings: u64,
    panics: u64,
    mode: Mode,
    abandoned: u64,
    completer_charges: u64,
    completed_keys: u64,
    completer_gave_up: u64,
    pub(crate) verdict: Verdict,
    phases: Phases,
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        args: &RunArgs,
        seed: u64,
        stats: &Stats,
        fleet: &Fleet,
        log: &DemoLog,
        faults: Faults<'_>,
        verdict: Verdict,
        phases: Phases,
        database: &Database,
    ) -> Self {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Self {
            seed,
            duration_secs: args.duration_secs,
            drain_secs: args.drain_secs,
            clients: args.clients,
            inject_bug: args.inject_bug,
            postgres: database.version(),
            requests: get(&stats.requests),
            retries: get(&stats.retries),
            replays: get(&stats.replays),
            conflicts: get(&stats.conflicts),
            server_errors: get(&stats.server_errors),
            unavailable: get(&stats.unavailable),
            overloaded: get(&stats.overloaded),
            connection_errors: get(&stats.connection_errors),
            timeouts: get(&stats.timeouts),
            hangups: get(&stats.hangups),
            kills: get(&fleet.kills),
            killed_in_flight: get(&fleet.killed_in_flight),
            starts: get(&fleet.starts),
            failed_starts: get(&fleet.failed_starts),
            pg_restarts: get(&faults.database.restarts),
            pg_in_flight: get(&faults.database.in_flight),
            restart: faults.restart,
            failover: FailoverFigures::new(args, database, faults.failovers),
            refusal: faults.refusal,
            refusal_windows: get(&faults.refused.windows),
            refused: get(&faults.refused.refused),
            refusal_held: Duration::from_millis(get(&faults.refused.held_ms)),
            catch_percent: crate::run::catch_percent(args),
            storms_planned: faults
                .storms
                .iter()
                .map(|storm| (storm.at, storm.struck()))
                .collect(),
            storms: get(&faults.stormed.storms),
            storm_hangups: get(&stats.storm_hangups),
            storm_charges: get(&stats.storm_charges),
            waits: Waits {
                wait_ms: args.in_flight_wait_ms,
                ended: log.waits.total(),
                replayed: get(&log.waits.replayed),
                acquired: get(&log.waits.acquired),
                timed_out: get(&log.waits.timed_out),
                full: get(&log.waits.full),
                hung_up: get(&log.waits.hung_up),
                store_error: get(&log.waits.store_error),
                other: get(&log.waits.other),
                planned_hangups: get(&stats.wait_hangups),
                storm_pair_hangups: get(&stats.storm_pair_hangups),
            },
            wait_read_fault: faults.wait_read_fault,
            wait_read_windows: get(&faults.wait_reads_failed.windows),
            wait_reads_failed: get(&faults.wait_reads_failed.failed),
            wait_reads_held: Duration::from_millis(get(&faults.wait_reads_failed.held_ms)),
            log_path: log.path().display().to_string(),
            charges_created: get(&log.charges_created),
            refunds_created: get(&log.refunds_created),
            commit_failures: get(&log.commit_failures),
            unstored_answers: get(&log.unstored_answers),
            aborted_successes: get(&log.aborted_successes),
            background_stores: get(&log.background_stores),
            layer_takeovers: get(&log.layer_takeovers),
            handler_takeovers: get(&log.handler_takeovers),
            log_errors: get(&log.errors),
            log_warnings: get(&log.warnings),
            panics: get(&log.panics),
            mode: args.mode,
            abandoned: get(&stats.abandoned),
            completer_charges: get(&log.completer_charges),
            completed_keys: get(&log.completed_keys),
            completer_gave_up: get(&log.completer_gave_up),
            verdict,
            phases,
        }
    }

    /// Prints the report on standard output.
    pub(crate) fn print(&self, teardown: Duration, total: Duration, kept_logs: Option<&Path>) {
        let v = &self.verdict;
        let line = |name: &str, value: u64, note: String| {
            if note.is_empty() {
                println!("  {name:<28} {value:>9}");
            } else {
                println!("  {name:<28} {value:>9}   {note}");
            }
        };
        println!();
        println!(
            "chaos run, seed {}: {} mode, {} s, {} clients, 2 instances, PostgreSQL {}{}",
            self.seed,
            self.mode.name(),
            self.duration_secs,
            self.clients,
            self.postgres,
            match self.inject_bug {
                Some(bug) => format!(", BUG INJECTED ({})", bug.name()),
                None => String::new(),
            }
        );
        println!("traffic (as the clients saw it)");
        line(
            "logical charges",
            v.charges,
            format!(
                "{} sent twice in parallel, {} resent after their answer, {} declined cards, {} \
                 caught database errors",
                v.parallel, v.resent, v.declined, v.caught
            ),
        );
        line(
            "logical refunds",
            v.refunds,
            format!(
                "of {} charges: {} sent at once with another refund of the charge (another \
                 key), {} resent after their answer, {} refused (amount_too_large or \
                 charge_already_refunded)",
                v.refunded_charges, v.refunds_parallel, v.refunds_resent, v.refunds_refused
            ),
        );
        line("requests", self.requests, String::new());
        line("retries", self.retries, String::new());
        line(
            "replays",
            self.replays,
            "answers marked Idempotent-Replayed: true".to_owned(),
        );
        line("409 in flight", self.conflicts, String::new());
        let w = &self.waits;
        line(
            "duplicates that waited",
            w.ended,
            format!(
                "up to {} ms: {} replayed, {} ran (the key was released), {} timed out, {} hung \
                 up (their clients left), {} failed reads (409), {} turned away (too many \
                 waiting), {} other",
                w.wait_ms,
                w.replayed,
                w.acquired,
                w.timed_out,
                w.hung_up,
                w.store_error,
                w.full,
                w.other
            ),
        );
        line(
            "waiting hang-ups",
            w.planned_hangups,
            format!(
                "second senders of charges sent at once that hung up 3–30 ms in; {} senders of \
                 such charges hung up by storms",
                w.storm_pair_hangups
            ),
        );
        line(
            "5xx",
            self.server_errors,
            format!(
                "{} of them 503, {} of these Overloaded",
                self.unavailable, self.overloaded
            ),
        );
        line("connection errors", self.connection_errors, String::new());
        line("timeouts", self.timeouts, String::new());
        line("hang-ups", self.hangups, String::new());
        println!("faults");
        line(
            "SIGKILLs",
            self.kills,
            format!(
                "{} charges in flight in the killed instances; {} instance starts, {} of them \
                 failed and retried",
                self.killed_in_flight, self.starts, self.failed_starts
            ),
        );
        line(
            "PostgreSQL restarts",
            self.pg_restarts,
            match self.failover {
                Some(_) => "none: the failovers below are the database's faults".to_owned(),
                None => format!(
                    "stop -m {} at {:.1} s with {} charges in flight, down {:.1} s",
                    self.restart.mode.as_str(),
                    self.restart.at.as_secs_f64(),
                    self.pg_in_flight,
                    self.restart.down_for.as_secs_f64(),
                ),
            },
        );
        let refusal = match self.refusal {
            Some(plan) if self.refusal_windows > 0 => format!(
                "by a trigger on idempotency.records at {:.1} s for {:.1} s (planned {} s; the \
                 instances' lease is {} s)",
                plan.at.as_secs_f64(),
                self.refusal_held.as_secs_f64(),
                plan.window.as_secs(),
                LEASE.as_secs()
            ),
            Some(plan) => format!(
                "planned at {:.1} s, not reached before the stop",
                plan.at.as_secs_f64()
            ),
            None => "off (--refuse-completions-secs 0, or the run is too short)".to_owned(),
        };
        line("completions refused", self.refused, refusal);
        line(
            "caught database errors",
            v.caught,
            if self.catch_percent == 0 {
                "off (--catch-percent 0, or lease mode)".to_owned()
            } else {
                format!(
                    "charges whose handler caught its failed INSERT and answered {}: {} answers, \
                     each fresh",
                    crate::catch::STATUS.as_u16(),
                    v.caught_answers
                )
            },
        );
        let storms = self
            .storms_planned
            .iter()
            .take(usize::try_from(self.storms).unwrap_or(usize::MAX))
            .map(|(at, struck)| format!("{:.1} s ({struck})", at.as_secs_f64()))
            .collect::<Vec<_>>();
        line(
            "hang-up storms",
            self.storms,
            if self.storms == 0 {
                "off (--storms 0)".to_owned()
            } else {
                format!(
                    "at {} (clients struck): {} charges sent in them, {} requests hung up; {} × \
                     503 Overloaded",
                    storms.join(", "),
                    self.storm_charges,
                    self.storm_hangups,
                    self.overloaded
                )
            },
        );
        let failed_reads = match self.wait_read_fault {
            Some(plan) if self.wait_read_windows > 0 => format!(
                "by the database (chaos.pg_try_advisory_xact_lock) at {:.1} s for {:.1} s: {} \
                 waiters' reads answered 409, the others retries' claims (503)",
                plan.at.as_secs_f64(),
                self.wait_reads_held.as_secs_f64(),
                self.waits.store_error
            ),
            Some(plan) => format!(
                "planned at {:.1} s, not reached before the stop",
                plan.at.as_secs_f64()
            ),
            None => "off (--fail-wait-reads-secs 0, or the run is too short)".to_owned(),
        };
        line("waiting reads failed", self.wait_reads_failed, failed_reads);
        println!("server side");
        let written = if self.charges_created >= v.rows {
            format!(
                "{} rows committed: {} written and rolled back (a kill, the database restart \
                 or a failed commit between the write and the commit)",
                v.rows,
                self.charges_created - v.rows
            )
        } else {
            format!(
                "{} rows committed: {} more than logged (written, then the handler was killed \
                 before logging, and the write stayed)",
                v.rows,
                v.rows - self.charges_created
            )
        };
        line("charges logged by handlers", self.charges_created, written);
        line(
            "refunds logged by handlers",
            self.refunds_created,
            format!(
                "{} refund rows committed, {} cents refunded in all",
                v.refund_rows, v.refunded_amount
            ),
        );
        line(
            "failed commits (503)",
            self.commit_failures,
            "the database restart, kills, and refused completions".to_owned(),
        );
        line(
            "answered over a failed tx",
            self.unstored_answers,
            format!(
                "delivered unstored, nothing committed, key released; {} success answers turned \
                 into 500",
                self.aborted_successes
            ),
        );
        line(
            "stored in the background",
            self.background_stores,
            "delivered responses whose storing failed, stored later with their claim kept alive; \
             0 when every handler writes through its transaction (a failed store is then a \
             failed commit)"
                .to_owned(),
        );
        let takeovers = v.takeover_records.max(self.layer_takeovers);
        let takeover_note = match self.inject_bug {
            _ if self.mode == Mode::Steps => format!(
                "lease mode: {} logged by the layer, {} seen by the charge handler (its finished \
                 steps taken back), {} records",
                self.layer_takeovers, self.handler_takeovers, v.takeover_records
            ),
            Some(Bug::LeaseMode) => format!(
                "lease mode: {} logged by the layer, {} seen by the handler, {} records",
                self.layer_takeovers, self.handler_takeovers, v.takeover_records
            ),
            _ => format!(
                "records {} / logged {}: transactional mode commits a claim only with its \
                 response, so no record is left in flight to take over",
                v.takeover_records, self.layer_takeovers
            ),
        };
        line("takeovers", takeovers, takeover_note);
        if self.mode == Mode::Steps {
            self.print_steps(&line);
        }
        line(
            "demo log errors",
            self.log_errors,
            format!(
                "{} warnings, {} panics ({})",
                self.log_warnings, self.panics, self.log_path
            ),
        );
        print_webhooks(&v.webhooks, &line);
        if let Some(failover) = &self.failover {
            self.print_failover(failover, &line);
        }
        println!("invariants");
        let settlements = v.webhooks.invariants();
        for (name, count) in v.invariants().into_iter().chain(settlements) {
            line(
                name,
                count,
                if count == 0 { "ok" } else { "FAILED" }.to_owned(),
            );
        }
        if !v.examples.is_empty() {
            println!("failures");
            for (kind, shown, more) in &v.examples {
                println!("  {kind}:");
                for example in shown {
                    println!("    - {example}");
                }
                if *more > 0 {
                    println!("    ... and {more} more");
                }
            }
        }
        let p = &self.phases;
        println!(
            "time: setup {:.1} s, chaos {:.1} s, drain {:.1} s, checks {:.1} s, teardown {:.1} s; \
             total {:.1} s (bounded by the chaos + {} s drain + start-up and checks)",
            p.setup.as_secs_f64(),
            p.chaos.as_secs_f64(),
            p.drain.as_secs_f64(),
            p.verify.as_secs_f64(),
            teardown.as_secs_f64(),
            total.as_secs_f64(),
            self.drain_secs,
        );
        if let Some(dir) = kept_logs {
            println!(
                "logs kept in {} (demo.log, and postgresql.log or ha/logs); remove it when done",
                dir.display()
            );
        }
        println!("{}", if v.passed() { "PASS" } else { "FAIL" });
    }
}
