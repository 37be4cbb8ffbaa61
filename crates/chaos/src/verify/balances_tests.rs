use bytes::Bytes;
use http::StatusCode;
use serde_json::json;

use super::*;

fn facts(amount: i64, refunds: Vec<i64>, settled: bool) -> Facts {
    Facts {
        account: "acct_1".to_owned(),
        currency: "usd".to_owned(),
        amount,
        succeeded: true,
        settled,
        refunds,
    }
}

fn settled(amount: i64) -> Value {
    json!({"outcome": "settled", "amount": amount, "currency": "usd"})
}

fn event(kind: EventKind, copies: Vec<Outcome>) -> Event {
    Event {
        id: "evt_1".to_owned(),
        charge: "ch_1".to_owned(),
        api_key: "sk_test_chaos_00".to_owned(),
        kind,
        copies,
    }
}

fn answered(status: u16, body: &'static str) -> Outcome {
    Outcome::Answered {
        status: StatusCode::from_u16(status).unwrap(),
        body: Bytes::from_static(body.as_bytes()),
    }
}

#[test]
fn a_settlement_adds_the_amount_less_the_refunds_made_before_it() {
    let charge = facts(1_000, vec![300, 200], true);
    for before in [1_000, 700, 800, 500] {
        assert!(settles_as_defined(&charge, &settled(before)), "{before}");
    }
    assert!(!settles_as_defined(&charge, &settled(600)));
    let euros = json!({"outcome": "settled", "amount": 1_000, "currency": "eur"});
    assert!(!settles_as_defined(&charge, &euros));
}

#[test]
fn settled_charges_count_in_available_and_the_others_in_pending() {
    let mut rows = HashMap::new();
    rows.insert("ch_1".to_owned(), facts(1_000, vec![300], true));
    rows.insert("ch_2".to_owned(), facts(500, vec![], false));
    rows.insert("ch_3".to_owned(), facts(400, vec![400], false));
    let mut declined = facts(900, vec![], false);
    declined.succeeded = false;
    rows.insert("ch_4".to_owned(), declined);
    let events = HashMap::from([("ch_1".to_owned(), vec![settled(1_000)])]);
    let expected = expected_balances(&rows, &events);
    let funds = &expected["acct_1"];
    assert_eq!(funds.available, BTreeMap::from([("usd".to_owned(), 700)]));
    assert_eq!(funds.pending, BTreeMap::from([("usd".to_owned(), 500)]));
}

#[test]
fn two_events_that_both_settle_a_charge_are_a_double_settlement() {
    let rows = HashMap::from([("ch_1".to_owned(), facts(1_000, vec![], true))]);
    let mut verdict = Verdict::default();
    let once = HashMap::from([(
        "ch_1".to_owned(),
        vec![settled(1_000), json!({"outcome": "already_settled"})],
    )]);
    check_charges(&mut verdict, &rows, &once);
    assert_eq!(verdict.webhooks.invariants().map(|(_, n)| n), [0; 7]);
    let twice = HashMap::from([("ch_1".to_owned(), vec![settled(1_000), settled(1_000)])]);
    check_charges(&mut verdict, &rows, &twice);
    assert_eq!(verdict.webhooks.double_settlements, 1);
}

#[test]
fn a_settled_mark_needs_an_event_answered_2xx_and_the_reverse() {
    let mut verdict = Verdict::default();
    let marked = HashMap::from([("ch_1".to_owned(), facts(1_000, vec![], true))]);
    check_charges(&mut verdict, &marked, &HashMap::new());
    assert_eq!(verdict.webhooks.settlement_mismatches, 1);
    let unmarked = HashMap::from([("ch_1".to_owned(), facts(1_000, vec![], false))]);
    let events = HashMap::from([("ch_1".to_owned(), vec![settled(1_000)])]);
    check_charges(&mut verdict, &unmarked, &events);
    assert_eq!(verdict.webhooks.settlement_mismatches, 2);
}

#[test]
fn copies_must_agree_and_unknown_charges_must_be_404() {
    let body =
        r#"{"received":true,"settlement":{"outcome":"settled","amount":5,"currency":"usd"}}"#;
    let mut verdict = Verdict::default();
    let same = event(
        EventKind::First,
        vec![answered(200, body), answered(200, body)],
    );
    assert_eq!(check_copies(&mut verdict, &same, "e"), Some(settled(5)));
    assert_eq!(verdict.webhooks.unexpected_answers, 0);
    let other = r#"{"received":true,"settlement":{"outcome":"already_settled"}}"#;
    let differ = event(
        EventKind::First,
        vec![answered(200, body), answered(200, other)],
    );
    check_copies(&mut verdict, &differ, "e");
    assert_eq!(verdict.webhooks.unexpected_answers, 1);
    let missing = r#"{"error":{"code":"resource_missing","type":"invalid_request_error"}}"#;
    let unknown = event(
        EventKind::UnknownCharge,
        vec![
            answered(404, missing),
            answered(404, "{}"),
            Outcome::Unresolved {
                attempts: 3,
                last: "timeout".to_owned(),
            },
        ],
    );
    assert_eq!(check_copies(&mut verdict, &unknown, "e"), None);
    let w = &verdict.webhooks;
    assert_eq!(
        (w.unexpected_answers, w.unresolved_copies, w.not_found),
        (2, 1, 2)
    );
}

#[test]
fn balances_are_read_in_stripes_shape_without_zeros() {
    let body = json!({
        "object": "balance",
        "available": [{"amount": 700, "currency": "usd", "source_types": {"card": 700}}],
        "livemode": false,
        "pending": [{"amount": 0, "currency": "usd", "source_types": {"card": 0}}],
    });
    let read = funds(&body).unwrap();
    assert_eq!(read.available, BTreeMap::from([("usd".to_owned(), 700)]));
    assert!(read.pending.is_empty());
    assert_eq!(funds(&json!({"object": "charge"})), None);
}

#[test]
fn inbox_keys_differ_by_event_and_are_stable() {
    assert_eq!(inbox_key("evt_1"), inbox_key("evt_1"));
    assert_ne!(inbox_key("evt_1"), inbox_key("evt_2"));
}
