//! A benchmark run: the database, the rounds of scenarios side by side, the report.

use std::{fmt::Write as _, sync::Arc, time::Duration};

use tokio::time::Instant;
use tower_idempotency::store::PostgresStore;

use crate::{
    BoxError, ceiling,
    cli::BenchArgs,
    db::BenchDb,
    load::{self, Plan},
    procfs::{self, Machine},
    report::{self, Cpu, Results, Sample},
    scenario::{self, Runner, SCENARIOS, Scenario},
    server::ServerProcess,
    stats::Window,
};

/// How long completing the keys a replay scenario retries may take.
const PREPARE_TIMEOUT: Duration = Duration::from_secs(120);

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

    let db = BenchDb::create(args.database_url.as_deref()).await?;
    eprintln!("created database {}", db.name());
    let server = db
        .describe_server()
        .await
        .unwrap_or_else(|e| format!("PostgreSQL (settings unreadable: {e})"));
    let outcome = tokio::select! {
        outcome = rounds(&db, &selected, &args, machine.cores) => outcome,
        _ = tokio::signal::ctrl_c() => {
            eprintln!();
            Err("interrupted".into())
        }
    };
    // Every server process is gone by now: they were stopped, or killed when dropped.
    let name = db.name().to_owned();
    match db.drop_database().await {
        Ok(()) => eprintln!("dropped database {name}"),
        Err(error) => eprintln!("warning: could not drop database {name}: {error}"),
    }
    let results = outcome?;

    let mut out = header(&args, &machine, &server, wall.elapsed());
    out.push_str(&results.table());
    let errors = results.errors();
    if !errors.is_empty() {
        out.push_str("\nFailed requests:\n\n");
        out.push_str(&errors);
    }
    out.push_str("\nCPU time per request (medians over rounds):\n\n");
    out.push_str(&results.cpu_table());
    print!("{out}");

    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&results.to_json())?;
        std::fs::write(path, json).map_err(|e| format!("writing {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Every round runs every scenario once; odd rounds run them backwards, so drift during the
/// run (a table growing, a neighbour compiling) weighs on both sides of each ratio alike.
async fn rounds(
    db: &BenchDb,
    selected: &[&'static Scenario],
    args: &BenchArgs,
    cores: usize,
) -> Result<Results, BoxError> {
    let mut results = Results {
        scenarios: selected.iter().map(|s| (*s, Vec::new())).collect(),
        cores,
    };
    let rounds = args.rounds.get();
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..selected.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let scenario = selected[i];
            eprint!("round {}/{rounds}  {:<14}", round + 1, scenario.name);
            let sample = measure(db, scenario, args, round).await.map_err(|e| {
                eprintln!();
                format!("scenario {}: {e}", scenario.name)
            })?;
            eprintln!("{}", progress(&sample));
            results.scenarios[i].1.push(sample);
        }
    }
    Ok(results)
}

/// Measures `scenario` once: a fresh server process (or store client), its preparation, the
/// warm-up, then the window.
async fn measure(
    db: &BenchDb,
    scenario: &Scenario,
    args: &BenchArgs,
    round: usize,
) -> Result<Sample, BoxError> {
    let warmup = Duration::from_secs(args.warmup_secs);
    let duration = Duration::from_secs(args.duration_secs.max(1));
    let pool_size = args.pool_size.get();
    match scenario.runner {
        Runner::Http {
            app,
            workload,
            connections,
        } => {
            let connections = connections.unwrap_or(args.connections.get());
            let server = ServerProcess::start(app, db, pool_size).await?;
            let plan = Arc::new(Plan::new(workload, server.addr()));
            load::prepare(server.addr(), &plan, connections, PREPARE_TIMEOUT).await?;
            let window = Window::after(warmup, duration);
            let (tally, cpu) = tokio::join!(
                load::run(server.addr(), &plan, connections, window),
                cpu_probe(db, Some(server.pid()), window),
            );
            let peak_rss = server.peak_rss().ok();
            server.stop().await?;
            Ok(Sample {
                round,
                connections,
                window: window.duration(),
                tally: tally?,
                peak_rss,
                cpu,
            })
        }
        Runner::Store { op } => {
            let connections = args.connections.get();
            let pool = db
                .pool(u32::try_from(pool_size).unwrap_or(u32::MAX))
                .await?;
            let store = Arc::new(PostgresStore::new(pool.clone()));
            let measured = async {
                let prepared = ceiling::prepare(&store, op, connections).await?;
                let window = Window::after(warmup, duration);
                let (tally, cpu) = tokio::join!(
                    ceiling::run(&store, &prepared, window),
                    cpu_probe(db, None, window),
                );
                Ok::<_, BoxError>((tally?, cpu, window))
            }
            .await;
            pool.close().await;
            let (tally, cpu, window) = measured?;
            Ok(Sample {
                round,
                connections,
                window: window.duration(),
                tally,
                peak_rss: None,
                cpu,
            })
        }
    }
}

/// CPU time used during `window` by the server process, the database's backends and this
/// process. Backends are those connected when the window opens (the pools are full by then).
async fn cpu_probe(db: &BenchDb, server: Option<u32>, window: Window) -> Cpu {
    tokio::time::sleep_until(window.start).await;
    let backends: Vec<u32> = db
        .backend_pids()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|&pid| procfs::is_postgres(pid))
        .collect();
    let client = std::process::id();
    let before = CpuSnapshot::take(server, &backends, client);
    tokio::time::sleep_until(window.end).await;
    let after = CpuSnapshot::take(server, &backends, client);
    after.since(&before)
}

struct CpuSnapshot {
    server: Option<Duration>,
    backends: Vec<(u32, Duration)>,
    client: Option<Duration>,
}

impl CpuSnapshot {
    fn take(server: Option<u32>, backends: &[u32], client: u32) -> Self {
        Self {
            server: server.and_then(|pid| procfs::cpu_time(pid).ok()),
            backends: backends
                .iter()
                .filter_map(|&pid| Some((pid, procfs::cpu_time(pid).ok()?)))
                .collect(),
            client: procfs::cpu_time(client).ok(),
        }
    }

    fn since(&self, before: &Self) -> Cpu {
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
        Cpu {
            server: diff(self.server, before.server),
            postgres,
            client: diff(self.client, before.client),
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
    if tally.errors > 0 {
        let _ = write!(line, "  {} errors", tally.errors);
    }
    line
}

fn header(args: &BenchArgs, machine: &Machine, server: &str, wall: Duration) -> String {
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
            Runner::Http {
                connections: Some(c),
                ..
            } => Some(format!("{}: {c}", s.name)),
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
    let mut out = String::from("| scenario | vs | target | what |\n|---|---|---|---|\n");
    for scenario in SCENARIOS {
        let targets: Vec<String> = scenario.targets.iter().map(ToString::to_string).collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
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
    out
}
