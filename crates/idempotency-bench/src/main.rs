//! `idempotency-bench`: what tower-idempotency costs, measured side by side with the bare
//! handler on this machine, over real HTTP/1.1 and real PostgreSQL.
//!
//! Run with
//!
//! ```text
//! cargo run --release -p idempotency-bench -- [--duration-secs N] [--warmup-secs N]
//!     [--connections N] [--rounds N] [--scenarios a,b,...] [--database-url URL]
//!     [--pool-size N] [--json PATH] [--list]
//!     [--full-store-rows N] [--expired-rows N] [--reaper-batch N] [--instances N]
//!     [--duplicate-keys N] [--storm-keys N] [--db-setting NAME=VALUE ...] [--no-pool-checks]
//! ```
//!
//! The report (markdown) goes to stdout, progress to stderr: `... > bench.md` keeps the table.
//! A full run with the defaults (10 s per scenario after 2 s of warm-up, 32 connections,
//! 3 rounds, every core scenario) takes about 9 minutes. The [scale scenarios](#scale-scenarios)
//! run only when named. Short runs
//! (`--duration-secs 3 --warmup-secs 1`) check that everything works; published numbers come
//! from a long run on a quiet machine. It is not a test, and CI only builds it.
//!
//! # What it needs
//!
//! Linux (it reads `/proc`) and a PostgreSQL server: `--database-url` or `DATABASE_URL` (any
//! database on it), else `127.0.0.1:5432` as `root` or `postgres` with trust authentication.
//! The run creates a database of its own there, `idem_bench_<pid>_<n>`, with the `charges`
//! table and the store's migrations (one more per kind of state the selected scale scenarios
//! need), and drops them at the end, on an error and on Ctrl-C too.
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
//! | `lease-wait` | lease | the same with `.with_in_flight_wait(Duration::from_secs(5))`: every completion also announces its key (`pg_notify` in the batched `complete_many`) and one pooled connection listens; new keys, so nobody waits |
//! | `transactional` | bare | the same `INSERT` through the `IdempotentTx` of `.transactional()`: claim, charge and record in one commit |
//! | `replay` | bare | the lease server answering retries of keys completed before the window |
//! | `memory-bare` | — | a handler doing no I/O, no layer |
//! | `memory` | memory-bare | the same, behind `IdempotencyLayer::memory()` |
//! | `memory-bare-busy` | memory-bare | the no-I/O handler spending 1 µs of CPU per request first, no layer: what a microsecond of work costs here |
//! | `store-ceiling` | bare | the store's `begin` + `complete` for new keys, through sqlx, no HTTP |
//! | `store-lookup` | bare | the store's `begin` on completed keys (a replay's lookup), no HTTP |
//! | `duplicate-storm-no-wait` | — | 32 requests with one key at once to a lease server whose handler takes 200 ms, key after key, waiting off: one runs, the rest get `409` |
//! | `duplicate-storm` | duplicate-storm-no-wait | the same storm with `.with_in_flight_wait(5 s)`: the duplicates wait for the first answer |
//! | `large-bodies` | — | 1 MiB JSON bodies through the lease layer at 64 connections |
//! | `hostile-bare` | — | nearly 2 MiB forms `a&a&a…` (a million pairs) to a no-I/O handler that parses no body, no layer, 16 connections |
//! | `hostile-form` | hostile-bare | the same behind `IdempotencyLayer::memory()`: the fingerprint of a million pairs |
//! | `hostile-json` | hostile-bare | nearly 2 MiB of JSON nested 120 objects deep, each out of order, behind `IdempotencyLayer::memory()` |
//!
//! The `hostile-*` scenarios are there for the server's CPU time per request and peak RSS on
//! bodies built to make a fingerprint expensive (see `tower_idempotency::fingerprint`); their
//! baseline receives bodies of the same size without the layer.
//!
//! `lease-wait` is there for what waiting costs the requests that never wait (issue 29: at
//! least 0.95× `lease`'s throughput): a layer built with waiting makes every completion and
//! release of its store notify, whether or not a duplicate waits, and keeps one connection of
//! the pool listening.
//!
//! The **duplicate storms** are not closed loops. Each round starts a fresh server whose
//! handler sleeps 200 ms before its `INSERT`, opens 32 keep-alive connections, sends one
//! warm-up key, then `--storm-keys` (20) keys one after the other, each by 32 requests released
//! at once (one per connection, the same account and key). Per key, the run counts the
//! executions (the key's rows in `charges`: each key charges an account of its own), the
//! replays, the `409`s and any other answer, and times every duplicate's answer from the
//! executing request's answer. With waiting on (`duplicate-storm`, target "1 execution, 31
//! replays, 0 409s per key") any other outcome on any key is a correctness failure: it is
//! listed under **CORRECTNESS FAILURES** and the run exits non-zero. With waiting off, only a
//! key run more than once (or never) is. The table's row for a storm gives the requests'
//! client-side latencies and req/s over the storms; a **Duplicate storms** section under the
//! tables gives the per-key counts round by round and over all rounds, and how soon after the
//! first answer the duplicates had theirs.
//!
//! `replay` runs with the layer's default 16 MiB replay cache, and each connection retries 16
//! keys, so after each key's first retry it measures the cache, not the store; the scale
//! scenarios below measure both paths apart.
//!
//! The scale scenarios (issue 7), which only run when named:
//!
//! | scenario | vs | target | what |
//! |---|---|---|---|
//! | `empty-lease` | — | — | lease mode, new keys, on a store of 1,000 records |
//! | `full-lease` | `empty-lease` | req/s ≥ 0.9× | the same on a store pre-filled with 10 million completed records |
//! | `empty-replay-store` | — | — | replays with the replay cache off (`with_replay_cache(0)`): each a random record of the 1,000 |
//! | `full-replay-store` | `empty-replay-store` | req/s ≥ 0.9× | the same, each a random record of the 10 million: the store's lookup |
//! | `empty-replay-cached` | — | — | replays with the default cache, each connection retrying 16 records in turn |
//! | `full-replay-cached` | `empty-replay-cached` | req/s ≥ 0.9× | the same with records of the 10 million: the cache |
//! | `expiry-idle` | — | — | lease mode, new keys, 1 million expired records in the table, no reaper |
//! | `expiry-reap` | `expiry-idle` | p99 ≤ 1.5× | the same while the expiry loop deletes them in batches, until they are gone |
//! | `partitioned-idle` | — | — | partitioned mode (6 h partitions), new keys, 1 million expired records in 4 expired partitions |
//! | `partitioned-reap` | `partitioned-idle` | — (shown) | the same while the expiry loop drops the partitions |
//! | `single-instance` | — | — | lease mode, new keys, one server process |
//! | `many-instances` | `single-instance` | one execution per key | 4 server processes, each with its own pool; then a burst of cross-instance duplicates |
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
//!   throughput, and this table says whose it is. Its last two columns count the **context
//!   switches** per request of the server's and the benchmark's threads (each time one went to
//!   sleep or was preempted): on a VM each costs microseconds of kernel time, waking it and its
//!   peer included, so a layer that makes requests wait more often (for a batch, a lock, a
//!   client that has gone idle) pays there as well as in its own code.
//!
//! The load generator shares the machine with the server and PostgreSQL. That is deliberate
//! (the ratios are what matters, and every scenario pays for the generator alike), but the
//! absolute numbers are those of the whole machine, not of the server alone.
//!
//! # Scale scenarios
//!
//! Issue 7's questions — does the layer's cost grow with the table, does expiry hurt live
//! traffic, do many instances agree — as scenarios of the same side-by-side kind. They are
//! opt-in (a full store takes minutes to fill): name them, or use a group, `scale` (all),
//! `full-store` or `expiry`:
//!
//! ```text
//! # A quick check that everything works (a smaller full store; about 2 minutes):
//! cargo run --release -p idempotency-bench -- --scenarios scale --rounds 1 \
//!     --duration-secs 3 --warmup-secs 1 --full-store-rows 1000000 --expired-rows 200000
//! # The published figures (about 15 minutes on 2 cores, of which 3.5 filling the full store;
//! # 8 GB of disk for it, and as much WAL):
//! cargo run --release -p idempotency-bench -- --scenarios scale > scale.md
//! # One question at a time:
//! cargo run --release -p idempotency-bench -- --scenarios full-store
//! cargo run --release -p idempotency-bench -- --scenarios expiry --reaper-batch 500
//! cargo run --release -p idempotency-bench -- --scenarios many-instances --instances 4
//! ```
//!
//! The full store takes the time and the disk: the fill writes about 130,000 records a second
//! (progress on stderr) and 810 bytes of table and index per record. The full-store figures
//! depend on how much of the table the OS keeps cached: the report gives the disk reads.
//!
//! Each kind of state gets a database of its own, prepared by SQL, never through HTTP, and the
//! table is followed by a **Scale scenarios** section: how the databases were prepared, and per
//! scenario and round what the table cannot show (reaper, locks, WAL, the duplicate burst).
//!
//! For every scale scenario the report says where the database's work went during the window:
//! the WAL the server wrote (`pg_wal_lsn_diff` of `pg_current_wal_lsn()`: the whole server's,
//! other databases' included) and — when the server has `pg_walinspect`, which the run enables
//! in its databases — the WAL records of the run database's own relations, read back after the
//! window (a temporary replication slot keeps that WAL from being recycled meanwhile), with
//! their share of full-page images and the relations that wrote most; the blocks per request
//! found in `shared_buffers` or read from outside it (`pg_stat_database`, approximate); what
//! the machine's disks read (`/proc/diskstats`), which tells the OS page cache from the disk;
//! and the share of the record updates (completions, mostly) that were HOT, staying on their
//! page without an index entry (`pg_stat_user_tables`, approximate).
//!
//! `--db-setting NAME=VALUE` (repeatable) sets a PostgreSQL setting on the run's databases only
//! (`ALTER DATABASE ... SET`, so the servers' sessions start with it), to try a setting on the
//! scenarios, e.g. `--db-setting wal_compression=lz4`; the report's header lists them.
//!
//! * **Full store.** Two databases, filled once per run and reused by every round: the *empty*
//!   store gets 1,000 completed records, the *full* one `--full-store-rows` (10 million), by
//!   `INSERT ... SELECT ... FROM generate_series` in chunks over two connections, with progress
//!   on stderr, then `VACUUM ANALYZE` and `CHECKPOINT`; the report gives the fill's time and the
//!   table's `pg_total_relation_size` (heap, indexes). The records look like the layer's own:
//!   SHA-256 scope keys computed in SQL exactly as `ScopeKey::new` does and stored as the store
//!   stores them, their first 128 bits as a `uuid` (checked against the crate after the fill), the fingerprint of the benchmark's charge body, status 201, two
//!   headers and a 190–400-byte JSON charge; they expire 1 to 24 hours from the fill. Record `n`
//!   is key `fill-<n>` of account `acct_<n % 16>`, so every one of them can be replayed. The
//!   replay scenarios pick among them: `*-replay-store` turns the layer's replay cache off and
//!   picks a random record per request (every replay is a lookup in the store: on the full
//!   store, in a table far larger than `shared_buffers`); `*-replay-cached` keeps the default
//!   16 MiB cache and has each connection retry 16 records in turn (all but each record's first
//!   retry are answered from memory).
//! * **Expiry under load.** Before each `expiry-*` measurement, `--expired-rows` (1 million)
//!   expired records are put back in the table (completed records whose 24 h TTL ran out in the
//!   last hour), then `VACUUM ANALYZE` and `CHECKPOINT`, so every measurement starts from the
//!   same table, without dead rows, and with every page due for a full-page image in the WAL
//!   (as pages last written a day earlier are). `expiry-reap` arms
//!   `continuously_delete_expired(store, 10 s, --reaper-batch)` **in the server process, on the
//!   server's own pool**, as an application runs it, and starts it when the window opens. The
//!   table's figures (requests, latency, CPU, WAL) are those of live traffic *while reaping*,
//!   from the window's opening to the drain (at most 10 minutes); the load goes on to
//!   `--duration-secs` at least, and the details also give the latency over that whole window
//!   (a drain of half a second weighs on a 10-second window's p99 only if it is bad enough).
//!   The baseline, `expiry-idle`, has the same expired records in
//!   the table and no reaper: the only difference between the two is the reaper's work, not the
//!   table's contents (a baseline without the expired rows would also charge the reaper with
//!   the cost of a larger table). The reaper's `delete_expired` calls are timed in the server
//!   (there is no `pg_stat_statements` or statement log to ask): records, calls, drain time,
//!   records/s, per-call p50/p99/max and whether calls slow down as the backlog shrinks;
//!   `pg_stat_activity` is sampled every 50 ms for backends waiting on heavyweight locks and
//!   for how long each kind of reaping statement (batch `DELETE`; partition `DETACH`,
//!   `count(*)`, `DROP`) is seen running.
//! * **Partitioned expiry.** `partitioned-*` do the same on a store in partitioned mode
//!   (`PostgresStore::partitioned(6 h)`, a quarter of the TTL): the records sit in 4 partitions
//!   that ended before now (created and named as the store names its own; the store's
//!   `maintain_partitions` creates those ahead), and the expiry loop's `delete_expired` drops
//!   them whole. The report's last table puts the two ways of expiring side by side: drain
//!   time, records/s, longest call, WAL, and live traffic's req/s and p99 while it ran, each
//!   against its own idle baseline.
//! * **Many instances.** `many-instances` runs `--instances` (4) server processes against the
//!   run's database, each with a pool of `--pool-size`, and connection `i` of the load generator
//!   talks to instance `i % 4`; throughput and CPU are the fleet's sums (peak RSS too). After
//!   the window, a burst of `--duplicate-keys` (1,000) keys, each sent to all instances at once
//!   (and `409 in flight` answers retried), must show exactly one execution per key: one `201`
//!   without `Idempotent-Replayed` and identical bodies on every instance, and exactly one row
//!   per key in `charges` (each key charges an account of its own). Anything else fails the
//!   scenario, is printed under **CORRECTNESS FAILURES**, and makes the run exit non-zero.
//!
//! # Adding a scenario
//!
//! Scenarios are data: one more entry in `scenario::SCENARIOS` (name, baseline, how it runs,
//! targets). A baseline may have its own (`lease-wait` → `lease` → `bare`): selecting a
//! scenario runs the whole chain. A new kind of server is a variant of `app::App`, a new kind
//! of request a variant of `load::Keys` or `load::BodySize`, a database in a new state a
//! `scenario::Database` (prepared in `run::databases::Databases`); the runner, the tables and the target
//! checks take it from there.
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
