//! The chaos itself: `SIGKILL` a random instance every few seconds and restart it, restart
//! PostgreSQL once, have the database refuse completions for a while, and make many clients hang
//! up at once (storms). All stop at the end of the chaos phase, after finishing what they were
//! doing, so the clients drain against two running instances and a database that accepts
//! everything. Each is planned from the seed before the chaos starts.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
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

/// How far the refusal of completions keeps from the database restart: a trigger's creation or
/// removal must not meet a server that is down, and the restart's own failures must not be
/// confused with refused completions.
const RESTART_CLEARANCE: Duration = Duration::from_secs(3);
/// How long a statement of the refusal waits for its lock on `idempotency.records` before it is
/// tried again: while it waits, new claims queue behind it.
const DDL_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '1s'";
/// How many times a statement of the refusal is tried.
const DDL_ATTEMPTS: u32 = 20;

/// The planned refusal of completions (issue 28.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// When, from the start of the chaos.
    pub(crate) at: Duration,
    /// How long completions are refused.
    pub(crate) window: Duration,
}

/// What the refusal of completions did.
#[derive(Debug, Default)]
pub(crate) struct RefusalFaults {
    /// Windows in which completions were refused (0 or 1).
    pub(crate) windows: AtomicU64,
    /// Completions the trigger refused.
    pub(crate) refused: AtomicU64,
    /// How long the trigger was in place, in milliseconds.
    pub(crate) held_ms: AtomicU64,
}

/// When completions are refused: at a time drawn between 10 % and 90 % of the chaos (the window
/// ends by then), clear of the database restart. `None` when the window is zero or does not fit.
pub(crate) fn plan_refusal(
    rng: &mut Rng,
    duration: Duration,
    window: Duration,
    restart: &DatabaseRestart,
) -> Option<Refusal> {
    if window.is_zero() {
        return None;
    }
    let earliest = duration / 10;
    let latest = (duration * 9 / 10).checked_sub(window)?;
    // Two spans: ending before the restart, or starting after it.
    let before = (
        earliest,
        latest.min(
            restart
                .at
                .saturating_sub(RESTART_CLEARANCE)
                .saturating_sub(window),
        ),
    );
    let after = (
        earliest.max(restart.at + restart.down_for + RESTART_CLEARANCE),
        latest,
    );
    let length = |(from, to): (Duration, Duration)| to.checked_sub(from).map(millis);
    let choices: Vec<_> = [before, after]
        .into_iter()
        .filter_map(|span| Some((span.0, length(span)?)))
        .collect();
    let total: u64 = choices.iter().map(|(_, length)| length + 1).sum();
    let mut drawn = rng.below(total);
    for (from, length) in choices {
        if drawn <= length {
            return Some(Refusal {
                at: from + Duration::from_millis(drawn),
                window,
            });
        }
        drawn -= length + 1;
    }
    None
}

/// The objects the refusal needs, made before the chaos: a counter and the trigger's function.
/// The counter is a sequence because `nextval` is not undone by the rollback that the trigger's
/// exception causes, where a row written to a table would be.
const REFUSAL_OBJECTS: &str = r#"
CREATE SCHEMA IF NOT EXISTS chaos;
CREATE SEQUENCE IF NOT EXISTS chaos.refused_completions;
CREATE OR REPLACE FUNCTION chaos.refuse_completion() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('chaos.refused_completions');
    RAISE EXCEPTION 'chaos run: the database refuses completions for now';
END
$$;
"#;

/// A completion is the one `UPDATE` that sets `status` on a record in flight; claims, renewals
/// and takeovers leave it `NULL`.
const REFUSE: &str = "CREATE TRIGGER chaos_refuse_completions
    BEFORE UPDATE OF status ON idempotency.records
    FOR EACH ROW WHEN (OLD.status IS NULL AND NEW.status IS NOT NULL)
    EXECUTE FUNCTION chaos.refuse_completion()";

const ACCEPT: &str = "DROP TRIGGER IF EXISTS chaos_refuse_completions ON idempotency.records";

const REFUSED: &str = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END
    FROM chaos.refused_completions";

/// Makes [`REFUSAL_OBJECTS`]; the instances have created `idempotency.records` by then.
pub(crate) async fn prepare_refusal(pool: &PgPool) -> Result<(), BoxError> {
    sqlx::raw_sql(REFUSAL_OBJECTS).execute(pool).await?;
    Ok(())
}

/// Refuses completions for the planned window (unless the stop comes first), then accepts them
/// again. The window is not cut short by the stop: the plan ends it before the chaos does.
pub(crate) async fn refuse_completions(
    pool: &PgPool,
    mut stop: watch::Receiver<bool>,
    plan: Option<Refusal>,
    faults: &RefusalFaults,
) -> Result<(), BoxError> {
    let Some(plan) = plan else {
        return Ok(());
    };
    if stopped_within(&mut stop, plan.at).await {
        return Ok(());
    }
    let before = refused(pool).await?;
    ddl(pool, REFUSE).await?;
    let started = Instant::now();
    faults.windows.fetch_add(1, Ordering::Relaxed);
    crate::progress(format_args!(
        "PostgreSQL: completions refused (a trigger on idempotency.records) for {:.1} s",
        plan.window.as_secs_f64()
    ));
    tokio::time::sleep(plan.window).await;
    ddl(pool, ACCEPT).await?;
    let held = started.elapsed();
    let refused = refused(pool).await?.saturating_sub(before);
    faults.refused.fetch_add(refused, Ordering::Relaxed);
    faults.held_ms.fetch_add(millis(held), Ordering::Relaxed);
    crate::progress(format_args!(
        "PostgreSQL: completions accepted again after {:.1} s; {refused} were refused",
        held.as_secs_f64()
    ));
    Ok(())
}

async fn refused(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let count: i64 = sqlx::query_scalar(REFUSED).fetch_one(pool).await?;
    Ok(u64::try_from(count).unwrap_or(0))
}

/// Runs `sql` with a short lock timeout, again until it gets its lock: it needs one that
/// excludes every open transaction that wrote to the table.
async fn ddl(pool: &PgPool, sql: &'static str) -> Result<(), BoxError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let done = async {
            let mut tx = pool.begin().await?;
            sqlx::query(DDL_LOCK_TIMEOUT).execute(&mut *tx).await?;
            sqlx::query(sql).execute(&mut *tx).await?;
            tx.commit().await
        }
        .await;
        match done {
            Ok(()) => return Ok(()),
            Err(error) if attempt < DDL_ATTEMPTS => crate::progress(format_args!(
                "PostgreSQL: {error}; trying again ({attempt}/{DDL_ATTEMPTS})"
            )),
            Err(error) => return Err(format!("`{sql}` failed: {error}").into()),
        }
    }
}

/// A hang-up storm: each client it strikes drops its request in flight, if any, and sends a new
/// charge whose first request it drops too, all at once (see [`client`](crate::client)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Storm {
    /// Its number, from 1.
    pub(crate) number: u32,
    /// When, from the start of the chaos.
    pub(crate) at: Duration,
    /// Whether it strikes each client, by index.
    pub(crate) clients: Arc<[bool]>,
}

impl Storm {
    pub(crate) fn strikes(&self, client: usize) -> bool {
        self.clients.get(client).copied().unwrap_or(false)
    }

    pub(crate) fn struck(&self) -> usize {
        self.clients.iter().filter(|hit| **hit).count()
    }
}

/// What the storms did (the clients count the requests they dropped).
#[derive(Debug, Default)]
pub(crate) struct StormFaults {
    pub(crate) storms: AtomicU64,
}

/// `count` storms, one drawn in each of as many equal spans of 10–90 % of the chaos, each
/// striking every client with probability `percent`.
pub(crate) fn plan_storms(
    rng: &mut Rng,
    duration: Duration,
    count: u8,
    clients: usize,
    percent: u8,
) -> Vec<Storm> {
    let start = duration / 10;
    let span = duration * 8 / 10 / u32::from(count.max(1));
    (0..u32::from(count))
        .map(|n| Storm {
            number: n + 1,
            at: start + span * n + Duration::from_millis(rng.below(millis(span).max(1))),
            clients: (0..clients).map(|_| rng.percent(percent)).collect(),
        })
        .collect()
}

/// Raises each storm at its time, unless the stop comes first.
pub(crate) async fn hang_up_storms(
    storms: &[Storm],
    raise: &watch::Sender<Storm>,
    mut stop: watch::Receiver<bool>,
    faults: &StormFaults,
) -> Result<(), BoxError> {
    let started = Instant::now();
    for storm in storms {
        let wait = storm.at.saturating_sub(started.elapsed());
        if stopped_within(&mut stop, wait).await {
            return Ok(());
        }
        faults.storms.fetch_add(1, Ordering::Relaxed);
        crate::progress(format_args!(
            "hang-up storm {}/{}: {} of {} clients drop their requests in flight and send a \
             charge they drop too",
            storm.number,
            storms.len(),
            storm.struck(),
            storm.clients.len()
        ));
        raise.send_replace(storm.clone());
    }
    Ok(())
}

/// Waits `wait`; `true` if the stop came first (or was already given).
pub(crate) async fn stopped_within(stop: &mut watch::Receiver<bool>, wait: Duration) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn restart(at: u64, down_for: u64) -> DatabaseRestart {
        DatabaseRestart {
            at: Duration::from_secs(at),
            mode: StopMode::Fast,
            down_for: Duration::from_secs(down_for),
        }
    }

    /// The window stays within 10–90 % of the chaos and clear of the restart, however the
    /// seed falls; the same seed gives the same plan.
    #[test]
    fn completions_are_refused_clear_of_the_restart() {
        let duration = Duration::from_secs(60);
        let window = Duration::from_secs(5);
        for seed in 0..2_000 {
            let restart = restart_from(seed);
            let plan = plan_refusal(&mut Rng::new(seed), duration, window, &restart)
                .expect("a 5 s window fits in 60 s");
            let again = plan_refusal(&mut Rng::new(seed), duration, window, &restart);
            assert_eq!(Some(plan), again, "seed {seed}");
            let end = plan.at + plan.window;
            assert!(plan.at >= Duration::from_secs(6), "{plan:?}");
            assert!(end <= Duration::from_secs(54), "{plan:?}");
            assert!(
                end + RESTART_CLEARANCE <= restart.at
                    || plan.at >= restart.at + restart.down_for + RESTART_CLEARANCE,
                "seed {seed}: {plan:?} meets {restart:?}"
            );
        }
    }

    /// A restart as the run draws one for 60 s: at 30–60 %, down 1–3 s.
    fn restart_from(seed: u64) -> DatabaseRestart {
        let mut rng = Rng::new(seed ^ 0x5eed);
        restart(rng.between(18, 36), rng.between(1, 3))
    }

    #[test]
    fn no_refusal_when_it_is_off_or_does_not_fit() {
        let mut rng = Rng::new(1);
        let plan = |rng: &mut Rng, secs, window| {
            plan_refusal(
                rng,
                Duration::from_secs(secs),
                Duration::from_secs(window),
                &restart(secs * 45 / 100, 2),
            )
        };
        assert_eq!(plan(&mut rng, 60, 0), None);
        assert_eq!(plan(&mut rng, 5, 5), None);
        // 10 s: 1–9 s minus a 5 s window, and the restart at 4 s leaves no room.
        assert_eq!(plan(&mut rng, 10, 5), None);
        assert!(plan(&mut rng, 600, 5).is_some());
    }

    #[test]
    fn storms_are_spread_over_the_chaos_and_strike_about_their_share() {
        let duration = Duration::from_secs(60);
        let storms = plan_storms(&mut Rng::new(9), duration, 3, 64, 50);
        assert_eq!(storms, plan_storms(&mut Rng::new(9), duration, 3, 64, 50));
        assert_eq!(storms.len(), 3);
        for (n, storm) in storms.iter().enumerate() {
            let span = Duration::from_secs(16);
            let from = Duration::from_secs(6) + span * n as u32;
            assert!(storm.at >= from && storm.at < from + span, "{n}: {storm:?}");
            assert_eq!(storm.number, n as u32 + 1);
            assert_eq!(storm.clients.len(), 64);
            assert!(
                (16..=48).contains(&storm.struck()),
                "{n}: {}",
                storm.struck()
            );
            assert!(!storm.strikes(64));
        }
        assert!(plan_storms(&mut Rng::new(9), duration, 0, 64, 50).is_empty());
        let none = plan_storms(&mut Rng::new(9), duration, 2, 64, 0);
        assert!(none.iter().all(|storm| storm.struck() == 0));
    }
}
