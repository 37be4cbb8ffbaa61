//! The cross-instance duplicate burst of `many-instances`: each key sent to every server at
//! once, and exactly one execution per key checked against the answers and the database.

use std::{
    collections::HashMap,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::Full;
use sqlx::Row;
use tokio::time::Instant;

use crate::{
    BoxError,
    app::CHARGES_PATH,
    db::BenchDb,
    load::{self, Answer, BodySize},
    report::format_rate,
};

/// The outcome of a duplicate burst: what it did, and what went wrong (nothing, when every
/// key ran once).
#[derive(Debug, Default)]
pub(crate) struct Burst {
    pub(crate) summary: String,
    pub(crate) failures: Vec<String>,
}

/// How long a duplicate keeps retrying a `409` (in flight) before the key counts as failed.
const BURST_RETRY_FOR: Duration = Duration::from_secs(10);
const BURST_RETRY_EVERY: Duration = Duration::from_millis(20);
/// Keys in flight at once.
const BURST_WORKERS: usize = 16;

/// Sends each of `keys` keys to every server at once (one request per server, concurrently),
/// retrying `409 in flight` answers until they are replays, then checks that every key ran
/// exactly once: one `201` without `Idempotent-Replayed` per key, the same body on every
/// server, and exactly one row in `charges` per key (each key is charged to an account of its
/// own, `dup_<run>_<key>`).
pub(crate) async fn duplicate_burst(
    addrs: &[std::net::SocketAddr],
    db: &BenchDb,
    keys: usize,
) -> Result<Burst, BoxError> {
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let account = move |k: usize| format!("dup_{nonce:x}_{k}");
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..BURST_WORKERS.min(keys.max(1)) {
        let addrs = addrs.to_vec();
        tasks.spawn(async move {
            let mut senders = Vec::with_capacity(addrs.len());
            for addr in &addrs {
                senders.push(Some(load::connect(*addr).await?));
            }
            let mut outcomes = Vec::new();
            for k in (worker..keys).step_by(BURST_WORKERS) {
                outcomes.push((k, one_key(&addrs, &mut senders, &account(k), k).await));
            }
            Ok::<_, BoxError>(outcomes)
        });
    }
    let mut failures = Vec::new();
    let mut after_409 = 0_u64;
    let mut answered = 0_u64;
    while let Some(joined) = tasks.join_next().await {
        for (k, outcome) in joined?? {
            match outcome {
                Ok(retried) => {
                    after_409 += retried;
                    answered += addrs.len() as u64;
                }
                Err(error) => failures.push(format!("key {k}: {error}")),
            }
        }
    }
    let took = started.elapsed();

    // The database's word: one charge per key.
    let rows =
        sqlx::query("SELECT account, count(*) FROM charges WHERE account LIKE $1 GROUP BY account")
            .bind(format!("dup\\_{nonce:x}\\_%"))
            .fetch_all(db.control())
            .await?;
    let mut charged: HashMap<String, i64> = HashMap::with_capacity(rows.len());
    for row in rows {
        charged.insert(row.try_get(0)?, row.try_get(1)?);
    }
    let mut executions = 0_i64;
    let (mut never, mut twice) = (0_usize, 0_usize);
    for k in 0..keys {
        let count = charged.get(&account(k)).copied().unwrap_or(0);
        executions += count;
        match count {
            1 => {}
            0 => {
                never += 1;
                if never <= 5 {
                    failures.push(format!("key {k}: no charge in the database"));
                }
            }
            n => {
                twice += 1;
                if twice <= 5 {
                    failures.push(format!("key {k}: charged {n} times"));
                }
            }
        }
    }
    if twice > 0 {
        failures.insert(
            0,
            format!("{twice} of {keys} keys EXECUTED MORE THAN ONCE across instances"),
        );
    }
    if never > 0 {
        failures.push(format!("{never} of {keys} keys never executed"));
    }
    Ok(Burst {
        summary: format!(
            "duplicate burst: {keys} keys, each sent to all {} instances at once ({} requests, \
             {:.1} s): {} charges in the database ({}), {} answers were a `409 in flight` \
             retried into a replay; every key's answers {}",
            addrs.len(),
            format_rate(answered as f64),
            took.as_secs_f64(),
            executions,
            if never == 0 && twice == 0 {
                "one per key".to_owned()
            } else {
                format!("{twice} keys more than once, {never} never")
            },
            after_409,
            if failures.is_empty() {
                "identical (one `201` executed, the others replays of it)"
            } else {
                "checked: see the failures"
            },
        ),
        failures,
    })
}

/// Sends key `k` to every server at once and retries `409`s; checks the answers agree.
/// Returns how many answers needed a retry.
async fn one_key(
    addrs: &[std::net::SocketAddr],
    senders: &mut [Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>],
    account: &str,
    k: usize,
) -> Result<u64, String> {
    let body = BodySize::Small.bytes();
    let request = |addr: std::net::SocketAddr| {
        Request::post(CHARGES_PATH)
            .header(header::HOST, addr.to_string())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::AUTHORIZATION, format!("Bearer {account}"))
            .header("idempotency-key", format!("dup-{k}"))
            .body(Full::new(body.clone()))
            .expect("a valid request")
    };
    // Every server at once: each sender moves into a task of its own and comes back with its
    // answer.
    let mut inflight = tokio::task::JoinSet::new();
    for (i, slot) in senders.iter_mut().enumerate() {
        let Some(mut sender) = slot.take() else {
            return Err("connection lost".to_owned());
        };
        let request = request(addrs[i]);
        inflight.spawn(async move {
            let answer = load::exchange(&mut sender, request).await;
            (i, sender, answer)
        });
    }
    let mut answers: Vec<Option<Answer>> = (0..addrs.len()).map(|_| None).collect();
    while let Some(joined) = inflight.join_next().await {
        let (i, sender, answer) = joined.map_err(|e| e.to_string())?;
        senders[i] = Some(sender);
        answers[i] = Some(answer.map_err(|e| format!("server {i}: {e}"))?);
    }
    let mut retried = 0;
    for (i, answer) in answers.iter_mut().enumerate() {
        let deadline = Instant::now() + BURST_RETRY_FOR;
        while answer
            .as_ref()
            .is_some_and(|a| a.status == StatusCode::CONFLICT)
        {
            if Instant::now() > deadline {
                return Err(format!(
                    "server {i}: still in flight after {BURST_RETRY_FOR:?}"
                ));
            }
            retried += 1;
            tokio::time::sleep(BURST_RETRY_EVERY).await;
            let sender = senders[i].as_mut().ok_or("connection lost")?;
            *answer = Some(
                load::exchange(sender, request(addrs[i]))
                    .await
                    .map_err(|e| format!("server {i}: {e}"))?,
            );
        }
    }
    let answers: Vec<Answer> = answers.into_iter().flatten().collect();
    if let Some(bad) = answers.iter().find(|a| a.status != StatusCode::CREATED) {
        return Err(format!(
            "answered {}: {}",
            bad.status,
            String::from_utf8_lossy(&bad.body[..bad.body.len().min(200)])
        ));
    }
    let executed = answers.iter().filter(|a| !a.replayed).count();
    if executed != 1 {
        return Err(format!(
            "{executed} of {} answers were executions, not replays",
            answers.len()
        ));
    }
    if answers.iter().any(|a| a.body != answers[0].body) {
        return Err("the servers' answers differ".to_owned());
    }
    Ok(retried)
}
