//! The report's section of a `--failover` run ([`failover`](crate::failover)): the kills and
//! what each failover cost, then the counts a failover can break.

use std::time::Duration;

use super::Report;
use crate::{
    RunArgs,
    database::Database,
    failover::{Failover, Failovers},
    ha::Replication,
};

/// What the failovers did.
#[derive(Debug)]
pub(crate) struct FailoverFigures {
    replication: Replication,
    minimum: u32,
    lag: Duration,
    kills: Vec<Failover>,
}

impl FailoverFigures {
    /// The figures of a `--failover` run on `database`; `None` for any other run.
    pub(crate) fn new(args: &RunArgs, database: &Database, failovers: &Failovers) -> Option<Self> {
        let Database::Ha { cluster, .. } = database else {
            return None;
        };
        Some(Self {
            replication: cluster.replication(),
            minimum: args.failovers,
            lag: failovers.lag,
            kills: failovers.list(),
        })
    }
}

impl Report {
    /// The failover section: each kill, then what a lost acknowledgement turns into.
    pub(super) fn print_failover(&self, f: &FailoverFigures, line: &impl Fn(&str, u64, String)) {
        let v = &self.verdict;
        println!(
            "failover (two Patroni nodes behind HAProxy, {} replication; the acquirer outside \
             the cluster)",
            f.replication.name()
        );
        let failed_over = f.kills.iter().filter(|kill| kill.failed_over()).count() as u64;
        let slowest = |of: fn(&Failover) -> Duration| {
            f.kills
                .iter()
                .map(of)
                .max()
                .unwrap_or_default()
                .as_secs_f64()
        };
        line(
            "failovers",
            failed_over,
            format!(
                "of {} kills of the primary (at least {}; {}); first write through the endpoint \
                 at most {:.1} s after a kill, killed node a standby again at most {:.1} s later",
                f.kills.len(),
                f.minimum,
                if f.lag.is_zero() {
                    "postmaster and whole node in turn".to_owned()
                } else {
                    format!(
                        "postmaster and whole node in turn, its walsenders stopped {} ms \
                         before a whole node",
                        f.lag.as_millis()
                    )
                },
                slowest(|kill| kill.first_write),
                slowest(|kill| kill.rejoined),
            ),
        );
        for kill in &f.kills {
            println!(
                "    {:>6.1} s  {:<10} {} -> {}: first write {:.1} s later, rejoined in {:.1} s",
                kill.at.as_secs_f64(),
                kill.kill.name(),
                kill.killed,
                kill.promoted,
                kill.first_write.as_secs_f64(),
                kill.rejoined.as_secs_f64()
            );
        }
        let lost = v.acknowledged_lost;
        line(
            "acknowledged records lost",
            lost.records,
            format!(
                "answers clients received whose record is gone: {} left without their row, \
                 {} ran again",
                lost.without_row, lost.ran_again
            ),
        );
        line("double executions", v.double_executions, String::new());
        if self.mode == crate::Mode::Steps {
            line(
                "double authorizations",
                v.double_authorizations,
                String::new(),
            );
            line(
                "orphaned authorizations",
                v.orphaned_authorizations,
                String::new(),
            );
        }
        line("stuck keys", v.stuck_keys, String::new());
    }
}
