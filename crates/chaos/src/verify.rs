//! The checks, once every client has its final answers: the database (the demo's `charges`
//! table and `idempotency.records`) against what every client saw.
//!
//! | invariant | how it is checked |
//! |---|---|
//! | exactly once | one `charges` row per logical charge (`metadata->>'order_id'`); every row beyond it is a *double execution* |
//! | nothing lost | every logical charge has its row and a final answer for every sender (else *lost* / *unresolved*) |
//! | replays are verbatim | every final answer for a key has the same status and body bytes (else a *body mismatch*), and at most one of them is not marked `Idempotent-Replayed` |
//! | the answer is the charge | the charge id in the body (`id`, or `error.charge` of a decline) is the row's, for the right account and status |
//! | the stored response is the one delivered | the key's `idempotency.records` row has the answer's status and a body with the same SHA-256 |
//! | nothing stuck | no record is left in flight (`status IS NULL`; in transactional mode no such row is ever committed) and no transaction is left open |
//! | nothing else | no charge row and no record belongs to no logical charge |
//! | never refunded past the charge | no charge's `amount_refunded` exceeds its `amount` (*over-refunded*), and it is the sum of its refund rows (else a *refund sum off*) |
//! | each refund exactly once | one `refunds` row per logical refund answered `200` (by `metadata->>'refund_id'`; every row beyond it is a *double refund*), of the amount, charge and id the answer names; none for one refused (else a *refund mismatch*); no row of no logical refund (*phantom refund rows*) |
//! | a failed read while waiting is a `409` | no sender of a charge sent at once (one of them waits for the other's answer) had its first attempt answered `503 StoreUnavailable` while waiting reads failed ([`wait_reads`](crate::wait_reads)); else a *503 for a failed wait read* |
//! | refused only when it had to be | a refund is refused (`400 amount_too_large` or `charge_already_refunded`) only when sent at once with another refund of the charge that left it too little (else a *refund mismatch*, or an *unexpected answer* for any other refusal) |
//!
//! A charge whose handler caught a database error ([`catch`]) must leave nothing:
//! no row (any is a double execution), no record (else a stored-record mismatch), and every
//! answer, the resend's included, is that handler's `402`, fresh (else an unexpected answer).
//!
//! A refund's answers are held to a charge's rules (the same bytes every time, at most one fresh
//! `200`, its stored record the answer delivered), but for a refusal: a `400` is never stored,
//! so each send of a refused refund runs again, and is refused again, fresh.

use std::collections::HashMap;

use charges_demo::auth::Account;
use http::StatusCode;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};
use tower_idempotency::{IdempotencyKey, Principal, ScopeKey};

use crate::{
    catch,
    client::{Answer, Observed, ObservedRefund},
};

/// How many failure examples of each kind the report shows.
const EXAMPLES: usize = 5;

/// The outcome of the checks.
#[derive(Debug, Default)]
pub(crate) struct Verdict {
    pub(crate) charges: u64,
    pub(crate) parallel: u64,
    pub(crate) resent: u64,
    pub(crate) declined: u64,
    /// Logical charges whose handler caught a database error, and the answers they got.
    pub(crate) caught: u64,
    pub(crate) caught_answers: u64,
    pub(crate) rows: u64,
    pub(crate) records: u64,
    /// Logical refunds, those sent at once with another, resent, and refused; refund rows.
    pub(crate) refunds: u64,
    pub(crate) refunds_parallel: u64,
    pub(crate) refunds_resent: u64,
    pub(crate) refunds_refused: u64,
    pub(crate) refund_rows: u64,
    /// Logical charges refunded (once or twice at once), and the sum of the refund rows.
    pub(crate) refunded_charges: u64,
    pub(crate) refunded_amount: i64,
    /// Completed records whose claim took over a lapsed lease.
    pub(crate) takeover_records: u64,

    /// Charge rows beyond the first of a logical charge.
    pub(crate) double_executions: u64,
    /// Logical charges answered as a fresh execution (not a replay) more than once.
    pub(crate) fresh_twice: u64,
    /// Logical charges without a charge row.
    pub(crate) lost: u64,
    /// Logical charges a sender of which got no final answer before the deadline.
    pub(crate) unresolved: u64,
    /// Records in flight (`status IS NULL`) after the run, and of them those past their lease.
    pub(crate) stuck_keys: u64,
    pub(crate) stuck_past_lease: u64,
    /// Transactions still open on the database after the run.
    pub(crate) open_transactions: u64,
    /// Logical charges whose final answers differ in status or body bytes.
    pub(crate) body_mismatches: u64,
    /// Logical charges whose answer names another charge than their row (or the wrong
    /// account or status).
    pub(crate) id_mismatches: u64,
    /// Logical charges whose stored record is missing or differs from the answer delivered.
    pub(crate) record_mismatches: u64,
    /// Logical charges with a final answer of an unexpected status (a 4xx other than 402).
    pub(crate) unexpected_answers: u64,
    /// Charge rows of no logical charge.
    pub(crate) phantom_rows: u64,
    /// Records of no logical charge.
    pub(crate) orphan_records: u64,
    /// Client tasks that failed or did not finish.
    pub(crate) client_failures: u64,
    /// Charges whose `amount_refunded` exceeds their `amount`.
    pub(crate) over_refunded: u64,
    /// Charges whose `amount_refunded` is not the sum of their refund rows.
    pub(crate) refund_sums_off: u64,
    /// Refund rows beyond one per logical refund answered `200`, or of a refused one.
    pub(crate) double_refunds: u64,
    /// Logical refunds whose row is missing or differs from the answer, or that were refused
    /// while enough was left.
    pub(crate) refund_mismatches: u64,
    /// Logical refunds a sender of which got no final answer before the deadline.
    pub(crate) unresolved_refunds: u64,
    /// Refund rows of no logical refund.
    pub(crate) phantom_refund_rows: u64,
    /// First attempts of charges sent at once answered `503` while waiting reads failed.
    pub(crate) wait_read_503s: u64,

    /// Failure examples by kind, in the order the kinds were first met: up to [`EXAMPLES`]
    /// each, and how many more there were.
    pub(crate) examples: Vec<(&'static str, Vec<String>, u64)>,
}

impl Verdict {
    /// Every invariant, its count, and whether it holds.
    pub(crate) fn invariants(&self) -> [(&'static str, u64); 21] {
        [
            ("double executions", self.double_executions),
            ("answered fresh twice", self.fresh_twice),
            ("lost charges", self.lost),
            ("unresolved charges", self.unresolved),
            ("stuck keys", self.stuck_keys),
            ("open transactions", self.open_transactions),
            ("body mismatches", self.body_mismatches),
            ("charge id mismatches", self.id_mismatches),
            ("stored-record mismatches", self.record_mismatches),
            ("unexpected answers", self.unexpected_answers),
            ("phantom charge rows", self.phantom_rows),
            ("orphan records", self.orphan_records),
            ("client failures", self.client_failures),
            ("stuck keys past their lease", self.stuck_past_lease),
            ("over-refunded charges", self.over_refunded),
            ("refund sums off", self.refund_sums_off),
            ("double refunds", self.double_refunds),
            ("refund mismatches", self.refund_mismatches),
            ("unresolved refunds", self.unresolved_refunds),
            ("phantom refund rows", self.phantom_refund_rows),
            ("503s for failed wait reads", self.wait_read_503s),
        ]
    }

    pub(crate) fn passed(&self) -> bool {
        self.invariants().iter().all(|(_, count)| *count == 0)
    }

    fn example(&mut self, kind: &'static str, text: String) {
        let index = match self.examples.iter().position(|(k, _, _)| *k == kind) {
            Some(index) => index,
            None => {
                self.examples.push((kind, Vec::new(), 0));
                self.examples.len() - 1
            }
        };
        let (_, shown, more) = &mut self.examples[index];
        if shown.len() < EXAMPLES {
            shown.push(text);
        } else {
            *more += 1;
        }
    }
}

/// The records, reduced to what the checks compare (each key as its 16 bytes).
const RECORDS: &str =
    "SELECT uuid_send(scope_key) AS scope_key, status, sha256(body) AS body_sha256, takeover,
        status IS NULL AND lease_until < now() AS lapsed
    FROM idempotency.records";

struct ChargeRow {
    id: String,
    account: String,
    status: String,
}

struct RefundRow {
    id: String,
    account: String,
    charge: String,
    amount: i64,
}

struct RecordRow {
    status: Option<i16>,
    body_sha256: Option<Vec<u8>>,
}

/// Open transactions on the run's database, other than this connection's.
pub(crate) async fn open_transactions(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
           AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(open).unwrap_or(0))
}

/// Checks `observed` against the database.
pub(crate) async fn verify(pool: &PgPool, observed: &[Observed]) -> Result<Verdict, sqlx::Error> {
    let mut verdict = Verdict::default();

    let mut refund_rows: HashMap<String, Vec<RefundRow>> = HashMap::new();
    let mut refunded: HashMap<String, i64> = HashMap::new();
    for row in sqlx::query(
        "SELECT id, account, charge, amount, coalesce(metadata->>'refund_id', '') AS refund_id
         FROM refunds",
    )
    .fetch_all(pool)
    .await?
    {
        verdict.refund_rows += 1;
        let row_of = RefundRow {
            id: row.try_get("id")?,
            account: row.try_get("account")?,
            charge: row.try_get("charge")?,
            amount: row.try_get("amount")?,
        };
        *refunded.entry(row_of.charge.clone()).or_default() += row_of.amount;
        verdict.refunded_amount += row_of.amount;
        refund_rows
            .entry(row.try_get("refund_id")?)
            .or_default()
            .push(row_of);
    }

    let mut rows: HashMap<String, Vec<ChargeRow>> = HashMap::new();
    for row in sqlx::query(
        "SELECT id, account, status, amount, amount_refunded,
                coalesce(metadata->>'order_id', '') AS order_id
         FROM charges",
    )
    .fetch_all(pool)
    .await?
    {
        verdict.rows += 1;
        let id: String = row.try_get("id")?;
        let (amount, amount_refunded): (i64, i64) =
            (row.try_get("amount")?, row.try_get("amount_refunded")?);
        if amount_refunded > amount {
            verdict.over_refunded += 1;
            verdict.example(
                "over-refunded charge",
                format!("charge {id}: {amount_refunded} refunded of {amount}"),
            );
        }
        let sum = refunded.get(&id).copied().unwrap_or(0);
        if sum != amount_refunded {
            verdict.refund_sums_off += 1;
            verdict.example(
                "refund sum off",
                format!(
                    "charge {id}: amount_refunded {amount_refunded}, its refund rows add up to \
                     {sum}"
                ),
            );
        }
        rows.entry(row.try_get("order_id")?)
            .or_default()
            .push(ChargeRow {
                id,
                account: row.try_get("account")?,
                status: row.try_get("status")?,
            });
    }

    let mut records: HashMap<[u8; 16], RecordRow> = HashMap::new();
    // The store's partitioned mode keeps its records in a table of its own: read both.
    let partitioned: bool =
        sqlx::query_scalar("SELECT to_regclass('idempotency.partitioned_records') IS NOT NULL")
            .fetch_one(pool)
            .await?;
    let mut select = String::from(RECORDS);
    if partitioned {
        select.push_str(" UNION ALL ");
        select.push_str(&RECORDS.replace("idempotency.records", "idempotency.partitioned_records"));
    }
    for row in sqlx::query(sqlx::AssertSqlSafe(select))
        .fetch_all(pool)
        .await?
    {
        verdict.records += 1;
        let status: Option<i16> = row.try_get("status")?;
        if row.try_get::<bool, _>("takeover")? {
            verdict.takeover_records += 1;
        }
        if status.is_none() {
            verdict.stuck_keys += 1;
        }
        if row.try_get::<Option<bool>, _>("lapsed")? == Some(true) {
            verdict.stuck_past_lease += 1;
        }
        let key: Vec<u8> = row.try_get("scope_key")?;
        let Ok(key) = <[u8; 16]>::try_from(key) else {
            verdict.orphan_records += 1;
            continue;
        };
        records.insert(
            key,
            RecordRow {
                status,
                body_sha256: row.try_get("body_sha256")?,
            },
        );
    }
    verdict.open_transactions = open_transactions(pool).await?;
    if verdict.stuck_keys > 0 {
        let text = format!(
            "{} idempotency record(s) still in flight (status IS NULL), {} of them past their \
             lease",
            verdict.stuck_keys, verdict.stuck_past_lease
        );
        verdict.example("stuck key", text);
    }

    for charge in observed {
        check_charge(&mut verdict, charge, &mut rows, &mut records);
        check_refunds(&mut verdict, charge, &mut refund_rows, &mut records);
    }

    for (refund_id, phantoms) in refund_rows {
        verdict.phantom_refund_rows += phantoms.len() as u64;
        let ids: Vec<&str> = phantoms.iter().map(|row| row.id.as_str()).collect();
        verdict.example(
            "phantom refund row",
            format!(
                "refund row(s) {ids:?} with refund_id {refund_id:?} belong to no logical refund"
            ),
        );
    }

    for (order_id, phantoms) in rows {
        verdict.phantom_rows += phantoms.len() as u64;
        let ids: Vec<&str> = phantoms.iter().map(|row| row.id.as_str()).collect();
        verdict.example(
            "phantom row",
            format!("charge row(s) {ids:?} with order_id {order_id:?} belong to no logical charge"),
        );
    }
    verdict.orphan_records += records.len() as u64;
    if !records.is_empty() {
        verdict.example(
            "orphan record",
            format!(
                "{} idempotency record(s) belong to no logical charge",
                records.len()
            ),
        );
    }
    Ok(verdict)
}

fn check_charge(
    verdict: &mut Verdict,
    charge: &Observed,
    rows: &mut HashMap<String, Vec<ChargeRow>>,
    records: &mut HashMap<[u8; 16], RecordRow>,
) {
    let plan = &charge.plan;
    let what = format!("order {} (key {})", plan.order_id, plan.key);
    verdict.charges += 1;
    verdict.parallel += u64::from(charge.parallel);
    verdict.resent += u64::from(charge.resent);
    verdict.declined += u64::from(plan.declined);
    verdict.caught += u64::from(plan.caught_error);

    let account = Account::from_api_key(&plan.api_key);
    let record = take_record(records, &account, &plan.key);
    let charge_rows = rows.remove(&plan.order_id).unwrap_or_default();
    let answers = &charge.answers;
    let seen = seen(answers);

    if charge.unresolved > 0 {
        verdict.unresolved += 1;
        verdict.example(
            "unresolved",
            format!(
                "{what}: {} sender(s) got no final answer before the deadline",
                charge.unresolved
            ),
        );
    }
    if charge.wait_read_503s > 0 {
        verdict.wait_read_503s += u64::from(charge.wait_read_503s);
        verdict.example(
            "503 for a failed wait read",
            format!(
                "{what}: sent twice at once, {} first attempt(s) answered 503 StoreUnavailable \
                 while waiting reads failed (a failed read while waiting must answer 409); \
                 the client saw [{seen}] in the end; the key's lock is {}",
                charge.wait_read_503s,
                lock_key(&account, &plan.key).unwrap_or_default()
            ),
        );
    }
    if plan.caught_error {
        check_caught(verdict, charge, &what, &seen, &charge_rows, record.as_ref());
        return;
    }
    match charge_rows.len() {
        0 => {
            verdict.lost += 1;
            verdict.example(
                "lost",
                format!("{what}: no charge row; the client saw [{seen}]"),
            );
        }
        1 => {}
        n => {
            verdict.double_executions += n as u64 - 1;
            let ids: Vec<&str> = charge_rows.iter().map(|row| row.id.as_str()).collect();
            verdict.example(
                "double execution",
                format!("{what}: {n} charge rows {ids:?}; the client saw [{seen}]"),
            );
        }
    }
    let Some(first) = answers.first() else {
        return;
    };
    if answers.iter().any(|a| a.status != plan.expected_status()) {
        verdict.unexpected_answers += 1;
        verdict.example(
            "unexpected answer",
            format!(
                "{what}: expected {}, got [{seen}]: {}",
                plan.expected_status().as_u16(),
                first.excerpt
            ),
        );
    }
    if let Some(other) = answers.iter().find(|a| !a.same_response(first)) {
        verdict.body_mismatches += 1;
        verdict.example(
            "body mismatch",
            format!(
                "{what}: [{seen}]: {:?} vs {:?}",
                first.excerpt, other.excerpt
            ),
        );
    }
    if answers.iter().filter(|a| !a.replayed).count() > 1 {
        verdict.fresh_twice += 1;
        verdict.example("answered fresh twice", format!("{what}: [{seen}]"));
    }
    if let [row] = charge_rows.as_slice() {
        let status = if plan.declined { "failed" } else { "succeeded" };
        if first.object_id.as_deref() != Some(row.id.as_str())
            || row.account != account.as_str()
            || row.status != status
        {
            verdict.id_mismatches += 1;
            let text = format!(
                "{what}: the answer names {:?}; the row is {} ({}, {}), expected ({}, {status})",
                first.object_id,
                row.id,
                row.account,
                row.status,
                account.as_str()
            );
            verdict.example("charge mismatch", text);
        }
    }
    match record {
        None => {
            verdict.record_mismatches += 1;
            verdict.example(
                "stored-record mismatch",
                format!("{what}: the client saw [{seen}] but the key has no stored response"),
            );
        }
        Some(record) => {
            let same_status =
                record.status == Some(i16::try_from(first.status.as_u16()).unwrap_or(0));
            let same_body = record.body_sha256.as_deref() == Some(first.body_sha256.as_slice());
            if !same_status || !same_body {
                verdict.record_mismatches += 1;
                let text = format!(
                    "{what}: the stored response has status {:?}, the same body: {same_body}; \
                     the client saw [{seen}]",
                    record.status
                );
                verdict.example("stored-record mismatch", text);
            }
        }
    }
}

/// The record of `key` sent by `account`, taken out of `records`. Keys reach across endpoints
/// (the demo's scope), so a charge's and a refund's are found alike.
fn take_record(
    records: &mut HashMap<[u8; 16], RecordRow>,
    account: &Account,
    key: &str,
) -> Option<RecordRow> {
    let key = IdempotencyKey::new(key.to_owned()).ok()?;
    let scope = ScopeKey::for_principal(&Principal::new(account.as_str()).ok()?, &key);
    // The store keeps the first 128 bits of the scope key (a `uuid`).
    records.remove(&scope.as_bytes()[..16])
}

/// The advisory lock of `key` sent by `account` in the store's transactional mode (the first
/// 64 bits of its scope key), which the database's messages about it name.
fn lock_key(account: &Account, key: &str) -> Option<i64> {
    let key = IdempotencyKey::new(key.to_owned()).ok()?;
    let scope = ScopeKey::for_principal(&Principal::new(account.as_str()).ok()?, &key);
    Some(i64::from_be_bytes(scope.as_bytes()[..8].try_into().ok()?))
}

/// Answers as the report shows them: status, replay, the object they name.
fn seen(answers: &[Answer]) -> String {
    answers
        .iter()
        .map(|a| {
            format!(
                "{}{} {}",
                a.status.as_u16(),
                if a.replayed { " (replay)" } else { "" },
                a.object_id.as_deref().or(a.code.as_deref()).unwrap_or("-")
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The refunds of `charge`; see the [module documentation](self).
fn check_refunds(
    verdict: &mut Verdict,
    charge: &Observed,
    rows: &mut HashMap<String, Vec<RefundRow>>,
    records: &mut HashMap<[u8; 16], RecordRow>,
) {
    let plan = &charge.plan;
    let account = Account::from_api_key(&plan.api_key);
    verdict.refunded_charges += u64::from(!charge.refunds.is_empty());
    // Each refund's outcome, when it has one: the amount refunded, or `None`: refused.
    let mut outcomes: Vec<(&ObservedRefund, Option<i64>)> = Vec::new();
    for refund in &charge.refunds {
        verdict.refunds += 1;
        verdict.refunds_parallel += u64::from(refund.parallel);
        verdict.refunds_resent += u64::from(refund.resent);
        let what = format!(
            "refund {} of order {} (key {})",
            refund.plan.refund_id, plan.order_id, refund.plan.key
        );
        let record = take_record(records, &account, &refund.plan.key);
        let refund_rows = rows.remove(&refund.plan.refund_id).unwrap_or_default();
        let answers = &refund.answers;
        let seen = seen(answers);
        if refund.unresolved > 0 {
            verdict.unresolved_refunds += 1;
            verdict.example(
                "unresolved refund",
                format!(
                    "{what}: {} sender(s) got no final answer before the deadline",
                    refund.unresolved
                ),
            );
        }
        let Some(first) = answers.first() else {
            if refund_rows.len() > 1 {
                verdict.double_refunds += refund_rows.len() as u64 - 1;
                verdict.example(
                    "double refund",
                    format!("{what}: {} rows, and no answer", refund_rows.len()),
                );
            }
            continue;
        };
        if let Some(other) = answers.iter().find(|a| !a.same_response(first)) {
            verdict.body_mismatches += 1;
            verdict.example(
                "body mismatch",
                format!(
                    "{what}: [{seen}]: {:?} vs {:?}",
                    first.excerpt, other.excerpt
                ),
            );
        }
        let refused = first.status == StatusCode::BAD_REQUEST
            && refund.parallel
            && matches!(
                first.code.as_deref(),
                Some("amount_too_large" | "charge_already_refunded")
            );
        if refused {
            verdict.refunds_refused += 1;
            outcomes.push((refund, None));
            if !refund_rows.is_empty() {
                verdict.double_refunds += refund_rows.len() as u64;
                verdict.example(
                    "double refund",
                    format!("{what}: refused, yet {} refund row(s)", refund_rows.len()),
                );
            }
            if let Some(record) = record {
                verdict.record_mismatches += 1;
                verdict.example(
                    "stored-record mismatch",
                    format!(
                        "{what}: a refusal is never stored, but the key has a record (status \
                         {:?}); the client saw [{seen}]",
                        record.status
                    ),
                );
            }
            continue;
        }
        if first.status != StatusCode::OK {
            verdict.unexpected_answers += 1;
            verdict.example(
                "unexpected answer",
                format!("{what}: [{seen}]: {}", first.excerpt),
            );
            continue;
        }
        outcomes.push((refund, first.amount));
        if answers.iter().filter(|a| !a.replayed).count() > 1 {
            verdict.fresh_twice += 1;
            verdict.example("answered fresh twice", format!("{what}: [{seen}]"));
        }
        match refund_rows.as_slice() {
            [] => {
                verdict.refund_mismatches += 1;
                verdict.example(
                    "refund mismatch",
                    format!("{what}: answered [{seen}], but no refund row"),
                );
            }
            [row] => {
                let asked = refund
                    .plan
                    .amount
                    .is_none_or(|asked| first.amount == Some(asked));
                if first.object_id.as_deref() != Some(row.id.as_str())
                    || first.amount != Some(row.amount)
                    || row.charge != refund.plan.charge_id
                    || row.account != account.as_str()
                    || !asked
                {
                    verdict.refund_mismatches += 1;
                    verdict.example(
                        "refund mismatch",
                        format!(
                            "{what}: asked {:?} of {}, answered {:?} of {:?}; the row is {} of {} \
                             ({}, {})",
                            refund.plan.amount,
                            refund.plan.charge_id,
                            first.object_id,
                            first.amount,
                            row.id,
                            row.amount,
                            row.charge,
                            row.account
                        ),
                    );
                }
            }
            more => {
                verdict.double_refunds += more.len() as u64 - 1;
                let ids: Vec<&str> = more.iter().map(|row| row.id.as_str()).collect();
                verdict.example(
                    "double refund",
                    format!(
                        "{what}: {} refund rows {ids:?}; the client saw [{seen}]",
                        more.len()
                    ),
                );
            }
        }
        let stored = record.as_ref().is_some_and(|record| {
            record.status == Some(200)
                && record.body_sha256.as_deref() == Some(first.body_sha256.as_slice())
        });
        if !stored {
            verdict.record_mismatches += 1;
            verdict.example(
                "stored-record mismatch",
                format!(
                    "{what}: the client saw [{seen}]; the key's record: {:?}",
                    record.map(|record| record.status)
                ),
            );
        }
    }
    // Of two refunds sent at once, one is refused only if the other left it too little.
    if let [(a, a_took), (b, b_took)] = outcomes.as_slice() {
        for (refused, took, other_took) in [(a, a_took, b_took), (b, b_took, a_took)] {
            if took.is_some() {
                continue;
            }
            let wrongly = match other_took {
                None => true,
                Some(took) => {
                    let left = plan.amount - took;
                    refused.plan.amount.map_or(left > 0, |asked| asked <= left)
                }
            };
            if wrongly {
                verdict.refund_mismatches += 1;
                verdict.example(
                    "refund mismatch",
                    format!(
                        "refund {} of order {}: asked {:?} of {}, refused though the other \
                         refund took {other_took:?}",
                        refused.plan.refund_id, plan.order_id, refused.plan.amount, plan.amount
                    ),
                );
            }
        }
    }
}

/// A charge whose handler caught a database error; see the [module documentation](self).
fn check_caught(
    verdict: &mut Verdict,
    charge: &Observed,
    what: &str,
    seen: &str,
    rows: &[ChargeRow],
    record: Option<&RecordRow>,
) {
    verdict.caught_answers += charge.answers.len() as u64;
    if !rows.is_empty() {
        verdict.double_executions += rows.len() as u64;
        let ids: Vec<&str> = rows.iter().map(|row| row.id.as_str()).collect();
        verdict.example(
            "double execution",
            format!(
                "{what}: its handler's write failed (caught), yet charge rows {ids:?} committed; \
                 the client saw [{seen}]"
            ),
        );
    }
    let expected: [u8; 32] = Sha256::digest(catch::BODY).into();
    if let Some(other) = charge
        .answers
        .iter()
        .find(|a| a.status != catch::STATUS || a.replayed || a.body_sha256 != expected)
    {
        verdict.unexpected_answers += 1;
        verdict.example(
            "unexpected answer",
            format!(
                "{what}: a caught database error is answered {} with its card error, fresh each \
                 time; got [{seen}]: {}",
                catch::STATUS.as_u16(),
                other.excerpt
            ),
        );
    }
    if let Some(record) = record {
        verdict.record_mismatches += 1;
        verdict.example(
            "stored-record mismatch",
            format!(
                "{what}: a caught database error's answer is never stored, but the key has a \
                 record (status {:?}); the client saw [{seen}]",
                record.status
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::StatusCode;

    use super::*;
    use crate::client::{Answer, Plan, RefundPlan};

    const KEY: &str = "5c2a5c1e-7f1e-4d0c-9a55-0b9b8f0a6c11";

    fn plan(caught_error: bool) -> Plan {
        Plan {
            api_key: "sk_test_chaos_00".to_owned(),
            key: KEY.to_owned(),
            order_id: "1-0-1".to_owned(),
            amount: 100,
            declined: false,
            caught_error,
        }
    }

    fn answer(status: StatusCode, replayed: bool, body: &'static str) -> Answer {
        Answer::new(status, replayed, &Bytes::from_static(body.as_bytes()))
    }

    fn caught(replayed: bool) -> Answer {
        answer(catch::STATUS, replayed, catch::BODY)
    }

    fn observed(plan: Plan, answers: Vec<Answer>) -> Observed {
        Observed {
            plan,
            answers,
            unresolved: 0,
            parallel: false,
            resent: true,
            refunds: Vec::new(),
            wait_read_503s: 0,
        }
    }

    /// Checks `charge` against `rows` (its order's) and, if given, the record of its key.
    fn check(charge: &Observed, rows: Vec<ChargeRow>, record: Option<RecordRow>) -> Verdict {
        let mut verdict = Verdict::default();
        let mut rows: HashMap<String, Vec<ChargeRow>> = [(charge.plan.order_id.clone(), rows)]
            .into_iter()
            .filter(|(_, rows)| !rows.is_empty())
            .collect();
        let mut records = HashMap::new();
        if let Some(record) = record {
            let account = Account::from_api_key(&charge.plan.api_key);
            let scope = ScopeKey::for_principal(
                &Principal::new(account.as_str()).unwrap(),
                &IdempotencyKey::new(KEY.to_owned()).unwrap(),
            );
            records.insert(scope.as_bytes()[..16].try_into().unwrap(), record);
        }
        check_charge(&mut verdict, charge, &mut rows, &mut records);
        assert!(records.is_empty(), "the key's record was looked up");
        verdict
    }

    fn row(charge: &Observed) -> ChargeRow {
        ChargeRow {
            id: "ch_1".to_owned(),
            account: Account::from_api_key(&charge.plan.api_key)
                .as_str()
                .to_owned(),
            status: "succeeded".to_owned(),
        }
    }

    fn failed(verdict: &Verdict) -> Vec<(&'static str, u64)> {
        verdict
            .invariants()
            .into_iter()
            .filter(|(_, count)| *count > 0)
            .collect()
    }

    /// A caught error answered fresh by both sends, with no row and no record, is as it must be:
    /// neither lost nor answered fresh twice.
    #[test]
    fn a_caught_error_answered_fresh_twice_and_leaving_nothing_passes() {
        let charge = observed(plan(true), vec![caught(false), caught(false)]);
        let verdict = check(&charge, Vec::new(), None);
        assert_eq!(failed(&verdict), []);
        assert_eq!((verdict.caught, verdict.caught_answers), (1, 2));
    }

    #[test]
    fn a_caught_error_replayed_stored_or_committed_fails() {
        let replayed = observed(plan(true), vec![caught(false), caught(true)]);
        assert_eq!(
            failed(&check(&replayed, Vec::new(), None)),
            [("unexpected answers", 1)]
        );
        let stored = observed(plan(true), vec![caught(false)]);
        let record = RecordRow {
            status: Some(402),
            body_sha256: Some(Sha256::digest(catch::BODY).to_vec()),
        };
        assert_eq!(
            failed(&check(&stored, Vec::new(), Some(record))),
            [("stored-record mismatches", 1)]
        );
        let committed = observed(plan(true), vec![caught(false), caught(false)]);
        let rows = vec![row(&committed)];
        assert_eq!(
            failed(&check(&committed, rows, None)),
            [("double executions", 1)]
        );
        let other_body = observed(
            plan(true),
            vec![answer(catch::STATUS, false, r#"{"error":{}}"#)],
        );
        assert_eq!(
            failed(&check(&other_body, Vec::new(), None)),
            [("unexpected answers", 1)]
        );
    }

    /// The same answers for an ordinary charge are failures: it must have its row and record,
    /// and only its first answer may be fresh.
    #[test]
    fn an_ordinary_charge_answered_fresh_twice_fails() {
        let body = r#"{"id":"ch_1","object":"charge"}"#;
        let charge = observed(
            plan(false),
            vec![
                answer(StatusCode::OK, false, body),
                answer(StatusCode::OK, false, body),
            ],
        );
        let record = RecordRow {
            status: Some(200),
            body_sha256: Some(Sha256::digest(body).to_vec()),
        };
        let rows = vec![row(&charge)];
        assert_eq!(
            failed(&check(&charge, rows, Some(record))),
            [("answered fresh twice", 1)]
        );
        assert_eq!(
            failed(&check(&charge, Vec::new(), None)),
            [
                ("answered fresh twice", 1),
                ("lost charges", 1),
                ("stored-record mismatches", 1)
            ]
        );
    }

    /// A charge sent at once whose waiting sender was turned away with a `503` by a failed read
    /// fails the run, though it ended well.
    #[test]
    fn a_503_after_a_failed_wait_read_fails() {
        let body = r#"{"id":"ch_1","object":"charge"}"#;
        let mut charge = observed(
            plan(false),
            vec![
                answer(StatusCode::OK, false, body),
                answer(StatusCode::OK, true, body),
            ],
        );
        charge.parallel = true;
        let record = || RecordRow {
            status: Some(200),
            body_sha256: Some(Sha256::digest(body).to_vec()),
        };
        assert_eq!(
            failed(&check(&charge, vec![row(&charge)], Some(record()))),
            []
        );
        charge.wait_read_503s = 1;
        assert_eq!(
            failed(&check(&charge, vec![row(&charge)], Some(record()))),
            [("503s for failed wait reads", 1)]
        );
    }

    /// A refund of `amount` (`None`: what is left) of charge `ch_1`, answered so, sent at once
    /// with another when `parallel`.
    fn refund(n: u8, amount: Option<i64>, parallel: bool, answers: Vec<Answer>) -> ObservedRefund {
        ObservedRefund {
            plan: RefundPlan {
                key: format!("5c2a5c1e-7f1e-4d0c-9a55-0b9b8f0a6c2{n}"),
                refund_id: format!("1-0-1-refund{n}"),
                charge_id: "ch_1".to_owned(),
                amount,
            },
            answers,
            unresolved: 0,
            parallel,
            resent: false,
        }
    }

    fn refunded(id: &str, amount: i64) -> (Answer, RefundRow) {
        let body = format!(r#"{{"id":"{id}","object":"refund","amount":{amount}}}"#);
        let answer = Answer::new(StatusCode::OK, false, &Bytes::from(body));
        let row = RefundRow {
            id: id.to_owned(),
            account: Account::from_api_key(&plan(false).api_key)
                .as_str()
                .to_owned(),
            charge: "ch_1".to_owned(),
            amount,
        };
        (answer, row)
    }

    fn too_large() -> Answer {
        answer(
            StatusCode::BAD_REQUEST,
            false,
            r#"{"error":{"code":"amount_too_large","type":"invalid_request_error"}}"#,
        )
    }

    /// Checks the refunds of a charge of 100 against `rows`; each refund answered `200` has its
    /// stored record.
    fn check_refunded(refunds: Vec<ObservedRefund>, rows: Vec<RefundRow>) -> Verdict {
        let mut charge = observed(plan(false), Vec::new());
        let account = Account::from_api_key(&charge.plan.api_key);
        let mut records = HashMap::new();
        for refund in refunds
            .iter()
            .filter(|r| r.answers[0].status == StatusCode::OK)
        {
            let scope = ScopeKey::for_principal(
                &Principal::new(account.as_str()).unwrap(),
                &IdempotencyKey::new(refund.plan.key.clone()).unwrap(),
            );
            let record = RecordRow {
                status: Some(200),
                body_sha256: Some(refund.answers[0].body_sha256.to_vec()),
            };
            records.insert(scope.as_bytes()[..16].try_into().unwrap(), record);
        }
        charge.refunds = refunds;
        let mut by_refund: HashMap<String, Vec<RefundRow>> = HashMap::new();
        for row in rows {
            let n = charge
                .refunds
                .iter()
                .position(|r| {
                    r.answers.first().and_then(|a| a.object_id.as_deref()) == Some(&row.id)
                })
                .unwrap_or(0);
            by_refund
                .entry(charge.refunds[n].plan.refund_id.clone())
                .or_default()
                .push(row);
        }
        let mut verdict = Verdict::default();
        check_refunds(&mut verdict, &charge, &mut by_refund, &mut records);
        assert!(records.is_empty(), "each record was looked up");
        verdict
    }

    #[test]
    fn two_refunds_at_once_of_more_than_the_charge_one_refused_passes() {
        let (done, row) = refunded("re_1", 70);
        let replay = Answer {
            replayed: true,
            ..done.clone()
        };
        let verdict = check_refunded(
            vec![
                refund(0, Some(70), true, vec![done.clone(), replay]),
                refund(1, Some(70), true, vec![too_large(), too_large()]),
            ],
            vec![row],
        );
        assert_eq!(failed(&verdict), []);
        assert_eq!((verdict.refunds, verdict.refunds_refused), (2, 1));
    }

    #[test]
    fn a_refund_refused_while_enough_was_left_fails() {
        let (done, row) = refunded("re_1", 30);
        let verdict = check_refunded(
            vec![
                refund(0, Some(30), true, vec![done]),
                refund(1, Some(70), true, vec![too_large()]),
            ],
            vec![row],
        );
        assert_eq!(failed(&verdict), [("refund mismatches", 1)]);
        // Refused alone, with nothing else to take the charge: wrongly too.
        let alone = check_refunded(vec![refund(0, None, false, vec![too_large()])], Vec::new());
        assert_eq!(failed(&alone), [("unexpected answers", 1)]);
    }

    #[test]
    fn a_refund_written_twice_or_refused_with_a_row_fails() {
        let (done, row) = refunded("re_1", 50);
        let twice = RefundRow {
            id: "re_2".to_owned(),
            ..refunded("re_1", 50).1
        };
        let verdict = check_refunded(
            vec![refund(0, Some(50), false, vec![done.clone()])],
            vec![row, twice],
        );
        assert_eq!(failed(&verdict), [("double refunds", 1)]);

        let (_, left_behind) = refunded("re_3", 70);
        let verdict = check_refunded(
            vec![
                refund(0, Some(50), true, vec![done]),
                refund(1, Some(70), true, vec![too_large()]),
            ],
            vec![refunded("re_1", 50).1, left_behind],
        );
        assert_eq!(failed(&verdict), [("double refunds", 1)]);
    }

    #[test]
    fn a_refund_answered_without_its_row_fails() {
        let (done, _) = refunded("re_1", 50);
        let verdict = check_refunded(vec![refund(0, None, false, vec![done])], Vec::new());
        assert_eq!(failed(&verdict), [("refund mismatches", 1)]);
    }
}
