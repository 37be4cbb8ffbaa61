//! A storm of waiters under load (issue 34.3): `--connections` connections charge fresh keys
//! at full load on a lease-mode server that waits, while a second such server, whose handler
//! is slow, runs one key sent by [`WAITERS`] + 1 requests at once: one holds the key and the
//! others wait for it. `waiter-storm-quiet` sends that key once, alone: the same run without
//! waiters, its baseline.
//!
//! Beside the load's figures: the holder's answer time (sent to answered), the waiters'
//! answers, and the row updates of `idempotency.records` from `pg_stat_user_tables`
//! (`n_tup_upd`, of which `n_tup_hot_upd`) beyond the completions (each completion is one
//! update): with the marks, one per claim a waiter found in flight. The statistics are read
//! with no server connected, so every backend has flushed its counts.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use tokio::time::Instant;

use super::cpu::cpu_probe;
use crate::{
    BoxError,
    app::{App, CHARGES_PATH},
    cli::BenchArgs,
    db::BenchDb,
    load::{self, BodySize, Keys, Plan, Workload},
    report::Sample,
    server::{ServeOptions, ServerProcess},
    stats::Window,
};

/// The waiting duplicates of `waiter-storm`'s one key.
pub(crate) const WAITERS: usize = 1_000;

/// Row updates beyond one per claim that the target allows: renewals, a re-read's mark of a
/// claim taken over.
const UPDATES_ALLOWED_BEYOND_ONE: i64 = 5;

/// How long the storm's answers may take: the handler's 200 ms, the wait's 5 s, and room.
const STORM_TIMEOUT: Duration = Duration::from_secs(30);

/// How long after the holder the waiters are sent: the holder has claimed the key by then, and
/// its handler (200 ms) is still running, so its completion is the one the waiters crowd.
const HOLDER_HEAD_START: Duration = Duration::from_millis(50);

/// How long the servers' backends may take to go once they are stopped.
const BACKENDS_GONE: Duration = Duration::from_secs(10);

/// Fresh keys, small bodies: the load on the other keys.
const OTHER_KEYS: Workload = Workload {
    keys: Keys::Fresh,
    body: BodySize::Small,
};

/// `idempotency.records`' update counters, and the database's clock when they were read.
struct Updates {
    updated: i64,
    hot: i64,
    /// The database's clock, as text: compared in the database only.
    at: String,
}

/// What the storm's key came to.
#[derive(Debug, Default)]
struct KeyAnswers {
    /// The holder's time from sent to answered, if it was the request that executed.
    holder: Option<Duration>,
    /// Requests other than the holder that executed.
    executed: usize,
    replays: usize,
    conflicts: usize,
    other: usize,
    /// What the first other answer was (status, or the error).
    first_other: Option<String>,
}

/// Measures the load with `waiters` duplicates of one key waiting meanwhile (0: the key alone),
/// or answered `409` at once on a server that does not wait (`waits` false).
pub(crate) async fn measure(
    db: &BenchDb,
    waiters: usize,
    waits: bool,
    args: &BenchArgs,
    round: usize,
) -> Result<Sample, BoxError> {
    let options = ServeOptions {
        reaper_batch: None,
        no_pool_checks: args.no_pool_checks,
    };
    backends_gone(db).await?;
    let before = updates(db).await?;
    let loaded = ServerProcess::start(App::LeaseWait, db, args.pool_size.get(), options).await?;
    let app = if waits {
        App::SlowLeaseWait
    } else {
        App::SlowLease
    };
    let slow = ServerProcess::start(app, db, args.pool_size.get(), options).await?;
    let mut senders = Vec::with_capacity(waiters + 1);
    for _ in 0..=waiters {
        senders.push(load::connect(slow.addr()).await?);
    }
    let connections = args.connections.get();
    let plan = Arc::new(Plan::new(OTHER_KEYS, &[loaded.addr()], 0));
    let duration = Duration::from_secs(args.duration_secs.max(1));
    let window = Window::after(Duration::from_secs(args.warmup_secs), duration);
    let key = format!("waiters-{}-{round}-{waiters}-{waits}", std::process::id());
    // The key is sent a third into the window, so the load runs before and after it.
    let storm = async {
        tokio::time::sleep_until(window.start + duration / 3).await;
        one_key(slow.addr(), senders, &key).await
    };
    let pids = [loaded.pid(), slow.pid()];
    let (tally, cpu, answers) = tokio::join!(
        load::run(&plan, connections, window, None, false),
        cpu_probe(db, &pids, window, None),
        storm,
    );
    let (tally, answers) = (tally?, answers?);
    loaded.stop().await?;
    slow.stop().await?;
    backends_gone(db).await?;
    let after = updates(db).await?;
    let completions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency.records WHERE completed_at >= $1::timestamptz",
    )
    .bind(&before.at)
    .fetch_one(db.control())
    .await?;

    let beyond = after.updated - before.updated - completions;
    let mut failures = Vec::new();
    if beyond > 1 + UPDATES_ALLOWED_BEYOND_ONE {
        failures.push(format!(
            "{beyond} row updates of idempotency.records beyond the completions for one claim \
             and {waiters} waiters (target: at most {})",
            1 + UPDATES_ALLOWED_BEYOND_ONE
        ));
    }
    // Without waiting, a duplicate that comes after the holder's answer is a replay.
    let answered = if waits {
        answers.replays
    } else {
        answers.conflicts + answers.replays
    };
    if answers.holder.is_none() || answers.executed > 0 || answered != waiters {
        failures.push(format!("the storm's key came to {answers:?}"));
    }
    let mut sample = Sample::new(round, connections, window.duration(), tally, cpu);
    sample.details = vec![format!(
        "{waiters} waiters: the holder answered in {}, {} replays, {} 409s, {} other; \
         idempotency.records: {} row updates ({} HOT), {completions} completions, so {beyond} \
         beyond them",
        answers.holder.map_or("—".to_owned(), |d| format!(
            "{:.1} ms",
            d.as_secs_f64() * 1e3
        )),
        answers.replays,
        answers.conflicts,
        answers.other,
        after.updated - before.updated,
        after.hot - before.hot,
    )];
    sample.failures = failures;
    Ok(sample)
}

/// The update counters of `idempotency.records` and the database's clock.
async fn updates(db: &BenchDb) -> Result<Updates, BoxError> {
    let (updated, hot, at): (i64, i64, String) = sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd, now()::text FROM pg_stat_user_tables
         WHERE schemaname = 'idempotency' AND relname = 'records'",
    )
    .fetch_one(db.control())
    .await?;
    Ok(Updates { updated, hot, at })
}

/// Waits until no backend but the benchmark's own is connected to the database: a backend
/// flushes its table statistics when it exits.
async fn backends_gone(db: &BenchDb) -> Result<(), BoxError> {
    let deadline = Instant::now() + BACKENDS_GONE;
    loop {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND backend_type = 'client backend'
               AND pid <> pg_backend_pid()",
        )
        .fetch_one(db.control())
        .await?;
        if others == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(
                format!("{others} backends still connected after {BACKENDS_GONE:?}").into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends one request with `key` on the first of `senders` (the holder), then on each of the
/// others at once, and sorts out the answers.
async fn one_key(
    addr: SocketAddr,
    senders: Vec<SendRequest<Full<Bytes>>>,
    key: &str,
) -> Result<KeyAnswers, BoxError> {
    let body = BodySize::Small.bytes();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, mut sender) in senders.into_iter().enumerate() {
        let request = Request::post(CHARGES_PATH)
            .header(header::HOST, addr.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::AUTHORIZATION, format!("Bearer {key}"))
            .header("idempotency-key", key)
            .body(Full::new(body.clone()))?;
        tasks.spawn(async move {
            let sent = Instant::now();
            let answer = load::exchange(&mut sender, request).await;
            (i == 0, answer.map_err(|e| e.to_string()), sent.elapsed())
        });
        if i == 0 {
            tokio::time::sleep(HOLDER_HEAD_START).await;
        }
    }
    let mut answers = KeyAnswers::default();
    let collected = tokio::time::timeout(STORM_TIMEOUT, async {
        while let Some(joined) = tasks.join_next().await {
            match joined? {
                (true, Ok(a), took) if a.status == StatusCode::CREATED && !a.replayed => {
                    answers.holder = Some(took);
                }
                (false, Ok(a), _) if a.status == StatusCode::CREATED && !a.replayed => {
                    answers.executed += 1;
                }
                (false, Ok(a), _) if a.status == StatusCode::CREATED => answers.replays += 1,
                (_, Ok(a), _) if a.status == StatusCode::CONFLICT => answers.conflicts += 1,
                (holder, answer, _) => {
                    answers.other += 1;
                    answers.first_other.get_or_insert_with(|| match answer {
                        Ok(a) => format!("holder {holder}: {} replayed {}", a.status, a.replayed),
                        Err(error) => format!("holder {holder}: {error}"),
                    });
                }
            }
        }
        Ok::<_, BoxError>(())
    })
    .await;
    collected.map_err(|_| format!("the storm's answers took over {STORM_TIMEOUT:?}"))??;
    Ok(answers)
}
