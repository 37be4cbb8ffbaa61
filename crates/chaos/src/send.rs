//! One logical request sent until its final answer, as a payments SDK sends it: a timeout per
//! request, retries with exponential backoff and jitter on connection errors, timeouts, `409`
//! and `5xx` (honouring `Retry-After`), the other instance after a failure, some requests hung
//! up, and those a storm strikes dropped (see [`client`](crate::client)).

use std::{
    sync::atomic::{AtomicBool, AtomicU32, Ordering},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::StatusCode;
use tokio::sync::watch;
use tower_idempotency::{PROBLEM_TYPE_BASE, RejectionKind};

use crate::{
    catch,
    client::{Answer, Shared, Stats},
    faults::Storm,
    rng::Rng,
};

/// The first backoff step and its cap.
const BACKOFF_BASE: Duration = Duration::from_millis(50);
const BACKOFF_CAP: Duration = Duration::from_secs(2);
/// A hang-up drops the request this long after sending it (a range, in milliseconds).
const HANGUP_AFTER_MS: (u64, u64) = (1, 60);
/// One logical request as [`send`] makes it.
pub(crate) struct Call<'a> {
    pub(crate) path: &'static str,
    pub(crate) api_key: &'a str,
    pub(crate) key: &'a str,
    pub(crate) form: Vec<(&'static str, String)>,
    pub(crate) caught_error: bool,
    /// The statuses of its correct final answers.
    pub(crate) expected: Vec<StatusCode>,
    /// Its senders' first attempts turned away by a failed waiting read (see [`First`]).
    pub(crate) wait_read_503s: AtomicU32,
    /// Attempts its senders made so far.
    pub(crate) attempts: AtomicU32,
    /// Set when its client went away ([`First::abandon`]): the sender returned without an
    /// answer, to come back after the run.
    pub(crate) abandoned: AtomicBool,
}

/// How [`send`] makes a logical request's first attempt.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct First {
    /// A storm drops it (a storm charge's first request).
    pub(crate) stormed: bool,
    /// One of two senders of a charge sent at once: one of them waits for the other's answer.
    pub(crate) pair: bool,
    /// The second of them hangs up this long after sending, while it waits.
    pub(crate) hang_up: Option<Duration>,
    /// The client goes away at this send's first connection error, as if it died with the
    /// instance: nothing retries the key until it comes back after the run.
    pub(crate) abandon: bool,
}

/// One client's HTTP connections and request timeout, and its index, which storms strike or
/// spare.
pub(crate) struct Sender<'a> {
    pub(crate) shared: &'a Shared,
    http: reqwest::Client,
    timeout: Duration,
    client: usize,
}

impl<'a> Sender<'a> {
    /// `None` (and a progress line) when the HTTP client cannot be built.
    pub(crate) fn new(shared: &'a Shared, client: usize, rng: &mut Rng) -> Option<Self> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(1))
            .pool_max_idle_per_host(4)
            .build()
            .inspect_err(|error| {
                crate::progress(format_args!(
                    "client {client}: cannot build an HTTP client: {error}"
                ));
            })
            .ok()?;
        let longest =
            u64::try_from(shared.behaviour.request_timeout.as_millis()).unwrap_or(u64::MAX);
        let timeout = Duration::from_millis(rng.between(longest / 20, longest).max(1));
        Some(Self {
            shared,
            http,
            timeout,
            client,
        })
    }

    pub(crate) fn api_key(&self) -> String {
        format!("sk_test_chaos_{:02}", self.client)
    }
}

/// What one attempt came to.
enum Attempt {
    Response {
        status: StatusCode,
        replayed: bool,
        retry_after: Option<Duration>,
        body: Bytes,
    },
    ConnectionError,
    Timeout,
    HungUp,
}

/// Sends `call` until a final answer, or `None` past the deadline; its first attempt as
/// `first` says.
pub(crate) async fn send(
    sender: &Sender<'_>,
    call: &Call<'_>,
    first: First,
    rng: &mut Rng,
) -> Option<Answer> {
    let Sender {
        shared,
        http,
        timeout,
        client,
    } = sender;
    let stats = &shared.stats;
    let mut instance = rng.below(2) as usize;
    for attempt in 0_u32.. {
        if shared.deadline.get().is_some_and(|d| Instant::now() >= *d) {
            return None;
        }
        if attempt > 0 {
            Stats::add(&stats.retries);
        }
        Stats::add(&stats.requests);
        call.attempts.fetch_add(1, Ordering::Relaxed);
        let url = format!("http://{}{}", shared.addrs.get(instance), call.path);
        let mut request = http
            .post(url)
            .bearer_auth(call.api_key)
            .header("idempotency-key", call.key)
            .form(&call.form)
            .timeout(*timeout);
        if call.caught_error {
            request = request.header(catch::HEADER, "1");
        }
        let exchange = exchange(request);
        let planned = if attempt == 0 {
            first
        } else {
            First::default()
        };
        let hangup = planned.hang_up.or_else(|| {
            (planned.stormed || rng.percent(shared.behaviour.hangup_percent))
                .then(|| Duration::from_millis(rng.between(HANGUP_AFTER_MS.0, HANGUP_AFTER_MS.1)))
        });
        // Only storms raised from now on strike this request.
        let mut storms = shared.storms.clone();
        storms.mark_unchanged();
        let phase = shared.wait_reads.now();
        let (outcome, stormed) = tokio::select! {
            outcome = hang_up_after(hangup, exchange) => (outcome, planned.stormed),
            _ = struck(&mut storms, *client) => (Attempt::HungUp, true),
        };
        let mut delay = backoff(attempt, rng);
        match outcome {
            Attempt::Response {
                status,
                replayed,
                retry_after,
                body,
            } => {
                if replayed {
                    Stats::add(&stats.replays);
                }
                if is_final(status) {
                    if !call.expected.contains(&status) {
                        Stats::add(&stats.unexpected);
                    }
                    return Some(Answer::new(status, replayed, &body));
                }
                if count_refusal(stats, status, &body) {
                    instance = 1 - instance;
                }
                // Once a sender retried, its claim may have armed the fault for the other's
                // first claim (see `wait_reads`): only the first two attempts tell.
                let turned_away = planned.pair
                    && call.attempts.load(Ordering::Relaxed) <= 2
                    && status == StatusCode::SERVICE_UNAVAILABLE
                    && problem_is(&body, RejectionKind::StoreUnavailable)
                    && shared.wait_reads.overlapped(phase);
                if turned_away {
                    Stats::add(&stats.wait_read_503s);
                    call.wait_read_503s.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(after) = retry_after {
                    delay = delay.max(after) + Duration::from_millis(rng.below(200));
                }
            }
            Attempt::ConnectionError => {
                Stats::add(&stats.connection_errors);
                if first.abandon {
                    // As if the client died with the instance: nothing retries this key now.
                    Stats::add(&stats.abandoned);
                    call.abandoned.store(true, Ordering::Relaxed);
                    return None;
                }
                instance = 1 - instance;
            }
            Attempt::Timeout => {
                Stats::add(&stats.timeouts);
                instance = 1 - instance;
            }
            Attempt::HungUp => count_hang_up(stats, stormed, first.pair, planned.hang_up),
        }
        let delay = match shared.deadline.get() {
            Some(deadline) => delay.min(deadline.saturating_duration_since(Instant::now())),
            None => delay,
        };
        tokio::time::sleep(delay).await;
        if attempt > 0 && rng.percent(50) {
            // A load balancer spreads retries too.
            instance = rng.below(2) as usize;
        }
    }
    None
}

/// Counts a `409` or `5xx`; `true` for a `5xx`, after which the next attempt goes to the other
/// instance.
fn count_refusal(stats: &Stats, status: StatusCode, body: &[u8]) -> bool {
    if status == StatusCode::CONFLICT {
        Stats::add(&stats.conflicts);
        return false;
    }
    Stats::add(&stats.server_errors);
    if status == StatusCode::SERVICE_UNAVAILABLE {
        Stats::add(&stats.unavailable);
        if problem_is(body, RejectionKind::Overloaded) {
            Stats::add(&stats.overloaded);
        }
    }
    true
}

/// Counts a hang-up: a storm's (of one of two senders at once, `pair`, or not), or a planned
/// one of a duplicate waiting (`planned`), or any other.
fn count_hang_up(stats: &Stats, stormed: bool, pair: bool, planned: Option<Duration>) {
    Stats::add(&stats.hangups);
    if stormed {
        Stats::add(&stats.storm_hangups);
        if pair {
            Stats::add(&stats.storm_pair_hangups);
        }
    } else if planned.is_some() {
        Stats::add(&stats.wait_hangups);
    }
}

/// `exchange`, dropped (with its connection) `after` it was sent, if given.
async fn hang_up_after(
    after: Option<Duration>,
    exchange: impl Future<Output = Attempt>,
) -> Attempt {
    match after {
        Some(after) => tokio::time::timeout(after, exchange)
            .await
            .unwrap_or(Attempt::HungUp),
        None => exchange.await,
    }
}

/// The number of the next storm that strikes `client`; never returns if none does.
pub(crate) async fn struck(storms: &mut watch::Receiver<Storm>, client: usize) -> u32 {
    loop {
        if storms.changed().await.is_err() {
            return std::future::pending().await;
        }
        let storm = storms.borrow_and_update();
        if storm.strikes(client) {
            return storm.number;
        }
    }
}

/// Whether `body` is the layer's problem document of `kind`.
fn problem_is(body: &[u8], kind: RejectionKind) -> bool {
    let problem: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let expected = format!("{PROBLEM_TYPE_BASE}{}", kind.name());
    problem
        .as_ref()
        .and_then(|problem| problem.get("type"))
        .and_then(|kind| kind.as_str())
        == Some(expected.as_str())
}

/// Whether an answer with `status` ends a logical request: anything but a `409` (the key in
/// flight) and a `5xx`, which a client retries.
pub(crate) fn is_final(status: StatusCode) -> bool {
    status != StatusCode::CONFLICT && !status.is_server_error()
}

/// Whether a response is marked `Idempotent-Replayed: true`.
pub(crate) fn replayed(headers: &http::HeaderMap) -> bool {
    headers
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes() == b"true")
}

async fn exchange(request: reqwest::RequestBuilder) -> Attempt {
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) if error.is_timeout() => return Attempt::Timeout,
        Err(_) => return Attempt::ConnectionError,
    };
    let status = response.status();
    let headers = response.headers();
    let replayed = replayed(headers);
    let retry_after = headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    match response.bytes().await {
        Ok(body) => Attempt::Response {
            status,
            replayed,
            retry_after,
            body,
        },
        Err(error) if error.is_timeout() => Attempt::Timeout,
        Err(_) => Attempt::ConnectionError,
    }
}

/// Exponential backoff with "equal jitter": half of the step, plus up to the other half.
fn backoff(attempt: u32, rng: &mut Rng) -> Duration {
    let step = BACKOFF_BASE
        .saturating_mul(1 << attempt.min(6))
        .min(BACKOFF_CAP);
    let half = u64::try_from(step.as_millis() / 2).unwrap_or(u64::MAX);
    Duration::from_millis(half + rng.below(half + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let mut rng = Rng::new(3);
        for attempt in 0..20 {
            let delay = backoff(attempt, &mut rng);
            let step = BACKOFF_BASE
                .saturating_mul(1 << attempt.min(6))
                .min(BACKOFF_CAP);
            assert!(delay >= step / 2 && delay <= step, "{attempt}: {delay:?}");
        }
    }

    #[test]
    fn overloaded_503s_are_told_from_other_503s_by_their_problem_type() {
        let body = |kind: RejectionKind| {
            tower_idempotency::Rejection::new(kind, "detail")
                .to_json()
                .to_vec()
        };
        assert!(problem_is(
            &body(RejectionKind::Overloaded),
            RejectionKind::Overloaded
        ));
        assert!(!problem_is(
            &body(RejectionKind::StoreUnavailable),
            RejectionKind::Overloaded
        ));
        assert!(!problem_is(b"not json", RejectionKind::Overloaded));
        assert!(!problem_is(
            br#"{"type":"Overloaded"}"#,
            RejectionKind::Overloaded
        ));
    }

    /// A storm ends the attempts in flight of the clients it strikes, and only theirs.
    #[tokio::test]
    async fn a_storm_strikes_the_clients_it_names() {
        let (raise, storms) = watch::channel(Storm::default());
        let waiting = |client| {
            let mut storms = storms.clone();
            storms.mark_unchanged();
            tokio::spawn(async move { struck(&mut storms, client).await })
        };
        let (first, second) = (waiting(0), waiting(1));
        raise.send_replace(Storm {
            number: 1,
            clients: vec![false, true].into(),
            ..Storm::default()
        });
        assert_eq!(second.await.expect("client 1 is struck"), 1);
        tokio::task::yield_now().await;
        assert!(!first.is_finished(), "client 0 was spared");
        raise.send_replace(Storm {
            number: 2,
            clients: vec![true, false].into(),
            ..Storm::default()
        });
        assert_eq!(first.await.expect("client 0 is struck"), 2);
    }
}
