//! One measurement of an HTTP scenario: fresh server processes, the load, and what runs
//! beside it (the database's activity, the reaper and its lock sampler, the duplicate burst).

use std::{fmt::Write as _, sync::Arc, time::Duration};

use tokio::{sync::watch, time::Instant};

use super::{cpu::cpu_probe, databases::Databases};
use crate::{
    BoxError,
    cli::BenchArgs,
    db::BenchDb,
    load::{self, Plan},
    reaper::{self, ReaperReport},
    report::{self, Sample},
    scale::{self, Table},
    scenario::{After, Database, During, Http, Instances, Scenario},
    server::{self, ServeOptions, ServerProcess},
    stats::Window,
};

/// How long completing the keys a replay scenario retries may take.
const PREPARE_TIMEOUT: Duration = Duration::from_secs(120);

/// The longest a reaping measurement waits for the expired records to be gone.
const REAPING_CAP: Duration = Duration::from_secs(600);

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

pub(super) async fn measure_http(
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
