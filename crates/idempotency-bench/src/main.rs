//! `idempotency-bench`: what tower-idempotency costs, measured side by side with the bare
//! handler on this machine, over real HTTP/1.1 and real PostgreSQL.
//!
//! ```text
//! cargo run --release -p idempotency-bench -- --list
//! cargo run --release -p idempotency-bench -- [--scenarios a,b,...] [--rounds N]
//! ```
//!
//! How to run it, what it needs, what each scenario measures, how to read the report, and the
//! latest figures: the crate's `README.md` (`crates/idempotency-bench/README.md`). Every run
//! before the latest, and every optimisation tried, is in its `RESULTS.md`.
//!
//! The modules: [`cli`] (the options, and the hidden `serve` subcommand), [`run`] (the
//! databases, the rounds, the report), [`scenario`] (every scenario as data), [`server`] and
//! [`app`] (a server process and the apps it serves), [`load`] (the load generator),
//! [`ceiling`] (the store without HTTP), [`storm`] (the duplicate storms), [`scale`] and
//! [`reaper`] (the scale scenarios' database work and the expiry loop), [`stats`], [`procfs`]
//! and [`report`] (the figures and their tables), [`db`] (a database created fresh and dropped
//! at the end).
//!
//! # Adding a scenario
//!
//! Scenarios are data: one more entry in `scenario::SCENARIOS` (name, baseline, how it runs,
//! targets). A baseline may have its own (`lease-wait` → `lease` → `bare`): selecting a
//! scenario runs the whole chain. A new kind of server is a variant of `app::App`, a new kind
//! of request a variant of `load::Keys` or `load::BodySize`, a database in a new state a
//! `scenario::Database` (prepared in `run::databases::Databases`); the runner, the tables and
//! the target checks take it from there.

mod app;
mod ceiling;
mod cli;
mod db;
mod fingerprint_cost;
mod load;
mod procfs;
mod reaper;
mod report;
mod run;
mod scale;
mod scenario;
mod server;
mod stats;
mod storm;

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
        Some(Command::FingerprintCosts { iterations, only }) => {
            fingerprint_cost::run(iterations, &only);
            return ExitCode::SUCCESS;
        }
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
