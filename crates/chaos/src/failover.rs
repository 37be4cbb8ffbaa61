//! `--failover` (issue 45.4): the database's faults become failovers. The primary of the
//! [high-availability cluster](crate::ha) is killed again and again, alternately its postmaster
//! only and the whole node; after each kill the run waits for the endpoint to take a write on
//! the node Patroni promoted, then for the killed node to rejoin as a standby (Patroni's
//! `sync_standby` with synchronous replication), and only then plans the next kill. The chaos
//! lasts until at least `--failovers` of them are done.
//!
//! The database restart, the refused completions and the failed waiting reads are off in such
//! a run: their statements go through the endpoint the failovers break, and their own runs
//! cover them. The acquirer keeps its authorizations in its own process, outside the cluster
//! (another company's system).

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use sqlx::PgPool;
use tokio::sync::watch;

use crate::{
    BoxError, RunArgs,
    database::Database,
    faults::{self, DatabaseFaults, DatabaseRestart, stopped_within},
    ha::{HaCluster, Kill},
    rng::Rng,
};

/// The shortest and longest pause before a kill (from the chaos's start, or the last rejoin).
const PAUSE_MS: (u64, u64) = (2_000, 4_000);
/// How long the endpoint may take to take a write after a kill (a node's TTL is 10 s).
const FIRST_WRITE_LIMIT: Duration = Duration::from_secs(60);
/// Mixed into the seed for the failovers' plan, so that the other faults' plans stay as they
/// were without `--failover`.
const SEED_MIX: u64 = 0xfa11_0e55;

/// One kill of the primary and what followed.
#[derive(Debug, Clone)]
pub(crate) struct Failover {
    pub(crate) kill: Kill,
    /// When, from the start of the chaos.
    pub(crate) at: Duration,
    pub(crate) killed: String,
    /// The primary once the endpoint took a write again (the killed node if Patroni restarted
    /// it rather than fail over: then no failover).
    pub(crate) promoted: String,
    /// From the kill to the first write through the endpoint.
    pub(crate) first_write: Duration,
    /// From that write until the killed node was a (synchronous) standby again.
    pub(crate) rejoined: Duration,
}

impl Failover {
    /// Whether another node took over.
    pub(crate) fn failed_over(&self) -> bool {
        self.promoted != self.killed
    }
}

/// The failovers of a run, as they are done.
#[derive(Debug)]
pub(crate) struct Failovers {
    /// `--failovers`: the chaos lasts until this many are done (0 without `--failover`).
    pub(crate) minimum: u32,
    /// `--failover-lag-ms`: the primary's walsenders stopped this long before a node kill.
    pub(crate) lag: Duration,
    done: watch::Sender<u32>,
    log: Mutex<Vec<Failover>>,
}

impl Failovers {
    pub(crate) fn new(args: &RunArgs) -> Self {
        Self {
            minimum: if args.failover { args.failovers } else { 0 },
            lag: Duration::from_millis(args.failover_lag_ms),
            done: watch::Sender::new(0),
            log: Mutex::new(Vec::new()),
        }
    }

    /// Every kill so far, in order.
    pub(crate) fn list(&self) -> Vec<Failover> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn push(&self, failover: Failover) {
        let failed_over = failover.failed_over();
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(failover);
        if failed_over {
            self.done.send_modify(|done| *done += 1);
        }
    }

    /// The chaos's time: `duration`, and then until [`minimum`](Self::minimum) failovers are
    /// done (an error of the driver ends the run before this returns).
    pub(crate) async fn chaos_time(&self, duration: Duration) {
        tokio::time::sleep(duration).await;
        let mut done = self.done.subscribe();
        let minimum = self.minimum;
        if *done.borrow() < minimum {
            crate::progress(format_args!(
                "chaos goes on until {minimum} failovers are done"
            ));
        }
        let _ = done.wait_for(|done| *done >= minimum).await;
    }
}

/// `--failover` turns the faults of the single database off (see the module documentation),
/// and says so.
pub(crate) fn adjust(mut args: RunArgs) -> RunArgs {
    if args.failover {
        args.refuse_completions_secs = 0;
        args.fail_wait_reads_secs = 0;
        eprintln!(
            "failover run: {} replication, at least {} failovers; no PostgreSQL restart, refused \
             completions or failed waiting reads",
            args.replication.name(),
            args.failovers
        );
    }
    args
}

/// The database's faults: the planned restart of the run's own server, or the failovers.
pub(crate) async fn database_faults(
    database: &Database,
    pool: &PgPool,
    stop: watch::Receiver<bool>,
    restart: DatabaseRestart,
    restarts: &DatabaseFaults,
    (seed, failovers): (u64, &Failovers),
) -> Result<(), BoxError> {
    match database {
        Database::Local(cluster) => {
            faults::restart_database(cluster, pool, stop, restart, restarts).await
        }
        Database::Ha { cluster, .. } => drive(cluster, stop, seed, failovers).await,
    }
}

/// Kills the primary after each pause, until the stop; see the module documentation. A kill
/// in progress is seen through (the killed node rejoined) before it returns.
async fn drive(
    cluster: &HaCluster,
    mut stop: watch::Receiver<bool>,
    seed: u64,
    failovers: &Failovers,
) -> Result<(), BoxError> {
    let started = Instant::now();
    let mut rng = Rng::new(seed ^ SEED_MIX);
    let mut kill = if rng.percent(50) {
        Kill::Postmaster
    } else {
        Kill::Node
    };
    for number in 1_u32.. {
        let pause = Duration::from_millis(rng.between(PAUSE_MS.0, PAUSE_MS.1));
        if stopped_within(&mut stop, pause).await {
            break;
        }
        let lag = match kill {
            Kill::Node => failovers.lag,
            Kill::Postmaster => Duration::ZERO,
        };
        let at = started.elapsed();
        crate::progress(format_args!(
            "failover {number}: killing the primary's {}{}",
            kill.name(),
            if lag.is_zero() {
                String::new()
            } else {
                format!(" after stopping its walsenders for {} ms", lag.as_millis())
            }
        ));
        let (killed, killed_at) = cluster.kill_primary(kill, lag).await?;
        let first_write = cluster.first_write(killed_at, FIRST_WRITE_LIMIT).await?;
        let promoted = cluster.primary().await?;
        crate::progress(format_args!(
            "failover {number}: {killed} killed; a write went through {promoted} {:.1} s later",
            first_write.as_secs_f64()
        ));
        let rejoining = Instant::now();
        cluster.rejoin().await?;
        let rejoined = rejoining.elapsed();
        crate::progress(format_args!(
            "failover {number}: {killed} rejoined as a standby in {:.1} s",
            rejoined.as_secs_f64()
        ));
        failovers.push(Failover {
            kill,
            at,
            killed,
            promoted,
            first_write,
            rejoined,
        });
        kill = kill.other();
    }
    Ok(())
}
