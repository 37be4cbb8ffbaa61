//! The phases of a run: setup, chaos, drain, checks, teardown; and the clean-up however it
//! ends (a signal included).

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    sync::{Arc, OnceLock},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use sqlx::postgres::PgPoolOptions;
use tokio::{sync::watch, task::JoinSet};

use crate::{
    BoxError, Mode, PgStopMode, RunArgs,
    client::{self, Behaviour, Shared, Stats},
    cluster::StopMode,
    database::Database,
    failover::{self, Failovers},
    faults::{self, DatabaseFaults, DatabaseRestart, RefusalFaults, Storm, StormFaults},
    instance::{DemoLog, Fleet, Spec},
    late,
    network::Network,
    progress,
    report::{Faults, Phases, Report},
    rng::Rng,
    serve::Bug,
    verify::{self, Verdict, authorizations},
    wait_reads::{self, Phase, WaitReadFaults},
    webhooks,
};

/// How long the database's transactions may take to end once the clients are done.
const SETTLE: Duration = Duration::from_secs(10);
/// Slack beyond the drain for client tasks to return (one request timeout and one backoff).
const DRAIN_SLACK: Duration = Duration::from_secs(15);
/// How long the acquirer takes to authorize, in steps mode.
const NETWORK_DELAY: Duration = Duration::from_millis(5);
/// How often progress is printed.
const TICK: Duration = Duration::from_secs(10);

/// The whole run; the exit status.
pub(crate) async fn main(args: RunArgs) -> ExitCode {
    let args = failover::adjust(args);
    if let Some(bug) = args.inject_bug
        && bug.mode() != args.mode
    {
        eprintln!(
            "chaos: --inject-bug {} breaks {} mode: add --mode {}",
            bug.name(),
            bug.mode().name(),
            bug.mode().name()
        );
        return ExitCode::from(2);
    }
    let seed = args.seed.unwrap_or_else(clock_seed);
    // Caught from the start: a Ctrl-C during setup still cleans up.
    let mut signals = Signals::install();
    eprintln!(
        "chaos run: seed {seed}, {} mode, {} s, {} clients, 2 charges-demo instances (processing delay \
         {}–{} ms), a SIGKILL every {:.1}–{:.1} s, one PostgreSQL restart, completions refused \
         for {} s, {} % caught database errors, {} hang-up storms of {} % of the clients, \
         duplicates waiting up to {} ms ({} % of them hanging up), waiting reads failing for {} s",
        args.mode.name(),
        args.duration_secs,
        args.clients,
        args.delay_min_ms,
        args.delay_max_ms,
        args.kill_min_ms as f64 / 1000.0,
        args.kill_max_ms as f64 / 1000.0,
        args.refuse_completions_secs,
        catch_percent(&args),
        args.storms,
        args.storm_percent,
        args.in_flight_wait_ms,
        args.wait_hangup_percent,
        args.fail_wait_reads_secs,
    );
    eprintln!(
        "replay it with: cargo run --release -p chaos -- {}",
        crate::replay::args(&args, seed)
    );
    if let Some(bug) = args.inject_bug {
        eprintln!(
            "SELF-CHECK: bug injected ({}: {}); this run is expected to FAIL",
            bug.name(),
            bug.describe()
        );
    }

    let setup_started = Instant::now();
    let made = tokio::task::spawn_blocking({
        let args = args.clone();
        move || Database::create(&args)
    });
    let cluster = match made.await {
        Ok(Ok(cluster)) => cluster,
        Ok(Err(error)) => {
            eprintln!("chaos: cannot start the run's database: {error}");
            return ExitCode::from(2);
        }
        Err(error) => {
            eprintln!("chaos: starting the run's database failed: {error}");
            return ExitCode::from(2);
        }
    };
    progress(format_args!("{}", cluster.describe()));

    let ended = tokio::select! {
        result = run(&args, seed, &cluster, setup_started) => Ok(result),
        signal = signals.recv() => Err(signal),
    };
    // Whatever `run` started is gone: its instances were killed and its clients aborted when
    // it was dropped.
    let keep_logs = match &ended {
        Ok(Ok(report)) => args.keep_logs || !report.verdict.passed(),
        Ok(Err(_)) => true,
        Err(_) => args.keep_logs,
    };
    let teardown_started = Instant::now();
    let removed = tokio::task::spawn_blocking(move || cluster.remove(keep_logs)).await;
    let teardown = teardown_started.elapsed();
    let kept = match removed {
        Ok(Ok(kept)) => kept,
        Ok(Err(error)) => {
            eprintln!("chaos: cleaning up the run's database: {error}");
            None
        }
        Err(error) => {
            eprintln!("chaos: cleaning up the run's database failed: {error}");
            None
        }
    };

    match ended {
        Ok(Ok(report)) => {
            report.print(teardown, crate::elapsed(), kept.as_deref());
            if report.verdict.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Ok(Err(error)) => {
            eprintln!("chaos: the run failed: {error}");
            if let Some(dir) = kept {
                eprintln!("chaos: logs kept in {}", dir.display());
            }
            ExitCode::from(2)
        }
        Err(signal) => {
            eprintln!(
                "chaos: {signal}: stopped; instances and PostgreSQL removed ({:.1} s in all)",
                crate::elapsed().as_secs_f64()
            );
            ExitCode::from(130)
        }
    }
}

/// Setup (the instances), chaos, drain and checks. The cluster is already up.
async fn run(
    args: &RunArgs,
    seed: u64,
    cluster: &Database,
    setup_started: Instant,
) -> Result<Report, BoxError> {
    let mut rng = Rng::new(seed);
    let log = Arc::new(DemoLog::create(&cluster.dir().join("demo.log"))?);
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(cluster.connect_options()?)
        .await?;
    let fail_wait_reads = Duration::from_secs(args.fail_wait_reads_secs);
    // Before the instances start: their statements must resolve the shim.
    if !fail_wait_reads.is_zero() {
        wait_reads::prepare(&pool).await?;
    }
    let exe = own_executable()?;
    let network = match args.mode {
        Mode::Steps => Some(start_network(&exe, args, seed, cluster).await?),
        Mode::Transactional => None,
    };
    let webhook_secret = webhooks::secret();
    let spec = Spec {
        exe,
        database_url: cluster.url(),
        delay_ms: (args.delay_min_ms, args.delay_max_ms),
        in_flight_wait_ms: args.in_flight_wait_ms,
        search_path: (!fail_wait_reads.is_zero()).then_some(wait_reads::SEARCH_PATH),
        inject_bug: args.inject_bug,
        mode: args.mode,
        acquirer_url: network.as_ref().map(Network::url),
        step_secret: format!("chaos run {seed}: the secret of the downstream keys"),
        webhook_secret: webhook_secret.clone(),
    };
    let fleet = Fleet::start(spec, Arc::clone(&log), pool.clone(), rng.fork()).await?;
    let setup = setup_started.elapsed();

    let duration = Duration::from_secs(args.duration_secs);
    let drain = Duration::from_secs(args.drain_secs);
    let restart = DatabaseRestart {
        at: duration * u32::try_from(rng.between(30, 60)).unwrap_or(50) / 100,
        mode: match args.pg_stop_mode {
            Some(PgStopMode::Fast) => StopMode::Fast,
            Some(PgStopMode::Immediate) => StopMode::Immediate,
            None if rng.percent(50) => StopMode::Immediate,
            None => StopMode::Fast,
        },
        down_for: Duration::from_millis(rng.between(1_000, 3_000)),
    };
    let refusal = faults::plan_refusal(
        &mut rng,
        duration,
        Duration::from_secs(args.refuse_completions_secs),
        &restart,
    );
    if refusal.is_some() {
        faults::prepare_refusal(&pool).await?;
    }
    let storms = faults::plan_storms(
        &mut rng,
        duration,
        args.storms,
        usize::from(args.clients),
        args.storm_percent,
    );
    // Drawn last, so that the other faults' plans of a seed stay as they were.
    let mut avoid = vec![(restart.at, restart.at + restart.down_for)];
    avoid.extend(refusal.map(|refusal| (refusal.at, refusal.at + refusal.window)));
    let wait_read_fault = wait_reads::plan(&mut rng, duration, fail_wait_reads, &avoid);
    let (storm_tx, storm_rx) = watch::channel(Storm::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let (feed, paid) = webhooks::Feed::channel(args.settle_percent > 0);
    let shared = Arc::new(Shared {
        addrs: Arc::clone(fleet.addrs()),
        behaviour: Behaviour {
            seed,
            request_timeout: Duration::from_millis(args.request_timeout_ms),
            parallel_percent: args.parallel_percent,
            hangup_percent: args.hangup_percent,
            resend_percent: args.resend_percent,
            decline_percent: args.decline_percent,
            catch_percent: catch_percent(args),
            refund_percent: args.refund_percent,
            wait_hangup_percent: args.wait_hangup_percent,
            abandon_percent: args.abandon_percent,
        },
        stats: Stats::default(),
        stop: stop_rx.clone(),
        deadline: OnceLock::new(),
        storms: storm_rx,
        wait_reads: Phase::default(),
        webhooks: feed,
    });
    let stop = || {
        let _ = shared.deadline.set(Instant::now() + drain);
        stop_tx.send_replace(true);
    };

    progress(format_args!(
        "chaos for {} s with {} clients; PostgreSQL restart (stop -m {}) planned at {:.1} s; {}; \
         hang-up storms at [{}] s; {}",
        duration.as_secs(),
        args.clients,
        restart.mode.as_str(),
        restart.at.as_secs_f64(),
        match refusal {
            Some(refusal) => format!(
                "completions refused at {:.1} s for {} s",
                refusal.at.as_secs_f64(),
                refusal.window.as_secs()
            ),
            None => "no completions refused".to_owned(),
        },
        storms
            .iter()
            .map(|storm| format!("{:.1}", storm.at.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", "),
        match wait_read_fault {
            Some(fault) => format!(
                "waiting reads fail at {:.1} s for {} s",
                fault.at.as_secs_f64(),
                fault.window.as_secs()
            ),
            None => "no waiting reads fail".to_owned(),
        },
    ));
    let chaos_started = Instant::now();
    let sending = tokio::spawn({
        let (shared, percent) = (Arc::clone(&shared), args.settle_percent);
        async move { webhooks::run(shared, paid, &webhook_secret, percent).await }
    });
    let mut clients = JoinSet::new();
    for index in 0..usize::from(args.clients) {
        let shared = Arc::clone(&shared);
        let rng = rng.fork();
        clients.spawn(async move { client::run(&shared, index, rng).await });
    }
    if !storms.is_empty() {
        for index in 0..usize::from(args.clients) {
            let shared = Arc::clone(&shared);
            let rng = rng.fork();
            clients.spawn(async move { client::storm_charges(&shared, index, rng).await });
        }
    }
    let database_faults = DatabaseFaults::default();
    let failovers = Failovers::new(args);
    let refusal_faults = RefusalFaults::default();
    let storm_faults = StormFaults::default();
    let wait_read_faults = WaitReadFaults::default();
    let faults = async {
        tokio::try_join!(
            faults::kill_instances(
                &fleet,
                stop_rx.clone(),
                rng.fork(),
                (
                    Duration::from_millis(args.kill_min_ms),
                    Duration::from_millis(args.kill_max_ms)
                ),
            ),
            failover::database_faults(
                cluster,
                &pool,
                stop_rx.clone(),
                restart,
                &database_faults,
                (seed, &failovers)
            ),
            faults::refuse_completions(&pool, stop_rx.clone(), refusal, &refusal_faults),
            faults::hang_up_storms(&storms, &storm_tx, stop_rx.clone(), &storm_faults),
            wait_reads::fail_wait_reads(
                &pool,
                stop_rx.clone(),
                wait_read_fault,
                &shared.wait_reads,
                &wait_read_faults,
            ),
            tick(&shared, &fleet, stop_rx.clone()),
        )
    };
    tokio::pin!(faults);
    let faulted = tokio::select! {
        // Returns early only on an error.
        result = &mut faults => result,
        () = failovers.chaos_time(duration) => {
            stop();
            progress(format_args!("chaos over: finishing the fault in progress"));
            faults.await
        }
    };
    stop();
    let chaos = chaos_started.elapsed();
    faulted?;

    progress(format_args!(
        "clients finishing their charges in progress (at most {} s)",
        drain.as_secs()
    ));
    let drain_started = Instant::now();
    let mut observed = Vec::new();
    let mut client_failures = 0;
    let collected = tokio::time::timeout(drain + DRAIN_SLACK, async {
        while let Some(joined) = clients.join_next().await {
            match joined {
                Ok(charges) => observed.extend(charges),
                Err(error) => {
                    client_failures += 1;
                    progress(format_args!("a client task failed: {error}"));
                }
            }
        }
    })
    .await;
    if collected.is_err() {
        client_failures += clients.len() as u64;
        progress(format_args!("{} client(s) did not finish", clients.len()));
        clients.abort_all();
    }
    let settled = webhooks::finish(sending, drain_started + drain + DRAIN_SLACK).await;
    // Handlers whose clients hung up finish on their own; wait for their transactions to end.
    let settle_until = Instant::now() + SETTLE;
    while verify::open_transactions(&pool).await? > 0 && Instant::now() < settle_until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let verdict = after_the_chaos(&pool, &mut observed, &shared, &fleet, network.as_ref()).await?;
    let drain_time = drain_started.elapsed();

    progress(format_args!("checking {} logical charges", observed.len()));
    let verify_started = Instant::now();
    let mut verdict = verify::verify(&pool, &observed, verdict, &settled, &shared.addrs).await?;
    verdict.client_failures = client_failures;
    let verify_time = verify_started.elapsed();
    pool.close().await;
    fleet.stop().await;
    if let Some(network) = network {
        network.stop().await;
    }
    log.flush();

    Ok(Report::new(
        args,
        seed,
        &shared.stats,
        &fleet,
        &log,
        Faults {
            restart,
            database: &database_faults,
            refusal,
            refused: &refusal_faults,
            storms: &storms,
            stormed: &storm_faults,
            wait_read_fault,
            wait_reads_failed: &wait_read_faults,
            failovers: &failovers,
        },
        verdict,
        Phases {
            setup,
            chaos,
            drain: drain_time,
            verify: verify_time,
        },
        cluster,
    ))
}

/// The acquirer of a steps run, its log beside the demo's.
async fn start_network(
    exe: &Path,
    args: &RunArgs,
    seed: u64,
    cluster: &Database,
) -> Result<Network, BoxError> {
    let log = std::fs::File::create(cluster.dir().join("acquirer.log"))?;
    let fail_rate = f64::from(args.acquirer_fail_percent) / 100.0;
    let network = Network::start(exe, NETWORK_DELAY, fail_rate, seed, log).await?;
    progress(format_args!(
        "acquirer listening on {} ({} % of calls failing)",
        network.url(),
        args.acquirer_fail_percent
    ));
    Ok(network)
}

/// Once the clients are done: the completer's time (no key left in flight), the network's
/// authorizations counted before any client comes back (none may lack its charge), then the
/// clients that went away come back, and the authorizations are counted again.
async fn after_the_chaos(
    pool: &sqlx::PgPool,
    observed: &mut [client::Observed],
    shared: &Shared,
    fleet: &Fleet,
    network: Option<&Network>,
) -> Result<Verdict, BoxError> {
    let mut verdict = Verdict {
        steps_mode: network.is_some(),
        ..Verdict::default()
    };
    let started = Instant::now();
    let (in_flight, kept) = late::wait_for_completion(pool, late::COMPLETION_LIMIT).await?;
    progress(format_args!(
        "{:.1} s after the clients finished: {in_flight} keys in flight, {kept} of them with a \
         kept request",
        started.elapsed().as_secs_f64()
    ));
    let before = match network {
        Some(network) => {
            let made = network.authorizations().await?;
            Some(authorizations::tally(pool, &made, &mut verdict).await?)
        }
        None => None,
    };
    let returning = observed.iter().filter(|charge| charge.abandoned).count();
    progress(format_args!("{returning} clients that went away come back"));
    late::come_back(observed, fleet.addrs(), &shared.stats).await;
    if let (Some(network), Some(before)) = (network, before) {
        let made = network.authorizations().await?;
        let after = authorizations::tally(pool, &made, &mut Verdict::default()).await?;
        if after.double > before.double || after.mismatched > before.mismatched {
            verdict.example(
                "double authorization",
                format!("after the clients came back: {after:?}, before: {before:?}"),
            );
        }
        verdict.authorizations = after.authorizations;
        verdict.orphaned_authorizations = before.orphaned;
        verdict.double_authorizations = before.double.max(after.double);
        verdict.authorization_mismatches = before.mismatched.max(after.mismatched);
        (verdict.network_calls, verdict.network_replays) = network.counts().await?;
    }
    Ok(verdict)
}

/// Prints the traffic so far every [`TICK`], until the stop.
async fn tick(
    shared: &Shared,
    fleet: &Fleet,
    mut stop: watch::Receiver<bool>,
) -> Result<(), BoxError> {
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + TICK, TICK);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = stop.wait_for(|stopped| *stopped) => return Ok(()),
        }
        let s = &shared.stats;
        progress(format_args!(
            "{} charges, {} refunds, {} requests, {} retries, {} replays, {} × 409, {} × 5xx \
             ({} × 503 Overloaded), {} connection errors, {} timeouts, {} hang-ups, {} kills",
            Stats::get(&s.charges),
            Stats::get(&s.refunds),
            Stats::get(&s.requests),
            Stats::get(&s.retries),
            Stats::get(&s.replays),
            Stats::get(&s.conflicts),
            Stats::get(&s.server_errors),
            Stats::get(&s.overloaded),
            Stats::get(&s.connection_errors),
            Stats::get(&s.timeouts),
            Stats::get(&s.hangups),
            Stats::get(&fleet.kills),
        ));
    }
}

/// `--catch-percent`, but none in lease mode (`--inject-bug lease-mode`): the catching handler
/// fails inside the request's transaction, which lease mode has not.
pub(crate) fn catch_percent(args: &RunArgs) -> u8 {
    match (args.mode, args.inject_bug) {
        (Mode::Steps, _) | (_, Some(Bug::LeaseMode)) => 0,
        _ => args.catch_percent,
    }
}

/// This program, to re-execute as `chaos serve`. On Linux `/proc/self/exe` names this very
/// binary even when a rebuild has replaced its file since it started, so the instances always
/// run the same code as the run.
fn own_executable() -> std::io::Result<PathBuf> {
    let own = Path::new("/proc/self/exe");
    if own.exists() {
        Ok(own.to_owned())
    } else {
        std::env::current_exe()
    }
}

fn clock_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    // Mixed once, so seeds of runs started close together differ in every digit.
    Rng::new(nanos as u64 ^ u64::from(std::process::id())).next_u64() % 1_000_000_000
}

/// `SIGINT` and `SIGTERM`, caught from the moment they are installed.
struct Signals {
    interrupt: Option<tokio::signal::unix::Signal>,
    terminate: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn install() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        Self {
            interrupt: signal(SignalKind::interrupt()).ok(),
            terminate: signal(SignalKind::terminate()).ok(),
        }
    }

    async fn recv(&mut self) -> &'static str {
        async fn next(signal: Option<&mut tokio::signal::unix::Signal>) {
            match signal {
                Some(signal) => {
                    signal.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            () = next(self.interrupt.as_mut()) => "SIGINT",
            () = next(self.terminate.as_mut()) => "SIGTERM",
        }
    }
}
