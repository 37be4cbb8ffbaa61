//! A benchmark run: the databases, the rounds of scenarios side by side, the report.
//!
//! - [`databases`]: the run's databases, created, prepared and dropped;
//! - [`http`]: one measurement of an HTTP scenario, and what runs beside its load;
//! - [`cpu`]: the CPU time of the servers, PostgreSQL and this process over a window;
//! - [`mod@print`]: the progress lines, the report's header and `--list`;
//! - [`waiters`]: a storm of waiters on one key while other keys run at full load.

mod cpu;
mod databases;
mod http;
mod print;
mod waiters;

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;
use tower_idempotency::store::PostgresStore;

pub(crate) use self::{cpu::CpuSnapshot, waiters::WAITERS};
use self::{
    cpu::cpu_probe,
    databases::Databases,
    http::measure_http,
    print::{header, list, progress},
};
use crate::{
    BoxError, ceiling,
    cli::BenchArgs,
    procfs::Machine,
    report::{Results, Sample},
    scenario::{self, Runner, Scenario},
    stats::Window,
    storm,
};

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
        Runner::Waiters { waiters, waits } => {
            waiters::measure(dbs.run(), waiters, waits, args, round).await
        }
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
