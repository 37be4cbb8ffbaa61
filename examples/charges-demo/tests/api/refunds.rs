//! Refunds: part then the rest, over what is left, retried, double-clicked, concurrent, across
//! accounts.

use std::time::Duration;

use axum::{body::Body, http::Request, http::StatusCode};
use serde_json::json;

use crate::common::{Backend, Gate, Harness, Reply, charge, get, new_api_key, new_key, refund};

on_every_backend!(
    refunds_part_then_what_is_left,
    a_refund_over_what_is_left_is_amount_too_large_and_releases_the_key,
    invalid_refund_parameters_are_400_and_release_the_key,
    a_declined_charge_cannot_be_refunded,
    a_retried_refund_is_replayed_and_refunds_once,
    a_double_clicked_refund_refunds_once,
    concurrent_refunds_with_different_keys_never_exceed_the_charge,
    a_charge_key_sent_on_a_refund_is_an_idempotency_error,
    refunds_are_scoped_per_account,
    refunding_an_unknown_charge_is_404,
);

/// A refund as Stripe's libraries see it: its object, and the charge it leaves.
pub(super) fn refunded(reply: &Reply) -> serde_json::Value {
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.content_type(), "application/json");
    let refund = reply.json();
    assert_eq!(refund["object"], "refund", "{refund}");
    assert!(
        refund["id"].as_str().unwrap().starts_with("re_"),
        "{refund}"
    );
    assert_eq!(refund["status"], "succeeded");
    refund
}

/// Issue 30.5: a refund of part of a charge, then one without an amount, which takes what is
/// left; the charge says so (`amount_refunded`, `refunded`), and then has nothing to refund.
async fn refunds_part_then_what_is_left(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let id = h.charged(&api_key, 2000).await;

    let part = h
        .send(refund(
            &api_key,
            Some(&new_key()),
            &format!("charge={id}&amount=500&metadata[reason]=damaged"),
        ))
        .await;
    let part = refunded(&part);
    assert_eq!(part["amount"], 500);
    assert_eq!(part["charge"], id.as_str());
    assert_eq!(part["currency"], "usd");
    assert_eq!(part["metadata"], json!({"reason": "damaged"}));
    let charge = h.charge_of(&api_key, &id).await;
    assert_eq!(charge["amount_refunded"], 500);
    assert_eq!(charge["refunded"], false, "refunded means in full");

    // JSON, as for a charge; no amount: what is left.
    let rest = Request::post("/v1/refunds")
        .header("authorization", format!("Bearer {api_key}"))
        .header("idempotency-key", new_key())
        .header("content-type", "application/json")
        .body(Body::from(json!({ "charge": id }).to_string()))
        .unwrap();
    let rest = refunded(&h.send(rest).await);
    assert_eq!(rest["amount"], 1500);
    let charge = h.charge_of(&api_key, &id).await;
    assert_eq!(charge["amount_refunded"], 2000);
    assert_eq!(charge["refunded"], true);
    assert_eq!(
        h.charges_of(&api_key).await[0]["refunded"],
        true,
        "lists say so too"
    );

    let again = h
        .send(refund(&api_key, Some(&new_key()), &format!("charge={id}")))
        .await;
    let error = again.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["code"], "charge_already_refunded");
    assert_eq!(error["param"], "charge");
    let ids: Vec<_> = h
        .refunds_of(&api_key)
        .await
        .iter()
        .map(|r| r["id"].clone())
        .collect();
    assert_eq!(
        ids,
        [rest["id"].clone(), part["id"].clone()],
        "newest first"
    );
}

/// More than is left is Stripe's `amount_too_large`, and changes nothing: the key is released,
/// so the corrected refund runs under it.
async fn a_refund_over_what_is_left_is_amount_too_large_and_releases_the_key(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let id = h.charged(&api_key, 1000).await;
    refunded(
        &h.send(refund(
            &api_key,
            Some(&new_key()),
            &format!("charge={id}&amount=600"),
        ))
        .await,
    );

    let key = new_key();
    let over = h
        .send(refund(
            &api_key,
            Some(&key),
            &format!("charge={id}&amount=401"),
        ))
        .await;
    let error = over.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["code"], "amount_too_large");
    assert_eq!(error["param"], "amount");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("401") && message.contains("400"),
        "{message}"
    );
    assert!(!over.replayed());
    assert_eq!(h.charge_of(&api_key, &id).await["amount_refunded"], 600);
    assert_eq!(h.refunds_of(&api_key).await.len(), 1, "nothing refunded");

    let corrected = h
        .send(refund(
            &api_key,
            Some(&key),
            &format!("charge={id}&amount=400"),
        ))
        .await;
    assert!(!corrected.replayed(), "the refusal was not kept");
    assert_eq!(refunded(&corrected)["amount"], 400);
    assert_eq!(h.charge_of(&api_key, &id).await["refunded"], true);
}

/// Each bad parameter names itself, changes nothing and keeps no answer under its key; a refund
/// needs a key like a charge.
async fn invalid_refund_parameters_are_400_and_release_the_key(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let id = h.charged(&api_key, 1000).await;
    let key = new_key();
    for (form, param, code) in [
        (
            format!("charge={id}&amount=0"),
            "amount",
            "parameter_invalid_integer",
        ),
        (
            format!("charge={id}&amount=-5"),
            "amount",
            "parameter_invalid_integer",
        ),
        (
            format!("charge={id}&amount=ten"),
            "amount",
            "parameter_invalid_integer",
        ),
        ("amount=100".to_owned(), "charge", "parameter_missing"),
        (
            format!("charge={id}&reason=fraud"),
            "reason",
            "parameter_unknown",
        ),
    ] {
        let reply = h.send(refund(&api_key, Some(&key), &form)).await;
        let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(
            (&error["param"], &error["code"]),
            (&json!(param), &json!(code)),
            "{form}"
        );
    }
    let missing = h
        .send(refund(&api_key, None, &format!("charge={id}")))
        .await;
    missing.problem(StatusCode::BAD_REQUEST, "KeyMissing");
    assert!(h.refunds_of(&api_key).await.is_empty(), "nothing refunded");
    assert_eq!(h.charge_of(&api_key, &id).await["amount_refunded"], 0);

    let corrected = h
        .send(refund(
            &api_key,
            Some(&key),
            &format!("charge={id}&amount=100"),
        ))
        .await;
    assert!(!corrected.replayed());
    assert_eq!(refunded(&corrected)["amount"], 100);
}

/// A declined charge took nothing, so it has nothing to refund: Stripe's
/// `charge_not_refundable`.
async fn a_declined_charge_cannot_be_refunded(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let declined = h
        .send(charge(
            &api_key,
            Some(&new_key()),
            "amount=2000&currency=usd&source=tok_chargeDeclined",
        ))
        .await;
    let id = declined.stripe_error(StatusCode::PAYMENT_REQUIRED, "card_error")["charge"]
        .as_str()
        .unwrap()
        .to_owned();
    for form in [format!("charge={id}"), format!("charge={id}&amount=1")] {
        let reply = h.send(refund(&api_key, Some(&new_key()), &form)).await;
        let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["code"], "charge_not_refundable", "{form}");
        assert_eq!(error["param"], "charge");
    }
    assert!(h.refunds_of(&api_key).await.is_empty());
    assert_eq!(h.charge_of(&api_key, &id).await["amount_refunded"], 0);
}

/// A refund whose response was lost, retried with its key: the same refund back, byte for byte,
/// and the charge refunded once.
async fn a_retried_refund_is_replayed_and_refunds_once(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let id = h.charged(&api_key, 1000).await;
    let key = new_key();
    let form = format!("charge={id}&amount=300");
    let first = h.send(refund(&api_key, Some(&key), &form)).await;
    refunded(&first);
    let retry = h.send(refund(&api_key, Some(&key), &form)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(
        retry.header("original-request"),
        first.header("request-id"),
        "the replay names the first request"
    );
    assert_eq!(h.refunds_of(&api_key).await.len(), 1);
    assert_eq!(h.charge_of(&api_key, &id).await["amount_refunded"], 300);
}

/// The same refund sent twice at once with one key: the second meets the first in flight
/// (`409`), and its retry gets the one refund.
async fn a_double_clicked_refund_refunds_once(backend: Backend) {
    let gate = Gate::new();
    let h = Harness::with_processor(backend, gate.processor(Duration::ZERO)).await;
    let api_key = new_api_key();
    gate.release(1); // the charge's
    let id = h.charged(&api_key, 1000).await;
    let key = new_key();
    let form = format!("charge={id}");

    let first = tokio::spawn({
        let app = h.app.clone();
        let request = refund(&api_key, Some(&key), &form);
        async move { tower::ServiceExt::oneshot(app, request).await }
    });
    // The first refund is inside the card processor: after the charge's, the second arrival.
    gate.started().await;
    gate.started().await;
    let duplicate = h.send(refund(&api_key, Some(&key), &form)).await;
    let error = duplicate.problem(StatusCode::CONFLICT, "InFlight");
    assert_eq!(error["code"], "idempotency_key_in_use");

    gate.release(1);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    let retry = h.send(refund(&api_key, Some(&key), &form)).await;
    assert!(retry.replayed());
    assert_eq!(refunded(&retry)["amount"], 1000);
    assert_eq!(
        gate.entered(),
        2,
        "the charge and one refund reached the processor"
    );
    assert_eq!(h.refunds_of(&api_key).await.len(), 1, "one refund");
}

/// The real race: two refunds of one charge with different keys, both in flight at once, that
/// together ask for more than the charge. Whichever records first gets its amount; the other
/// then finds too little left: the refunds never add up past the charge.
async fn concurrent_refunds_with_different_keys_never_exceed_the_charge(backend: Backend) {
    let gate = Gate::new();
    let h = Harness::with_processor(backend, gate.processor(Duration::ZERO)).await;
    let api_key = new_api_key();
    for (forms, refused_code) in [
        (["amount=700", "amount=700"], "amount_too_large"),
        // Both for what is left: the second finds nothing.
        (["", ""], "charge_already_refunded"),
    ] {
        gate.release(1);
        let id = h.charged(&api_key, 1000).await;
        let refunds = forms.map(|form| {
            let app = h.app.clone();
            let request = refund(&api_key, Some(&new_key()), &format!("charge={id}&{form}"));
            tokio::spawn(async move { tower::ServiceExt::oneshot(app, request).await })
        });
        // Both are past their keys and in the card processor before either is recorded.
        gate.started().await; // the charge
        gate.started().await;
        gate.started().await;
        gate.release(2);
        let mut replies = Vec::new();
        for task in refunds {
            let response = task.await.unwrap().unwrap();
            let (parts, body) = response.into_parts();
            let body = http_body_util::BodyExt::collect(body)
                .await
                .unwrap()
                .to_bytes();
            replies.push(Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            });
        }
        let (done, refused): (Vec<_>, Vec<_>) = replies
            .iter()
            .partition(|reply| reply.status == StatusCode::OK);
        assert_eq!(
            (done.len(), refused.len()),
            (1, 1),
            "{refused_code}: one each"
        );
        let error = refused[0].stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["code"], refused_code);
        let amount = refunded(done[0])["amount"].as_i64().unwrap();
        let charge = h.charge_of(&api_key, &id).await;
        assert_eq!(charge["amount_refunded"], amount, "{refused_code}");
        let sum: i64 = h
            .refunds_of(&api_key)
            .await
            .iter()
            .filter(|r| r["charge"] == id.as_str())
            .map(|r| r["amount"].as_i64().unwrap())
            .sum();
        assert_eq!(sum, amount, "one refund row, of the amount answered");
        assert!(sum <= 1000);
    }
}

/// One key space per account across endpoints (Stripe's): a charge's key sent on a refund is a
/// key reused for another request, `422` with Stripe's `idempotency_error`, and runs nothing; so
/// is a refund's key sent on a charge.
async fn a_charge_key_sent_on_a_refund_is_an_idempotency_error(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let charge_key = new_key();
    let form = "amount=1000&currency=usd";
    let charged = h.send(charge(&api_key, Some(&charge_key), form)).await;
    let id = charged.json()["id"].as_str().unwrap().to_owned();

    let reused = h
        .send(refund(&api_key, Some(&charge_key), &format!("charge={id}")))
        .await;
    let error = reused.problem(StatusCode::UNPROCESSABLE_ENTITY, "Mismatch");
    assert_eq!(error["type"], "idempotency_error");
    assert_eq!(reused.should_retry(), Some(false));
    assert!(h.refunds_of(&api_key).await.is_empty(), "nothing refunded");
    let still = h.send(charge(&api_key, Some(&charge_key), form)).await;
    assert!(still.replayed(), "the key still answers for its charge");
    assert_eq!(still.body, charged.body);

    let refund_key = new_key();
    refunded(
        &h.send(refund(
            &api_key,
            Some(&refund_key),
            &format!("charge={id}&amount=1"),
        ))
        .await,
    );
    let reused = h.send(charge(&api_key, Some(&refund_key), form)).await;
    let error = reused.problem(StatusCode::UNPROCESSABLE_ENTITY, "Mismatch");
    assert_eq!(error["type"], "idempotency_error");
    assert_eq!(h.charges_of(&api_key).await.len(), 1, "nothing charged");
    // Another account's key space is its own.
    let other = new_api_key();
    let theirs = h.send(charge(&other, Some(&charge_key), form)).await;
    assert_eq!(theirs.status, StatusCode::OK);
    assert!(!theirs.replayed());
}

/// Refunds are visible only to the account that made them: another account's refund, or
/// charge, is "no such" one, like a missing one.
async fn refunds_are_scoped_per_account(backend: Backend) {
    let h = Harness::start(backend).await;
    let alice = new_api_key();
    let bob = new_api_key();
    let id = h.charged(&alice, 1000).await;
    let mut alices = Vec::new();
    for amount in [100, 200, 300] {
        let reply = h
            .send(refund(
                &alice,
                Some(&new_key()),
                &format!("charge={id}&amount={amount}"),
            ))
            .await;
        alices.push(refunded(&reply)["id"].as_str().unwrap().to_owned());
    }

    let own = h
        .send(get(&alice, &format!("/v1/refunds/{}", alices[0])))
        .await;
    assert_eq!(refunded(&own)["amount"], 100);
    let foreign = h
        .send(get(&bob, &format!("/v1/refunds/{}", alices[0])))
        .await;
    let error = foreign.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert_eq!(error["code"], "resource_missing");
    assert!(h.refunds_of(&bob).await.is_empty());
    // Bob cannot refund Alice's charge either, and cannot tell it exists.
    let theft = h
        .send(refund(&bob, Some(&new_key()), &format!("charge={id}")))
        .await;
    let error = theft.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert_eq!(
        (&error["code"], &error["param"]),
        (&json!("resource_missing"), &json!("charge"))
    );
    assert_eq!(h.charge_of(&alice, &id).await["amount_refunded"], 600);

    // Alice's list pages, newest first; a cursor of another account's is refused.
    let page = h.send(get(&alice, "/v1/refunds?limit=2")).await.json();
    assert_eq!(
        (page["object"].as_str(), page["url"].as_str()),
        (Some("list"), Some("/v1/refunds"))
    );
    assert_eq!(page["has_more"], true);
    assert_eq!(page["data"][0]["id"], alices[2].as_str());
    assert_eq!(page["data"][1]["id"], alices[1].as_str());
    let last = h
        .send(get(
            &alice,
            &format!("/v1/refunds?limit=2&starting_after={}", alices[1]),
        ))
        .await
        .json();
    assert_eq!(last["has_more"], false);
    assert_eq!(last["data"][0]["id"], alices[0].as_str());
    let cursor = h
        .send(get(
            &bob,
            &format!("/v1/refunds?starting_after={}", alices[0]),
        ))
        .await;
    let error = cursor.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["param"], "starting_after");
    for query in ["limit=0", "charge=x"] {
        let reply = h.send(get(&alice, &format!("/v1/refunds?{query}"))).await;
        reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    }
}

async fn refunding_an_unknown_charge_is_404(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let reply = h
        .send(refund(&api_key, Some(&new_key()), "charge=ch_doesnotexist"))
        .await;
    let error = reply.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert_eq!(error["code"], "resource_missing");
    assert_eq!(error["param"], "charge");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("ch_doesnotexist")
    );
    let missing = h.send(get(&api_key, "/v1/refunds/re_doesnotexist")).await;
    missing.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert!(h.refunds_of(&api_key).await.is_empty());
}
