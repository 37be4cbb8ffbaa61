//! One attempt of a logical request, as the chaos makes it: which instance it goes to, whether
//! it hangs up or a storm drops it, and what it counts.
//!
//! [`Attempts`] runs inside tower-idempotency-client's `IdempotentMiddleware`, once per attempt
//! (see [`send`](crate::send)): the crate keeps the key, decides what is retried, and waits
//! (backoff, `Retry-After`); this middleware plays the network and the load balancer. It reads
//! each answer whole within the attempt, so that a hang-up may strike while the body streams.

use std::{
    fmt, io,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Extensions, StatusCode};
use reqwest::{Request, Response, ResponseBuilderExt, Url};
use reqwest_middleware::{Middleware, Next};
use tower_idempotency::RejectionKind;

use crate::{
    client::{Shared, Stats},
    rng::Rng,
    send::{First, is_final, problem_is, replayed, struck},
};

/// A hang-up drops the request this long after sending it (a range, in milliseconds).
const HANGUP_AFTER_MS: (u64, u64) = (1, 60);

/// What a logical request carries from one attempt to the next, in its extensions.
#[derive(Debug, Clone)]
pub(crate) struct Progress {
    pub(crate) first: First,
    pub(crate) path: &'static str,
    pub(crate) instance: usize,
    /// Attempts made so far.
    pub(crate) made: u32,
    /// The last attempt sends the next to the other instance.
    pub(crate) switch: bool,
    pub(crate) rng: Rng,
    /// Shared with its [`Call`](crate::send::Call): attempts of all its senders, first
    /// attempts turned away by a failed waiting read, and whether its client went away.
    pub(crate) attempts: Arc<AtomicU32>,
    pub(crate) wait_read_503s: Arc<AtomicU32>,
    pub(crate) abandoned: Arc<AtomicBool>,
}

/// Why the chaos ends a logical request: the crate does not retry these.
#[derive(Debug)]
pub(crate) enum Stop {
    /// The run's deadline passed: the sender gives up, unresolved.
    PastDeadline,
    /// The client went away at a connection error, to come back after the run.
    Abandoned,
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::PastDeadline => "the run's deadline passed",
            Self::Abandoned => "the client went away",
        })
    }
}

impl std::error::Error for Stop {}

/// What one attempt came to.
enum Met {
    /// An answer, read whole: the response rebuilt around its body, and the body.
    Answer(Response, Bytes),
    ConnectionError(String),
    Timeout(String),
    HungUp,
}

/// The per-attempt middleware of one client.
pub(crate) struct Attempts {
    pub(crate) shared: Arc<Shared>,
    pub(crate) client: usize,
}

#[async_trait::async_trait]
impl Middleware for Attempts {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let shared = &self.shared;
        if self.past_deadline() {
            return Err(reqwest_middleware::Error::middleware(Stop::PastDeadline));
        }
        // Out of the extensions while the attempt borrows them; back in for the next one.
        let Some(mut progress) = extensions.remove::<Progress>() else {
            return next.run(request, extensions).await;
        };
        let (planned, hangup) = self.plan(&mut progress);
        let addr = shared.addrs.get(progress.instance);
        *request.url_mut() = Url::parse(&format!("http://{addr}{}", progress.path))
            .map_err(reqwest_middleware::Error::middleware)?;
        // Only storms raised from now on strike this request.
        let mut storms = shared.storms.clone();
        storms.mark_unchanged();
        let phase = shared.wait_reads.now();
        let exchange = hang_up_after(hangup, exchange(next, request, extensions));
        let (met, stormed) = tokio::select! {
            met = exchange => (met, planned.stormed),
            _ = struck(&mut storms, self.client) => (Met::HungUp, true),
        };
        let result = self.count(&mut progress, met, Struck { planned, stormed }, phase);
        extensions.insert(progress);
        self.settle(result)
    }
}

/// How an attempt was planned, and whether a storm struck it.
struct Struck {
    planned: First,
    stormed: bool,
}

impl Attempts {
    /// Counts what the attempt met, notes whether the next goes to the other instance, and
    /// turns it into what the crate judges: an answer, or a failure it retries.
    fn count(
        &self,
        progress: &mut Progress,
        met: Met,
        attempt: Struck,
        phase: u64,
    ) -> reqwest_middleware::Result<Response> {
        let stats = &self.shared.stats;
        let (first, planned) = (progress.first, attempt.planned);
        progress.switch = false;
        match met {
            Met::Answer(answer, body) => {
                let pair_start = planned.pair && progress.attempts.load(Ordering::Relaxed) <= 2;
                self.count_answer(progress, &answer, &body, pair_start, phase);
                Ok(answer)
            }
            Met::ConnectionError(error) => {
                Stats::add(&stats.connection_errors);
                if first.abandon {
                    // As if the client died with the instance: nothing retries this key now.
                    Stats::add(&stats.abandoned);
                    progress.abandoned.store(true, Ordering::Relaxed);
                    return Err(reqwest_middleware::Error::middleware(Stop::Abandoned));
                }
                progress.switch = true;
                Err(transient(io::ErrorKind::ConnectionReset, error))
            }
            Met::Timeout(error) => {
                Stats::add(&stats.timeouts);
                progress.switch = true;
                Err(transient(io::ErrorKind::TimedOut, error))
            }
            Met::HungUp => {
                count_hang_up(stats, attempt.stormed, first.pair, planned.hang_up);
                Err(transient(
                    io::ErrorKind::TimedOut,
                    "the client hung up".to_owned(),
                ))
            }
        }
    }

    fn past_deadline(&self) -> bool {
        self.shared
            .deadline
            .get()
            .is_some_and(|deadline| Instant::now() >= *deadline)
    }

    /// Counts the attempt, picks its instance, and plans its hang-up: the first attempt as
    /// `first` says, the others by chance.
    fn plan(&self, progress: &mut Progress) -> (First, Option<Duration>) {
        let stats = &self.shared.stats;
        if progress.made > 0 {
            Stats::add(&stats.retries);
            if progress.switch {
                progress.instance = 1 - progress.instance;
            }
            if progress.made > 1 && progress.rng.percent(50) {
                // A load balancer spreads retries too.
                progress.instance = progress.rng.below(2) as usize;
            }
        }
        Stats::add(&stats.requests);
        progress.attempts.fetch_add(1, Ordering::Relaxed);
        let planned = if progress.made == 0 {
            progress.first
        } else {
            First::default()
        };
        progress.made += 1;
        let percent = self.shared.behaviour.hangup_percent;
        let hangup = planned.hang_up.or_else(|| {
            (planned.stormed || progress.rng.percent(percent)).then(|| {
                let (lo, hi) = HANGUP_AFTER_MS;
                Duration::from_millis(progress.rng.between(lo, hi))
            })
        });
        (planned, hangup)
    }

    /// Counts an answer: a replay, a `409` or a `5xx` (after which the next attempt goes to
    /// the other instance), a first attempt of a pair turned away by a failed waiting read.
    fn count_answer(
        &self,
        progress: &mut Progress,
        answer: &Response,
        body: &[u8],
        pair_start: bool,
        phase: u64,
    ) {
        let stats = &self.shared.stats;
        let status = answer.status();
        if replayed(answer.headers()) {
            Stats::add(&stats.replays);
        }
        if is_final(status) {
            return;
        }
        if count_refusal(stats, status, body) {
            progress.switch = true;
        }
        // Once a sender retried, its claim may have armed the fault for the other's first
        // claim (see `wait_reads`): only the first two attempts tell.
        let turned_away = pair_start
            && status == StatusCode::SERVICE_UNAVAILABLE
            && problem_is(body, RejectionKind::StoreUnavailable)
            && self.shared.wait_reads.overlapped(phase);
        if turned_away {
            Stats::add(&stats.wait_read_503s);
            progress.wait_read_503s.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An answer goes up to the crate, unless the run's deadline passed and it is not final;
    /// a failure goes up as it is.
    fn settle(
        &self,
        result: reqwest_middleware::Result<Response>,
    ) -> reqwest_middleware::Result<Response> {
        let retried = match &result {
            Ok(answer) => !is_final(answer.status()),
            Err(_) => true,
        };
        if retried && self.past_deadline() {
            return Err(reqwest_middleware::Error::middleware(Stop::PastDeadline));
        }
        result
    }
}

/// A failure the crate retries: an I/O error of `kind`.
fn transient(kind: io::ErrorKind, what: String) -> reqwest_middleware::Error {
    reqwest_middleware::Error::middleware(io::Error::new(kind, what))
}

/// The attempt, its answer read whole.
async fn exchange(next: Next<'_>, request: Request, extensions: &mut Extensions) -> Met {
    let response = match next.run(request, extensions).await {
        Ok(response) => response,
        Err(error) if error.is_timeout() => return Met::Timeout(error.to_string()),
        Err(error) => return Met::ConnectionError(error.to_string()),
    };
    let (status, version) = (response.status(), response.version());
    let (headers, url) = (response.headers().clone(), response.url().clone());
    let body = match response.bytes().await {
        Ok(body) => body,
        Err(error) if error.is_timeout() => return Met::Timeout(error.to_string()),
        Err(error) => return Met::ConnectionError(error.to_string()),
    };
    let rebuilt = http::Response::builder()
        .status(status)
        .version(version)
        .url(url)
        .body(body.clone());
    match rebuilt {
        Ok(mut rebuilt) => {
            *rebuilt.headers_mut() = headers;
            Met::Answer(Response::from(rebuilt), body)
        }
        Err(error) => Met::ConnectionError(error.to_string()),
    }
}

/// `exchange`, dropped (with its connection) `after` it was sent, if given.
async fn hang_up_after(after: Option<Duration>, exchange: impl Future<Output = Met>) -> Met {
    match after {
        Some(after) => tokio::time::timeout(after, exchange)
            .await
            .unwrap_or(Met::HungUp),
        None => exchange.await,
    }
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
