use bytes::Bytes;
use http::StatusCode;
use sha2::{Digest, Sha256};

use super::*;
use crate::{
    catch,
    client::{Answer, ObservedRefund, Plan, RefundPlan},
};

const KEY: &str = "5c2a5c1e-7f1e-4d0c-9a55-0b9b8f0a6c11";

fn plan(caught_error: bool) -> Plan {
    Plan {
        api_key: "sk_test_chaos_00".to_owned(),
        key: KEY.to_owned(),
        order_id: "1-0-1".to_owned(),
        amount: 100,
        declined: false,
        caught_error,
        abandon: false,
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
        abandoned: false,
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
            ("stored-record mismatches", 1),
            ("acknowledged records lost", 1)
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
            .position(|r| r.answers.first().and_then(|a| a.object_id.as_deref()) == Some(&row.id))
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

/// In steps mode a second fresh answer (of the same bytes, checked apart) is a takeover that
/// resumed from the recorded steps; in transactional mode it is a second execution.
#[test]
fn a_second_fresh_answer_fails_only_outside_steps_mode() {
    let mut transactional = Verdict::default();
    transactional.fresh_again("order 1");
    assert_eq!(transactional.fresh_twice, 1);
    assert!(!transactional.passed());
    let mut steps = Verdict {
        steps_mode: true,
        ..Verdict::default()
    };
    steps.fresh_again("order 1");
    assert_eq!((steps.fresh_twice, steps.resumed_fresh), (0, 1));
    assert!(steps.passed());
}
