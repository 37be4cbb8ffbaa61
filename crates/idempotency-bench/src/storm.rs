//! The duplicate storms: many requests with one key sent at once to a server whose handler is
//! slow, key after key, and what each key came to.
//!
//! For each key, [`Storm::size`] requests (one per keep-alive connection, all released by one
//! barrier) carry the same `Idempotency-Key` and account. The first to claim the key runs the
//! handler, which takes `app::SLOW_HANDLER`, so every duplicate arrives while it runs. A key's
//! **executions** are its account's rows in `charges` (each key charges an account of its own);
//! its answers are counted as the executing `201`, replays (`Idempotent-Replayed: true`),
//! `409`s and anything else. Each duplicate's answer is also timed **from the executing
//! request's answer**: with waiting on, how soon the notification of the completion woke it
//! and its replay came back. The first key of each measurement warms the server up (its pool,
//! its listener) and is not counted.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Request, StatusCode, header};
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use serde::Serialize;
use sqlx::Row;
use tokio::{sync::Barrier, time::Instant};

use crate::{
    BoxError,
    app::CHARGES_PATH,
    cli::BenchArgs,
    db::BenchDb,
    load::{self, BodySize},
    procfs,
    report::{Sample, format_micros},
    run::CpuSnapshot,
    scenario::Storm,
    server::{ServeOptions, ServerProcess},
    stats::Tally,
};

/// How long one key's storm may take: the handler's 200 ms, the wait's 5 s, and room.
const STORM_TIMEOUT: Duration = Duration::from_secs(30);

/// Correctness failures listed per measurement; the rest are counted.
const LISTED_FAILURES: usize = 5;

/// What one key of a storm came to.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct KeyOutcome {
    /// The key's rows in `charges`: how many times the handler ran.
    pub(crate) executions: i64,
    /// `201` answers without `Idempotent-Replayed`.
    pub(crate) executed: usize,
    /// `201` answers with `Idempotent-Replayed: true`.
    pub(crate) replays: usize,
    /// `409` answers.
    pub(crate) conflicts: usize,
    /// Any other answer, or none (a transport error).
    pub(crate) other: usize,
    /// The first of those, for the report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) first_other: Option<String>,
    /// Whether the `201` answers' bodies differ (a replay must be the executed response).
    pub(crate) bodies_differ: bool,
    /// Duplicates answered before the executing request was (the `409`s, with waiting off).
    pub(crate) before_first: usize,
    /// For each duplicate answered after the executing request: how long after, in µs.
    pub(crate) after_first_us: Vec<u64>,
}

impl KeyOutcome {
    /// One execution, and every duplicate a replay of it: what waiting promises.
    fn settled(&self, size: usize) -> bool {
        self.executions == 1
            && self.executed == 1
            && self.replays + 1 == size
            && self.conflicts == 0
            && self.other == 0
            && !self.bodies_differ
    }

    fn describe(&self) -> String {
        let mut out = format!(
            "{} execution{} ({} answers as executed), {} replays, {} 409s, {} other",
            self.executions,
            if self.executions == 1 { "" } else { "s" },
            self.executed,
            self.replays,
            self.conflicts,
            self.other,
        );
        if let Some(other) = &self.first_other {
            out.push_str(&format!(" (first: {other})"));
        }
        if self.bodies_differ {
            out.push_str("; the 201 bodies differ");
        }
        out
    }
}

/// One storm measurement: every key's outcome.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct StormReport {
    pub(crate) waits: bool,
    pub(crate) size: usize,
    pub(crate) keys: Vec<KeyOutcome>,
}

/// A per-key count over many keys: the same on every key, or its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PerKey {
    pub(crate) min: u64,
    pub(crate) max: u64,
}

impl std::fmt::Display for PerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}–{}", self.min, self.max)
        }
    }
}

/// Figures over the keys of one or more storm measurements.
#[derive(Debug)]
pub(crate) struct StormSummary {
    pub(crate) keys: usize,
    pub(crate) executions: PerKey,
    pub(crate) replays: PerKey,
    pub(crate) conflicts: PerKey,
    /// Other answers, summed over the keys.
    pub(crate) other: u64,
    /// Keys that did not come to one execution and replays only (waiting on).
    pub(crate) unsettled: usize,
    /// Duplicates answered before the executing request.
    pub(crate) before_first: PerKey,
    /// The duplicates answered after the executing request: how long after, in µs.
    pub(crate) after_first: Histogram<u64>,
}

impl StormSummary {
    /// Over every key of `reports` (all of one scenario: the same size and mode).
    pub(crate) fn of<'a>(reports: impl IntoIterator<Item = &'a StormReport>) -> Option<Self> {
        let mut keys = Vec::new();
        let mut size = 0;
        for report in reports {
            size = report.size;
            keys.extend(report.keys.iter());
        }
        if keys.is_empty() {
            return None;
        }
        let range = |count: fn(&KeyOutcome) -> u64| PerKey {
            min: keys.iter().map(|k| count(k)).min().unwrap_or(0),
            max: keys.iter().map(|k| count(k)).max().unwrap_or(0),
        };
        let mut after_first = Histogram::new_with_bounds(1, 60_000_000, 3)
            .expect("constant histogram bounds are valid");
        for us in keys.iter().flat_map(|k| &k.after_first_us) {
            after_first.saturating_record((*us).max(1));
        }
        Some(Self {
            keys: keys.len(),
            executions: range(|k| u64::try_from(k.executions).unwrap_or(0)),
            replays: range(|k| k.replays as u64),
            conflicts: range(|k| k.conflicts as u64),
            other: keys.iter().map(|k| k.other as u64).sum(),
            unsettled: keys.iter().filter(|k| !k.settled(size)).count(),
            before_first: range(|k| k.before_first as u64),
            after_first,
        })
    }

    /// `p50`, `p99` and `max` of the duplicates' answers after the first answer.
    pub(crate) fn after_first(&self) -> [Option<String>; 3] {
        if self.after_first.is_empty() {
            return [None, None, None];
        }
        let at = |q: f64| Some(format_micros(self.after_first.value_at_quantile(q) as f64));
        [
            at(0.5),
            at(0.99),
            Some(format_micros(self.after_first.max() as f64)),
        ]
    }
}

impl StormSummary {
    /// One sentence over `rounds` rounds of scenario `name`: the counts per key, how soon the
    /// duplicates were answered and, with waiting on, whether every key settled.
    pub(crate) fn line(&self, name: &str, waits: bool, rounds: usize) -> String {
        let uniform = |range: PerKey| range.min == range.max;
        let every = if uniform(self.executions) && uniform(self.replays) && uniform(self.conflicts)
        {
            "every key"
        } else {
            "keys varied:"
        };
        let mut line = format!(
            "`{name}` (waiting {}), {rounds} round{} × {} keys: {every} {} execution{}, {} replays, \
             {} 409s, {} other answers",
            if waits { "on" } else { "off" },
            if rounds == 1 { "" } else { "s" },
            self.keys / rounds.max(1),
            self.executions,
            if self.executions.max == 1 { "" } else { "s" },
            self.replays,
            self.conflicts,
            self.other,
        );
        if let [Some(p50), Some(p99), _] = self.after_first() {
            line.push_str(&format!(
                "; the duplicates answered {p50} (p50) and {p99} (p99) after the first answer"
            ));
        }
        if waits {
            if self.unsettled == 0 {
                line.push_str(" — PASS");
            } else {
                line.push_str(&format!(
                    " — **FAIL**: {} keys not so (listed under CORRECTNESS FAILURES)",
                    self.unsettled
                ));
            }
        }
        line
    }
}

/// Runs `storm` once on a fresh server: one warm-up key, then `--storm-keys` keys.
pub(crate) async fn measure(
    db: &BenchDb,
    storm: Storm,
    args: &BenchArgs,
    round: usize,
) -> Result<Sample, BoxError> {
    let options = ServeOptions {
        reaper_batch: None,
        no_pool_checks: args.no_pool_checks,
    };
    let server = ServerProcess::start(storm.app, db, args.pool_size.get(), options).await?;
    let addr = server.addr();
    let mut senders = Vec::with_capacity(storm.size);
    for _ in 0..storm.size {
        senders.push(Some(load::connect(addr).await?));
    }
    let nonce = nonce();
    let account = |k: &str| format!("storm_{nonce}_{k}");

    one_key(addr, &mut senders, &account("warmup"), "warmup").await?;

    let backends: Vec<u32> = db
        .backend_pids()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|&pid| procfs::is_postgres(pid))
        .collect();
    let before = CpuSnapshot::take(&[server.pid()], &backends, std::process::id());
    let mut storming = Duration::ZERO;
    let mut answers = Vec::with_capacity(args.storm_keys);
    for k in 0..args.storm_keys {
        let started = Instant::now();
        let key = k.to_string();
        answers.push(one_key(addr, &mut senders, &account(&key), &key).await?);
        storming += started.elapsed();
    }
    let cpu = CpuSnapshot::take(&[server.pid()], &backends, std::process::id()).since(&before);
    let peak_rss = server.peak_rss().ok();
    drop(senders);
    server.stop().await?;

    // The database's word: the charges of each key's account.
    let rows =
        sqlx::query("SELECT account, count(*) FROM charges WHERE account LIKE $1 GROUP BY account")
            .bind(format!("storm\\_{nonce}\\_%"))
            .fetch_all(db.control())
            .await?;
    let mut charged: HashMap<String, i64> = HashMap::with_capacity(rows.len());
    for row in rows {
        charged.insert(row.try_get(0)?, row.try_get(1)?);
    }

    let mut tally = Tally::new();
    let mut keys = Vec::with_capacity(answers.len());
    for (k, answers) in answers.iter().enumerate() {
        let executions = charged.get(&account(&k.to_string())).copied().unwrap_or(0);
        for answer in answers {
            match &answer.outcome {
                Ok(a)
                    if a.status == StatusCode::CREATED
                        || (!storm.waits && a.status == StatusCode::CONFLICT) =>
                {
                    tally.record_latency(answer.answered - answer.sent);
                }
                Ok(a) => tally.error(format!("status {}", a.status)),
                Err(error) => tally.error(error.clone()),
            }
        }
        keys.push(outcome(executions, answers));
    }

    let failures = check(storm, &keys);
    let mut sample = Sample::new(round, storm.size, storming, tally, cpu);
    sample.peak_rss = peak_rss;
    sample.failures = failures;
    sample.storm = Some(StormReport {
        waits: storm.waits,
        size: storm.size,
        keys,
    });
    Ok(sample)
}

/// The correctness failures of a storm measurement: a key run more than once (or never), and
/// with waiting on, any duplicate not answered by a replay of the execution.
fn check(storm: Storm, keys: &[KeyOutcome]) -> Vec<String> {
    let mut failures = Vec::new();
    let wrong: Vec<(usize, &KeyOutcome)> = keys
        .iter()
        .enumerate()
        .filter(|(_, key)| {
            if storm.waits {
                !key.settled(storm.size)
            } else {
                key.executions != 1 || key.bodies_differ
            }
        })
        .collect();
    if wrong.is_empty() {
        return failures;
    }
    let twice = wrong.iter().filter(|(_, key)| key.executions > 1).count();
    if twice > 0 {
        failures.push(format!(
            "{twice} of {} keys EXECUTED MORE THAN ONCE",
            keys.len()
        ));
    }
    failures.push(format!(
        "{} of {} keys not {}",
        wrong.len(),
        keys.len(),
        if storm.waits {
            format!(
                "1 execution, {} replays, 0 409s",
                storm.size.saturating_sub(1)
            )
        } else {
            "executed exactly once".to_owned()
        }
    ));
    for (k, key) in wrong.iter().take(LISTED_FAILURES) {
        failures.push(format!("key {k}: {}", key.describe()));
    }
    failures
}

/// One request of a storm: when it was sent and answered, and what came back.
struct Timed {
    sent: Instant,
    answered: Instant,
    outcome: Result<load::Answer, String>,
}

/// Sends `size` requests with `key` for `account` at once, one per connection, and waits for
/// all their answers. A connection that failed is reopened for the next key.
async fn one_key(
    addr: SocketAddr,
    senders: &mut [Option<SendRequest<Full<Bytes>>>],
    account: &str,
    key: &str,
) -> Result<Vec<Timed>, BoxError> {
    let body = BodySize::Small.bytes();
    let barrier = Arc::new(Barrier::new(senders.len()));
    let mut tasks = tokio::task::JoinSet::new();
    for (i, slot) in senders.iter_mut().enumerate() {
        let sender = match slot.take() {
            Some(sender) => sender,
            None => load::connect(addr).await?,
        };
        let request = Request::post(CHARGES_PATH)
            .header(header::HOST, addr.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::AUTHORIZATION, format!("Bearer {account}"))
            .header("idempotency-key", format!("storm-{key}"))
            .body(Full::new(body.clone()))?;
        let barrier = Arc::clone(&barrier);
        tasks.spawn(async move {
            let mut sender = sender;
            barrier.wait().await;
            let sent = Instant::now();
            let outcome = load::exchange(&mut sender, request)
                .await
                .map_err(|e| format!("HTTP: {e}"));
            let answered = Instant::now();
            let sender = outcome.is_ok().then_some(sender);
            (
                i,
                sender,
                Timed {
                    sent,
                    answered,
                    outcome,
                },
            )
        });
    }
    let mut answers = Vec::with_capacity(senders.len());
    let collected = tokio::time::timeout(STORM_TIMEOUT, async {
        while let Some(joined) = tasks.join_next().await {
            let (i, sender, timed) = joined?;
            senders[i] = sender;
            answers.push(timed);
        }
        Ok::<_, BoxError>(())
    })
    .await;
    match collected {
        Ok(result) => result?,
        Err(_) => {
            return Err(format!("storm of key {key}: no answers within {STORM_TIMEOUT:?}").into());
        }
    }
    Ok(answers)
}

/// Counts a key's answers against its `executions`, and times the duplicates from the
/// executing request's answer.
fn outcome(executions: i64, answers: &[Timed]) -> KeyOutcome {
    let mut key = KeyOutcome {
        executions,
        ..KeyOutcome::default()
    };
    let mut first_body: Option<&Bytes> = None;
    for answer in answers {
        match &answer.outcome {
            Ok(a) if a.status == StatusCode::CREATED => {
                if a.replayed {
                    key.replays += 1;
                } else {
                    key.executed += 1;
                }
                match first_body {
                    Some(body) => key.bodies_differ |= *body != a.body,
                    None => first_body = Some(&a.body),
                }
            }
            Ok(a) if a.status == StatusCode::CONFLICT => key.conflicts += 1,
            Ok(a) => {
                key.other += 1;
                key.first_other.get_or_insert_with(|| {
                    format!(
                        "status {}: {}",
                        a.status,
                        String::from_utf8_lossy(&a.body[..a.body.len().min(200)])
                    )
                });
            }
            Err(error) => {
                key.other += 1;
                key.first_other.get_or_insert_with(|| error.clone());
            }
        }
    }
    let executing = answers.iter().find(|answer| {
        answer
            .outcome
            .as_ref()
            .is_ok_and(|a| a.status == StatusCode::CREATED && !a.replayed)
    });
    if let Some(first) = executing {
        for answer in answers {
            if std::ptr::eq(answer, first) {
                continue;
            }
            match answer.answered.checked_duration_since(first.answered) {
                Some(after) if !after.is_zero() => key
                    .after_first_us
                    .push(u64::try_from(after.as_micros()).unwrap_or(u64::MAX)),
                _ => key.before_first += 1,
            }
        }
    }
    key
}

/// A prefix no other measurement's accounts share (no `_`, which separates it).
fn nonce() -> String {
    static STORMS: AtomicU64 = AtomicU64::new(0);
    let epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis());
    format!(
        "{epoch:x}x{:x}x{}",
        std::process::id(),
        STORMS.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: StatusCode, replayed: bool, after_ms: u64, base: Instant) -> Timed {
        Timed {
            sent: base,
            answered: base + Duration::from_millis(after_ms),
            outcome: Ok(load::Answer {
                status,
                replayed,
                body: Bytes::from_static(b"{}"),
            }),
        }
    }

    #[test]
    fn a_settled_key_is_one_execution_and_replays_after_it() {
        let base = Instant::now();
        let mut answers = vec![answer(StatusCode::CREATED, false, 200, base)];
        answers.extend((0..3).map(|i| answer(StatusCode::CREATED, true, 201 + i, base)));
        let key = outcome(1, &answers);
        assert!(key.settled(4));
        assert_eq!(key.after_first_us, [1_000, 2_000, 3_000]);
        assert_eq!(key.before_first, 0);
        let storm = Storm {
            app: crate::app::App::SlowLeaseWait,
            size: 4,
            waits: true,
        };
        assert!(check(storm, std::slice::from_ref(&key)).is_empty());

        let mut refused = answers;
        refused[3] = answer(StatusCode::CONFLICT, false, 1, base);
        let key = outcome(1, &refused);
        assert!(!key.settled(4));
        assert_eq!((key.conflicts, key.before_first), (1, 1));
        assert!(!check(storm, std::slice::from_ref(&key)).is_empty());
        let no_wait = Storm {
            waits: false,
            ..storm
        };
        assert!(check(no_wait, &[key]).is_empty(), "409s are allowed");
        let twice = outcome(2, &refused);
        assert!(check(no_wait, &[twice])[0].contains("MORE THAN ONCE"));
    }

    #[test]
    fn summaries_give_ranges_per_key() {
        let base = Instant::now();
        let one = outcome(1, &[answer(StatusCode::CREATED, false, 1, base)]);
        let two = outcome(
            1,
            &[
                answer(StatusCode::CREATED, false, 1, base),
                answer(StatusCode::CREATED, true, 3, base),
            ],
        );
        let report = StormReport {
            waits: true,
            size: 2,
            keys: vec![one, two],
        };
        let summary = StormSummary::of([&report]).unwrap();
        assert_eq!(summary.keys, 2);
        assert_eq!(summary.executions.to_string(), "1");
        assert_eq!(summary.replays.to_string(), "0–1");
        assert_eq!(summary.unsettled, 1);
        assert_eq!(summary.after_first()[0].as_deref(), Some("2.00 ms"));
        assert!(
            summary
                .line("s", true, 1)
                .contains("keys varied: 1 execution, 0–1 replays")
        );
        assert!(
            summary
                .line("s", true, 1)
                .ends_with("**FAIL**: 1 keys not so (listed under CORRECTNESS FAILURES)")
        );
    }
}
