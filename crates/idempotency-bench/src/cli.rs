//! The command line: the benchmark's options, and the hidden `serve` subcommand the benchmark
//! re-executes itself with to run each server in a process of its own.

use std::{num::NonZeroUsize, path::PathBuf};

use clap::{Args, Parser, Subcommand};

use crate::app::App;

/// Measures tower-idempotency side by side with the bare handler, over real HTTP/1.1 and real
/// PostgreSQL on this machine, and prints a markdown table of the results.
#[derive(Debug, Parser)]
#[command(
    name = "idempotency-bench",
    version,
    args_conflicts_with_subcommands = true
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    #[command(flatten)]
    pub(crate) bench: BenchArgs,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Runs one benchmark server (used by the benchmark itself, not by people).
    #[command(hide = true)]
    Serve(ServeArgs),
    /// Times the fingerprint of each hostile body shape in process, against plain bytes of
    /// the same size (no database, no HTTP).
    FingerprintCosts {
        /// Timed runs of each shape; the median is reported.
        #[arg(long, default_value_t = 15)]
        iterations: usize,
        /// Only the shapes whose name contains this.
        #[arg(long, default_value = "")]
        only: String,
    },
}

/// Options of a benchmark run.
#[derive(Debug, Clone, Args)]
pub(crate) struct BenchArgs {
    /// Seconds each scenario is measured for, in every round.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub(crate) duration_secs: u64,

    /// Seconds of load before each measurement starts (pools fill, caches warm); not recorded.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub(crate) warmup_secs: u64,

    /// Concurrent keep-alive connections (or store clients), each sending back to back.
    /// Scenarios defined at a fixed concurrency (large-bodies: 64) ignore it.
    #[arg(long, default_value = "32", value_name = "N")]
    pub(crate) connections: NonZeroUsize,

    /// Rounds: every scenario runs once per round, alternating with the others; the table
    /// reports medians over the rounds (use at least 3).
    #[arg(long, default_value = "3", value_name = "N")]
    pub(crate) rounds: NonZeroUsize,

    /// Scenarios to run, comma-separated (see `--list`); their baselines are added. Default:
    /// every core scenario. The scale scenarios only run when named, or with the groups
    /// `scale` (all of them), `full-store` or `expiry`.
    #[arg(long, value_delimiter = ',', value_name = "A,B,...")]
    pub(crate) scenarios: Vec<String>,

    /// PostgreSQL server to create the run's database on (any database of it; the run creates
    /// its own beside it and drops it at the end). Default: 127.0.0.1:5432 as `root` or
    /// `postgres`, trust authentication.
    #[arg(long, env = "DATABASE_URL", value_name = "URL", hide_env_values = true)]
    pub(crate) database_url: Option<String>,

    /// Connections in each server's PostgreSQL pool (shared by the handler and the store), and
    /// in the store-ceiling client's pool.
    #[arg(long, default_value = "16", value_name = "N")]
    pub(crate) pool_size: NonZeroUsize,

    /// Servers' pools skip sqlx's connection check before each checkout
    /// (`PgPoolOptions::test_before_acquire(false)`, a round trip saved per checkout), to measure
    /// what the check costs; the default keeps sqlx's default (checks on), which the README
    /// recommends keeping.
    #[arg(long)]
    pub(crate) no_pool_checks: bool,

    /// Completed records pre-filled (by SQL, once per run) into the full store of the
    /// `full-*` scenarios. Only used when one of them is selected.
    #[arg(long, default_value_t = 10_000_000, value_name = "N")]
    pub(crate) full_store_rows: u64,

    /// Expired records in the table at the start of each `expiry-*` and `partitioned-*`
    /// measurement (put back before each).
    #[arg(long, default_value_t = 1_000_000, value_name = "N")]
    pub(crate) expired_rows: u64,

    /// The batch size of the expiry loop (`continuously_delete_expired`) in the reaping
    /// scenarios.
    #[arg(long, default_value_t = 1_000, value_name = "N")]
    pub(crate) reaper_batch: u32,

    /// Server processes in `many-instances`, each with a pool of `--pool-size`.
    #[arg(long, default_value = "4", value_name = "N")]
    pub(crate) instances: NonZeroUsize,

    /// Keys in `many-instances`' duplicate burst, each sent to every instance at once.
    #[arg(long, default_value_t = 1_000, value_name = "N")]
    pub(crate) duplicate_keys: usize,

    /// Keys per round in the duplicate storms (`duplicate-storm*`), each sent by 32 requests at
    /// once, one key after the other (after one warm-up key).
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub(crate) storm_keys: usize,

    /// A PostgreSQL setting for the run's databases only (`ALTER DATABASE ... SET`, so every
    /// session on them, the servers' included, starts with it), e.g. `wal_compression=lz4`:
    /// for trying a server setting on the scenarios. Repeatable.
    #[arg(long = "db-setting", value_name = "NAME=VALUE")]
    pub(crate) db_settings: Vec<String>,

    /// Also write every round's raw measurements as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub(crate) json: Option<PathBuf>,

    /// Lists the scenarios and exits.
    #[arg(long)]
    pub(crate) list: bool,
}

/// Options of the hidden `serve` subcommand. The database URL comes from the environment
/// (`DATABASE_URL`), so a password never shows in the process list.
#[derive(Debug, Clone, Args)]
pub(crate) struct ServeArgs {
    /// Which application to serve.
    #[arg(long, value_enum)]
    pub(crate) app: App,

    /// The database to connect to on the `DATABASE_URL` server (apps that use PostgreSQL).
    #[arg(long)]
    pub(crate) database: Option<String>,

    /// Size of the PostgreSQL pool.
    #[arg(long, default_value = "16")]
    pub(crate) pool_size: NonZeroUsize,

    /// Arms the expiry loop (`continuously_delete_expired`) with this batch size, on the app's
    /// store and pool; it starts when `reap` is written on stdin.
    #[arg(long)]
    pub(crate) reaper_batch: Option<u32>,

    /// The pool skips sqlx's connection check before each checkout.
    #[arg(long)]
    pub(crate) no_pool_checks: bool,

    /// The expiry loop's period, in milliseconds.
    #[arg(long, default_value = "10000")]
    pub(crate) reaper_period_ms: u64,
}
