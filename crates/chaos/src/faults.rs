//! The chaos itself: `SIGKILL` a random instance every few seconds and restart it, and restart
//! PostgreSQL once, mid-run. Both stop at the end of the chaos phase, after finishing what they
//! were doing, so the clients drain against two running instances and a running database.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use sqlx::PgPool;
use tokio::sync::watch;

use crate::{
    BoxError,
    cluster::{Cluster, StopMode},
    instance::{Fleet, INSTANCES},
    rng::Rng,
    verify,
};

/// The planned database restart.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DatabaseRestart {
    /// When, from the start of the chaos.
    pub(crate) at: Duration,
    pub(crate) mode: StopMode,
    /// How long the server stays down.
    pub(crate) down_for: Duration,
}

/// What the database restart did.
#[derive(Debug, Default)]
pub(crate) struct DatabaseFaults {
    pub(crate) restarts: AtomicU64,
    /// Open transactions (charges in flight) when the server was stopped.
    pub(crate) in_flight: AtomicU64,
}

/// Kills a random instance every `every` (a range, drawn each time) until the stop.
pub(crate) async fn kill_instances(
    fleet: &Fleet,
    mut stop: watch::Receiver<bool>,
    mut rng: Rng,
    every: (Duration, Duration),
) -> Result<(), BoxError> {
    let range = (millis(every.0), millis(every.1));
    loop {
        let wait = Duration::from_millis(rng.between(range.0, range.1));
        if stopped_within(&mut stop, wait).await {
            return Ok(());
        }
        let index = rng.below(INSTANCES as u64) as usize;
        fleet.kill_and_restart(index).await?;
    }
}

/// Restarts the database once, as planned, unless the stop comes first.
pub(crate) async fn restart_database(
    cluster: &Cluster,
    pool: &PgPool,
    mut stop: watch::Receiver<bool>,
    plan: DatabaseRestart,
    faults: &DatabaseFaults,
) -> Result<(), BoxError> {
    if stopped_within(&mut stop, plan.at).await {
        return Ok(());
    }
    let in_flight = tokio::time::timeout(Duration::from_secs(1), verify::open_transactions(pool))
        .await
        .ok()
        .and_then(Result::ok);
    crate::progress(format_args!(
        "PostgreSQL: pg_ctl stop -m {} with {} charges in flight; down for {:.1} s",
        plan.mode.as_str(),
        in_flight.map_or_else(|| "?".to_owned(), |n| n.to_string()),
        plan.down_for.as_secs_f64()
    ));
    faults
        .in_flight
        .fetch_add(in_flight.unwrap_or(0), Ordering::Relaxed);
    let started = Instant::now();
    cluster.restart(plan.mode, plan.down_for).await?;
    faults.restarts.fetch_add(1, Ordering::Relaxed);
    crate::progress(format_args!(
        "PostgreSQL: up again ({:.1} s after the stop began)",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Waits `wait`; `true` if the stop came first (or was already given).
async fn stopped_within(stop: &mut watch::Receiver<bool>, wait: Duration) -> bool {
    if *stop.borrow() {
        return true;
    }
    let stopped = tokio::select! {
        () = tokio::time::sleep(wait) => false,
        _ = stop.wait_for(|stopped| *stopped) => true,
    };
    stopped || *stop.borrow()
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
