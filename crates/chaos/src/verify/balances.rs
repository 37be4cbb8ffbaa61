//! The settlements: what the webhook sender's copies got ([`webhooks`](crate::webhooks))
//! against the inbox records, the charges' `settled` marks and every account's
//! `GET /v1/balance`.
//!
//! The expectation is computed here from the rows, not with the demo's SQL. The demo defines
//! (`ledger/settlement.rs`) available as what settled charges brought in less their refunds,
//! and pending as the same for succeeded charges not settled; a refund before settlement lowers
//! what the settlement adds, one after it takes its amount back from available. Either way a
//! charge ends counted once, at its amount less all its refund rows: in available if an event
//! of it was answered `2xx`, else in pending.
//!
//! | invariant | how it is checked |
//! |---|---|
//! | no double settlement | of a charge's events answered `2xx`, at most one says `settled` (the others `already_settled`) |
//! | balances | `available` and `pending` per currency of each account, read on both instances, equal the expectation |
//! | settlements | a charge is marked settled exactly when an event of it was answered `2xx`, by one event that says `settled`, of its amount less some of its refunds (those before it) |
//! | inbox | every event answered `2xx` has its inbox record, holding the settlement its copies got; an unknown charge's event has none; no inbox record of no event |
//! | answers | every copy of an event got the same `2xx` body; every copy of an unknown charge's event `404 resource_missing`; nothing else |
//! | resolved | every copy got a final answer before the deadline |

use std::collections::{BTreeMap, HashMap};

use charges_demo::auth::Account;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};

use super::{RecordRow, Verdict};
use crate::{
    client::Observed,
    instance::{Addrs, INSTANCES},
    webhooks::{Event, EventKind, Log, Outcome},
};

/// The figures and invariants of the settlements.
#[derive(Debug, Default)]
pub(crate) struct WebhookVerdict {
    pub(crate) settle_percent: u8,
    pub(crate) offered: u64,
    /// Events, and of them second events of a charge and events of unknown charges.
    pub(crate) events: u64,
    pub(crate) second_events: u64,
    pub(crate) unknown_events: u64,
    pub(crate) copies: u64,
    pub(crate) deliveries: u64,
    pub(crate) retries: u64,
    pub(crate) connection_errors: u64,
    pub(crate) timeouts: u64,
    pub(crate) server_errors: u64,
    pub(crate) conflicts: u64,
    pub(crate) peak_at_once: u64,
    pub(crate) all_at_once: u64,
    /// Copies answered `404` (all of unknown charges' events, when the run passes).
    pub(crate) not_found: u64,
    /// Charges settled (an event answered `2xx`), of them refunded, and with two events so.
    pub(crate) settled_charges: u64,
    pub(crate) settled_refunded: u64,
    /// Settled charges refunded (in part) before their settlement, and after it.
    pub(crate) refunded_before: u64,
    pub(crate) refunded_after: u64,
    pub(crate) settled_twice_sent: u64,
    pub(crate) inbox_records: u64,
    pub(crate) accounts: u64,
    pub(crate) balance_reads: u64,

    pub(crate) double_settlements: u64,
    pub(crate) balance_mismatches: u64,
    pub(crate) settlement_mismatches: u64,
    pub(crate) inbox_mismatches: u64,
    pub(crate) unexpected_answers: u64,
    pub(crate) unresolved_copies: u64,
    pub(crate) sender_failures: u64,
}

impl WebhookVerdict {
    /// Every invariant of the settlements and its count.
    pub(crate) fn invariants(&self) -> [(&'static str, u64); 7] {
        [
            ("double settlements", self.double_settlements),
            ("balance mismatches", self.balance_mismatches),
            ("settlement mismatches", self.settlement_mismatches),
            ("inbox mismatches", self.inbox_mismatches),
            ("unexpected webhook answers", self.unexpected_answers),
            ("unresolved webhook copies", self.unresolved_copies),
            ("webhook sender failures", self.sender_failures),
        ]
    }
}

/// The scope the demo's inbox keys its `webhook-id`s under (`WebhookReceiver`: `webhook/` and
/// the sender).
const SCOPE: &str = "webhook/acquirer";

/// Completed results of `Once`, the inbox's records: their key, status and body.
const INBOX: &str = "SELECT uuid_send(scope_key) AS key, status, body FROM idempotency.records
     WHERE 'x-idempotency-once' = ANY(header_names)";
const CHARGES: &str = "SELECT id, account, currency, amount, status = 'succeeded' AS succeeded,
        settled IS NOT NULL AS settled
     FROM charges";
const REFUNDS: &str = "SELECT charge, amount FROM refunds";

/// A charge as its rows say.
#[derive(Debug, Clone, Default)]
struct Facts {
    account: String,
    currency: String,
    amount: i64,
    succeeded: bool,
    settled: bool,
    refunds: Vec<i64>,
}

impl Facts {
    fn net(&self) -> i64 {
        self.amount - self.refunds.iter().sum::<i64>()
    }
}

/// Available and pending per currency.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Funds {
    available: BTreeMap<String, i64>,
    pending: BTreeMap<String, i64>,
}

/// Checks the settlements; takes the inbox records out of `records` (they belong to no
/// charge's key). See the [module documentation](self).
pub(super) async fn check_settlements(
    pool: &PgPool,
    verdict: &mut Verdict,
    log: &Log,
    observed: &[Observed],
    addrs: &Addrs,
    records: &mut HashMap<[u8; 16], RecordRow>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    figures(&mut verdict.webhooks, log);
    let mut inbox = read_inbox(pool).await?;
    verdict.webhooks.inbox_records = inbox.len() as u64;
    let facts = read_facts(pool).await?;
    for event in &log.events {
        records.remove(&inbox_key(&event.id));
    }
    let settled = check_events(verdict, log, &mut inbox);
    check_charges(verdict, &facts, &settled);
    let mut accounts = BTreeMap::new();
    for charge in observed {
        let account = Account::from_api_key(&charge.plan.api_key);
        accounts.insert(account.as_str().to_owned(), charge.plan.api_key.clone());
    }
    let expected = expected_balances(&facts, &settled);
    check_balances(verdict, &accounts, &expected, addrs).await?;
    Ok(())
}

fn figures(w: &mut WebhookVerdict, log: &Log) {
    let get =
        |counter: &std::sync::atomic::AtomicU64| counter.load(std::sync::atomic::Ordering::Relaxed);
    let kinds = |kind| log.events.iter().filter(|e| e.kind == kind).count() as u64;
    let s = &log.stats;
    *w = WebhookVerdict {
        settle_percent: log.settle_percent,
        offered: log.offered,
        events: log.events.len() as u64,
        second_events: kinds(EventKind::Second),
        unknown_events: kinds(EventKind::UnknownCharge),
        copies: log.events.iter().map(|e| e.copies.len() as u64).sum(),
        deliveries: get(&s.deliveries),
        retries: get(&s.retries),
        connection_errors: get(&s.connection_errors),
        timeouts: get(&s.timeouts),
        server_errors: get(&s.server_errors),
        conflicts: get(&s.conflicts),
        peak_at_once: get(&s.peak_at_once),
        all_at_once: get(&s.all_at_once),
        sender_failures: log.failures,
        ..WebhookVerdict::default()
    };
}

/// The first 16 bytes of the inbox's key for `event` (the store keeps them, as a `uuid`):
/// tower-idempotency's key for `Once` (`ScopeKey::off_request`), rebuilt here. Were it wrong,
/// every event answered `2xx` would miss its record and the run would fail.
fn inbox_key(event: &str) -> [u8; 16] {
    let mut hasher = Sha256::new();
    hasher.update(b"tower-idempotency/scope/once/v1\0");
    for part in [SCOPE.as_bytes(), event.as_bytes()] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    let digest = hasher.finalize();
    let mut key = [0; 16];
    key.copy_from_slice(&digest[..16]);
    key
}

/// The inbox's completed records: their key, and their result (`None`: not a `200` of JSON).
async fn read_inbox(pool: &PgPool) -> Result<HashMap<[u8; 16], Option<Value>>, sqlx::Error> {
    let mut inbox = HashMap::new();
    for row in sqlx::query(INBOX).fetch_all(pool).await? {
        let key: Vec<u8> = row.try_get("key")?;
        let status: Option<i16> = row.try_get("status")?;
        let body: Option<Vec<u8>> = row.try_get("body")?;
        let result = body
            .filter(|_| status == Some(200))
            .and_then(|body| serde_json::from_slice(&body).ok());
        if let Ok(key) = <[u8; 16]>::try_from(key) {
            inbox.insert(key, result);
        }
    }
    Ok(inbox)
}

/// Every charge row, with its refund rows' amounts.
async fn read_facts(pool: &PgPool) -> Result<HashMap<String, Facts>, sqlx::Error> {
    let mut facts = HashMap::new();
    for row in sqlx::query(CHARGES).fetch_all(pool).await? {
        let charge = Facts {
            account: row.try_get("account")?,
            currency: row.try_get("currency")?,
            amount: row.try_get("amount")?,
            succeeded: row.try_get("succeeded")?,
            settled: row.try_get("settled")?,
            refunds: Vec::new(),
        };
        facts.insert(row.try_get("id")?, charge);
    }
    for row in sqlx::query(REFUNDS).fetch_all(pool).await? {
        let charge: String = row.try_get("charge")?;
        facts
            .entry(charge)
            .or_default()
            .refunds
            .push(row.try_get("amount")?);
    }
    Ok(facts)
}

/// Each event's copies and inbox record; returns, by charge, the settlement each of its events
/// answered `2xx` got.
fn check_events(
    verdict: &mut Verdict,
    log: &Log,
    inbox: &mut HashMap<[u8; 16], Option<Value>>,
) -> HashMap<String, Vec<Value>> {
    let mut settled: HashMap<String, Vec<Value>> = HashMap::new();
    for event in &log.events {
        let record = inbox.remove(&inbox_key(&event.id));
        let what = format!(
            "event {} ({:?}) of charge {} ({})",
            event.id, event.kind, event.charge, event.api_key
        );
        let answered = check_copies(verdict, event, &what);
        if event.kind == EventKind::UnknownCharge {
            if record.is_some() {
                verdict.webhooks.inbox_mismatches += 1;
                verdict.example(
                    "inbox mismatch",
                    format!("{what}: 404, yet an inbox record"),
                );
            }
            continue;
        }
        let Some(settlement) = answered else { continue };
        if record.as_ref() != Some(&Some(settlement.clone())) {
            verdict.webhooks.inbox_mismatches += 1;
            verdict.example(
                "inbox mismatch",
                format!("{what}: answered {settlement}; its inbox record: {record:?}"),
            );
        }
        settled
            .entry(event.charge.clone())
            .or_default()
            .push(settlement);
    }
    if !inbox.is_empty() {
        verdict.webhooks.inbox_mismatches += inbox.len() as u64;
        verdict.example(
            "inbox mismatch",
            format!("{} inbox record(s) of no event sent", inbox.len()),
        );
    }
    settled
}

/// The copies of `event`: each resolved, with the answer it should get; returns the
/// settlement of a known charge's event answered `2xx` (the same by every copy).
fn check_copies(verdict: &mut Verdict, event: &Event, what: &str) -> Option<Value> {
    let unknown = event.kind == EventKind::UnknownCharge;
    let mut first: Option<&bytes::Bytes> = None;
    for copy in &event.copies {
        let (status, body) = match copy {
            Outcome::Unresolved { attempts, last } => {
                verdict.webhooks.unresolved_copies += 1;
                let text = format!("{what}: no final answer after {attempts} attempts ({last})");
                verdict.example("unresolved webhook copy", text);
                continue;
            }
            Outcome::Answered { status, body } => (*status, body),
        };
        verdict.webhooks.not_found += u64::from(status == http::StatusCode::NOT_FOUND);
        let expected = if unknown {
            status == http::StatusCode::NOT_FOUND
                && code(body).as_deref() == Some("resource_missing")
        } else {
            status.is_success() && first.is_none_or(|first| first == body)
        };
        if !expected {
            verdict.webhooks.unexpected_answers += 1;
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            let excerpt = text.split_whitespace().collect::<Vec<_>>().join(" ");
            verdict.example(
                "unexpected webhook answer",
                format!("{what}: {status} {excerpt}"),
            );
        } else if !unknown {
            first.get_or_insert(body);
        }
    }
    let settlement = first
        .and_then(|body| serde_json::from_slice::<Value>(body).ok())
        .and_then(|mut json| json.get_mut("settlement").map(Value::take));
    if first.is_some() && settlement.is_none() {
        verdict.webhooks.unexpected_answers += 1;
        verdict.example(
            "unexpected webhook answer",
            format!("{what}: a 2xx without a settlement"),
        );
    }
    settlement
}

/// The `error.code` of a Stripe error body.
fn code(body: &[u8]) -> Option<String> {
    let json: Value = serde_json::from_slice(body).ok()?;
    Some(json.get("error")?.get("code")?.as_str()?.to_owned())
}

/// Each charge's `settled` mark against its events, and what its settlement added.
fn check_charges(
    verdict: &mut Verdict,
    facts: &HashMap<String, Facts>,
    settled: &HashMap<String, Vec<Value>>,
) {
    for (charge, outcomes) in settled {
        if !facts.contains_key(charge) {
            verdict.webhooks.settlement_mismatches += 1;
            let text = format!("charge {charge}: settled by {outcomes:?}, but it has no row");
            verdict.example("settlement mismatch", text);
        }
    }
    for (charge, facts) in facts {
        let outcomes = settled.get(charge).map_or(&[][..], Vec::as_slice);
        let by_settling: Vec<&Value> = outcomes
            .iter()
            .filter(|outcome| outcome["outcome"] == "settled")
            .collect();
        count_settled(&mut verdict.webhooks, facts, outcomes, &by_settling);
        if by_settling.len() > 1 {
            verdict.webhooks.double_settlements += by_settling.len() as u64 - 1;
            let text = format!(
                "charge {charge}: settled by {} events: {outcomes:?}",
                by_settling.len()
            );
            verdict.example("double settlement", text);
        }
        if let Some(wrong) = settlement_wrong(facts, outcomes, &by_settling) {
            verdict.webhooks.settlement_mismatches += 1;
            verdict.example("settlement mismatch", format!("charge {charge}: {wrong}"));
        }
    }
}

/// The figures of a settled charge: refunded, before or after its settlement, sent twice.
fn count_settled(w: &mut WebhookVerdict, facts: &Facts, outcomes: &[Value], by: &[&Value]) {
    if outcomes.is_empty() {
        return;
    }
    w.settled_charges += 1;
    w.settled_refunded += u64::from(!facts.refunds.is_empty());
    w.settled_twice_sent += u64::from(outcomes.len() > 1);
    if let Some(added) = by.first().and_then(|settled| settled["amount"].as_i64()) {
        w.refunded_before += u64::from(added < facts.amount);
        w.refunded_after += u64::from(added > facts.net());
    }
}

/// What is wrong with a charge's settlement, if anything: marked settled exactly when an event
/// was answered `2xx`, by one that says `settled`, of an amount its refunds explain.
fn settlement_wrong(facts: &Facts, outcomes: &[Value], by_settling: &[&Value]) -> Option<String> {
    if facts.settled == outcomes.is_empty() {
        return Some(format!(
            "marked settled: {}; answered: {outcomes:?}",
            facts.settled
        ));
    }
    if !outcomes.is_empty() && by_settling.is_empty() {
        return Some(format!("no event settled it: {outcomes:?}"));
    }
    let wrong = by_settling
        .iter()
        .find(|outcome| !settles_as_defined(facts, outcome))?;
    Some(format!(
        "settled {wrong}; the charge is {} {} with refunds {:?}",
        facts.amount, facts.currency, facts.refunds
    ))
}

/// Whether `settlement` added the charge's amount less the refunds made before it: some of its
/// refund rows (the order is not known here, so any subset of them).
fn settles_as_defined(facts: &Facts, settlement: &Value) -> bool {
    let Some(added) = settlement["amount"].as_i64() else {
        return false;
    };
    if settlement["currency"] != facts.currency.as_str() || !facts.succeeded {
        return false;
    }
    let refunds = &facts.refunds[..facts.refunds.len().min(12)];
    (0_u32..1 << refunds.len()).any(|subset| {
        let before: i64 = (0..refunds.len())
            .filter(|i| subset & (1 << i) != 0)
            .map(|i| refunds[i])
            .sum();
        facts.amount - before == added
    })
}

/// Each account's funds, from the rows: a succeeded charge's amount less its refunds, in
/// available if settled by an event answered `2xx`, else in pending.
fn expected_balances(
    facts: &HashMap<String, Facts>,
    settled: &HashMap<String, Vec<Value>>,
) -> BTreeMap<String, Funds> {
    let mut balances: BTreeMap<String, Funds> = BTreeMap::new();
    for (charge, facts) in facts.iter().filter(|(_, facts)| facts.succeeded) {
        let funds = balances.entry(facts.account.clone()).or_default();
        let into = if settled.contains_key(charge) {
            &mut funds.available
        } else {
            &mut funds.pending
        };
        *into.entry(facts.currency.clone()).or_default() += facts.net();
    }
    for funds in balances.values_mut() {
        funds.available.retain(|_, amount| *amount != 0);
        funds.pending.retain(|_, amount| *amount != 0);
    }
    balances
}

/// Reads every account's balance on every instance and compares it with `expected`.
async fn check_balances(
    verdict: &mut Verdict,
    accounts: &BTreeMap<String, String>,
    expected: &BTreeMap<String, Funds>,
    addrs: &Addrs,
) -> Result<(), reqwest::Error> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_secs(10))
        .build()?;
    for (account, api_key) in accounts {
        verdict.webhooks.accounts += 1;
        let want = expected.get(account).cloned().unwrap_or_default();
        for instance in 0..INSTANCES {
            verdict.webhooks.balance_reads += 1;
            let got = read_balance(&http, addrs, instance, api_key).await;
            if got.as_ref().ok() != Some(&want) {
                verdict.webhooks.balance_mismatches += 1;
                let text = format!(
                    "account {account} on instance {}: expected {want:?}, got {got:?}",
                    crate::instance::NAMES[instance]
                );
                verdict.example("balance mismatch", text);
            }
        }
    }
    Ok(())
}

/// `GET /v1/balance` as `api_key` on `instance` (a few tries: it may be starting again).
async fn read_balance(
    http: &reqwest::Client,
    addrs: &Addrs,
    instance: usize,
    api_key: &str,
) -> Result<Funds, String> {
    let mut last = String::new();
    for _ in 0..5 {
        let url = format!("http://{}/v1/balance", addrs.get(instance));
        match http.get(url).bearer_auth(api_key).send().await {
            Ok(response) if response.status().is_success() => {
                let json: Value = response.json().await.map_err(|e| e.to_string())?;
                return funds(&json).ok_or_else(|| format!("not a balance: {json}"));
            }
            Ok(response) => last = response.status().to_string(),
            Err(error) => last = error.to_string(),
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    Err(last)
}

/// A balance's available and pending per currency, without zeros.
fn funds(json: &Value) -> Option<Funds> {
    let side = |name: &str| -> Option<BTreeMap<String, i64>> {
        let mut amounts = BTreeMap::new();
        for entry in json.get(name)?.as_array()? {
            let amount = entry.get("amount")?.as_i64()?;
            if amount != 0 {
                amounts.insert(entry.get("currency")?.as_str()?.to_owned(), amount);
            }
        }
        Some(amounts)
    };
    (json.get("object")? == "balance").then_some(())?;
    Some(Funds {
        available: side("available")?,
        pending: side("pending")?,
    })
}

#[cfg(test)]
#[path = "balances_tests.rs"]
mod tests;
