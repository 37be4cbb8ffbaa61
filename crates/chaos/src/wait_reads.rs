//! Failed reads while waiting (issue 34.2): for a window, the database fails a waiting
//! duplicate's read of its key in flight, while the request that holds the key goes on.
//!
//! In transactional mode a duplicate finds its key in flight when the claim statement's
//! `pg_try_advisory_xact_lock` finds the key's lock taken. The instances connect with `chaos`
//! ahead of `pg_catalog` on their `search_path` ([`SEARCH_PATH`]), so that call resolves to
//! [`SHIM`]'s `chaos.pg_try_advisory_xact_lock`: it calls the real one, and while the window is
//! open it raises on the read of a busy key that follows another within 100 ms. The first is a
//! duplicate's claim; the next is its read as it starts waiting, right after: so the claim goes
//! through, the waiting read fails with a real database error (its transaction rolled back),
//! and the holder, whose lock was free, never meets the fault.
//!
//! The clients see the window through a [`Phase`]: a duplicate sent at once whose first attempt
//! overlapped it and was answered `503 StoreUnavailable` was turned away by a failed waiting
//! read (the old behaviour: the layer must answer `409`), counted by the checks.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use sqlx::PgPool;
use tokio::sync::watch;

use crate::{BoxError, faults::stopped_within, rng::Rng};

/// The instances' `search_path`: the shim's schema ahead of `pg_catalog`, and `public` first so
/// that the demo's tables are made where they always are.
pub(crate) const SEARCH_PATH: &str = "public,chaos,pg_catalog";

/// How far the window keeps from the database restart and the refused completions: their `503`s
/// must not be taken for a failed waiting read's.
const CLEARANCE: Duration = Duration::from_secs(3);

/// The shim and what it needs, made before the instances prepare their statements (a prepared
/// statement keeps the function it resolved). A busy read *arms* the key; the next busy read of
/// it within 100 ms (the waiter's, a millisecond later) fails and disarms it, so a key fails one
/// read per waiter and a later retry's claim arms it again rather than failing. The armed keys
/// live in sequences, 64 buckets of a key and a time, because `setval` is not undone by the
/// failed read's rollback where a row would be; a key whose bucket another overwrote just
/// escapes the fault. The window is a sequence too: opened and closed by `setval`, with no lock
/// on any table.
pub(crate) const SHIM: &str = r#"
CREATE SCHEMA IF NOT EXISTS chaos;
CREATE SEQUENCE IF NOT EXISTS chaos.failing_wait_reads MINVALUE 0;
CREATE SEQUENCE IF NOT EXISTS chaos.failed_wait_reads;
DO $$
BEGIN
    FOR bucket IN 0..63 LOOP
        EXECUTE format(
            'CREATE SEQUENCE IF NOT EXISTS chaos.busy_key_%s MINVALUE -9223372036854775808',
            bucket
        );
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS chaos.busy_at_%s MINVALUE 0', bucket);
    END LOOP;
END
$$;
CREATE OR REPLACE FUNCTION chaos.pg_try_advisory_xact_lock(key bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    seen regclass;
    armed regclass;
    now_ms bigint;
BEGIN
    IF pg_catalog.pg_try_advisory_xact_lock(key) THEN
        RETURN true;
    END IF;
    IF pg_catalog.pg_sequence_last_value('chaos.failing_wait_reads') IS DISTINCT FROM 1 THEN
        RETURN false;
    END IF;
    seen := pg_catalog.format('chaos.busy_key_%s', key & 63)::regclass;
    armed := pg_catalog.format('chaos.busy_at_%s', key & 63)::regclass;
    now_ms := (extract(epoch FROM pg_catalog.clock_timestamp()) * 1000)::bigint;
    IF pg_catalog.pg_sequence_last_value(seen) IS DISTINCT FROM key
        OR now_ms - coalesce(pg_catalog.pg_sequence_last_value(armed), 0) > 100 THEN
        PERFORM pg_catalog.setval(seen, key);
        PERFORM pg_catalog.setval(armed, now_ms);
        RETURN false;
    END IF;
    PERFORM pg_catalog.setval(armed, 0);
    PERFORM pg_catalog.nextval('chaos.failed_wait_reads');
    RAISE EXCEPTION 'chaos run: the database fails this read of a key in flight (lock %)', key;
END
$$;
"#;

const FAILED: &str = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END
    FROM chaos.failed_wait_reads";

/// The planned window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WaitReadFault {
    /// When, from the start of the chaos.
    pub(crate) at: Duration,
    /// How long waiting reads fail.
    pub(crate) window: Duration,
}

/// What the window did.
#[derive(Debug, Default)]
pub(crate) struct WaitReadFaults {
    /// Windows opened (0 or 1).
    pub(crate) windows: AtomicU64,
    /// Reads the shim failed.
    pub(crate) failed: AtomicU64,
    /// How long the window was open, in milliseconds.
    pub(crate) held_ms: AtomicU64,
}

/// The window as the clients see it: odd while open. It is marked open before the database
/// starts failing reads and closed after it stopped, so it covers the database's window.
#[derive(Debug, Default)]
pub(crate) struct Phase(AtomicU64);

impl Phase {
    pub(crate) fn now(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Whether the window was open at some time since `since` (a [`now`](Self::now)).
    pub(crate) fn overlapped(&self, since: u64) -> bool {
        since % 2 == 1 || self.now() != since
    }

    fn turn(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

/// When waiting reads fail: at a time drawn between 10 % and 90 % of the chaos (the window ends
/// by then), [`CLEARANCE`] away from each span of `avoid`. `None` when the window is zero or
/// does not fit.
pub(crate) fn plan(
    rng: &mut Rng,
    duration: Duration,
    window: Duration,
    avoid: &[(Duration, Duration)],
) -> Option<WaitReadFault> {
    if window.is_zero() {
        return None;
    }
    // Inclusive spans of allowed starts.
    let mut spans = vec![(duration / 10, (duration * 9 / 10).checked_sub(window)?)];
    spans.retain(|(a, b)| a <= b);
    for &(from, to) in avoid {
        let last_before = from.checked_sub(CLEARANCE + window);
        let first_after = to + CLEARANCE;
        spans = spans
            .into_iter()
            .flat_map(|(a, b)| {
                let before = last_before.filter(|&lo| a <= lo).map(|lo| (a, b.min(lo)));
                let after = (b >= first_after).then(|| (a.max(first_after), b));
                before.into_iter().chain(after)
            })
            .collect();
    }
    let length = |(a, b): (Duration, Duration)| millis(b - a) + 1;
    let mut drawn = rng.below(spans.iter().map(|&span| length(span)).sum());
    for span in spans {
        if drawn < length(span) {
            return Some(WaitReadFault {
                at: span.0 + Duration::from_millis(drawn),
                window,
            });
        }
        drawn -= length(span);
    }
    None
}

/// Makes [`SHIM`].
pub(crate) async fn prepare(pool: &PgPool) -> Result<(), BoxError> {
    sqlx::raw_sql(SHIM).execute(pool).await?;
    Ok(())
}

/// Fails waiting reads for the planned window (unless the stop comes first). The window is not
/// cut short by the stop: the plan ends it before the chaos does.
pub(crate) async fn fail_wait_reads(
    pool: &PgPool,
    mut stop: watch::Receiver<bool>,
    plan: Option<WaitReadFault>,
    phase: &Phase,
    faults: &WaitReadFaults,
) -> Result<(), BoxError> {
    let Some(plan) = plan else {
        return Ok(());
    };
    if stopped_within(&mut stop, plan.at).await {
        return Ok(());
    }
    let before = failed(pool).await?;
    phase.turn();
    let opened = set_failing(pool, true).await;
    let started = Instant::now();
    if opened.is_ok() {
        faults.windows.fetch_add(1, Ordering::Relaxed);
        crate::progress(format_args!(
            "PostgreSQL: waiting duplicates' reads of keys in flight fail for {:.1} s",
            plan.window.as_secs_f64()
        ));
        tokio::time::sleep(plan.window).await;
    }
    let closed = set_failing(pool, false).await;
    phase.turn();
    opened?;
    closed?;
    let held = started.elapsed();
    let failed = failed(pool).await?.saturating_sub(before);
    faults.failed.fetch_add(failed, Ordering::Relaxed);
    faults.held_ms.fetch_add(millis(held), Ordering::Relaxed);
    crate::progress(format_args!(
        "PostgreSQL: reads of keys in flight succeed again after {:.1} s; {failed} failed",
        held.as_secs_f64()
    ));
    Ok(())
}

async fn set_failing(pool: &PgPool, failing: bool) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT setval('chaos.failing_wait_reads', $1)")
        .bind(i64::from(failing))
        .execute(pool)
        .await?;
    Ok(())
}

async fn failed(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let count: i64 = sqlx::query_scalar(FAILED).fetch_one(pool).await?;
    Ok(u64::try_from(count).unwrap_or(0))
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// The window stays within 10–90 % of the chaos and clear of every span to avoid, however
    /// the seed falls; the same seed gives the same plan.
    #[test]
    fn the_window_keeps_clear_of_the_other_database_faults() {
        let window = secs(5);
        for seed in 0..2_000 {
            let mut draw = Rng::new(seed ^ 0x5eed);
            let restart = draw.between(18, 36);
            let refusal = draw.between(6, 49);
            let avoid = [
                (secs(restart), secs(restart + 2)),
                (secs(refusal), secs(refusal + 5)),
            ];
            let Some(plan) = plan(&mut Rng::new(seed), secs(60), window, &avoid) else {
                continue;
            };
            assert_eq!(
                Some(plan),
                super::plan(&mut Rng::new(seed), secs(60), window, &avoid),
                "seed {seed}"
            );
            let end = plan.at + plan.window;
            assert!(plan.at >= secs(6) && end <= secs(54), "{plan:?}");
            for (from, to) in avoid {
                assert!(
                    end + CLEARANCE <= from || plan.at >= to + CLEARANCE,
                    "seed {seed}: {plan:?} meets {from:?}..{to:?}"
                );
            }
        }
    }

    #[test]
    fn no_window_when_it_is_off_or_does_not_fit() {
        let mut rng = Rng::new(1);
        assert_eq!(plan(&mut rng, secs(60), Duration::ZERO, &[]), None);
        assert_eq!(plan(&mut rng, secs(5), secs(5), &[]), None);
        assert_eq!(plan(&mut rng, secs(6), secs(5), &[]), None);
        // 10 s: starts 1–4 s, all within 3 s of a fault at 4–5 s.
        assert_eq!(
            plan(&mut rng, secs(10), secs(5), &[(secs(4), secs(5))]),
            None
        );
        assert!(plan(&mut rng, secs(60), secs(5), &[(secs(20), secs(25))]).is_some());
    }

    #[test]
    fn the_phase_tells_whether_an_attempt_met_the_window() {
        let phase = Phase::default();
        let before = phase.now();
        assert!(!phase.overlapped(before));
        phase.turn();
        assert!(phase.overlapped(before), "opened during the attempt");
        let during = phase.now();
        assert!(phase.overlapped(during), "sent while open");
        phase.turn();
        let after = phase.now();
        assert!(phase.overlapped(during));
        assert!(!phase.overlapped(after));
    }
}
