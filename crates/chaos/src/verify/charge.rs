//! One logical charge: its rows, its record and every answer its senders saw; see the
//! [module documentation](super).

use std::collections::HashMap;

use charges_demo::auth::Account;
use sha2::{Digest, Sha256};

use super::{ChargeRow, RecordRow, Verdict, acknowledged, lock_key, seen, take_record};
use crate::{catch, client::Observed};

/// One logical charge against its rows and record; see the [module documentation](super).
pub(super) fn check_charge(
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
    verdict.abandoned += u64::from(charge.abandoned);

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
    acknowledged::count(verdict, &what, answers, record.as_ref(), charge_rows.len());
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
        verdict.fresh_again(&format!("{what}: [{seen}]"));
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
