//! The clients: each behaves like a payments SDK creating charges one after another.
//!
//! A *logical charge* is one payment the client means to make: a fresh UUID `Idempotency-Key`,
//! a unique `metadata[order_id]`, an amount, and a card (a few are declined cards, whose `402`
//! is a final answer too). The client sends it until it gets a final answer:
//!
//! * it goes through tower-idempotency-client's middleware ([`send`](crate::send)), which
//!   sends the key on every attempt; every request has a timeout (each client its own, from
//!   100 ms to 2 s by default); connection errors, timeouts, `409` and `5xx` are retried with
//!   exponential backoff and full jitter, honouring `Retry-After`;
//! * each attempt goes to one of the two instances, as a load balancer would pick, and to the
//!   other one after a connection error or a timeout;
//! * some attempts hang up: the client drops the request (and its connection) after a few
//!   milliseconds, not knowing whether the charge went through, and retries;
//! * some charges are sent twice **in parallel** (a double click: two senders, same key): the
//!   instances make the duplicate wait for the first one's answer; in some pairs the second
//!   sender, sent just after the first, hangs up while its duplicate waits;
//! * some are sent once more after their answer (a client whose response was lost), which must
//!   be a replay of the same bytes;
//! * some are marked (the [`catch::HEADER`]) for the instances' handler that catches a database
//!   error: their `402` must be fresh every time, so each of them is sent again after its answer;
//! * in a hang-up storm, the clients it strikes drop their requests in flight at once, and each
//!   sends one more charge at that moment whose first request it drops too
//!   ([`storm_charges`]): a burst of handlers left running for clients that went away;
//! * some charges that succeeded are then **refunded** ([`RefundPlan`]): a random part or all of
//!   them, each refund a logical request of its own (a fresh key, a unique `metadata[refund_id]`)
//!   sent like a charge, retries and hang-ups included; some twice at once with different keys
//!   (together often more than the charge: one of them may then be refused, `400
//!   amount_too_large` or `charge_already_refunded`), some sent again after their answer.
//!
//! A sender of a charge sent at once whose first attempt met the window of failed waiting reads
//! ([`wait_reads`](crate::wait_reads)) and was answered `503 StoreUnavailable` before either
//! sender retried was turned away by a failed read while it waited; it is counted for the
//! checks ([`Observed`]).
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

use crate::{
    catch,
    faults::Storm,
    instance::Addrs,
    rng::Rng,
    send::{Call, First, Sender, send, struck},
    wait_reads::Phase,
    webhooks::Feed,
};

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
    pub(crate) refund_percent: u8,
    pub(crate) wait_hangup_percent: u8,
    pub(crate) abandon_percent: u8,
}

/// Of two senders of a charge sent at once, the second that hangs up while it waits starts
/// this much later (so that it is the one that waits), and hangs up this long after sending (a
/// range, in milliseconds: within the instances' processing delay of 10–50 ms).
const DUPLICATE_LAG: Duration = Duration::from_millis(2);
const WAIT_HANGUP_AFTER_MS: (u64, u64) = (3, 30);
/// Of the refunded charges: those refunded twice at once (different keys), those refunded in
/// full (no `amount`: what is left), and the refunds sent again after their answer.
const REFUND_PARALLEL_PERCENT: u8 = 30;
const REFUND_ALL_PERCENT: u8 = 30;
const REFUND_RESEND_PERCENT: u8 = 20;

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
    /// The latest hang-up storm.
    pub(crate) storms: watch::Receiver<Storm>,
    /// The window in which waiting reads fail.
    pub(crate) wait_reads: Phase,
    /// Where charges that succeeded are offered for settlement ([`webhooks`](crate::webhooks)).
    pub(crate) webhooks: Feed,
}

/// Counters of what the clients did and met.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) charges: AtomicU64,
    /// Logical refunds.
    pub(crate) refunds: AtomicU64,
    pub(crate) requests: AtomicU64,
    pub(crate) retries: AtomicU64,
    /// Answers carrying `Idempotent-Replayed: true`.
    pub(crate) replays: AtomicU64,
    pub(crate) conflicts: AtomicU64,
    pub(crate) server_errors: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    /// `503`s whose problem is `Overloaded`: too many handlers detached.
    pub(crate) overloaded: AtomicU64,
    pub(crate) connection_errors: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) hangups: AtomicU64,
    /// Of the hang-ups, those of storms.
    pub(crate) storm_hangups: AtomicU64,
    /// Logical charges sent in storms.
    pub(crate) storm_charges: AtomicU64,
    /// Second senders of a charge sent at once that hung up while waiting, as planned.
    pub(crate) wait_hangups: AtomicU64,
    /// Senders of a charge sent at once whose request a storm dropped.
    pub(crate) storm_pair_hangups: AtomicU64,
    /// First attempts of a charge sent at once answered `503 StoreUnavailable` while waiting
    /// reads failed.
    pub(crate) wait_read_503s: AtomicU64,
    pub(crate) unexpected: AtomicU64,
    /// Logical charges whose client went away at a connection error, to come back late.
    pub(crate) abandoned: AtomicU64,
}

impl Stats {
    pub(crate) fn add(counter: &AtomicU64) {
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
    /// Its client goes away at its first connection error, and comes back after the run.
    pub(crate) abandon: bool,
}

impl Plan {
    pub(crate) fn call(&self) -> Call<'_> {
        let source = if self.declined {
            "tok_chargeDeclined"
        } else {
            "tok_visa"
        };
        Call {
            path: "/v1/charges",
            api_key: &self.api_key,
            key: &self.key,
            form: vec![
                ("amount", self.amount.to_string()),
                ("currency", "usd".to_owned()),
                ("source", source.to_owned()),
                ("description", "chaos run".to_owned()),
                ("metadata[order_id]", self.order_id.clone()),
            ],
            caught_error: self.caught_error,
            expected: vec![self.expected_status()],
            wait_read_503s: Arc::default(),
            attempts: Arc::default(),
            abandoned: Arc::default(),
        }
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

/// One refund the client means to make, of a charge that succeeded: as a charge is, a logical
/// request with a key of its own, sent until it has a final answer.
#[derive(Debug, Clone)]
pub(crate) struct RefundPlan {
    pub(crate) key: String,
    /// Unique, in `metadata[refund_id]`: how the checks find its row.
    pub(crate) refund_id: String,
    pub(crate) charge_id: String,
    /// `None`: what is left of the charge.
    pub(crate) amount: Option<i64>,
}

impl RefundPlan {
    /// `parallel`: its sibling may take what it asks for, so a `400` may be its right answer.
    fn call<'a>(&'a self, api_key: &'a str, parallel: bool) -> Call<'a> {
        let mut form = vec![
            ("charge", self.charge_id.clone()),
            ("metadata[refund_id]", self.refund_id.clone()),
        ];
        if let Some(amount) = self.amount {
            form.push(("amount", amount.to_string()));
        }
        let mut expected = vec![StatusCode::OK];
        if parallel {
            expected.push(StatusCode::BAD_REQUEST);
        }
        Call {
            path: "/v1/refunds",
            api_key,
            key: &self.key,
            form,
            caught_error: false,
            expected,
            wait_read_503s: Arc::default(),
            attempts: Arc::default(),
            abandoned: Arc::default(),
        }
    }
}

/// A final answer, reduced to what the checks compare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) replayed: bool,
    pub(crate) body_sha256: [u8; 32],
    /// The id of the object the body names (`id` of a charge or refund, or `error.charge` for a
    /// decline).
    pub(crate) object_id: Option<String>,
    /// The body's `amount` (a refund's), or the error's `code`.
    pub(crate) amount: Option<i64>,
    pub(crate) code: Option<String>,
    /// The body's first bytes, for the report.
    pub(crate) excerpt: String,
}

impl Answer {
    pub(crate) fn new(status: StatusCode, replayed: bool, body: &Bytes) -> Self {
        let json: Option<serde_json::Value> = serde_json::from_slice(body).ok();
        let json = json.as_ref();
        let error = json.and_then(|json| json.get("error"));
        let object_id = json
            .and_then(|json| json.get("id").or_else(|| error?.get("charge")))
            .and_then(|id| id.as_str())
            .map(str::to_owned);
        Self {
            status,
            replayed,
            body_sha256: Sha256::digest(body).into(),
            object_id,
            amount: json
                .and_then(|json| json.get("amount"))
                .and_then(serde_json::Value::as_i64),
            code: error
                .and_then(|error| error.get("code"))
                .and_then(|code| code.as_str())
                .map(str::to_owned),
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
    /// The refunds made of it afterwards (none, one, or two at once).
    pub(crate) refunds: Vec<ObservedRefund>,
    /// First attempts of its senders (sent at once) answered `503 StoreUnavailable` while
    /// waiting reads failed: a failed read while waiting must answer `409`.
    pub(crate) wait_read_503s: u32,
    /// Its client went away at a connection error; its answer is the one it got when it came
    /// back after the run ([`late`](crate::late)).
    pub(crate) abandoned: bool,
}

/// What the senders of one logical refund saw.
#[derive(Debug)]
pub(crate) struct ObservedRefund {
    pub(crate) plan: RefundPlan,
    pub(crate) answers: Vec<Answer>,
    pub(crate) unresolved: u32,
    /// Sent at the same time as another refund of the charge, with another key.
    pub(crate) parallel: bool,
    pub(crate) resent: bool,
}

/// One client: logical charges one after another until the stop, then returns what it saw.
pub(crate) async fn run(shared: &Arc<Shared>, index: usize, mut rng: Rng) -> Vec<Observed> {
    let Some(sender) = Sender::new(shared, index, &mut rng) else {
        return Vec::new();
    };
    let behaviour = &shared.behaviour;
    let api_key = sender.api_key();
    let mut observed = Vec::new();
    let mut n = 0_u64;
    while !*shared.stop.borrow() {
        n += 1;
        let caught_error = rng.percent(behaviour.catch_percent);
        let parallel = rng.percent(behaviour.parallel_percent);
        let plan = Plan {
            api_key: api_key.clone(),
            key: rng.uuid().to_string(),
            order_id: format!("{:x}-{index}-{n}", behaviour.seed),
            amount: i64::try_from(rng.between(50, 99_999)).unwrap_or(100),
            declined: !caught_error && rng.percent(behaviour.decline_percent),
            caught_error,
            abandon: !caught_error && !parallel && rng.percent(behaviour.abandon_percent),
        };
        let mut answers = Vec::new();
        let mut unresolved = 0;
        let mut record = |result: Option<Answer>| match result {
            Some(answer) => answers.push(answer),
            None => unresolved += 1,
        };
        let call = plan.call();
        if parallel {
            let (mut first, mut second) = (rng.fork(), rng.fork());
            let pair = First {
                pair: true,
                ..First::default()
            };
            let hang_up = rng.percent(behaviour.wait_hangup_percent).then(|| {
                let (lo, hi) = WAIT_HANGUP_AFTER_MS;
                Duration::from_millis(rng.between(lo, hi))
            });
            let (a, b) = tokio::join!(send(&sender, &call, pair, &mut first), async {
                if hang_up.is_some() {
                    tokio::time::sleep(DUPLICATE_LAG).await;
                }
                send(&sender, &call, First { hang_up, ..pair }, &mut second).await
            });
            record(a);
            record(b);
        } else {
            let first = First {
                abandon: plan.abandon,
                ..First::default()
            };
            let answer = send(&sender, &call, first, &mut rng).await;
            if !call.abandoned.load(Ordering::Relaxed) {
                record(answer);
            }
        }
        let abandoned = call.abandoned.load(Ordering::Relaxed);
        // A client whose response was lost sends again: a replay of the same bytes, or, for a
        // caught error, whose key must have been released, a fresh answer.
        let resent = answers.len() == usize::from(parallel) + 1
            && (plan.caught_error || rng.percent(behaviour.resend_percent));
        if resent {
            let mut again = rng.fork();
            match send(&sender, &call, First::default(), &mut again).await {
                Some(answer) => answers.push(answer),
                None => unresolved += 1,
            }
        }
        let wait_read_503s = call.wait_read_503s.load(Ordering::Relaxed);
        drop(call);
        let succeeded = answers
            .first()
            .filter(|answer| answer.status == StatusCode::OK && !plan.caught_error)
            .and_then(|answer| answer.object_id.clone());
        if let Some(charge_id) = &succeeded {
            shared.webhooks.offer(&plan.api_key, charge_id);
        }
        let refunds = match succeeded {
            Some(charge_id) if rng.percent(behaviour.refund_percent) => {
                refund(&sender, &plan, charge_id, &mut rng).await
            }
            _ => Vec::new(),
        };
        Stats::add(&shared.stats.charges);
        observed.push(Observed {
            plan,
            answers,
            unresolved,
            parallel,
            resent,
            refunds,
            wait_read_503s,
            abandoned,
        });
    }
    observed
}

/// Client `index`'s part in the storms that strike it, beside [`run`]: a new charge at each,
/// whose first request it drops after 1–60 ms and then retries as any other, so that every
/// storm leaves a burst of handlers running for clients that went away at once. Returns what it
/// saw, at the stop.
pub(crate) async fn storm_charges(
    shared: &Arc<Shared>,
    index: usize,
    mut rng: Rng,
) -> Vec<Observed> {
    let Some(sender) = Sender::new(shared, index, &mut rng) else {
        return Vec::new();
    };
    let mut storms = shared.storms.clone();
    let mut stop = shared.stop.clone();
    let mut observed = Vec::new();
    loop {
        // A storm raised while the previous storm's charge was still being sent is let go.
        storms.mark_unchanged();
        let storm = tokio::select! {
            storm = struck(&mut storms, index) => storm,
            _ = stop.wait_for(|stopped| *stopped) => break,
        };
        let plan = Plan {
            api_key: sender.api_key(),
            key: rng.uuid().to_string(),
            order_id: format!("{:x}-{index}-storm{storm}", shared.behaviour.seed),
            amount: i64::try_from(rng.between(50, 99_999)).unwrap_or(100),
            declined: false,
            caught_error: false,
            abandon: false,
        };
        Stats::add(&shared.stats.storm_charges);
        let stormed = First {
            stormed: true,
            ..First::default()
        };
        let answer = send(&sender, &plan.call(), stormed, &mut rng).await;
        Stats::add(&shared.stats.charges);
        observed.push(Observed {
            plan,
            unresolved: u32::from(answer.is_none()),
            answers: answer.into_iter().collect(),
            parallel: false,
            resent: false,
            refunds: Vec::new(),
            wait_read_503s: 0,
            abandoned: false,
        });
    }
    observed
}

/// Refunds the charge `charge_id` of `plan`, which succeeded: once, or twice at once with
/// different keys; a random part or all of it. Returns what each refund's senders saw.
async fn refund(
    sender: &Sender<'_>,
    plan: &Plan,
    charge_id: String,
    rng: &mut Rng,
) -> Vec<ObservedRefund> {
    let parallel = rng.percent(REFUND_PARALLEL_PERCENT);
    let max = u64::try_from(plan.amount).unwrap_or(1);
    let mut refund_plan = |n: u8| RefundPlan {
        key: rng.uuid().to_string(),
        refund_id: format!("{}-refund{n}", plan.order_id),
        charge_id: charge_id.clone(),
        amount: (!rng.percent(REFUND_ALL_PERCENT))
            .then(|| i64::try_from(rng.between(1, max)).unwrap_or(1)),
    };
    let first = refund_plan(0);
    if !parallel {
        return vec![send_refund(sender, plan, first, false, rng.fork()).await];
    }
    let second = refund_plan(1);
    let (a, b) = tokio::join!(
        send_refund(sender, plan, first, true, rng.fork()),
        send_refund(sender, plan, second, true, rng.fork())
    );
    vec![a, b]
}

/// Sends one refund until its final answer, and sometimes once more after it.
async fn send_refund(
    sender: &Sender<'_>,
    plan: &Plan,
    refund: RefundPlan,
    parallel: bool,
    mut rng: Rng,
) -> ObservedRefund {
    let resent = rng.percent(REFUND_RESEND_PERCENT);
    let call = refund.call(&plan.api_key, parallel);
    let mut answers = Vec::new();
    let mut unresolved = 0;
    for _ in 0..=u8::from(resent) {
        match send(sender, &call, First::default(), &mut rng).await {
            Some(answer) => answers.push(answer),
            None => unresolved += 1,
        }
    }
    drop(call);
    Stats::add(&sender.shared.stats.refunds);
    ObservedRefund {
        plan: refund,
        answers,
        unresolved,
        parallel,
        resent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_name_their_object() {
        let ok = Answer::new(
            StatusCode::OK,
            false,
            &Bytes::from_static(br#"{"id":"ch_1","object":"charge"}"#),
        );
        assert_eq!(ok.object_id.as_deref(), Some("ch_1"));
        let declined = Answer::new(
            StatusCode::PAYMENT_REQUIRED,
            true,
            &Bytes::from_static(br#"{"error":{"charge":"ch_2","type":"card_error"}}"#),
        );
        assert_eq!(declined.object_id.as_deref(), Some("ch_2"));
        assert!(!ok.same_response(&declined));
        let refund = Answer::new(
            StatusCode::OK,
            false,
            &Bytes::from_static(br#"{"id":"re_1","object":"refund","amount":500}"#),
        );
        assert_eq!(
            (refund.object_id.as_deref(), refund.amount),
            (Some("re_1"), Some(500))
        );
        let refused = Answer::new(
            StatusCode::BAD_REQUEST,
            false,
            &Bytes::from_static(br#"{"error":{"code":"amount_too_large","param":"amount"}}"#),
        );
        assert_eq!(refused.code.as_deref(), Some("amount_too_large"));
        assert_eq!(refused.object_id, None);
    }
}
