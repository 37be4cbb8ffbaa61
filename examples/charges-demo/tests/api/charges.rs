//! Creating charges: Stripe's forms and JSON, replays, reused keys, declines, refused parameters,
//! duplicates in flight.

use std::time::{Duration, Instant};

use axum::{body::Body, http::Request, http::StatusCode};
use serde_json::json;

use crate::common::{Backend, Gate, Harness, charge, charge_json, get, new_api_key, new_key};

on_every_backend!(
    creates_a_charge_from_a_stripe_form,
    creates_a_charge_from_json,
    retry_replays_the_charge_byte_for_byte,
    reused_key_with_another_amount_is_stripes_idempotency_error,
    declined_card_is_402_and_replayed,
    invalid_parameters_are_400_and_release_the_key,
    a_json_body_that_is_not_utf8_is_400_and_releases_the_key,
    in_flight_duplicate_is_409,
    processing_takes_the_configured_delay,
    same_key_in_two_accounts_makes_two_charges,
);

async fn creates_a_charge_from_a_stripe_form(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let reply = h
        .send(charge(
            &api_key,
            Some(&new_key()),
            "amount=2000&currency=USD&description=Order+%236735\
             &customer=cus_123&metadata[order_id]=6735&metadata[note]=a%26b",
        ))
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.content_type(), "application/json");
    assert!(!reply.replayed());
    let charge = reply.json();
    assert!(charge["id"].as_str().unwrap().starts_with("ch_"));
    assert_eq!(charge["object"], "charge");
    assert_eq!(charge["amount"], 2000);
    assert_eq!(charge["currency"], "usd", "currency is lowercased");
    assert_eq!(charge["status"], "succeeded");
    assert_eq!(charge["paid"], true);
    assert_eq!(charge["captured"], true);
    assert_eq!(charge["livemode"], false);
    assert_eq!(charge["description"], "Order #6735");
    assert_eq!(charge["customer"], "cus_123");
    assert_eq!(
        charge["metadata"],
        json!({"order_id": "6735", "note": "a&b"})
    );
    assert!(charge["failure_code"].is_null());
    let created = charge["created"].as_i64().unwrap();
    assert!((before..=before + 60).contains(&created), "{created}");

    // Retrievable, identical.
    let id = charge["id"].as_str().unwrap();
    let fetched = h.send(get(&api_key, &format!("/v1/charges/{id}"))).await;
    assert_eq!(fetched.status, StatusCode::OK);
    assert_eq!(fetched.json(), charge);
}

async fn creates_a_charge_from_json(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let key = new_key();
    let body = json!({"amount": 1500, "currency": "eur", "metadata": {"cart": "42"}});
    let reply = h.send(charge_json(&api_key, &key, &body)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let charge = reply.json();
    assert_eq!(charge["amount"], 1500);
    assert_eq!(charge["currency"], "eur");
    assert_eq!(charge["metadata"], json!({"cart": "42"}));
    assert!(charge["description"].is_null());

    // The same parameters in another order are the same request: a replay.
    let reordered = json!({"metadata": {"cart": "42"}, "currency": "eur", "amount": 1500});
    let retry = h.send(charge_json(&api_key, &key, &reordered)).await;
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], charge["id"]);
}

async fn retry_replays_the_charge_byte_for_byte(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let key = new_key();
    let form = "amount=2000&currency=usd&metadata[order_id]=6735";
    let first = h.send(charge(&api_key, Some(&key), form)).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text());
    assert!(!first.replayed());

    // The response was "lost"; the client retries twice with the same key.
    for _ in 0..2 {
        let retry = h.send(charge(&api_key, Some(&key), form)).await;
        assert_eq!(retry.status, StatusCode::OK);
        assert!(retry.replayed(), "a retry is marked as a replay");
        assert_eq!(retry.body, first.body, "the replay is byte for byte");
        assert_eq!(retry.content_type(), first.content_type());
    }

    let charges = h.charges_of(&api_key).await;
    assert_eq!(charges.len(), 1, "charged once");
    assert_eq!(charges[0]["id"], first.json()["id"]);
}

async fn reused_key_with_another_amount_is_stripes_idempotency_error(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let key = new_key();
    let first = h
        .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
        .await;
    assert_eq!(first.status, StatusCode::OK);

    let changed = h
        .send(charge(&api_key, Some(&key), "amount=3000&currency=usd"))
        .await;
    // Issue 34: the IETF draft's status, the layer's own, not Stripe's `400`.
    let error = changed.problem(StatusCode::UNPROCESSABLE_ENTITY, "Mismatch");
    // Stripe's error for a key reused with other parameters; retrying it cannot help.
    assert_eq!(error["type"], "idempotency_error");
    assert!(error.get("code").is_none(), "{error}");
    assert!(
        error["doc_url"]
            .as_str()
            .is_some_and(|u| u.starts_with("https://docs.stripe.com/"))
    );
    assert_eq!(changed.should_retry(), Some(false));
    assert!(!changed.text().contains(&key), "the key is not in the body");
    assert!(!changed.replayed());

    // The stored outcome is untouched: the original request still replays, one charge exists.
    let retry = h
        .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
        .await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    let charges = h.charges_of(&api_key).await;
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0]["amount"], 2000);
}

async fn declined_card_is_402_and_replayed(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let key = new_key();
    let form = "amount=2000&currency=usd&source=tok_chargeDeclined";
    let declined = h.send(charge(&api_key, Some(&key), form)).await;
    let error = declined.stripe_error(StatusCode::PAYMENT_REQUIRED, "card_error");
    assert_eq!(error["code"], "card_declined");
    assert_eq!(error["decline_code"], "generic_decline");
    let charge_id = error["charge"].as_str().expect("the failed charge's id");
    assert!(charge_id.starts_with("ch_"));

    // A decline is a final outcome: kept, and replayed rather than tried again.
    let retry = h.send(charge(&api_key, Some(&key), form)).await;
    assert_eq!(retry.status, StatusCode::PAYMENT_REQUIRED);
    assert!(retry.replayed());
    assert_eq!(retry.body, declined.body);

    // Stripe records the failed attempt: one charge, failed.
    let charges = h.charges_of(&api_key).await;
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0]["id"], charge_id);
    assert_eq!(charges[0]["status"], "failed");
    assert_eq!(charges[0]["paid"], false);
    assert_eq!(charges[0]["failure_code"], "card_declined");

    let insufficient = h
        .send(charge(
            &api_key,
            Some(&new_key()),
            "amount=2000&currency=usd&source=tok_chargeDeclinedInsufficientFunds",
        ))
        .await;
    let error = insufficient.stripe_error(StatusCode::PAYMENT_REQUIRED, "card_error");
    assert_eq!(error["decline_code"], "insufficient_funds");
}

/// A "JSON" body that is not UTF-8 (a Latin-1 `é`, bytes before the object): the layer passes
/// it on (it compares such a body by its bytes), the charge's parser refuses it with a `400`
/// naming the problem, and the key is released, so the corrected request runs under it.
async fn a_json_body_that_is_not_utf8_is_400_and_releases_the_key(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    for body in [
        &b"{\"amount\": 2000, \"currency\": \"usd\", \"description\": \"caf\xe9\"}"[..],
        &b"\xff\xfe{\"amount\": 2000, \"currency\": \"usd\"}"[..],
    ] {
        let key = new_key();
        let request = Request::post("/v1/charges")
            .header("authorization", format!("Bearer {api_key}"))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(Body::from(body.to_vec()))
            .expect("request");
        let reply = h.send(request).await;
        let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{error}"
        );

        let corrected = h
            .send(charge_json(
                &api_key,
                &key,
                &json!({ "amount": 2000, "currency": "usd" }),
            ))
            .await;
        assert_eq!(corrected.status, StatusCode::OK, "{}", corrected.text());
        assert!(!corrected.replayed());
    }
    assert_eq!(h.charges_of(&api_key).await.len(), 2);
}

async fn invalid_parameters_are_400_and_release_the_key(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let cases = [
        ("currency=usd", "amount", "parameter_missing"),
        (
            "amount=0&currency=usd",
            "amount",
            "parameter_invalid_integer",
        ),
        (
            "amount=-100&currency=usd",
            "amount",
            "parameter_invalid_integer",
        ),
        (
            "amount=12.50&currency=usd",
            "amount",
            "parameter_invalid_integer",
        ),
        ("amount=2000", "currency", "parameter_missing"),
        (
            "amount=2000&currency=dollars",
            "currency",
            "parameter_invalid_string",
        ),
        (
            "amount=2000&currency=usd&source=4242424242424242",
            "source",
            "resource_missing",
        ),
        (
            "amount=2000&currency=usd&capture=false",
            "capture",
            "parameter_unknown",
        ),
    ];
    for (form, param, code) in cases {
        let key = new_key();
        let reply = h.send(charge(&api_key, Some(&key), form)).await;
        let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["param"], param, "{form}");
        assert_eq!(error["code"], code, "{form}");

        // Nothing was done, so the key was released: the corrected request runs under it.
        let corrected = h
            .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
            .await;
        assert_eq!(
            corrected.status,
            StatusCode::OK,
            "{form}: {}",
            corrected.text()
        );
        assert!(!corrected.replayed());
    }
    assert_eq!(h.charges_of(&api_key).await.len(), cases.len());

    let bad_json = Request::post("/v1/charges")
        .header("authorization", format!("Bearer {api_key}"))
        .header("idempotency-key", new_key())
        .header("content-type", "application/json")
        .body(Body::from("{\"amount\": 2000,"))
        .unwrap();
    let reply = h.send(bad_json).await;
    reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
}

async fn in_flight_duplicate_is_409(backend: Backend) {
    let gate = Gate::new();
    let h = Harness::with_processor(backend, gate.processor(Duration::from_millis(50))).await;
    let api_key = new_api_key();
    let key = new_key();
    let form = "amount=2000&currency=usd";

    let first = tokio::spawn({
        let app = h.app.clone();
        let request = charge(&api_key, Some(&key), form);
        async move { tower::ServiceExt::oneshot(app, request).await }
    });
    // The first charge is now inside the card processor, holding the key.
    gate.started().await;

    // The double click.
    let duplicate = h.send(charge(&api_key, Some(&key), form)).await;
    let error = duplicate.problem(StatusCode::CONFLICT, "InFlight");
    // Stripe's error for a key whose request is still running; a later retry gets its answer.
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["code"], "idempotency_key_in_use");
    assert_eq!(
        error["doc_url"],
        "https://docs.stripe.com/error-codes/idempotency-key-in-use"
    );
    assert_eq!(duplicate.should_retry(), Some(true));
    assert_eq!(duplicate.headers["retry-after"], "1");
    assert_eq!(duplicate.header("idempotency-key"), Some(key.as_str()));
    assert!(
        !duplicate.text().contains(&key),
        "the key is not in the body"
    );

    gate.release(1);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let first = http_body_util::BodyExt::collect(first.into_body())
        .await
        .unwrap()
        .to_bytes();

    // Once it finished, the retry the 409 asked for gets the charge.
    let retry = h.send(charge(&api_key, Some(&key), form)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first);
    assert_eq!(gate.entered(), 1, "the processor saw the charge once");
    assert_eq!(h.charges_of(&api_key).await.len(), 1, "one charge");
}

async fn processing_takes_the_configured_delay(backend: Backend) {
    let delay = Duration::from_millis(300);
    let h =
        Harness::with_processor(backend, charges_demo::processor::CardProcessor::new(delay)).await;
    let start = Instant::now();
    let reply = h
        .send(charge(
            &new_api_key(),
            Some(&new_key()),
            "amount=1&currency=usd",
        ))
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(start.elapsed() >= delay, "{:?}", start.elapsed());
}

async fn same_key_in_two_accounts_makes_two_charges(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = new_key();
    let form = "amount=2000&currency=usd";
    let a = h.send(charge(&new_api_key(), Some(&key), form)).await;
    let b = h.send(charge(&new_api_key(), Some(&key), form)).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(b.status, StatusCode::OK);
    assert!(!b.replayed(), "keys are scoped to the account");
    assert_ne!(a.json()["id"], b.json()["id"]);
}
