//! The clients: each behaves like a payments SDK creating charges one after another.
//!
//! A *logical charge* is one payment the client means to make: a fresh UUID `Idempotency-Key`,
//! a unique `metadata[order_id]`, an amount, and a card (a few are declined cards, whose `402`
//! is a final answer too). The client sends it until it gets a final answer:
//!
//! * every request has a timeout (each client its own, from 100 ms to 2 s by default);
//!   connection errors, timeouts, `409` and `5xx` are retried with exponential backoff and
//!   jitter, honouring `Retry-After`;
//! * each attempt goes to one of the two instances, as a load balancer would pick, and to the
//!   other one after a connection error or a timeout;
//! * some attempts hang up: the client drops the request (and its connection) after a few
//!   milliseconds, not knowing whether the charge went through, and retries;
//! * some charges are sent twice **in parallel** (a double click: two senders, same key);
//! * some are sent once more after their answer (a client whose response was lost), which must
//!   be a replay of the same bytes;
//! * some are marked (the [`catch::HEADER`]) for the instances' handler that catches a database
//!   error: their `402` must be fresh every time, so each of them is sent again after its answer.
//!
//! Any other answer (`400`, `422`...) is final and reported: it should never happen here.
//! What each sender saw is kept in an [`Observed`] for the final checks.

use std::{
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::StatusCode;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::{catch, instance::Addrs, rng::Rng};

/// How the clients behave (the command line's client options).
#[derive(Debug, Clone)]
pub(crate) struct Behaviour {
    pub(crate) seed: u64,
    /// The longest request timeout; each client draws its own, from a twentieth of it up to
    /// it (impatient SDK configurations time out under load; patient ones ride out restarts).
    pub(crate) request_timeout: Duration,
    pub(crate) parallel_percent: u8,
    pub(crate) hangup_percent: u8,
    pub(crate) resend_percent: u8,
    pub(crate) decline_percent: u8,
    pub(crate) catch_percent: u8,
}

/// The first backoff step and its cap.
const BACKOFF_BASE: Duration = Duration::from_millis(50);
const BACKOFF_CAP: Duration = Duration::from_secs(2);
/// A hang-up drops the request this long after sending it (a range, in milliseconds).
const HANGUP_AFTER_MS: (u64, u64) = (1, 60);

/// Everything the clients share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) addrs: Arc<Addrs>,
    pub(crate) behaviour: Behaviour,
    pub(crate) stats: Stats,
    /// `true` once the chaos is over: clients finish their charge in progress and stop.
    pub(crate) stop: watch::Receiver<bool>,
    /// Set with the stop: senders give up (and report the charge unresolved) past it.
    pub(crate) deadline: OnceLock<Instant>,
}

/// Counters of what the clients did and met.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) charges: AtomicU64,
    pub(crate) requests: AtomicU64,
    pub(crate) retries: AtomicU64,
    /// Answers carrying `Idempotent-Replayed: true`.
    pub(crate) replays: AtomicU64,
    pub(crate) conflicts: AtomicU64,
    pub(crate) server_errors: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    pub(crate) connection_errors: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) hangups: AtomicU64,
    pub(crate) unexpected: AtomicU64,
}

impl Stats {
    fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// One logical charge, as planned.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) api_key: String,
    pub(crate) key: String,
    pub(crate) order_id: String,
    pub(crate) amount: i64,
    pub(crate) declined: bool,
    /// Handled by the instances' handler that catches a database error ([`catch`]).
    pub(crate) caught_error: bool,
}

impl Plan {
    fn form(&self) -> [(&'static str, String); 5] {
        let source = if self.declined {
            "tok_chargeDeclined"
        } else {
            "tok_visa"
        };
        [
            ("amount", self.amount.to_string()),
            ("currency", "usd".to_owned()),
            ("source", source.to_owned()),
            ("description", "chaos run".to_owned()),
            ("metadata[order_id]", self.order_id.clone()),
        ]
    }

    /// The status of this charge's correct final answer.
    pub(crate) fn expected_status(&self) -> StatusCode {
        if self.caught_error {
            catch::STATUS
        } else if self.declined {
            StatusCode::PAYMENT_REQUIRED
        } else {
            StatusCode::OK
        }
    }
}

/// A final answer, reduced to what the checks compare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) replayed: bool,
    pub(crate) body_sha256: [u8; 32],
    /// The charge id the body names (`id`, or `error.charge` for a decline).
    pub(crate) charge_id: Option<String>,
    /// The body's first bytes, for the report.
    pub(crate) excerpt: String,
}

impl Answer {
    pub(crate) fn new(status: StatusCode, replayed: bool, body: &Bytes) -> Self {
        let json: Option<serde_json::Value> = serde_json::from_slice(body).ok();
        let charge_id = json.as_ref().and_then(|json| {
            json.get("id")
                .or_else(|| json.get("error").and_then(|e| e.get("charge")))
                .and_then(|id| id.as_str())
                .map(str::to_owned)
        });
        Self {
            status,
            replayed,
            body_sha256: Sha256::digest(body).into(),
            charge_id,
            excerpt: String::from_utf8_lossy(&body[..body.len().min(160)]).into_owned(),
        }
    }

    /// The same status and body bytes (the replay marker may differ).
    pub(crate) fn same_response(&self, other: &Self) -> bool {
        self.status == other.status && self.body_sha256 == other.body_sha256
    }
}

/// What the senders of one logical charge saw.
#[derive(Debug)]
pub(crate) struct Observed {
    pub(crate) plan: Plan,
    /// The final answer of every sender that got one, in order.
    pub(crate) answers: Vec<Answer>,
    /// Senders that gave up at the deadline without a final answer.
    pub(crate) unresolved: u32,
    pub(crate) parallel: bool,
    pub(crate) resent: bool,
}

/// One client: logical charges one after another until the stop, then returns what it saw.
pub(crate) async fn run(shared: &Shared, index: usize, mut rng: Rng) -> Vec<Observed> {
    let http = match reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(1))
        .pool_max_idle_per_host(4)
        .build()
    {
        Ok(http) => http,
        Err(error) => {
            crate::progress(format_args!(
                "client {index}: cannot build an HTTP client: {error}"
            ));
            return Vec::new();
        }
    };
    let behaviour = &shared.behaviour;
    let longest = u64::try_from(behaviour.request_timeout.as_millis()).unwrap_or(u64::MAX);
    let timeout = Duration::from_millis(rng.between(longest / 20, longest).max(1));
    let api_key = format!("sk_test_chaos_{index:02}");
    let mut observed = Vec::new();
    let mut n = 0_u64;
    while !*shared.stop.borrow() {
        n += 1;
        let caught_error = rng.percent(behaviour.catch_percent);
        let plan = Plan {
            api_key: api_key.clone(),
            key: rng.uuid().to_string(),
            order_id: format!("{:x}-{index}-{n}", behaviour.seed),
            amount: i64::try_from(rng.between(50, 99_999)).unwrap_or(100),
            declined: !caught_error && rng.percent(behaviour.decline_percent),
            caught_error,
        };
        let parallel = rng.percent(behaviour.parallel_percent);
        let mut answers = Vec::new();
        let mut unresolved = 0;
        let mut record = |result: Option<Answer>| match result {
            Some(answer) => answers.push(answer),
            None => unresolved += 1,
        };
        if parallel {
            let (mut first, mut second) = (rng.fork(), rng.fork());
            let (a, b) = tokio::join!(
                send(shared, &http, timeout, &plan, &mut first),
                send(shared, &http, timeout, &plan, &mut second)
            );
            record(a);
            record(b);
        } else {
            record(send(shared, &http, timeout, &plan, &mut rng).await);
        }
        // A client whose response was lost sends again: a replay of the same bytes, or, for a
        // caught error, whose key must have been released, a fresh answer.
        let resent = answers.len() == usize::from(parallel) + 1
            && (plan.caught_error || rng.percent(behaviour.resend_percent));
        if resent {
            let mut again = rng.fork();
            match send(shared, &http, timeout, &plan, &mut again).await {
                Some(answer) => answers.push(answer),
                None => unresolved += 1,
            }
        }
        Stats::add(&shared.stats.charges);
        observed.push(Observed {
            plan,
            answers,
            unresolved,
            parallel,
            resent,
        });
    }
    observed
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

/// Sends `plan` until a final answer, or `None` past the deadline.
async fn send(
    shared: &Shared,
    http: &reqwest::Client,
    timeout: Duration,
    plan: &Plan,
    rng: &mut Rng,
) -> Option<Answer> {
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
        let url = format!("http://{}/v1/charges", shared.addrs.get(instance));
        let mut request = http
            .post(url)
            .bearer_auth(&plan.api_key)
            .header("idempotency-key", &plan.key)
            .form(&plan.form())
            .timeout(timeout);
        if plan.caught_error {
            request = request.header(catch::HEADER, "1");
        }
        let exchange = exchange(request);
        let outcome = if rng.percent(shared.behaviour.hangup_percent) {
            let after = Duration::from_millis(rng.between(HANGUP_AFTER_MS.0, HANGUP_AFTER_MS.1));
            tokio::time::timeout(after, exchange)
                .await
                .unwrap_or(Attempt::HungUp)
        } else {
            exchange.await
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
                if status == StatusCode::CONFLICT || status.is_server_error() {
                    if status == StatusCode::CONFLICT {
                        Stats::add(&stats.conflicts);
                    } else {
                        Stats::add(&stats.server_errors);
                        if status == StatusCode::SERVICE_UNAVAILABLE {
                            Stats::add(&stats.unavailable);
                        }
                        instance = 1 - instance;
                    }
                    if let Some(after) = retry_after {
                        delay = delay.max(after) + Duration::from_millis(rng.below(200));
                    }
                } else {
                    if status != plan.expected_status() {
                        Stats::add(&stats.unexpected);
                    }
                    return Some(Answer::new(status, replayed, &body));
                }
            }
            Attempt::ConnectionError => {
                Stats::add(&stats.connection_errors);
                instance = 1 - instance;
            }
            Attempt::Timeout => {
                Stats::add(&stats.timeouts);
                instance = 1 - instance;
            }
            Attempt::HungUp => Stats::add(&stats.hangups),
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

async fn exchange(request: reqwest::RequestBuilder) -> Attempt {
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) if error.is_timeout() => return Attempt::Timeout,
        Err(_) => return Attempt::ConnectionError,
    };
    let status = response.status();
    let headers = response.headers();
    let replayed = headers
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes() == b"true");
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
    fn answers_name_their_charge() {
        let ok = Answer::new(
            StatusCode::OK,
            false,
            &Bytes::from_static(br#"{"id":"ch_1","object":"charge"}"#),
        );
        assert_eq!(ok.charge_id.as_deref(), Some("ch_1"));
        let declined = Answer::new(
            StatusCode::PAYMENT_REQUIRED,
            true,
            &Bytes::from_static(br#"{"error":{"charge":"ch_2","type":"card_error"}}"#),
        );
        assert_eq!(declined.charge_id.as_deref(), Some("ch_2"));
        assert!(!ok.same_response(&declined));
    }
}
