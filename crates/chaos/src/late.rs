//! After the chaos, the charges whose clients went away ([`Observed::abandoned`]): first the
//! completer's time, until no key is left in flight, then each client comes back and sends its
//! charge once more, as a client restarted the next day would. Its answer must be the replay of
//! what the completer finished (or, for a key never claimed, the charge made now); the checks
//! then hold it to every rule a charge's answers are held to.

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use sqlx::PgPool;

use http::StatusCode;
use reqwest_middleware::ClientBuilder;
use tower_idempotency_client::{Error, IdempotentMiddleware, Outcome, Policy, StopReason};

use crate::{
    client::{Answer, Observed, Stats},
    instance::Addrs,
};

/// How long the completer may take to finish the abandoned keys (a lease, the grace, a few
/// rounds and attempts).
pub(crate) const COMPLETION_LIMIT: Duration = Duration::from_secs(60);
/// How long a returning client keeps retrying an answer that is not final, and its longest
/// wait between attempts.
const RETURN_LIMIT: Duration = Duration::from_secs(30);
const RETRY_EVERY: Duration = Duration::from_millis(200);

/// Keys in flight, and of them those with a kept request (the completer's to finish). A key
/// claimed by an instance killed before it kept the request never reached its handler: only
/// its client can finish it, as it does here when it comes back.
const IN_FLIGHT: &str = "SELECT count(*), count(*) FILTER (WHERE EXISTS (
        SELECT 1 FROM idempotency.pending_requests p WHERE p.scope_key = r.scope_key))
    FROM idempotency.records r WHERE r.status IS NULL";

/// Waits until no key with a kept request is in flight, at most `limit`; returns the keys in
/// flight then, and of them those with a kept request (0 when the completer finished them).
pub(crate) async fn wait_for_completion(
    pool: &PgPool,
    limit: Duration,
) -> Result<(u64, u64), sqlx::Error> {
    let until = Instant::now() + limit;
    loop {
        let (in_flight, kept): (i64, i64) = sqlx::query_as(IN_FLIGHT).fetch_one(pool).await?;
        if kept == 0 || Instant::now() >= until {
            let count = |n: i64| u64::try_from(n).unwrap_or(0);
            return Ok((count(in_flight), count(kept)));
        }
        // Polled: the completer's progress is only visible in the database.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Each abandoned charge's client comes back and sends it again, through the same middleware
/// as the clients ([`send`](crate::send)), until a final answer or [`RETURN_LIMIT`].
pub(crate) async fn come_back(observed: &mut [Observed], addrs: &Addrs, stats: &Stats) {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("an HTTP client without TLS or proxies builds");
    let http = ClientBuilder::new(http)
        .with(IdempotentMiddleware::new(policy()))
        .build();
    for (n, charge) in observed.iter_mut().filter(|c| c.abandoned).enumerate() {
        let call = charge.plan.call();
        let url = format!("http://{}{}", addrs.get(n % 2), call.path);
        let sent = http
            .post(url)
            .bearer_auth(call.api_key)
            .header("idempotency-key", call.key)
            .form(&call.form)
            .send()
            .await;
        drop(call);
        match answer(sent, stats).await {
            Some(answer) => charge.answers.push(answer),
            None => charge.unresolved += 1,
        }
    }
}

/// A returning client's policy: every `5xx` retried, every [`RETRY_EVERY`] at most, for
/// [`RETURN_LIMIT`].
fn policy() -> Policy {
    Policy::new()
        .with_retry_on_500(true)
        .with_backoff(RETRY_EVERY, RETRY_EVERY)
        .and_then(|policy| policy.with_max_attempts(u32::MAX))
        .and_then(|policy| policy.with_deadline(RETURN_LIMIT))
        .expect("the returning clients' policy is valid")
}

/// The final answer the middleware returned, counting its attempts and replays; `None`
/// without one.
async fn answer(
    sent: reqwest_middleware::Result<reqwest::Response>,
    stats: &Stats,
) -> Option<Answer> {
    let (attempts, answer) = match sent {
        Ok(response) => {
            let outcome = response.extensions().get::<Outcome>().cloned()?;
            let status = response.status();
            let body = response.bytes().await;
            let final_answer = outcome.stop() == StopReason::Final;
            let answer = body
                .ok()
                .filter(|_| final_answer)
                .map(|body| Answer::new(status, outcome.replayed(), &body));
            (outcome.attempts(), answer)
        }
        Err(reqwest_middleware::Error::Middleware(error)) => match error.downcast_ref() {
            Some(Error::KeyReused {
                attempts, problem, ..
            }) => {
                let body = problem.clone().unwrap_or_default();
                let answer = Answer::new(StatusCode::UNPROCESSABLE_ENTITY, false, &body);
                (*attempts, Some(answer))
            }
            Some(other) => (other.attempts(), None),
            None => (0, None),
        },
        Err(_) => (0, None),
    };
    stats
        .requests
        .fetch_add(u64::from(attempts), Ordering::Relaxed);
    if answer.as_ref().is_some_and(|answer| answer.replayed) {
        Stats::add(&stats.replays);
    }
    answer
}
