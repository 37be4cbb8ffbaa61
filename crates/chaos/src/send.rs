//! One logical request sent until its final answer, as a payments SDK sends it, through
//! tower-idempotency-client's `IdempotentMiddleware`: the same key on every attempt, a timeout
//! per attempt, retries of connection errors, timeouts, `409` and `5xx` with exponential
//! backoff and full jitter (honouring `Retry-After`), never of another answer. Inside its loop,
//! [`Attempts`] sends each attempt to an instance, to the other one after a failure, hangs some
//! up, and drops those a storm strikes (see [`client`](crate::client)).

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32},
    },
    time::Duration,
};

use http::StatusCode;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use tokio::sync::watch;
use tower_idempotency::{PROBLEM_TYPE_BASE, RejectionKind};
use tower_idempotency_client::{Error, IdempotentMiddleware, Outcome, Policy, StopReason};

use crate::{
    attempt::{Attempts, Progress},
    catch,
    client::{Answer, Shared, Stats},
    faults::Storm,
    rng::Rng,
};

/// The first backoff step and its cap.
const BACKOFF_BASE: Duration = Duration::from_millis(50);
const BACKOFF_CAP: Duration = Duration::from_secs(2);
/// Longer than any run: the run's own deadline ([`Shared::deadline`]) ends the retries, in
/// [`Attempts`].
const NO_DEADLINE: Duration = Duration::from_secs(24 * 60 * 60);

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
    pub(crate) wait_read_503s: Arc<AtomicU32>,
    /// Attempts its senders made so far.
    pub(crate) attempts: Arc<AtomicU32>,
    /// Set when its client went away ([`First::abandon`]): the sender returned without an
    /// answer, to come back after the run.
    pub(crate) abandoned: Arc<AtomicBool>,
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
    http: ClientWithMiddleware,
    timeout: Duration,
    client: usize,
}

impl<'a> Sender<'a> {
    /// `None` (and a progress line) when the HTTP client cannot be built.
    pub(crate) fn new(shared: &'a Arc<Shared>, client: usize, rng: &mut Rng) -> Option<Self> {
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
        let attempts = Attempts {
            shared: Arc::clone(shared),
            client,
        };
        let http = ClientBuilder::new(http)
            .with(IdempotentMiddleware::new(policy()))
            .with(attempts)
            .build();
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

/// The clients' policy: every `5xx` retried, as many attempts as the run's deadline allows.
fn policy() -> Policy {
    Policy::new()
        .with_retry_on_500(true)
        .with_backoff(BACKOFF_BASE, BACKOFF_CAP)
        .and_then(|policy| policy.with_max_attempts(u32::MAX))
        .and_then(|policy| policy.with_deadline(NO_DEADLINE))
        .expect("the chaos policy is valid")
}

/// Sends `call` until a final answer, or `None` past the deadline (or when its client went
/// away); its first attempt as `first` says.
pub(crate) async fn send(
    sender: &Sender<'_>,
    call: &Call<'_>,
    first: First,
    rng: &mut Rng,
) -> Option<Answer> {
    let progress = Progress {
        first,
        path: call.path,
        instance: rng.below(2) as usize,
        made: 0,
        switch: false,
        rng: rng.fork(),
        attempts: Arc::clone(&call.attempts),
        wait_read_503s: Arc::clone(&call.wait_read_503s),
        abandoned: Arc::clone(&call.abandoned),
    };
    // The URL's address is each attempt's instance, set by `Attempts`.
    let url = format!("http://{}{}", sender.shared.addrs.get(0), call.path);
    let mut request = sender
        .http
        .post(url)
        .bearer_auth(call.api_key)
        .header("idempotency-key", call.key)
        .form(&call.form)
        .timeout(sender.timeout)
        .with_extension(progress);
    if call.caught_error {
        request = request.header(catch::HEADER, "1");
    }
    let (status, replayed, body) = match request.send().await {
        Ok(response) => {
            let outcome = response.extensions().get::<Outcome>().cloned()?;
            if outcome.stop() != StopReason::Final {
                return None;
            }
            let status = response.status();
            (status, outcome.replayed(), response.bytes().await.ok()?)
        }
        Err(reqwest_middleware::Error::Middleware(error)) => match error.downcast_ref() {
            Some(Error::KeyReused { problem, .. }) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                false,
                problem.clone().unwrap_or_default(),
            ),
            _ => return None,
        },
        Err(_) => return None,
    };
    if !call.expected.contains(&status) {
        Stats::add(&sender.shared.stats.unexpected);
    }
    Some(Answer::new(status, replayed, &body))
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
pub(crate) fn problem_is(body: &[u8], kind: RejectionKind) -> bool {
    let problem: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let expected = format!("{PROBLEM_TYPE_BASE}{}", kind.name());
    problem
        .as_ref()
        .and_then(|problem| problem.get("type"))
        .and_then(|kind| kind.as_str())
        == Some(expected.as_str())
}

/// Whether an answer with `status` ends a logical request: anything but what the clients'
/// [`policy`] retries, a `409` (the key in flight), a `429` and a `500`, `502`, `503` or `504`.
pub(crate) fn is_final(status: StatusCode) -> bool {
    !matches!(status.as_u16(), 409 | 429 | 500 | 502 | 503 | 504)
}

/// Whether a response is marked `Idempotent-Replayed: true`.
pub(crate) fn replayed(headers: &http::HeaderMap) -> bool {
    headers
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes() == b"true")
}

#[cfg(test)]
mod tests {
    use super::*;

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

#[cfg(test)]
#[path = "send_tests.rs"]
mod through_the_crate;
