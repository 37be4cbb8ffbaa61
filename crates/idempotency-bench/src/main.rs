//! `idempotency-bench`: what tower-idempotency costs, measured side by side with the bare
//! handler on this machine, over real HTTP/1.1 and real PostgreSQL.
//!
//! Run with
//!
//! ```text
//! cargo run --release -p idempotency-bench -- [--duration-secs N] [--warmup-secs N]
//!     [--connections N] [--rounds N] [--scenarios a,b,...] [--database-url URL]
//!     [--pool-size N] [--json PATH] [--list]
//! ```
//!
//! The report (markdown) goes to stdout, progress to stderr: `... > bench.md` keeps the table.
//! A full run with the defaults (10 s per scenario after 2 s of warm-up, 32 connections,
//! 3 rounds, every scenario) takes about 6 minutes. Short runs
//! (`--duration-secs 3 --warmup-secs 1`) check that everything works; published numbers come
//! from a long run on a quiet machine. It is not a test, and CI only builds it.
//!
//! # What it needs
//!
//! Linux (it reads `/proc`) and a PostgreSQL server: `--database-url` or `DATABASE_URL` (any
//! database on it), else `127.0.0.1:5432` as `root` or `postgres` with trust authentication.
//! The run creates a database of its own there, `idem_bench_<pid>_<n>`, with the `charges`
//! table and the store's migrations, and drops it at the end, on an error and on Ctrl-C too.
//! Nothing else: the load generator is built in.
//!
//! # What it does
//!
//! Each scenario of each round gets a **fresh server process**: the benchmark re-executes its
//! own binary with a hidden `serve` subcommand, which binds `127.0.0.1:0`, so the server's peak
//! RSS (`VmHWM`) and CPU time are its own. A child exits when the benchmark closes its stdin,
//! is killed when the benchmark drops it (errors, panics, Ctrl-C), and exits by itself if the
//! benchmark dies outright: no server outlives a run.
//!
//! The load generator, in the benchmark process, opens N HTTP/1.1 keep-alive connections
//! (hyper's client connections), each sending requests back to back — a closed loop — and
//! records every latency in an HDR histogram. It warms up first, then measures a window; only
//! requests that start and end inside the window count. Every response is checked (`201`, and
//! `Idempotent-Replayed: true` exactly when the scenario replays): a wrong answer is an error,
//! never throughput.
//!
//! Rounds alternate the scenarios — A B C, then C B A, then A B C… — so each ratio compares two
//! measurements taken minutes apart at most, under the same conditions.
//!
//! Every app puts the same authentication middleware in front (it turns the bearer token into
//! the `Principal` the layer scopes keys by), and every request carries an `Idempotency-Key`
//! (the bare apps ignore it): the layer is the only difference between a scenario and its
//! baseline. `--list` prints the scenarios:
//!
//! | scenario | vs | what |
//! |---|---|---|
//! | `bare` | — | the charge handler: one `INSERT` into `charges` through a pool, no layer |
//! | `lease` | bare | the same, behind `IdempotencyLayer::postgres(pool)`, a new key per request |
//! | `transactional` | bare | the same `INSERT` through the `IdempotentTx` of `.transactional()`: claim, charge and record in one commit |
//! | `replay` | bare | the lease server answering retries of keys completed before the window |
//! | `memory-bare` | — | a handler doing no I/O, no layer |
//! | `memory` | memory-bare | the same, behind `IdempotencyLayer::memory()` |
//! | `store-ceiling` | bare | the store's `begin` + `complete` for new keys, through sqlx, no HTTP |
//! | `store-lookup` | bare | the store's `begin` on completed keys (a replay's lookup), no HTTP |
//! | `large-bodies` | — | 1 MiB JSON bodies through the lease layer at 64 connections |
//!
//! # Reading the table
//!
//! ```text
//! | scenario | vs   | conns | req/s         | p50             | p99             | peak RSS         | errors | target       | result |
//! |----------|------|------:|--------------:|----------------:|----------------:|-----------------:|-------:|--------------|--------|
//! | bare     | —    | 32    | 6,385         | 4.44 ms         | 12.1 ms         | 9.4 MiB          | 0      | —            | —      |
//! | lease    | bare | 32    | 1,891 (0.29×) | 16.5 ms (3.61×) | 33.4 ms (2.76×) | 13.7 MiB (1.48×) | 0      | req/s ≥ 0.6× | **FAIL** (req/s ≥ 0.6×) |
//! ```
//!
//! (From a short run on a busy 2-core machine: an illustration of the format, not a result.)
//!
//! * Figures are **medians over the rounds**. A ratio in parentheses is the **median of the
//!   per-round ratios** to the scenario named in `vs`, measured in the same round — not the
//!   ratio of the medians — so noise that hits one round hits both sides of its ratio.
//! * `req/s` counts successful requests; `p50`/`p99` are client-side latencies, queueing
//!   included; `peak RSS` is the server process's `VmHWM` (HTTP scenarios only). The memory
//!   store keeps every record until its TTL (24 h), so `memory`'s RSS grows with the number of
//!   requests the round made, not with concurrency.
//! * `target` is the issue's target for that scenario, checked on the median ratios (or, for
//!   `large-bodies`, the median RSS against 64 × 2 MiB + 64 MiB); a scenario that failed more
//!   than 1% of its requests fails regardless. Failed requests are listed under the table.
//! * The second table splits the **CPU time per request** between the server process, the
//!   PostgreSQL backends of the run's database (local servers only) and the benchmark process
//!   (the load generator, or the store client), with how busy that kept the machine's cores.
//!   On a machine where everything shares a few cores, CPU per request is what sets the
//!   throughput, and this table says whose it is.
//!
//! The load generator shares the machine with the server and PostgreSQL. That is deliberate
//! (the ratios are what matters, and every scenario pays for the generator alike), but the
//! absolute numbers are those of the whole machine, not of the server alone.
//!
//! # Adding a scenario
//!
//! Scenarios are data: one more entry in `scenario::SCENARIOS` (name, baseline, how it runs,
//! targets). A new kind of server is a variant of `app::App`, a new kind of request a variant
//! of `load::Keys` or `load::BodySize`; the runner, the tables and the target checks take it
//! from there.
//!
//! # Profiling
//!
//! Run one scenario for a while and record the whole machine (`perf` with software clocks
//! works in VMs without hardware counters); the server's threads are named `bench-server`, the
//! generator's `bench-client`:
//!
//! ```text
//! cargo build --release -p idempotency-bench
//! target/release/idempotency-bench --scenarios lease --rounds 1 --duration-secs 20 &
//! sleep 10; perf record -a -g -e cpu-clock -F 999 -- sleep 8
//! perf report --sort comm,dso
//! ```

mod app;
mod ceiling;
mod cli;
mod db;
mod load;
mod procfs;
mod report;
mod run;
mod scenario;
mod server;
mod stats;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();

    let (thread_name, outcome) = match cli.command {
        Some(Command::Serve(args)) => ("bench-server", Task::Serve(args)),
        None => ("bench-client", Task::Bench(cli.bench)),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(thread_name)
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idempotency-bench: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = match outcome {
        Task::Serve(args) => runtime.block_on(server::serve(args)),
        Task::Bench(args) => runtime.block_on(run::run(args)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idempotency-bench: {error}");
            ExitCode::FAILURE
        }
    }
}

enum Task {
    Serve(cli::ServeArgs),
    Bench(cli::BenchArgs),
}
