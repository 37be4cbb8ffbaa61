//! The scenarios, as data: what runs, against which baseline, and the targets it must meet.
//!
//! A new scenario is one more entry in [`SCENARIOS`]: a server [`App`] and a [`Workload`] for
//! HTTP, or a [`StoreOp`] for the store alone. A scenario that needs a new kind of server adds
//! a variant to [`App`]; one that needs a new kind of request, a variant to
//! [`Keys`] or [`BodySize`]; one that needs the database filled first (a
//! full store) adds that step to [`Runner::Http`] and runs it in `run::measure` before the
//! server starts. The table and the targets need no change.

use std::fmt;

use crate::{
    BoxError,
    app::App,
    ceiling::StoreOp,
    load::{BodySize, Keys, Workload},
};

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
    pub(crate) targets: &'static [Target],
}

/// How a scenario is measured.
#[derive(Debug)]
pub(crate) enum Runner {
    /// A server process running `app`, driven over HTTP/1.1 keep-alive connections.
    Http {
        app: App,
        workload: Workload,
        /// A fixed concurrency that is part of the scenario's definition; `None` takes
        /// `--connections`.
        connections: Option<usize>,
    },
    /// The PostgreSQL store's operations through its `Store` trait, in the benchmark process.
    Store { op: StoreOp },
}

/// A target from issue 5, checked on the medians.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target {
    /// req/s at least this multiple of the baseline's.
    Throughput(f64),
    /// p99 latency at most this multiple of the baseline's.
    P99(f64),
    /// The server's peak RSS at most this many bytes.
    PeakRss(u64),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Throughput(ratio) => write!(f, "req/s ≥ {ratio}×"),
            Self::P99(ratio) => write!(f, "p99 ≤ {ratio}×"),
            Self::PeakRss(bytes) => write!(f, "RSS ≤ {} MiB", bytes / MIB),
        }
    }
}

/// A small charge with a fresh key: a new request.
const NEW_CHARGES: Workload = Workload {
    keys: Keys::Fresh,
    body: BodySize::Small,
};

/// Every scenario, in the order a round runs them (odd rounds run them backwards).
pub(crate) static SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "bare",
        about: "the charge handler (one INSERT through the pool) without the layer: the baseline",
        baseline: None,
        runner: Runner::Http {
            app: App::Bare,
            workload: NEW_CHARGES,
            connections: None,
        },
        targets: &[],
    },
    Scenario {
        name: "lease",
        about: "the same handler behind IdempotencyLayer::postgres (lease mode), a new key per request",
        baseline: Some("bare"),
        runner: Runner::Http {
            app: App::Lease,
            workload: NEW_CHARGES,
            connections: None,
        },
        targets: &[Target::Throughput(0.6)],
    },
    Scenario {
        name: "transactional",
        about: "the handler's INSERT, the claim and the record in one transaction \
                (IdempotencyLayer::postgres(pool).transactional()), a new key per request",
        baseline: Some("bare"),
        runner: Runner::Http {
            app: App::Transactional,
            workload: NEW_CHARGES,
            connections: None,
        },
        targets: &[Target::Throughput(0.8)],
    },
    Scenario {
        name: "replay",
        about: "the lease server answering retries of completed keys",
        baseline: Some("bare"),
        runner: Runner::Http {
            app: App::Lease,
            workload: Workload {
                keys: Keys::Completed { per_connection: 16 },
                body: BodySize::Small,
            },
            connections: None,
        },
        targets: &[Target::Throughput(1.5), Target::P99(1.0)],
    },
    Scenario {
        name: "memory-bare",
        about: "a handler doing no I/O, without the layer: the memory store's baseline",
        baseline: None,
        runner: Runner::Http {
            app: App::MemoryBare,
            workload: NEW_CHARGES,
            connections: None,
        },
        targets: &[],
    },
    Scenario {
        name: "memory",
        about: "the no-I/O handler behind IdempotencyLayer::memory(), a new key per request",
        baseline: Some("memory-bare"),
        runner: Runner::Http {
            app: App::Memory,
            workload: NEW_CHARGES,
            connections: None,
        },
        targets: &[Target::Throughput(0.8)],
    },
    Scenario {
        name: "store-ceiling",
        about: "the PostgreSQL store's begin + complete for a new key, through sqlx, no HTTP",
        baseline: Some("bare"),
        runner: Runner::Store {
            op: StoreOp::ClaimComplete,
        },
        targets: &[],
    },
    Scenario {
        name: "store-lookup",
        about: "the PostgreSQL store's begin on a completed key (a replay's lookup), no HTTP",
        baseline: Some("bare"),
        runner: Runner::Store {
            op: StoreOp::Lookup { per_client: 16 },
        },
        targets: &[],
    },
    Scenario {
        name: "large-bodies",
        about: "1 MiB JSON request bodies through the lease layer at 64 connections: peak RSS",
        baseline: None,
        runner: Runner::Http {
            app: App::Lease,
            workload: Workload {
                keys: Keys::Fresh,
                body: BodySize::Padded(1 << 20),
            },
            connections: Some(64),
        },
        // At most one buffered copy of each body: 64 × 2 MiB + 64 MiB.
        targets: &[Target::PeakRss(64 * 2 * MIB + 64 * MIB)],
    },
];

/// Looks a scenario up by name.
pub(crate) fn find(name: &str) -> Option<&'static Scenario> {
    SCENARIOS.iter().find(|scenario| scenario.name == name)
}

/// The scenarios named (all if none), with their baselines, in [`SCENARIOS`] order.
pub(crate) fn select(names: &[String]) -> Result<Vec<&'static Scenario>, BoxError> {
    if names.is_empty() {
        return Ok(SCENARIOS.iter().collect());
    }
    let mut wanted = Vec::new();
    for name in names
        .iter()
        .map(|name| name.trim())
        .filter(|n| !n.is_empty())
    {
        let scenario = find(name).ok_or_else(|| {
            let known: Vec<&str> = SCENARIOS.iter().map(|s| s.name).collect();
            format!("unknown scenario `{name}`; known: {}", known.join(", "))
        })?;
        wanted.push(scenario.name);
        wanted.extend(scenario.baseline);
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
    fn names_are_unique_and_baselines_exist_and_are_plain() {
        for (i, scenario) in SCENARIOS.iter().enumerate() {
            assert!(
                SCENARIOS[..i].iter().all(|s| s.name != scenario.name),
                "{} twice",
                scenario.name
            );
            if let Some(baseline) = scenario.baseline {
                let baseline = find(baseline).expect("baseline exists");
                assert!(baseline.baseline.is_none(), "baselines have no baseline");
                assert!(matches!(baseline.runner, Runner::Http { .. }));
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
    }

    #[test]
    fn selecting_adds_baselines_in_table_order() {
        let names = |v: Vec<&Scenario>| v.iter().map(|s| s.name).collect::<Vec<_>>();
        let picked = select(&["memory".into(), "replay".into()]).unwrap();
        assert_eq!(names(picked), ["bare", "replay", "memory-bare", "memory"]);
        assert_eq!(select(&[]).unwrap().len(), SCENARIOS.len());
        assert!(select(&["nope".into()]).is_err());
    }
}
