//! The refunds of one charge against their rows and records; see the
//! [module documentation](super).

use std::collections::HashMap;

use charges_demo::auth::Account;
use http::StatusCode;

use super::{RecordRow, RefundRow, Verdict, acknowledged, seen, take_record};
use crate::client::{Observed, ObservedRefund};

/// The refunds of `charge`; see the [module documentation](self).
pub(super) fn check_refunds(
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
            verdict.fresh_again(&format!("{what}: [{seen}]"));
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
        acknowledged::count(verdict, &what, answers, record.as_ref(), refund_rows.len());
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
