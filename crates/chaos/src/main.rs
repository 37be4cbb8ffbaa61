//! The chaos run: proof that tower-idempotency charges exactly once through crashes, database
//! restarts, refused completions, timeouts, hang-ups (and storms of them) and duplicate
//! requests, in either of its modes (`--mode`):
//!
//! * **steps** (the default, the demo's own mode): lease mode, each charge authorized at a
//!   separate acquirer process (step `authorize`, under its downstream key), then written to
//!   the ledger (step `ledger`), the completer on. Kills land between the two (the processing
//!   delay); some clients go away at the kill and come back only after the run. The acquirer's
//!   authorizations are counted per charge: one each (*double authorizations*: 0), none without
//!   its charge once the completer ran and before any client came back (*orphaned
//!   authorizations*: 0). `--inject-bug no-completer` must fail on the latter.
//! * **transactional**: each charge written through the request's transaction, committed with
//!   its response; handlers that catch a database error too (described below).
//!
//! Run with `cargo run --release -p chaos -- --mode steps --duration-secs 60` and
//! `--mode transactional --duration-secs 30` (the CI commands). Everything is on
//! loopback and bounded in time: setup (about 3 s), the chaos (`--duration-secs`), a drain of at
//! most `--drain-secs` (60 s; normally about a second), the checks and the teardown. Only the
//! PostgreSQL server binaries need to be installed (`apt install postgresql`); nothing needs to
//! be running.
//!
//! # What it does
//!
//! 1. Starts a **throwaway PostgreSQL cluster** of its own ([`cluster`]) in a temporary
//!    directory, on a Unix socket only, so it can stop and restart it without disturbing any
//!    other database; it is removed at the end, also on an error, a panic, Ctrl-C or `SIGTERM`
//!    (and by a watchdog if this program is killed with `SIGKILL`).
//! 2. Starts **two `charges-demo` instances** on that database ([`instance`]), as child
//!    processes of this same binary re-executed as `chaos serve` ([`serve`]): the demo through
//!    its library on PostgreSQL, in the run's mode, with a 2 s lease.
//!    Each listens on `127.0.0.1:0` and takes a random processing delay (10–50 ms), so kills
//!    land mid-charge. Both make a duplicate of a charge in flight wait up to 1 s for its answer
//!    (`--in-flight-wait-ms`), and log how each wait ended ([`waits`]). Charges marked so go to a
//!    handler that catches a database error ([`catch`]).
//! 3. Runs **64 clients** ([`client`]) that create charges like a payments SDK: a UUID
//!    `Idempotency-Key` and a unique `metadata[order_id]` per charge, a timeout per request,
//!    retries with exponential backoff and jitter on connection errors, timeouts, `409` and
//!    `5xx` (honouring `Retry-After`), both instances behind a simulated load balancer, some
//!    charges sent twice in parallel (a quarter of them with the second sender hanging up while
//!    it waits), some requests hung up mid-flight, some charges sent again
//!    after their answer, 3 % marked for the catching handler; and **refund** 5 % of the charges
//!    that succeed (a random part or all; some twice at once with different keys, together often
//!    more than the charge; some sent again after their answer).
//!    As an acquirer, it **settles 10 %** of the charges that succeed (`--settle-percent`,
//!    [`webhooks`]): a signed `charge.settled` webhook (the run's own secret) delivered as **20
//!    copies at once** over both instances, each retried until a final answer; some charges get
//!    a second event with another id, and a few events name a charge that does not exist.
//! 4. Meanwhile ([`faults`]) **`SIGKILL`s a random instance every 2–5 s** and restarts it on a
//!    new port (the clients learn it), **restarts PostgreSQL once** (`pg_ctl stop -m fast`
//!    or `immediate`, down 1–3 s) between 30 % and 60 % of the run, **refuses completions for
//!    5 s** once, clear of the restart (a trigger on `idempotency.records`: longer than the
//!    lease), and raises **3 hang-up storms**: half the clients drop their requests at once and
//!    send one more each, dropped too, so the instances' detached handlers pass the layer's
//!    limit (half the pool, 10) and some requests get `503 Overloaded`; and **fails waiting
//!    reads for 5 s** once, clear of the restart and the refusal ([`wait_reads`]): the database
//!    raises on a waiting duplicate's read of its key in flight, which must answer `409`.
//! 5. Stops the chaos, lets every client finish the charge it is on (retrying until a final
//!    answer, up to `--drain-secs`), waits for the database's transactions to end, and
//!    **checks** ([`verify`]) the database against what every client saw: exactly one charge
//!    row per logical charge, byte-identical bodies on every answer and replay, the charge id
//!    in the body matching the row, the stored record matching the answer, no key in flight,
//!    nothing lost; and for the caught errors, no row, no record and a fresh `402` every time.
//!    No duplicate sent at once was turned away with a `503` by a failed read while it waited.
//!    For refunds: no charge refunded past its amount, its `amount_refunded` the sum of its
//!    refund rows, one row per refund answered `200` and none for one refused, and a refusal only
//!    where the other refund sent at once left too little.
//!    For settlements: every account's `GET /v1/balance` (on both instances) equals what its
//!    charge and refund rows give for the charges whose events were answered `2xx`, no charge
//!    settled twice, every such event has its inbox record, every unknown charge's copy got a
//!    `404` and left none, and no copy got another answer.
//!
//! In steps mode, after the drain, the run waits (up to 60 s) until no key with a kept request
//! is in flight, counts the acquirer's authorizations against the charge rows, then lets each
//! client that went away send its charge again: its answer is held to every rule above, and
//! is the replay of what the completer finished. A takeover that resumes from recorded steps
//! answers the same bytes again, unmarked: counted as *answered fresh again*, not as a failure.
//!
//! The choices (kill times and targets, keys, amounts, hang-ups, jitter, the refusal's window,
//! the storms and whom they strike, the charges that catch an error, the webhooks) follow from
//! `--seed`; without one a seed is drawn and printed. Timing still differs between runs.
//!
//! # Reading the output
//!
//! Progress goes to standard error, each line stamped with the time since the start: every
//! kill and restart, the database restart, the refusal's start and end, each storm, and every
//! 10 s the traffic so far. The report goes
//! to standard output:
//!
//! * **traffic**: logical charges (and how many were sent in parallel, resent, declined), the
//!   duplicates that waited (by how their wait ended: replayed, ran, timed out, hung up, failed
//!   read, turned away) and the waiting hang-ups the clients made, logical
//!   refunds (of how many charges, sent at once with another, resent, refused),
//!   requests, retries, replays (answers marked `Idempotent-Replayed: true`), `409`s (a
//!   duplicate met the charge in flight), `5xx`, `503`s (the database was away, a kill or
//!   restart broke a request, a completion was refused) and of them `Overloaded` (a storm),
//!   connection errors (an instance was down), timeouts and hang-ups;
//! * **faults**: kills, instance starts (and failed starts: an instance restarted while the
//!   database was down retries), database restarts; completions refused (counted by the
//!   trigger); caught database errors (charges, and their answers); storms (charges sent in
//!   them, requests they hung up, `503 Overloaded` answers); waiting reads failed (counted by
//!   the database);
//! * **server side**: charges the handlers wrote (`charge created` in the demo's logs) against
//!   the rows that committed — the difference were rolled back by a kill or the database
//!   restart, mid-charge; refunds likewise (`refund created`); failed commits; answers over a failed transaction (the caught
//!   errors' `402`s, delivered unstored); responses stored in the background (0: every
//!   handler writes through its transaction); takeovers (always 0 in transactional mode: a claim
//!   commits only together with its response, so no record is ever left in flight for a
//!   retry to take over; a killed holder's transaction is simply aborted);
//! * **webhooks**: events (second events, unknown charges), copies and deliveries, retries
//!   (and why), the most copies of one event in flight at once, `404`s, charges settled (and of
//!   them refunded), accounts and balances checked;
//! * **invariants**: each with its count; any non-zero count is a failure, explained by up to
//!   20 examples below the table;
//! * **time**: each phase, and the total.
//!
//! The last line is `PASS` (exit status 0) or `FAIL` (exit status 1; the demo's and the
//! server's logs are then kept and their directory printed). An error that prevents the run
//! exits with 2, an interrupted run with 130.
//!
//! # Through failovers
//!
//! `--failover` runs on a high-availability cluster instead (two Patroni nodes behind HAProxy,
//! made by `scripts/ha-cluster.sh`, [`ha`]) and kills its primary again and again, each killed
//! node rejoining before the next kill ([`failover`]); the report adds the failovers and the
//! acknowledged records they lost. With `--replication sync` (the default) nothing is lost.
//!
//! # Self-check
//!
//! `--inject-bug writes-outside-tx` or `--inject-bug lease-mode` (hidden options) run the demo
//! wired wrongly on purpose ([`serve::Bug`]), to show that the checks catch a real exactly-once
//! bug: such a run must report double executions and `FAIL`. The banner says so; it is never
//! the default.

mod attempt;
mod catch;
mod client;
mod cluster;
mod database;
mod failover;
mod faults;
mod ha;
mod instance;
mod late;
mod network;
mod replay;
mod report;
mod rng;
mod run;
mod send;
mod serve;
mod verify;
mod wait_reads;
mod waits;
mod watchdog;
mod webhooks;

use std::{
    ffi::OsStr,
    fmt,
    process::ExitCode,
    sync::OnceLock,
    time::{Duration, Instant},
};

use clap::{Parser, ValueEnum};

/// Errors that end the run (they are reported, and the exit status is 2).
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The command line of a run; see the [crate documentation](crate).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "chaos",
    version,
    about = "Chaos run for tower-idempotency: two charges-demo instances (steps mode with an \
             acquirer and the completer, or transactional mode) on a throwaway \
             PostgreSQL, retrying clients, SIGKILLs, a database restart, refused completions, \
             handlers that catch a database error, hang-up storms and duplicates waiting for \
             their keys (some hanging up, some whose reads fail); then checks that every \
             charge and refund ran exactly once, and no charge was refunded past its amount"
)]
pub(crate) struct RunArgs {
    /// How long the chaos lasts, in seconds; then the clients finish and the checks run.
    #[arg(long, default_value_t = 60, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub(crate) duration_secs: u64,

    /// Concurrent clients.
    #[arg(long, default_value_t = 64, value_name = "N",
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub(crate) clients: u16,

    /// Seed of the run's choices (default: drawn from the clock, and printed).
    #[arg(long, value_name = "S")]
    pub(crate) seed: Option<u64>,

    /// Shortest time between two kills, in milliseconds.
    #[arg(long, default_value_t = 2_000, value_name = "MS")]
    pub(crate) kill_min_ms: u64,

    /// Longest time between two kills, in milliseconds.
    #[arg(long, default_value_t = 5_000, value_name = "MS")]
    pub(crate) kill_max_ms: u64,

    /// Shortest processing delay of an instance (drawn at each start), in milliseconds.
    #[arg(long, default_value_t = 10, value_name = "MS")]
    pub(crate) delay_min_ms: u64,

    /// Longest processing delay of an instance, in milliseconds.
    #[arg(long, default_value_t = 50, value_name = "MS")]
    pub(crate) delay_max_ms: u64,

    /// How the database is stopped for its restart (default: drawn from the seed).
    #[arg(long, value_enum, value_name = "MODE")]
    pub(crate) pg_stop_mode: Option<PgStopMode>,

    /// The longest request timeout, in milliseconds; each client draws its own from a
    /// twentieth of it up to it.
    #[arg(long, default_value_t = 2_000, value_name = "MS")]
    pub(crate) request_timeout_ms: u64,

    /// How long the clients may take to finish their charges once the chaos stops, in seconds.
    #[arg(long, default_value_t = 60, value_name = "N")]
    pub(crate) drain_secs: u64,

    /// Percentage of charges sent twice in parallel.
    #[arg(long, default_value_t = 10, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) parallel_percent: u8,

    /// Percentage of requests the client hangs up on (after 1–60 ms).
    #[arg(long, default_value_t = 5, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) hangup_percent: u8,

    /// Percentage of charges sent again after their final answer (expecting a replay).
    #[arg(long, default_value_t = 10, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) resend_percent: u8,

    /// Percentage of charges made with a declined card (a `402`, final and replayed too).
    #[arg(long, default_value_t = 5, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) decline_percent: u8,

    /// How long the database refuses completions, once, in seconds (0: never): a trigger on
    /// `idempotency.records` raises on every response being stored, for longer than the
    /// instances' 2 s lease.
    #[arg(long, default_value_t = 5, value_name = "N",
          value_parser = clap::value_parser!(u64).range(0..=3_600))]
    pub(crate) refuse_completions_secs: u64,

    /// Percentage of charges whose handler catches a database error (its INSERT fails in the
    /// request's transaction) and answers a `402` anyway, which must be neither stored nor
    /// committed.
    #[arg(long, default_value_t = 3, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) catch_percent: u8,

    /// Percentage of the charges that succeeded which are then refunded: a random part or all,
    /// some twice at once with different keys, some sent again after their answer.
    #[arg(long, default_value_t = 5, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) refund_percent: u8,

    /// How long a duplicate of a charge in flight waits for its answer in the instances, in
    /// milliseconds (0: `409` at once).
    #[arg(long, default_value_t = 1_000, value_name = "MS")]
    pub(crate) in_flight_wait_ms: u64,

    /// Percentage of the charges sent twice in parallel whose second request, sent just after
    /// the first so that it waits, hangs up while waiting (after 3–30 ms).
    #[arg(long, default_value_t = 25, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) wait_hangup_percent: u8,

    /// How long, once, waiting duplicates' reads of their keys in flight fail, in seconds (0:
    /// never): the database raises on them while the requests holding the keys go on.
    #[arg(long, default_value_t = 5, value_name = "N",
          value_parser = clap::value_parser!(u64).range(0..=3_600))]
    pub(crate) fail_wait_reads_secs: u64,

    /// Hang-up storms, spread over the chaos: many clients drop their requests at once (and
    /// send one more, which they drop too).
    #[arg(long, default_value_t = 3, value_name = "N",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) storms: u8,

    /// Percentage of the clients each storm strikes.
    #[arg(long, default_value_t = 50, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) storm_percent: u8,

    /// How the instances make a charge exactly once: in lease mode with steps, a separate
    /// acquirer process and the completer on (the demo's own mode), or in transactional mode.
    #[arg(long, value_enum, default_value_t = Mode::Steps, value_name = "MODE")]
    pub(crate) mode: Mode,

    /// Percentage of charges whose client goes away at its first connection error (its
    /// instance was killed mid-charge, perhaps after a `503` the client was retrying), and comes back only after the run, once the completer
    /// has had its time; its answer then must be the replay of what the completer finished.
    #[arg(long, default_value_t = 10, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) abandon_percent: u8,

    /// In steps mode, the percentage of calls the acquirer fails with `503` (half before
    /// authorizing, half after: a lost answer, which must not authorize twice).
    #[arg(long, default_value_t = 5, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) acquirer_fail_percent: u8,

    /// Percentage of the charges that succeeded which get a `charge.settled` webhook, each
    /// delivered as 20 copies at once over both instances (see [`webhooks`]).
    #[arg(long, default_value_t = 10, value_name = "P",
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) settle_percent: u8,

    /// Run on a high-availability cluster (two Patroni nodes behind HAProxy, made by
    /// `scripts/ha-cluster.sh`) whose primary is killed again and again, each killed node
    /// rejoining before the next kill; see [`failover`]. The database restart, refused
    /// completions and failed waiting reads are then off.
    #[arg(long)]
    pub(crate) failover: bool,

    /// With `--failover`: how the primary's commits reach the standby.
    #[arg(long, value_enum, default_value_t = ha::Replication::Sync, value_name = "MODE")]
    pub(crate) replication: ha::Replication,

    /// With `--failover`: the chaos lasts until at least this many failovers are done.
    #[arg(long, default_value_t = 3, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=1_000))]
    pub(crate) failovers: u32,

    /// With `--failover`: how long the primary's walsenders are stopped before each kill of
    /// the whole node, in milliseconds, so that the standby is behind when it takes over.
    #[arg(long, default_value_t = 0, value_name = "MS",
          value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub(crate) failover_lag_ms: u64,

    /// Keep the demo's and the server's logs even when the run passes.
    #[arg(long)]
    pub(crate) keep_logs: bool,

    /// SELF-CHECK ONLY: run the demo with a deliberate exactly-once bug; the run must FAIL.
    #[arg(long, hide = true, value_enum, value_name = "BUG")]
    pub(crate) inject_bug: Option<serve::Bug>,
}

/// `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    /// Lease mode with steps: each charge authorized at a separate acquirer (step `authorize`),
    /// then written to the ledger (step `ledger`); the completer finishes abandoned charges.
    Steps,
    /// Transactional mode: each charge written through the request's transaction, committed
    /// with its stored response.
    Transactional,
}

impl Mode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Steps => "steps",
            Self::Transactional => "transactional",
        }
    }
}

/// `--pg-stop-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PgStopMode {
    /// Sessions terminated, a checkpoint, a clean shutdown.
    Fast,
    /// A crash: the server recovers from its WAL when it starts.
    Immediate,
}

fn main() -> ExitCode {
    if std::env::args_os().nth(1).as_deref() == Some(OsStr::new("serve")) {
        return serve::main(serve::ServeArgs::parse_from(std::env::args_os().skip(1)));
    }
    if std::env::args_os().nth(1).as_deref() == Some(OsStr::new("acquirer")) {
        return network::main(network::NetworkArgs::parse_from(
            std::env::args_os().skip(1),
        ));
    }
    let args = RunArgs::parse();
    START.get_or_init(Instant::now);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("chaos: cannot start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    let code = runtime.block_on(run::main(args));
    // Client tasks still parked on a timer must not hold the exit.
    runtime.shutdown_timeout(Duration::from_secs(1));
    code
}

static START: OnceLock<Instant> = OnceLock::new();

/// The time since the run started.
pub(crate) fn elapsed() -> Duration {
    START.get_or_init(Instant::now).elapsed()
}

/// A progress line on standard error, stamped with the time since the start.
pub(crate) fn progress(message: fmt::Arguments<'_>) {
    eprintln!("[{:7.1}s] {message}", elapsed().as_secs_f64());
}
