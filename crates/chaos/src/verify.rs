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
//!
//! A charge whose handler caught a database error ([`catch`](crate::catch)) must leave nothing:
//! no row (any is a double execution), no record (else a stored-record mismatch), and every
//! answer, the resend's included, is that handler's `402`, fresh (else an unexpected answer).

use std::collections::HashMap;

use charges_demo::auth::Account;
use http::Method;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};
use tower_idempotency::{IdempotencyKey, Principal, ScopeKey};

use crate::{catch, client::Observed};

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

    /// Failure examples by kind, in the order the kinds were first met: up to [`EXAMPLES`]
    /// each, and how many more there were.
    pub(crate) examples: Vec<(&'static str, Vec<String>, u64)>,
}

impl Verdict {
    /// Every invariant, its count, and whether it holds.
    pub(crate) fn invariants(&self) -> [(&'static str, u64); 14] {
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

    let mut rows: HashMap<String, Vec<ChargeRow>> = HashMap::new();
    for row in sqlx::query(
        "SELECT id, account, status, coalesce(metadata->>'order_id', '') AS order_id FROM charges",
    )
    .fetch_all(pool)
    .await?
    {
        verdict.rows += 1;
        rows.entry(row.try_get("order_id")?)
            .or_default()
            .push(ChargeRow {
                id: row.try_get("id")?,
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
    let record = IdempotencyKey::new(plan.key.clone()).ok().and_then(|key| {
        let scope = ScopeKey::new(
            &Principal::new(account.as_str()).ok()?,
            &Method::POST,
            "/v1/charges",
            &key,
        );
        // The store keeps the first 128 bits of the scope key (a `uuid`).
        records.remove(&scope.as_bytes()[..16])
    });
    let charge_rows = rows.remove(&plan.order_id).unwrap_or_default();
    let answers = &charge.answers;
    let seen = answers
        .iter()
        .map(|a| {
            format!(
                "{}{} {}",
                a.status.as_u16(),
                if a.replayed { " (replay)" } else { "" },
                a.charge_id.as_deref().unwrap_or("-")
            )
        })
        .collect::<Vec<_>>()
        .join(", ");

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
        if first.charge_id.as_deref() != Some(row.id.as_str())
            || row.account != account.as_str()
            || row.status != status
        {
            verdict.id_mismatches += 1;
            let text = format!(
                "{what}: the answer names {:?}; the row is {} ({}, {}), expected ({}, {status})",
                first.charge_id,
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
    use crate::client::{Answer, Plan};

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
            let scope = ScopeKey::new(
                &Principal::new(account.as_str()).unwrap(),
                &Method::POST,
                "/v1/charges",
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
}
