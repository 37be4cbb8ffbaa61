//! The acquirer's side of settlement during the chaos: `charge.settled` webhooks, each
//! delivered as [`COPIES`] copies at once, to both instances while they are being killed.
//!
//! As the clients get charges that succeeded (`200`, charge id and account known), they offer
//! them here ([`Feed::offer`]); `--settle-percent` of them get an event
//! `{"id": "evt_...", "type": "charge.settled", "data": {"object": {"id": "<charge>"}}}`,
//! signed once with the run's secret (Standard Webhooks, with the `standardwebhooks` crate)
//! and then sent as [`COPIES`] identical deliveries (same `webhook-id`, body, timestamp and
//! signature) released together by a barrier, spread over the two instances. Each copy is
//! retried as a webhook sender retries: a connection error, a timeout, a `5xx`, a `409` (another
//! copy is being handled) or a `429` are retried with exponential backoff and jitter, with the
//! same bytes, until a final answer or the drain's deadline.
//!
//! * An event is sent 0–100 ms after the charge's answer, so it races the client's refund of
//!   the charge (5 % of them) as often as it follows it.
//! * [`SECOND_EVENT_PERCENT`] of the settled charges get a second event with another id, at
//!   the same time as the first or after its answers: the charge must still settle once.
//! * [`UNKNOWN_PERCENT`] of the settled charges also bring an event naming a charge that does
//!   not exist: every copy must be answered `404`, and it must leave no inbox record.
//!
//! Every copy's final answer is kept in the [`Log`]; the checks
//! ([`verify::balances`](crate::verify)) hold it against the database and each account's
//! `GET /v1/balance`. Events are offered only until the stop; those in progress then finish.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use base64::{Engine as _, engine::general_purpose::STANDARD};
use bytes::Bytes;
use http::StatusCode;
use standardwebhooks::Webhook;
use tokio::{
    sync::{Barrier, mpsc},
    task::{JoinHandle, JoinSet},
};

use crate::{BoxError, client::Shared, rng::Rng};

/// Copies of each event delivered at once.
pub(crate) const COPIES: usize = 20;
/// Of the settled charges, those that get a second event (another id).
pub(crate) const SECOND_EVENT_PERCENT: u8 = 20;
/// Of the settled charges, those that also bring an event for a charge that does not exist.
pub(crate) const UNKNOWN_PERCENT: u8 = 3;
/// The demo's endpoint.
const PATH: &str = "/v1/webhooks/acquirer";
/// A sender's patience for one delivery (svix and Stripe wait 15 s and more); a copy that
/// meets another in flight waits up to 10 s in the demo before its `409`.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// The first backoff step and its cap.
const BACKOFF_BASE: Duration = Duration::from_millis(100);
const BACKOFF_CAP: Duration = Duration::from_secs(2);
/// An event goes out this long after the charge's answer (a range, in milliseconds).
const DELAY_MS: (u64, u64) = (0, 100);
/// Mixed into the seed: the sender's choices must not shift the rest of the run's plan.
const SEED_MIX: u64 = 0x5e77_1ed0_0000_0001;

/// A run-specific `whsec_` secret: 32 random bytes, base64.
pub(crate) fn secret() -> String {
    let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let bytes: Vec<u8> = a.as_bytes().iter().chain(b.as_bytes()).copied().collect();
    format!("whsec_{}", STANDARD.encode(bytes))
}

/// A charge that succeeded, as a client offers it.
#[derive(Debug)]
pub(crate) struct Paid {
    pub(crate) api_key: String,
    pub(crate) charge: String,
}

/// Where the clients offer their charges that succeeded; a no-op when nothing is settled.
#[derive(Debug, Clone, Default)]
pub(crate) struct Feed(Option<mpsc::UnboundedSender<Paid>>);

impl Feed {
    /// A feed and its receiving end (for [`run`]); `on` false: offers are dropped.
    pub(crate) fn channel(on: bool) -> (Self, mpsc::UnboundedReceiver<Paid>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self(on.then_some(tx)), rx)
    }

    /// Offers the charge `charge` of the account of `api_key`, which succeeded.
    pub(crate) fn offer(&self, api_key: &str, charge: &str) {
        if let Some(tx) = &self.0 {
            let _ = tx.send(Paid {
                api_key: api_key.to_owned(),
                charge: charge.to_owned(),
            });
        }
    }
}

/// Counters of the deliveries.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// Requests sent, and of them retries.
    pub(crate) deliveries: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) connection_errors: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) server_errors: AtomicU64,
    /// `409`: another copy of the event was being handled.
    pub(crate) conflicts: AtomicU64,
    /// The most copies of one event in flight at once, and the events whose copies were all in
    /// flight at once.
    pub(crate) peak_at_once: AtomicU64,
    pub(crate) all_at_once: AtomicU64,
}

fn add(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// What an event is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    /// The first event of a charge.
    First,
    /// Another event (another id) for a charge that has a first one.
    Second,
    /// An event naming a charge that does not exist.
    UnknownCharge,
}

/// The final state of one copy.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// A final answer (anything but a connection error, a timeout, `409`, `429` or `5xx`).
    Answered { status: StatusCode, body: Bytes },
    /// No final answer before the deadline; the last thing it met.
    Unresolved { attempts: u32, last: String },
}

/// One event and what each of its copies got.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) id: String,
    pub(crate) charge: String,
    /// The charge's account's key (empty for an unknown charge).
    pub(crate) api_key: String,
    pub(crate) kind: EventKind,
    pub(crate) copies: Vec<Outcome>,
}

/// What the sender did, for the checks and the report.
#[derive(Debug, Default)]
pub(crate) struct Log {
    pub(crate) settle_percent: u8,
    /// Charges offered by the clients before the stop.
    pub(crate) offered: u64,
    pub(crate) events: Vec<Event>,
    pub(crate) stats: Arc<Stats>,
    /// Event tasks that failed (panicked) or did not finish.
    pub(crate) failures: u64,
}

/// An event ready to send: the same bytes for every copy and every retry.
#[derive(Debug)]
struct Prepared {
    id: String,
    charge: String,
    api_key: String,
    kind: EventKind,
    body: String,
    timestamp: String,
    signature: String,
}

/// Sends the events: the HTTP client, the signer, the instances' addresses and the deadline.
struct Sender {
    shared: Arc<Shared>,
    http: reqwest::Client,
    signer: Webhook,
    stats: Arc<Stats>,
}

/// Settles `settle_percent` of the charges `paid` brings, until the stop; then lets the events
/// in progress finish (each copy up to the drain's deadline) and returns what they got.
pub(crate) async fn run(
    shared: Arc<Shared>,
    mut paid: mpsc::UnboundedReceiver<Paid>,
    secret: &str,
    settle_percent: u8,
) -> Result<Log, BoxError> {
    let stats = Arc::new(Stats::default());
    let sender = Arc::new(Sender {
        http: reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(1))
            .build()?,
        signer: Webhook::new(secret)?,
        stats: Arc::clone(&stats),
        shared: Arc::clone(&shared),
    });
    let mut rng = Rng::new(shared.behaviour.seed ^ SEED_MIX);
    let mut stop = shared.stop.clone();
    let mut tasks = JoinSet::new();
    let mut offered = 0;
    loop {
        let paid = tokio::select! {
            paid = paid.recv() => paid,
            _ = stop.wait_for(|stopped| *stopped) => None,
        };
        let Some(paid) = paid else { break };
        offered += 1;
        if !rng.percent(settle_percent) {
            continue;
        }
        if rng.percent(UNKNOWN_PERCENT) {
            let unknown = Paid {
                api_key: String::new(),
                charge: format!("ch_chaosunknown{}", rng.uuid().simple()),
            };
            let (sender, rng) = (Arc::clone(&sender), rng.fork());
            tasks.spawn(async move { vec![sender.unknown(unknown, rng).await] });
        }
        let (sender, rng) = (Arc::clone(&sender), rng.fork());
        tasks.spawn(async move { sender.settle(paid, rng).await });
    }
    let mut log = Log {
        settle_percent,
        offered,
        ..Log::default()
    };
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(events) => log.events.extend(events),
            Err(error) => {
                log.failures += 1;
                crate::progress(format_args!("a webhook task failed: {error}"));
            }
        }
    }
    log.stats = stats;
    Ok(log)
}

/// The sender's result by `until` (the drain's end): its [`Log`], or one that says it failed
/// (which fails the run), with the task aborted.
pub(crate) async fn finish(mut task: JoinHandle<Result<Log, BoxError>>, until: Instant) -> Log {
    let failed = match tokio::time::timeout_at(until.into(), &mut task).await {
        Ok(Ok(Ok(log))) => return log,
        Ok(Ok(Err(error))) => format!("the webhook sender failed: {error}"),
        Ok(Err(error)) => format!("the webhook sender's task failed: {error}"),
        Err(_) => {
            task.abort();
            "the webhook sender did not finish".to_owned()
        }
    };
    crate::progress(format_args!("{failed}"));
    Log {
        failures: 1,
        ..Log::default()
    }
}

impl Sender {
    /// The events of one charge: the first, and sometimes a second one, at once with it or
    /// after its answers.
    async fn settle(self: Arc<Self>, paid: Paid, mut rng: Rng) -> Vec<Event> {
        let (lo, hi) = DELAY_MS;
        tokio::time::sleep(Duration::from_millis(rng.between(lo, hi))).await;
        let first = self.prepare(&paid, EventKind::First, &mut rng);
        if !rng.percent(SECOND_EVENT_PERCENT) {
            return vec![Arc::clone(&self).deliver(first, rng.fork()).await];
        }
        let second = self.prepare(&paid, EventKind::Second, &mut rng);
        if rng.percent(50) {
            let (a, b) = tokio::join!(
                Arc::clone(&self).deliver(first, rng.fork()),
                Arc::clone(&self).deliver(second, rng.fork())
            );
            vec![a, b]
        } else {
            let a = Arc::clone(&self).deliver(first, rng.fork()).await;
            vec![a, self.deliver(second, rng.fork()).await]
        }
    }

    async fn unknown(self: Arc<Self>, paid: Paid, mut rng: Rng) -> Event {
        let event = self.prepare(&paid, EventKind::UnknownCharge, &mut rng);
        self.deliver(event, rng).await
    }

    /// The event's body, signed now, once: its copies and retries carry the same headers.
    fn prepare(&self, paid: &Paid, kind: EventKind, rng: &mut Rng) -> Prepared {
        let id = format!("evt_{}", rng.uuid().simple());
        let body = serde_json::json!({
            "id": id,
            "object": "event",
            "type": "charge.settled",
            "data": {"object": {"id": paid.charge, "object": "charge"}},
        })
        .to_string();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        let timestamp = i64::try_from(now).unwrap_or(i64::MAX);
        // A body of text always signs; an unsigned copy would be refused (400) and reported.
        let signature = self
            .signer
            .sign(&id, timestamp, body.as_bytes())
            .unwrap_or_default();
        Prepared {
            id,
            charge: paid.charge.clone(),
            api_key: paid.api_key.clone(),
            kind,
            body,
            timestamp: timestamp.to_string(),
            signature,
        }
    }

    /// Sends [`COPIES`] copies of `event` at once, alternating the instances, each until its
    /// final answer or the deadline.
    async fn deliver(self: Arc<Self>, event: Prepared, mut rng: Rng) -> Event {
        let event = Arc::new(event);
        let gate = Arc::new(Gate {
            barrier: Barrier::new(COPIES),
            in_flight: AtomicU32::new(0),
            peak: AtomicU32::new(0),
        });
        let mut copies = JoinSet::new();
        for n in 0..COPIES {
            let (sender, event, gate) = (Arc::clone(&self), Arc::clone(&event), Arc::clone(&gate));
            let rng = rng.fork();
            copies.spawn(async move { sender.copy(&event, n % 2, rng, &gate).await });
        }
        let mut answers = Vec::with_capacity(COPIES);
        while let Some(joined) = copies.join_next().await {
            answers.push(joined.unwrap_or_else(|error| Outcome::Unresolved {
                attempts: 0,
                last: format!("the copy's task failed: {error}"),
            }));
        }
        let peak = u64::from(gate.peak.load(Ordering::Relaxed));
        self.stats.peak_at_once.fetch_max(peak, Ordering::Relaxed);
        if peak == COPIES as u64 {
            add(&self.stats.all_at_once);
        }
        Event {
            id: event.id.clone(),
            charge: event.charge.clone(),
            api_key: event.api_key.clone(),
            kind: event.kind,
            copies: answers,
        }
    }

    /// One copy, from the barrier to its final answer, or the deadline.
    async fn copy(
        &self,
        event: &Prepared,
        mut instance: usize,
        mut rng: Rng,
        gate: &Gate,
    ) -> Outcome {
        gate.barrier.wait().await;
        let mut last = String::from("not sent");
        for attempt in 0_u32.. {
            let timeout = match self.shared.deadline.get() {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => REQUEST_TIMEOUT,
            };
            if timeout.is_zero() {
                return Outcome::Unresolved {
                    attempts: attempt,
                    last,
                };
            }
            add(&self.stats.deliveries);
            if attempt > 0 {
                add(&self.stats.retries);
            }
            gate.enter();
            let outcome = self
                .post(event, instance, timeout.min(REQUEST_TIMEOUT))
                .await;
            gate.leave();
            match outcome {
                Ok((status, body)) if is_final(status) => {
                    return Outcome::Answered { status, body };
                }
                Ok((status, _)) => {
                    last = status.to_string();
                    if status == StatusCode::CONFLICT {
                        add(&self.stats.conflicts);
                    } else {
                        add(&self.stats.server_errors);
                        instance = 1 - instance;
                    }
                }
                Err(error) => {
                    last = error.to_string();
                    add(if error.is_timeout() {
                        &self.stats.timeouts
                    } else {
                        &self.stats.connection_errors
                    });
                    instance = 1 - instance;
                }
            }
            self.pause(attempt, &mut rng).await;
            if rng.percent(50) {
                // A load balancer spreads retries too.
                instance = rng.below(2) as usize;
            }
        }
        Outcome::Unresolved {
            attempts: u32::MAX,
            last,
        }
    }

    /// One delivery: the event's bytes and headers, to instance `instance`.
    async fn post(
        &self,
        event: &Prepared,
        instance: usize,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), reqwest::Error> {
        let url = format!("http://{}{PATH}", self.shared.addrs.get(instance));
        let response = self
            .http
            .post(url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("webhook-id", &event.id)
            .header("webhook-timestamp", &event.timestamp)
            .header("webhook-signature", &event.signature)
            .body(event.body.clone())
            .timeout(timeout)
            .send()
            .await?;
        let status = response.status();
        Ok((status, response.bytes().await?))
    }

    /// The backoff before the next attempt: exponential with equal jitter, never past the
    /// deadline.
    async fn pause(&self, attempt: u32, rng: &mut Rng) {
        let step = BACKOFF_BASE
            .saturating_mul(1 << attempt.min(6))
            .min(BACKOFF_CAP);
        let half = u64::try_from(step.as_millis() / 2).unwrap_or(u64::MAX);
        let mut delay = Duration::from_millis(half + rng.below(half + 1));
        if let Some(deadline) = self.shared.deadline.get() {
            delay = delay.min(deadline.saturating_duration_since(Instant::now()));
        }
        tokio::time::sleep(delay).await;
    }
}

/// Whether a sender stops at `status`: all but `409` (another copy in flight), `429` and
/// `5xx`, which it retries.
pub(crate) fn is_final(status: StatusCode) -> bool {
    !(status == StatusCode::CONFLICT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error())
}

/// The copies of one event: released together, and how many are in flight at once.
struct Gate {
    barrier: Barrier,
    in_flight: AtomicU32,
    peak: AtomicU32,
}

impl Gate {
    fn enter(&self) {
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn leave(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retried_answers_are_those_a_webhook_sender_retries() {
        for status in [409, 429, 500, 502, 503] {
            assert!(!is_final(StatusCode::from_u16(status).unwrap()), "{status}");
        }
        for status in [200, 204, 400, 404, 422] {
            assert!(is_final(StatusCode::from_u16(status).unwrap()), "{status}");
        }
    }

    #[test]
    fn the_secret_is_a_standard_webhooks_secret_and_new_each_run() {
        let secret = secret();
        assert!(charges_demo::webhooks::WebhookSecret::parse(&secret).is_ok());
        assert!(Webhook::new(&secret).is_ok());
        assert_ne!(secret, self::secret());
    }

    #[test]
    fn a_feed_that_is_off_drops_offers() {
        let (feed, mut rx) = Feed::channel(false);
        feed.offer("sk_test_chaos_00", "ch_1");
        assert!(rx.try_recv().is_err());
        let (feed, mut rx) = Feed::channel(true);
        feed.offer("sk_test_chaos_00", "ch_1");
        assert_eq!(
            rx.try_recv().map(|paid| paid.charge).ok(),
            Some("ch_1".into())
        );
    }
}
