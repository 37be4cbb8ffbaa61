//! A benchmark run: the databases, the rounds of scenarios side by side, the report.

use std::{fmt::Write as _, sync::Arc, time::Duration};

use tokio::{sync::watch, time::Instant};
use tower_idempotency::store::PostgresStore;

use crate::{
    BoxError,
    app::PARTITION_WIDTH,
    ceiling,
    cli::BenchArgs,
    db::BenchDb,
    load::{self, Plan},
    procfs::{self, Machine},
    reaper::{self, ReaperReport},
    report::{self, Cpu, Results, Sample},
    scale::{self, Table},
    scenario::{self, After, Database, During, Http, Instances, Runner, SCENARIOS, Scenario},
    server::{self, ServeOptions, ServerProcess},
    stats::Window,
    storm,
};

/// How long completing the keys a replay scenario retries may take.
const PREPARE_TIMEOUT: Duration = Duration::from_secs(120);

/// The longest a reaping measurement waits for the expired records to be gone.
const REAPING_CAP: Duration = Duration::from_secs(600);

/// Runs the benchmark and prints the report on stdout (progress goes to stderr).
pub(crate) async fn run(args: BenchArgs) -> Result<(), BoxError> {
    if args.list {
        print!("{}", list());
        return Ok(());
    }
    let selected = scenario::select(&args.scenarios)?;
    if args.rounds.get() < 3 {
        eprintln!("note: fewer than 3 rounds; the medians are not robust against noise");
    }
    let machine = Machine::detect();
    let wall = Instant::now();

    let settings = args
        .db_settings
        .iter()
        .map(|setting| {
            setting
                .split_once('=')
                .map(|(name, value)| (name.trim().to_owned(), value.trim().to_owned()))
                .ok_or_else(|| format!("--db-setting `{setting}` is not NAME=VALUE"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut dbs = Databases::create(args.database_url.as_deref(), &selected, &settings).await?;
    let server = dbs
        .run()
        .describe_server()
        .await
        .unwrap_or_else(|e| format!("PostgreSQL (settings unreadable: {e})"));
    let outcome = tokio::select! {
        outcome = async {
            dbs.prepare(&args).await?;
            rounds(&dbs, &selected, &args, machine.cores).await
        } => outcome,
        _ = tokio::signal::ctrl_c() => {
            eprintln!();
            Err("interrupted".into())
        }
    };
    // Every server process is gone by now: they were stopped, or killed when dropped.
    let notes = std::mem::take(&mut dbs.notes);
    dbs.drop_all().await;
    let mut results = outcome?;
    results.notes = notes;

    let mut out = header(&args, &selected, &machine, &server, wall.elapsed());
    out.push_str(&results.table());
    let errors = results.errors();
    if !errors.is_empty() {
        out.push_str("\nFailed requests:\n\n");
        out.push_str(&errors);
    }
    let failures = results.failures();
    if !failures.is_empty() {
        out.push_str("\n**CORRECTNESS FAILURES:**\n\n");
        out.push_str(&failures);
    }
    out.push_str("\nCPU time per request (medians over rounds):\n\n");
    out.push_str(&results.cpu_table());
    out.push_str(&results.storm_section());
    out.push_str(&results.scale_section());
    print!("{out}");

    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&results.to_json())?;
        std::fs::write(path, json).map_err(|e| format!("writing {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if !failures.is_empty() {
        return Err(format!("correctness check failed:\n{failures}").into());
    }
    Ok(())
}

/// The run's databases: its own, shared by the core scenarios, and one more for each kind of
/// state the selected scale scenarios need (created once per run, dropped at the end).
struct Databases {
    dbs: Vec<(Database, BenchDb)>,
    /// How many replayable records each database was filled with.
    filled: Vec<(Database, u64)>,
    /// What preparing them took, for the report.
    notes: Vec<String>,
    /// Whether `pg_walinspect` could be enabled in them (scale scenarios).
    inspects_wal: bool,
}

impl Databases {
    async fn create(
        url: Option<&str>,
        selected: &[&Scenario],
        settings: &[(String, String)],
    ) -> Result<Self, BoxError> {
        let mut wanted = vec![Database::Run];
        for scenario in selected {
            if let Runner::Http(http) = &scenario.runner
                && !wanted.contains(&http.database)
            {
                wanted.push(http.database);
            }
        }
        let scale = selected.iter().any(|s| s.scale);
        let mut dbs = Vec::with_capacity(wanted.len());
        let mut inspects_wal = scale;
        for kind in wanted {
            // On an error, those already created are dropped with `dbs`.
            let db = BenchDb::create(url).await?;
            eprintln!("created database {} ({})", db.name(), describe(kind));
            for (name, value) in settings {
                db.set(name, value).await?;
            }
            if scale {
                inspects_wal &= scale::enable_wal_inspection(&db).await;
            }
            dbs.push((kind, db));
        }
        if scale && !inspects_wal {
            eprintln!("note: pg_walinspect is not available; WAL is the whole server's only");
        }
        Ok(Self {
            dbs,
            filled: Vec::new(),
            notes: Vec::new(),
            inspects_wal,
        })
    }

    fn get(&self, kind: Database) -> &BenchDb {
        self.dbs
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, db)| db)
            .expect("every database a selected scenario uses is created")
    }

    fn run(&self) -> &BenchDb {
        self.get(Database::Run)
    }

    /// Replayable records filled into `kind`.
    fn filled(&self, kind: Database) -> u64 {
        self.filled
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, rows)| *rows)
    }

    /// The once-per-run fills: the empty store's handful of records, the full store's many.
    async fn prepare(&mut self, args: &BenchArgs) -> Result<(), BoxError> {
        for i in 0..self.dbs.len() {
            let (kind, db) = (self.dbs[i].0, &self.dbs[i].1);
            let rows = match kind {
                Database::Empty => scale::EMPTY_STORE_ROWS,
                Database::Full => args.full_store_rows,
                _ => continue,
            };
            eprintln!(
                "filling the {} store ({}) with {} completed records by SQL...",
                if kind == Database::Full {
                    "full"
                } else {
                    "empty"
                },
                db.name(),
                report::format_rate(rows as f64),
            );
            let label = (kind == Database::Full).then_some("full store");
            let fill = scale::fill_completed(db, rows, label).await?;
            let what = if kind == Database::Full {
                "full store"
            } else {
                "empty store"
            };
            let note = fill.describe(what);
            eprintln!("{note}");
            self.notes.push(note);
            self.filled.push((kind, rows));
            if kind == Database::Empty {
                eprintln!("measuring bytes per record by body size...");
                self.notes.push(scale::record_sizes(db).await?);
            }
        }
        Ok(())
    }

    /// Puts `http`'s database in the state its measurement starts from; says what it did.
    async fn before(&self, http: &Http, args: &BenchArgs) -> Result<Option<String>, BoxError> {
        let db = self.get(http.database);
        match http.database {
            Database::Expired => Ok(Some(scale::restore_expired(db, args.expired_rows).await?)),
            Database::ExpiredPartitions => Ok(Some(
                scale::restore_expired_partitions(db, args.expired_rows, PARTITION_WIDTH).await?,
            )),
            Database::Run | Database::Empty | Database::Full => Ok(None),
        }
    }

    async fn drop_all(self) {
        for (_, db) in self.dbs {
            let name = db.name().to_owned();
            match db.drop_database().await {
                Ok(()) => eprintln!("dropped database {name}"),
                Err(error) => eprintln!("warning: could not drop database {name}: {error}"),
            }
        }
    }
}

fn describe(kind: Database) -> &'static str {
    match kind {
        Database::Run => "the core scenarios",
        Database::Empty => "the empty store",
        Database::Full => "the full store",
        Database::Expired => "expired records",
        Database::ExpiredPartitions => "expired partitions",
    }
}

/// Every round runs every scenario once; odd rounds run them backwards, so drift during the
/// run (a table growing, a neighbour compiling) weighs on both sides of each ratio alike.
async fn rounds(
    dbs: &Databases,
    selected: &[&'static Scenario],
    args: &BenchArgs,
    cores: usize,
) -> Result<Results, BoxError> {
    let mut results = Results {
        scenarios: selected.iter().map(|s| (*s, Vec::new())).collect(),
        cores,
        notes: Vec::new(),
    };
    let rounds = args.rounds.get();
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..selected.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let scenario = selected[i];
            let sample = measure(dbs, scenario, args, round)
                .await
                .map_err(|e| format!("scenario {}: {e}", scenario.name))?;
            // One write per line, once measured, so that what the servers log meanwhile (sqlx's
            // slow-statement warnings, say) lands between lines rather than inside one.
            eprintln!(
                "round {}/{rounds}  {:<24}{}",
                round + 1,
                scenario.name,
                progress(&sample)
            );
            for failure in &sample.failures {
                eprintln!("  !!! {}: {failure}", scenario.name);
            }
            results.scenarios[i].1.push(sample);
        }
    }
    Ok(results)
}

/// Measures `scenario` once: fresh server processes (or a store client), their preparation,
/// the warm-up, then the window.
async fn measure(
    dbs: &Databases,
    scenario: &Scenario,
    args: &BenchArgs,
    round: usize,
) -> Result<Sample, BoxError> {
    match scenario.runner {
        Runner::Http(http) => measure_http(dbs, scenario, &http, args, round).await,
        Runner::Storm(storm) => storm::measure(dbs.run(), storm, args, round).await,
        Runner::Store { op } => {
            let db = dbs.run();
            let warmup = Duration::from_secs(args.warmup_secs);
            let duration = Duration::from_secs(args.duration_secs.max(1));
            let connections = args.connections.get();
            let pool = db
                .pool(u32::try_from(args.pool_size.get()).unwrap_or(u32::MAX))
                .await?;
            let store = Arc::new(PostgresStore::new(pool.clone()));
            let measured = async {
                let prepared = ceiling::prepare(&store, op, connections).await?;
                let window = Window::after(warmup, duration);
                let (tally, cpu) = tokio::join!(
                    ceiling::run(&store, &prepared, window),
                    cpu_probe(db, &[], window, None),
                );
                Ok::<_, BoxError>((tally?, cpu, window))
            }
            .await;
            pool.close().await;
            let (tally, cpu, window) = measured?;
            Ok(Sample::new(
                round,
                connections,
                window.duration(),
                tally,
                cpu,
            ))
        }
    }
}

/// What happened beside the load during a window.
#[derive(Default)]
struct Beside {
    /// When the load stopped, if before the window's end.
    ended: Option<Instant>,
    /// When the reaper reported the backlog drained.
    drained_at: Option<Instant>,
    /// The database's activity over the window, or while reaping.
    database: Option<scale::DbDelta>,
    drained: Option<ReaperReport>,
    locks: Option<scale::LockSamples>,
}

async fn measure_http(
    dbs: &Databases,
    scenario: &Scenario,
    http: &Http,
    args: &BenchArgs,
    round: usize,
) -> Result<Sample, BoxError> {
    let connections = http.connections.unwrap_or(args.connections.get());
    let warmup = Duration::from_secs(args.warmup_secs);
    let duration = Duration::from_secs(args.duration_secs.max(1));
    let mut details = Vec::new();
    details.extend(dbs.before(http, args).await?);
    let db = dbs.get(http.database);

    let reaping = http.during == During::Reaping;
    let instances = match http.instances {
        Instances::One => 1,
        Instances::Many => args.instances.get(),
    };
    let mut servers = Vec::with_capacity(instances);
    for i in 0..instances {
        let options = ServeOptions {
            reaper_batch: (reaping && i == 0).then_some(args.reaper_batch),
            no_pool_checks: args.no_pool_checks,
        };
        servers.push(ServerProcess::start(http.app, db, args.pool_size.get(), options).await?);
    }
    let addrs: Vec<_> = servers.iter().map(ServerProcess::addr).collect();
    let pids: Vec<u32> = servers.iter().map(ServerProcess::pid).collect();
    let plan = Arc::new(Plan::new(http.workload, &addrs, dbs.filled(http.database)));
    load::prepare(&plan, connections, PREPARE_TIMEOUT).await?;

    let window = Window::after(warmup, if reaping { REAPING_CAP } else { duration });
    let (stop, stopped) = watch::channel(false);
    // CPU is counted over the same time as the requests: while reaping, until the drain.
    let (drained_tx, drained_rx) = watch::channel(false);
    let watching = Watching {
        scale: scenario.scale,
        inspect: dbs.inspects_wal,
        reaping,
        duration,
    };
    let (tally, cpu, beside) = tokio::join!(
        load::run(&plan, connections, window, Some(stopped.clone()), reaping),
        cpu_probe(
            db,
            &pids,
            window,
            Some(if reaping { drained_rx } else { stopped })
        ),
        beside_load(db, &mut servers[0], watching, window, stop, drained_tx),
    );
    let beside = beside?;
    let whole = tally?;
    let ended = beside.ended.unwrap_or(window.end);
    let peak_rss = servers
        .iter()
        .map(ServerProcess::peak_rss)
        .sum::<std::io::Result<u64>>()
        .ok();

    let mut failures = Vec::new();
    if http.after == After::DuplicateBurst {
        let burst = scale::duplicate_burst(&addrs, db, args.duplicate_keys).await?;
        details.push(burst.summary);
        failures.extend(burst.failures);
    }

    let mut printed = Vec::new();
    for server in servers {
        printed.extend(server.stop().await?);
    }
    let final_report = printed.iter().find_map(|line| {
        let json = line.strip_prefix(reaper::FINAL)?;
        serde_json::from_str::<ReaperReport>(json.trim()).ok()
    });

    // A reaping sample is the traffic while the reaper ran; the rest of the window is shown
    // apart.
    let (mut tally, measured, view) = match beside.drained_at {
        Some(drained) if reaping => {
            let reaped = drained.saturating_duration_since(window.start);
            let part = whole.within(Duration::ZERO, reaped);
            let shown = ended.saturating_duration_since(window.start);
            (part, reaped, Some((whole, shown)))
        }
        _ => (whole, ended.saturating_duration_since(window.start), None),
    };
    if let Some(delta) = &beside.database {
        details.push(delta.describe(tally.ok, measured));
    }
    let mut reaper_report = None;
    let mut fixed_view = None;
    if reaping {
        let table = if http.database == Database::ExpiredPartitions {
            Table::Partitioned
        } else {
            Table::Records
        };
        let left = scale::expired_left(db, table).await?;
        match &beside.drained {
            Some(drained) => {
                details.push(describe_reaping(drained, final_report.as_ref(), left));
                reaper_report = Some(drained.clone());
            }
            None => {
                details.push(format!(
                    "the reaper had not drained the backlog after {} s: {left} expired records \
                     left",
                    REAPING_CAP.as_secs()
                ));
                reaper_report.clone_from(&final_report);
                failures.push("the reaper did not finish within the cap".to_owned());
            }
        }
        if let Some(locks) = &beside.locks {
            details.push(locks.describe(scale::SAMPLE_EVERY));
        }
        details.push(format!(
            "live traffic while reaping (the table's figures): {:.1} s, {}",
            measured.as_secs_f64(),
            describe_latency(&tally),
        ));
        if let Some((whole, shown)) = &view {
            details.push(format!(
                "live traffic over the first {:.1} s from the reaper's start (the load runs \
                 --duration-secs at least): {:.0} req/s, {}",
                shown.as_secs_f64(),
                whole.ok as f64 / shown.as_secs_f64().max(1e-9),
                describe_latency(whole),
            ));
            fixed_view = (whole.ok > 0).then(|| {
                (
                    shown.as_secs_f64(),
                    whole.latency.value_at_quantile(0.99) as f64,
                )
            });
        }
        if let Some(report) = &final_report
            && report.errors > 0
        {
            failures.push(format!(
                "the reaper failed {} times; first: {}",
                report.errors,
                report.first_error.as_deref().unwrap_or("?")
            ));
        }
    }
    if tally.ok == 0 && tally.errors == 0 {
        tally.error("no request completed in the window".to_owned());
    }
    let mut sample = Sample::new(round, connections, measured, tally, cpu);
    sample.peak_rss = peak_rss;
    sample.details = details;
    sample.failures = failures;
    sample.reaper = reaper_report;
    sample.wal_bytes = beside.database.as_ref().map(scale::DbDelta::wal_bytes);
    sample.fixed_view = fixed_view;
    Ok(sample)
}

/// `N requests, p50 .., p99 .., max ..`.
fn describe_latency(tally: &crate::stats::Tally) -> String {
    let at = |q: f64| report::format_micros(tally.latency.value_at_quantile(q) as f64);
    if tally.ok == 0 {
        return "no requests".to_owned();
    }
    format!(
        "{} requests, p50 {}, p99 {}, max {}",
        tally.ok,
        at(0.5),
        at(0.99),
        report::format_micros(tally.latency.max() as f64)
    )
}

/// What [`beside_load`] watches.
#[derive(Debug, Clone, Copy)]
struct Watching {
    /// A scale scenario: the database's WAL and block counters are watched.
    scale: bool,
    /// `pg_walinspect` is there to attribute WAL to the run's database.
    inspect: bool,
    reaping: bool,
    /// `--duration-secs`: the least a reaping window lasts.
    duration: Duration,
}

/// What runs beside the load. For scale scenarios, the database's WAL and counters over the
/// window. When reaping: the expiry loop (started in `server` when the window opens) and the
/// lock sampler until the backlog is drained (the WAL and counters then stop there too); the
/// load stops then, or at `--duration-secs` if that is later.
async fn beside_load(
    db: &BenchDb,
    server: &mut ServerProcess,
    watching: Watching,
    window: Window,
    stop: watch::Sender<bool>,
    drained_tx: watch::Sender<bool>,
) -> Result<Beside, BoxError> {
    tokio::time::sleep_until(window.start).await;
    let wal = if watching.scale {
        scale::watch(db).await
    } else {
        None
    };
    let mut beside = Beside::default();
    let mut end = None;
    if watching.reaping {
        server.command(server::REAP).await?;
        let drained_rx = drained_tx.subscribe();
        let (drained, locks) = tokio::join!(
            async {
                let line = server.line_starting(reaper::DRAINED, window.end).await;
                let _ = drained_tx.send(true);
                line
            },
            scale::sample_locks(db, drained_rx, window.end),
        );
        let drained_at = Instant::now().min(window.end);
        end = scale::snapshot(db).await;
        beside.drained_at = Some(drained_at);
        beside.drained = drained.and_then(|json| serde_json::from_str(&json).ok());
        beside.locks = Some(locks);
        let until = (window.start + watching.duration)
            .max(drained_at)
            .min(window.end);
        tokio::time::sleep_until(until).await;
        let _ = stop.send(true);
        beside.ended = Some(until);
    } else {
        tokio::time::sleep_until(window.end).await;
    }
    if let Some(wal) = wal {
        let end = match end {
            Some(end) => Some(end),
            None => scale::snapshot(db).await,
        };
        beside.database = scale::finish(db, wal, end, watching.inspect).await;
    }
    Ok(beside)
}

fn describe_reaping(drained: &ReaperReport, last: Option<&ReaperReport>, left: u64) -> String {
    let took = drained.drained_after_us.unwrap_or(0) as f64;
    let mut out = format!(
        "reaper (`continuously_delete_expired` in the server process, on its pool; batch {}): \
         {} records deleted in {} `delete_expired` calls, drained in {} ({} records/s); per \
         call until drained, timed in the server: p50 {}, p99 {}, max {} (median of the first \
         tenth of the calls {}, of the last tenth {}); at most {} records per call; {} expired \
         records left",
        drained.batch,
        report::format_rate(drained.rows as f64),
        drained.calls,
        report::format_micros(took),
        report::format_rate(drained.rows_per_sec().unwrap_or(0.0)),
        report::format_micros(drained.call_p50_us as f64),
        report::format_micros(drained.call_p99_us as f64),
        report::format_micros(drained.call_max_us as f64),
        report::format_micros(drained.first_tenth_p50_us as f64),
        report::format_micros(drained.last_tenth_p50_us as f64),
        report::format_rate(drained.max_rows_per_call as f64),
        report::format_rate(left as f64),
    );
    if let Some(last) = last
        && last.errors > 0
    {
        let _ = write!(out, "; {} errors", last.errors);
    }
    out
}

/// CPU time used during `window` (ended early if `stop` turns true) by the server processes,
/// the database's backends and this process. Backends are those connected when the window
/// opens (the pools are full by then).
async fn cpu_probe(
    db: &BenchDb,
    servers: &[u32],
    window: Window,
    stop: Option<watch::Receiver<bool>>,
) -> Cpu {
    tokio::time::sleep_until(window.start).await;
    let backends: Vec<u32> = db
        .backend_pids()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|&pid| procfs::is_postgres(pid))
        .collect();
    let client = std::process::id();
    let before = CpuSnapshot::take(servers, &backends, client);
    match stop {
        Some(mut stop) => {
            tokio::select! {
                _ = tokio::time::sleep_until(window.end) => {}
                _ = stop.wait_for(|stopped| *stopped) => {}
            }
        }
        None => tokio::time::sleep_until(window.end).await,
    }
    let after = CpuSnapshot::take(servers, &backends, client);
    after.since(&before)
}

/// CPU time and context switches of the servers, the database's backends and this process,
/// at one moment.
pub(crate) struct CpuSnapshot {
    server: Option<Duration>,
    backends: Vec<(u32, Duration)>,
    client: Option<Duration>,
    server_switches: Option<u64>,
    client_switches: Option<u64>,
}

/// `read` of every process in `pids`, summed; `None` if there are none or one cannot be read.
fn sum_over<T: std::iter::Sum<T>>(pids: &[u32], read: fn(u32) -> std::io::Result<T>) -> Option<T> {
    if pids.is_empty() {
        return None;
    }
    pids.iter().map(|&pid| read(pid).ok()).sum()
}

impl CpuSnapshot {
    pub(crate) fn take(servers: &[u32], backends: &[u32], client: u32) -> Self {
        Self {
            server: sum_over(servers, procfs::cpu_time),
            backends: backends
                .iter()
                .filter_map(|&pid| Some((pid, procfs::cpu_time(pid).ok()?)))
                .collect(),
            client: procfs::cpu_time(client).ok(),
            server_switches: sum_over(servers, procfs::context_switches),
            client_switches: procfs::context_switches(client).ok(),
        }
    }

    pub(crate) fn since(&self, before: &Self) -> Cpu {
        let diff = |after: Option<Duration>, before: Option<Duration>| {
            Some(after?.saturating_sub(before?))
        };
        let postgres = (!before.backends.is_empty()).then(|| {
            self.backends
                .iter()
                .filter_map(|(pid, after)| {
                    let (_, before) = before.backends.iter().find(|(p, _)| p == pid)?;
                    Some(after.saturating_sub(*before))
                })
                .sum()
        });
        let count = |after: Option<u64>, before: Option<u64>| Some(after?.saturating_sub(before?));
        Cpu {
            server: diff(self.server, before.server),
            postgres,
            client: diff(self.client, before.client),
            server_switches: count(self.server_switches, before.server_switches),
            client_switches: count(self.client_switches, before.client_switches),
        }
    }
}

fn progress(sample: &Sample) -> String {
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

fn header(
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
fn list() -> String {
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
