//! The scenarios, as data: what runs, against which baseline, and the targets it must meet.
//!
//! A new scenario is one more entry in [`SCENARIOS`]: a server [`App`] and a [`Workload`] for
//! HTTP ([`Http`]), a [`StoreOp`] for the store alone, or a [`Storm`] of duplicates. A scenario that needs a new kind of
//! server adds a variant to [`App`]; one that needs a new kind of request, a variant to
//! [`Keys`] or [`BodySize`]; one that needs its database in some state first (a full store,
//! expired records), a [`Database`] that `run::databases::Databases` prepares. The table and the targets
//! need no change.

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

/// A small charge with a fresh key: a new request.
const NEW_CHARGES: Workload = Workload {
    keys: Keys::Fresh,
    body: BodySize::Small,
};

/// Retries of pre-filled completed records, each request a random one: through the store.
const RANDOM_REPLAYS: Workload = Workload {
    keys: Keys::Filled { working_set: None },
    body: BodySize::Small,
};

/// Retries of 16 pre-filled completed records per connection, in turn: the replay cache.
const CACHED_REPLAYS: Workload = Workload {
    keys: Keys::Filled {
        working_set: Some(16),
    },
    body: BodySize::Small,
};

/// Requests per key in the duplicate storms.
const STORM_SIZE: usize = 32;

/// The hostile bodies' size: just under the layer's default limit (2 MiB), and axum's.
pub(crate) const HOSTILE_BODY_BYTES: usize = 2 * 1024 * 1024 - 1024;

/// The hostile-body scenarios' fixed concurrency.
const HOSTILE_CONNECTIONS: usize = 16;

/// New keys, each request a nearly 2 MiB form of a million pairs.
const HOSTILE_FORM: Workload = Workload {
    keys: Keys::Fresh,
    body: BodySize::RepeatedPairs(HOSTILE_BODY_BYTES),
};

/// Every scenario, in the order a round runs them (odd rounds run them backwards).
pub(crate) static SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "bare",
        about: "the charge handler (one INSERT through the pool) without the layer: the baseline",
        baseline: None,
        runner: Runner::Http(Http::new(App::Bare, NEW_CHARGES)),
        scale: false,
        targets: &[],
    },
    Scenario {
        name: "lease",
        about: "the same handler behind IdempotencyLayer::postgres (lease mode), a new key per request",
        baseline: Some("bare"),
        runner: Runner::Http(Http::new(App::Lease, NEW_CHARGES)),
        scale: false,
        targets: &[Target::Throughput(0.6)],
    },
    Scenario {
        name: "lease-wait",
        about: "lease mode with duplicates waiting for their key (with_in_flight_wait(5 s)), so \
                every completion also announces its key (pg_notify in the batched completion) and \
                one pooled connection listens; a new key per request, so nobody waits",
        baseline: Some("lease"),
        runner: Runner::Http(Http::new(App::LeaseWait, NEW_CHARGES)),
        scale: false,
        targets: &[Target::Throughput(0.95)],
    },
    Scenario {
        name: "transactional",
        about: "the handler's INSERT, the claim and the record in one transaction \
                (IdempotencyLayer::new(PostgresStore::new(pool).transactional())), a new key per request",
        baseline: Some("bare"),
        runner: Runner::Http(Http::new(App::Transactional, NEW_CHARGES)),
        scale: false,
        targets: &[Target::Throughput(0.8)],
    },
    Scenario {
        name: "replay",
        about: "the lease server answering retries of keys it completed before the window, with the default \
                16 MiB replay cache: each key's first retry reads the store, the others are answered \
                from memory",
        baseline: Some("bare"),
        runner: Runner::Http(Http::new(
            App::Lease,
            Workload {
                keys: Keys::Completed { per_connection: 16 },
                body: BodySize::Small,
            },
        )),
        scale: false,
        targets: &[Target::Throughput(1.5), Target::P99(1.0)],
    },
    Scenario {
        name: "memory-bare",
        about: "a handler doing no I/O, without the layer: the memory store's baseline",
        baseline: None,
        runner: Runner::Http(Http::new(App::MemoryBare, NEW_CHARGES)),
        scale: false,
        targets: &[],
    },
    Scenario {
        name: "memory",
        about: "the no-I/O handler behind IdempotencyLayer::memory(), a new key per request",
        baseline: Some("memory-bare"),
        runner: Runner::Http(Http::new(App::Memory, NEW_CHARGES)),
        scale: false,
        targets: &[Target::Throughput(0.8)],
    },
    Scenario {
        name: "memory-bare-busy",
        about: "the no-I/O handler spending 1 µs of CPU per request first, without the layer: \
                what one microsecond of work per request costs here, to read the memory ratio by",
        baseline: Some("memory-bare"),
        runner: Runner::Http(Http::new(App::MemoryBareBusy, NEW_CHARGES)),
        scale: false,
        targets: &[],
    },
    Scenario {
        name: "store-ceiling",
        about: "the PostgreSQL store's claim + complete for a new key, through sqlx, no HTTP",
        baseline: Some("bare"),
        runner: Runner::Store {
            op: StoreOp::ClaimComplete,
        },
        scale: false,
        targets: &[],
    },
    Scenario {
        name: "store-lookup",
        about: "the PostgreSQL store's claim on a completed key (a replay's lookup), no HTTP",
        baseline: Some("bare"),
        runner: Runner::Store {
            op: StoreOp::Lookup { per_client: 16 },
        },
        scale: false,
        targets: &[],
    },
    Scenario {
        name: "duplicate-storm-no-wait",
        about: "32 requests with one key at once, each on its own connection, to a lease server \
                whose handler takes 200 ms, for --storm-keys keys (20), waiting off (the default): \
                one runs, the duplicates get 409",
        baseline: None,
        runner: Runner::Storm(Storm {
            app: App::SlowLease,
            size: STORM_SIZE,
            waits: false,
        }),
        scale: false,
        targets: &[],
    },
    Scenario {
        name: "duplicate-storm",
        about: "the same storm with waiting on (with_in_flight_wait(5 s)): the duplicates wait for \
                the first answer, woken by LISTEN/NOTIFY, and must all be replays of it",
        baseline: Some("duplicate-storm-no-wait"),
        runner: Runner::Storm(Storm {
            app: App::SlowLeaseWait,
            size: STORM_SIZE,
            waits: true,
        }),
        scale: false,
        targets: &[Target::StormReplayed(STORM_SIZE)],
    },
    Scenario {
        name: "waiter-storm-quiet",
        about: "fresh keys at full load on a waiting lease server, while a second one runs one \
                key with a 200 ms handler, sent once: the baseline of waiter-storm",
        baseline: None,
        runner: Runner::Waiters {
            waiters: 0,
            waits: true,
        },
        scale: true,
        targets: &[],
    },
    Scenario {
        name: "waiter-storm",
        about: "the same with the key sent by 1,001 requests at once: 1,000 wait for it \
                (issue 34.3); the other keys' req/s and p99, the holder's answer, the records' \
                row updates",
        baseline: Some("waiter-storm-quiet"),
        runner: Runner::Waiters {
            waiters: crate::run::WAITERS,
            waits: true,
        },
        scale: true,
        targets: &[Target::Throughput(0.9)],
    },
    Scenario {
        name: "waiter-storm-409",
        about: "the same 1,000 duplicates on a server that does not wait: each gets 409 after \
                its one read; the bound of waiter-storm (the holder's answer with 1,000 first \
                reads and no waiting)",
        baseline: Some("waiter-storm-quiet"),
        runner: Runner::Waiters {
            waiters: crate::run::WAITERS,
            waits: false,
        },
        scale: true,
        targets: &[],
    },
    Scenario {
        name: "large-bodies",
        about: "1 MiB JSON request bodies through the lease layer at 64 connections: peak RSS",
        baseline: None,
        runner: Runner::Http(Http {
            connections: Some(64),
            ..Http::new(
                App::Lease,
                Workload {
                    keys: Keys::Fresh,
                    body: BodySize::Padded(1 << 20),
                },
            )
        }),
        // At most one buffered copy of each body: 64 × 2 MiB + 64 MiB.
        scale: false,
        targets: &[Target::PeakRss(64 * 2 * MIB + 64 * MIB)],
    },
    Scenario {
        name: "hostile-bare",
        about: "nearly 2 MiB form bodies, `a&a&a…` (a million pairs), to a handler that reads any \
                body and parses none, without the layer, at 16 connections: the hostile bodies' baseline",
        baseline: None,
        runner: Runner::Http(Http {
            connections: Some(HOSTILE_CONNECTIONS),
            ..Http::new(App::AnyBodyBare, HOSTILE_FORM)
        }),
        scale: false,
        targets: &[],
    },
    Scenario {
        name: "hostile-form",
        about: "the same form bodies behind IdempotencyLayer::memory(): the fingerprint's cost for \
                a million pairs (CPU per request, peak RSS)",
        baseline: Some("hostile-bare"),
        runner: Runner::Http(Http {
            connections: Some(HOSTILE_CONNECTIONS),
            ..Http::new(App::AnyBodyMemory, HOSTILE_FORM)
        }),
        scale: false,
        targets: &[],
    },
    Scenario {
        name: "hostile-json",
        about: "nearly 2 MiB JSON bodies nested 120 objects deep, every object's members out of \
                order, behind IdempotencyLayer::memory() (its baseline receives forms of the same size)",
        baseline: Some("hostile-bare"),
        runner: Runner::Http(Http {
            connections: Some(HOSTILE_CONNECTIONS),
            ..Http::new(
                App::AnyBodyMemory,
                Workload {
                    keys: Keys::Fresh,
                    body: BodySize::DeepUnordered {
                        depth: 120,
                        size: HOSTILE_BODY_BYTES,
                    },
                },
            )
        }),
        scale: false,
        targets: &[],
    },
    // The scale scenarios (issue 7): opt-in, see `--scenarios scale`.
    Scenario {
        name: "empty-lease",
        about: "lease mode, a new key per request, on a store holding only 1,000 completed records: \
                the full store's baseline",
        baseline: None,
        runner: Runner::Http(Http::new(App::Lease, NEW_CHARGES).on(Database::Empty)),
        scale: true,
        targets: &[],
    },
    Scenario {
        name: "full-lease",
        about: "the same on a store pre-filled with --full-store-rows completed records (10 million)",
        baseline: Some("empty-lease"),
        runner: Runner::Http(Http::new(App::Lease, NEW_CHARGES).on(Database::Full)),
        scale: true,
        targets: &[Target::Throughput(0.9)],
    },
    Scenario {
        name: "empty-replay-store",
        about: "replays through the store (replay cache off: with_replay_cache(0)), each a random \
                record among the 1,000 of the empty store",
        baseline: None,
        runner: Runner::Http(Http::new(App::LeaseNoCache, RANDOM_REPLAYS).on(Database::Empty)),
        scale: true,
        targets: &[],
    },
    Scenario {
        name: "full-replay-store",
        about: "the same on the full store: each replay a random record among the 10 million, \
                read from the store",
        baseline: Some("empty-replay-store"),
        runner: Runner::Http(Http::new(App::LeaseNoCache, RANDOM_REPLAYS).on(Database::Full)),
        scale: true,
        targets: &[Target::Throughput(0.9)],
    },
    Scenario {
        name: "empty-replay-cached",
        about: "replays with the default 16 MiB replay cache: each connection retries 16 records of \
                the empty store in turn, so all but each key's first retry come from memory",
        baseline: None,
        runner: Runner::Http(Http::new(App::Lease, CACHED_REPLAYS).on(Database::Empty)),
        scale: true,
        targets: &[],
    },
    Scenario {
        name: "full-replay-cached",
        about: "the same with 16 records per connection drawn from the full store's 10 million",
        baseline: Some("empty-replay-cached"),
        runner: Runner::Http(Http::new(App::Lease, CACHED_REPLAYS).on(Database::Full)),
        scale: true,
        targets: &[Target::Throughput(0.9)],
    },
    Scenario {
        name: "expiry-idle",
        about: "lease mode, a new key per request, with --expired-rows expired records (1 million) \
                in the table and no reaper: the reaper's baseline",
        baseline: None,
        runner: Runner::Http(Http::new(App::Lease, NEW_CHARGES).on(Database::Expired)),
        scale: true,
        targets: &[],
    },
    Scenario {
        name: "expiry-reap",
        about: "the same while continuously_delete_expired (in the server process, on its pool, \
                --reaper-batch rows a batch) deletes the expired records; measured until they are gone",
        baseline: Some("expiry-idle"),
        runner: Runner::Http(Http {
            during: During::Reaping,
            ..Http::new(App::Lease, NEW_CHARGES).on(Database::Expired)
        }),
        scale: true,
        targets: &[Target::P99(1.5)],
    },
    Scenario {
        name: "partitioned-idle",
        about: "partitioned mode (PostgresStore::partitioned, 6 h partitions), a new key per request, \
                with --expired-rows expired records in 4 expired partitions, no reaper",
        baseline: None,
        runner: Runner::Http(
            Http::new(App::LeasePartitioned, NEW_CHARGES).on(Database::ExpiredPartitions),
        ),
        scale: true,
        targets: &[],
    },
    Scenario {
        name: "partitioned-reap",
        about: "the same while continuously_delete_expired drops the expired partitions \
                (partitioned mode's delete_expired); measured until they are gone",
        baseline: Some("partitioned-idle"),
        runner: Runner::Http(Http {
            during: During::Reaping,
            ..Http::new(App::LeasePartitioned, NEW_CHARGES).on(Database::ExpiredPartitions)
        }),
        scale: true,
        // Issue 7 sets the p99 target for row deletes; partitioned expiry's cost is shown, not
        // judged: its drain is over in about a second, a p99 taken over so short a window is
        // the hiccup of the partition drops themselves (the report shows both windows).
        targets: &[],
    },
    Scenario {
        name: "single-instance",
        about: "lease mode, a new key per request, one server process: the many-instances baseline",
        baseline: None,
        runner: Runner::Http(Http::new(App::Lease, NEW_CHARGES)),
        scale: true,
        targets: &[],
    },
    Scenario {
        name: "many-instances",
        about: "the same on --instances server processes (4), each with its own pool, the \
                connections spread over them; then a burst of the same keys sent to every \
                instance at once must run each key exactly once",
        baseline: Some("single-instance"),
        runner: Runner::Http(Http {
            instances: Instances::Many,
            after: After::DuplicateBurst,
            ..Http::new(App::Lease, NEW_CHARGES)
        }),
        scale: true,
        targets: &[Target::ExactlyOnce],
    },
];

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
