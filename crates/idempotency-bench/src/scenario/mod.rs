//! The scenarios, as data: what runs, against which baseline, and the targets it must meet.
//!
//! A new scenario is one more entry in [`SCENARIOS`]: a server [`App`] and a [`Workload`] for
//! HTTP ([`Http`]), a [`StoreOp`] for the store alone, or a [`Storm`] of duplicates. A scenario that needs a new kind of
//! server adds a variant to [`App`]; one that needs a new kind of request, a variant to
//! [`Keys`] or [`BodySize`]; one that needs its database in some state first (a full store,
//! expired records), a [`Database`] that `run::databases::Databases` prepares. The table and the targets
//! need no change.

mod table;

use std::fmt;

pub(crate) use self::table::{HOSTILE_BODY_BYTES, SCENARIOS};
#[cfg(doc)]
use crate::load::{BodySize, Keys};
use crate::{BoxError, app::App, ceiling::StoreOp, load::Workload};

const MIB: u64 = 1024 * 1024;

/// One line of the table.
#[derive(Debug)]
pub(crate) struct Scenario {
    /// Its name on the command line and in the table.
    pub(crate) name: &'static str,
    /// One sentence for `--list`.
    pub(crate) about: &'static str,
    /// The scenario its ratios are taken against (run whenever this one is).
    pub(crate) baseline: Option<&'static str>,
    pub(crate) runner: Runner,
    /// A scale scenario (issue 7): run only when named (or with `--scenarios scale`).
    pub(crate) scale: bool,
    pub(crate) targets: &'static [Target],
}

/// How a scenario is measured.
#[derive(Debug)]
pub(crate) enum Runner {
    /// Server processes, driven over HTTP/1.1 keep-alive connections.
    Http(Http),
    /// The PostgreSQL store's operations through its `Store` trait, in the benchmark process.
    Store { op: StoreOp },
    /// Storms of duplicates: one server process, many requests with one key at once.
    Storm(Storm),
    /// Fresh keys at full load while `waiters` duplicates wait for one slow key on a second
    /// server (0: the key sent alone); see `run::waiters`.
    Waiters { waiters: usize, waits: bool },
}

/// A storm scenario: for each of `--storm-keys` keys, [`size`](Self::size) requests with that
/// key sent at once, each on a connection of its own, to one server of `app`; see `storm`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Storm {
    /// A server whose handler is slow, so that every duplicate arrives while the first runs.
    pub(crate) app: App,
    /// Requests per key.
    pub(crate) size: usize,
    /// Whether the duplicates wait for the first request (and must all be replays of it), or
    /// may be refused with `409`.
    pub(crate) waits: bool,
}

/// An HTTP scenario: which servers, on which database, doing what.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Http {
    pub(crate) app: App,
    pub(crate) workload: Workload,
    /// A fixed concurrency that is part of the scenario's definition; `None` takes
    /// `--connections`.
    pub(crate) connections: Option<usize>,
    /// The database the servers use, and the state it is put in before each measurement.
    pub(crate) database: Database,
    /// How many server processes share the load.
    pub(crate) instances: Instances,
    /// What else happens while the load runs.
    pub(crate) during: During,
    /// What is checked once the measurement is over, with the servers still up.
    pub(crate) after: After,
}

impl Http {
    /// `app` serving `workload` on the run's database, one instance, nothing else going on.
    pub(crate) const fn new(app: App, workload: Workload) -> Self {
        Self {
            app,
            workload,
            connections: None,
            database: Database::Run,
            instances: Instances::One,
            during: During::Nothing,
            after: After::Nothing,
        }
    }

    /// The same on `database`.
    pub(crate) const fn on(self, database: Database) -> Self {
        Self { database, ..self }
    }
}

/// The databases of a run. Each is created (and dropped) once per run, and only when a
/// selected scenario uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Database {
    /// The run's own database, shared by the core scenarios.
    Run,
    /// An empty store, but for `EMPTY_STORE_ROWS` completed records for replays to find,
    /// filled by the same SQL as [`Full`](Self::Full).
    Empty,
    /// A store pre-filled once per run with `--full-store-rows` completed records.
    Full,
    /// `--expired-rows` expired records in `idempotency.records`, restored (and the table
    /// vacuumed) before each measurement.
    Expired,
    /// Partitioned mode's table with `--expired-rows` expired records in expired partitions,
    /// restored before each measurement.
    ExpiredPartitions,
}

/// How many server processes a scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Instances {
    One,
    /// `--instances` of them, each with its own pool; connection `i` talks to instance
    /// `i % n`.
    Many,
}

/// What runs alongside the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum During {
    Nothing,
    /// `continuously_delete_expired` in the (first) server process, started when the window
    /// opens; the window closes when the expired records are gone (or after
    /// `REAPING_CAP`). Reaping statements are timed, locks sampled, WAL counted.
    Reaping,
}

/// What is checked after the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    Nothing,
    /// `--duplicate-keys` keys, each sent at once to every instance: each must run once.
    DuplicateBurst,
}

/// A target from issues 5 and 7, checked on the medians.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target {
    /// req/s at least this multiple of the baseline's.
    Throughput(f64),
    /// req/s at least `min` times the baseline's, where `bound`, printed beside it, is what
    /// limits any layer here: the target is anchored to that bound, not to a wish.
    Bounded { min: f64, bound: &'static str },
    /// p99 latency at most this multiple of the baseline's.
    P99(f64),
    /// The server's peak RSS at most this many bytes.
    PeakRss(u64),
    /// Every key of the duplicate burst executed exactly once, in every round.
    ExactlyOnce,
    /// Every key of a storm of this many duplicates executed once and replayed to all the
    /// others, with no `409` and no other answer, in every round.
    StormReplayed(usize),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Throughput(ratio) => write!(f, "req/s ≥ {ratio}×"),
            Self::Bounded { min, bound } => write!(f, "req/s ≥ {min}× ({bound})"),
            Self::P99(ratio) => write!(f, "p99 ≤ {ratio}×"),
            Self::PeakRss(bytes) => write!(f, "RSS ≤ {} MiB", bytes / MIB),
            Self::ExactlyOnce => f.write_str("one execution per key"),
            Self::StormReplayed(size) => write!(
                f,
                "1 execution, {} replays, 0 409s per key",
                size.saturating_sub(1)
            ),
        }
    }
}

/// Looks a scenario up by name.
pub(crate) fn find(name: &str) -> Option<&'static Scenario> {
    SCENARIOS.iter().find(|scenario| scenario.name == name)
}

/// Names that select a group of scenarios.
const GROUPS: &[(&str, &[&str])] = &[
    (
        "scale",
        &[
            "full-lease",
            "full-replay-store",
            "full-replay-cached",
            "expiry-reap",
            "partitioned-reap",
            "many-instances",
            "waiter-storm-quiet",
            "waiter-storm",
            "waiter-storm-409",
        ],
    ),
    (
        "full-store",
        &["full-lease", "full-replay-store", "full-replay-cached"],
    ),
    ("expiry", &["expiry-reap", "partitioned-reap"]),
];

/// The scenarios named (the core ones if none), with their baselines, in [`SCENARIOS`] order.
/// A group name (`scale`, `full-store`, `expiry`) stands for its scenarios.
pub(crate) fn select(names: &[String]) -> Result<Vec<&'static Scenario>, BoxError> {
    if names.iter().all(|name| name.trim().is_empty()) {
        return Ok(SCENARIOS.iter().filter(|s| !s.scale).collect());
    }
    let mut wanted = Vec::new();
    for name in names
        .iter()
        .map(|name| name.trim())
        .filter(|n| !n.is_empty())
    {
        let members: Vec<&str> = match GROUPS.iter().find(|(group, _)| *group == name) {
            Some((_, members)) => members.to_vec(),
            None => vec![name],
        };
        for member in members {
            let scenario = find(member).ok_or_else(|| {
                let known: Vec<&str> = SCENARIOS
                    .iter()
                    .map(|s| s.name)
                    .chain(GROUPS.iter().map(|(group, _)| *group))
                    .collect();
                format!("unknown scenario `{member}`; known: {}", known.join(", "))
            })?;
            // A baseline may have its own (lease-wait, lease, bare): each ratio needs its own.
            let mut next = Some(scenario);
            while let Some(scenario) = next {
                wanted.push(scenario.name);
                next = scenario.baseline.and_then(find);
            }
        }
    }
    Ok(SCENARIOS
        .iter()
        .filter(|scenario| wanted.contains(&scenario.name))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_baseline_chains_end() {
        for (i, scenario) in SCENARIOS.iter().enumerate() {
            assert!(
                SCENARIOS[..i].iter().all(|s| s.name != scenario.name),
                "{} twice",
                scenario.name
            );
            assert!(
                GROUPS.iter().all(|(group, _)| *group != scenario.name),
                "{} is a group",
                scenario.name
            );
            if let Some(baseline) = scenario.baseline {
                let baseline = find(baseline).expect("baseline exists");
                // A chain of baselines ends, earlier in the table.
                assert!(
                    SCENARIOS[..i].iter().any(|s| s.name == baseline.name),
                    "{}",
                    scenario.name
                );
                let storm = |s: &Scenario| matches!(s.runner, Runner::Storm(_));
                assert!(!matches!(baseline.runner, Runner::Store { .. }));
                assert_eq!(storm(baseline), storm(scenario), "{}", scenario.name);
                assert_eq!(baseline.scale, scenario.scale, "{}", scenario.name);
            }
            for target in scenario.targets {
                if let Target::StormReplayed(size) = target {
                    assert!(
                        matches!(scenario.runner, Runner::Storm(s) if s.waits && s.size == *size),
                        "{}",
                        scenario.name
                    );
                }
            }
            let relative = scenario
                .targets
                .iter()
                .any(|t| matches!(t, Target::Throughput(_) | Target::P99(_)));
            assert!(
                !relative || scenario.baseline.is_some(),
                "{}",
                scenario.name
            );
        }
        for (_, members) in GROUPS {
            assert!(members.iter().all(|m| find(m).is_some_and(|s| s.scale)));
        }
    }

    #[test]
    fn selecting_adds_baselines_in_table_order() {
        let names = |v: Vec<&Scenario>| v.iter().map(|s| s.name).collect::<Vec<_>>();
        let picked = select(&["memory".into(), "replay".into()]).unwrap();
        assert_eq!(names(picked), ["bare", "replay", "memory-bare", "memory"]);
        let picked = select(&["memory-bare-busy".into(), "memory".into()]).unwrap();
        assert_eq!(names(picked), ["memory-bare", "memory", "memory-bare-busy"]);
        let picked = select(&["lease-wait".into()]).unwrap();
        assert_eq!(names(picked), ["bare", "lease", "lease-wait"]);
        assert!(select(&["nope".into()]).is_err());
    }

    #[test]
    fn scale_scenarios_are_opt_in() {
        let default = select(&[]).unwrap();
        assert_eq!(default.len(), SCENARIOS.iter().filter(|s| !s.scale).count());
        assert!(default.iter().all(|s| !s.scale));
        let names = |v: Vec<&Scenario>| v.iter().map(|s| s.name).collect::<Vec<_>>();
        assert_eq!(
            names(select(&["expiry".into()]).unwrap()),
            [
                "expiry-idle",
                "expiry-reap",
                "partitioned-idle",
                "partitioned-reap"
            ]
        );
        assert_eq!(
            select(&["scale".into()]).unwrap().len(),
            SCENARIOS.iter().filter(|s| s.scale).count()
        );
    }
}
