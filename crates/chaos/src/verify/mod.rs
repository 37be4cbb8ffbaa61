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
//! | settled once, balances right | every account's balance equals its rows for the charges whose `charge.settled` webhooks were answered `2xx`, no charge settled twice, each such event has its inbox record; see [`balances`] |
//! | refused only when it had to be | a refund is refused (`400 amount_too_large` or `charge_already_refunded`) only when sent at once with another refund of the charge that left it too little (else a *refund mismatch*, or an *unexpected answer* for any other refusal) |
//!
//! A charge whose handler caught a database error ([`catch`](crate::catch)) must leave nothing:
//! no row (any is a double execution), no record (else a stored-record mismatch), and every
//! answer, the resend's included, is that handler's `402`, fresh (else an unexpected answer).
//!
//! A refund's answers are held to a charge's rules (the same bytes every time, at most one fresh
//! `200`, its stored record the answer delivered), but for a refusal: a `400` is never stored,
//! so each send of a refused refund runs again, and is refused again, fresh.

mod acknowledged;
pub(crate) mod authorizations;
mod balances;
mod charge;
mod refunds;

use std::collections::HashMap;

use charges_demo::auth::Account;
use sqlx::{PgPool, Row};
use tower_idempotency::{IdempotencyKey, Principal, ScopeKey};

pub(crate) use self::balances::WebhookVerdict;
use self::{charge::check_charge, refunds::check_refunds};
use crate::{
    BoxError,
    client::{Answer, Observed},
    instance::Addrs,
    webhooks,
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
    /// Steps mode: the network's authorizations, calls, and calls it answered as replays.
    pub(crate) authorizations: u64,
    pub(crate) network_calls: u64,
    pub(crate) network_replays: u64,
    /// Authorizations beyond the first of a charge, after the returning clients.
    pub(crate) double_authorizations: u64,
    /// Authorizations without a charge once the completer ran (before any client came back).
    pub(crate) orphaned_authorizations: u64,
    /// Authorizations of another amount than their charge's.
    pub(crate) authorization_mismatches: u64,
    /// Logical charges whose client went away, and came back after the run.
    pub(crate) abandoned: u64,
    /// Steps mode: answers are fresh again when a takeover resumes from the recorded steps.
    pub(crate) steps_mode: bool,
    /// Logical charges and refunds answered fresh more than once so, the same bytes each time.
    pub(crate) resumed_fresh: u64,
    /// Answers clients received whose record is gone ([`acknowledged`]).
    pub(crate) acknowledged_lost: acknowledged::Lost,

    /// The settlements by webhook ([`balances`]).
    pub(crate) webhooks: balances::WebhookVerdict,

    /// Failure examples by kind, in the order the kinds were first met: up to [`EXAMPLES`]
    /// each, and how many more there were.
    pub(crate) examples: Vec<(&'static str, Vec<String>, u64)>,
}

impl Verdict {
    /// Every invariant, its count, and whether it holds.
    pub(crate) fn invariants(&self) -> [(&'static str, u64); 25] {
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
            ("double authorizations", self.double_authorizations),
            ("orphaned authorizations", self.orphaned_authorizations),
            ("authorization mismatches", self.authorization_mismatches),
            ("acknowledged records lost", self.acknowledged_lost.records),
        ]
    }

    pub(crate) fn passed(&self) -> bool {
        let settlements = self.webhooks.invariants();
        self.invariants()
            .iter()
            .chain(&settlements)
            .all(|(_, count)| *count == 0)
    }

    /// A logical request answered fresh more than once (its answers' bytes are checked apart).
    /// In steps mode a takeover resumed from the recorded steps does so, having run no step
    /// twice; otherwise it is a second execution.
    fn fresh_again(&mut self, what: &str) {
        if self.steps_mode {
            self.resumed_fresh += 1;
        } else {
            self.fresh_twice += 1;
            self.example("answered fresh twice", what.to_owned());
        }
    }

    pub(crate) fn example(&mut self, kind: &'static str, text: String) {
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

/// Checks `observed`, and the settlements `webhooks` made, against the database (and the
/// instances at `addrs`, for the balances), adding to `verdict` (which may hold the network's
/// tally already).
pub(crate) async fn verify(
    pool: &PgPool,
    observed: &[Observed],
    mut verdict: Verdict,
    webhooks: &webhooks::Log,
    addrs: &Addrs,
) -> Result<Verdict, BoxError> {
    let (mut refund_rows, refunded) = read_refunds(pool, &mut verdict).await?;
    let mut rows = read_charges(pool, &mut verdict, &refunded).await?;
    let mut records = read_records(pool, &mut verdict).await?;
    verdict.open_transactions = open_transactions(pool).await?;
    if verdict.stuck_keys > 0 {
        let text = format!(
            "{} idempotency record(s) still in flight (status IS NULL), {} of them past their \
             lease",
            verdict.stuck_keys, verdict.stuck_past_lease
        );
        verdict.example("stuck key", text);
    }

    balances::check_settlements(pool, &mut verdict, webhooks, observed, addrs, &mut records)
        .await?;
    for charge in observed {
        check_charge(&mut verdict, charge, &mut rows, &mut records);
        check_refunds(&mut verdict, charge, &mut refund_rows, &mut records);
    }

    leftovers(&mut verdict, refund_rows, rows, records);
    Ok(verdict)
}

/// The refund rows by logical refund, and the sum refunded of each charge.
async fn read_refunds(
    pool: &PgPool,
    verdict: &mut Verdict,
) -> Result<(HashMap<String, Vec<RefundRow>>, HashMap<String, i64>), sqlx::Error> {
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
    Ok((refund_rows, refunded))
}

/// The charge rows by logical charge, each checked against its refunds' sum.
async fn read_charges(
    pool: &PgPool,
    verdict: &mut Verdict,
    refunded: &HashMap<String, i64>,
) -> Result<HashMap<String, Vec<ChargeRow>>, sqlx::Error> {
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
    Ok(rows)
}

/// The records by the first 16 bytes of their key, counting those in flight.
async fn read_records(
    pool: &PgPool,
    verdict: &mut Verdict,
) -> Result<HashMap<[u8; 16], RecordRow>, sqlx::Error> {
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
    Ok(records)
}

/// What no logical charge or refund took: phantom rows and orphan records.
fn leftovers(
    verdict: &mut Verdict,
    refund_rows: HashMap<String, Vec<RefundRow>>,
    rows: HashMap<String, Vec<ChargeRow>>,
    records: HashMap<[u8; 16], RecordRow>,
) {
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
#[cfg(test)]
mod tests;
