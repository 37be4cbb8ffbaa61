//! The API in process (`app()` with `oneshot`), every scenario on both backends: memory, and
//! PostgreSQL with a database of its own per test.

mod common;

use std::time::{Duration, Instant};

use axum::{body::Body, http::Request, http::StatusCode};
use base64::{Engine, engine::general_purpose::STANDARD};
use common::{
    Backend, Gate, Harness, Reply, bounded, charge, charge_json, get, is_request_id, new_api_key,
    new_key, refund,
};
use serde_json::json;

/// Runs each scenario on each backend, bounded in time.
macro_rules! on_every_backend {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    crate::common::bounded(super::$scenario(crate::common::Backend::Memory)).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    crate::common::bounded(super::$scenario(crate::common::Backend::Postgres)).await
                }
            )*
        }
    };
}

on_every_backend!(
    creates_a_charge_from_a_stripe_form,
    creates_a_charge_from_json,
    retry_replays_the_charge_byte_for_byte,
    reused_key_with_another_amount_is_stripes_idempotency_error,
    declined_card_is_402_and_replayed,
    invalid_parameters_are_400_and_release_the_key,
    a_json_body_that_is_not_utf8_is_400_and_releases_the_key,
    idempotency_key_is_required,
    authentication_is_required_and_checked,
    basic_auth_with_the_key_as_user_name,
    in_flight_duplicate_is_409,
    a_malformed_key_is_400_and_not_echoed,
    a_body_over_the_limit_is_413,
    an_unreadable_body_is_400,
    every_response_has_a_request_id_of_its_own,
    responses_to_keyed_requests_echo_the_key,
    a_replay_names_its_original_request,
    processing_takes_the_configured_delay,
    retrieve_and_list_are_scoped_per_account,
    list_pages_and_validates_its_parameters,
    same_key_in_two_accounts_makes_two_charges,
    unknown_urls_and_methods,
    the_published_description_says_what_the_layer_does,
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

/// Issue 30.6: `GET /openapi.json` publishes the idempotency contract of `POST /v1/charges`
/// from the layer's own configuration, and the API then does what it says.
async fn the_published_description_says_what_the_layer_does(backend: Backend) {
    let h = Harness::start(backend).await;
    let described = h
        .send(
            Request::get("/openapi.json")
                .body(Body::empty())
                .expect("request"),
        )
        .await;
    assert_eq!(
        described.status,
        StatusCode::OK,
        "public, without an API key"
    );
    let doc = described.json();
    let create = &doc["paths"]["/v1/charges"]["post"];
    let key = &create["parameters"][0];
    assert_eq!(key["name"], "Idempotency-Key");
    assert_eq!(key["in"], "header");
    assert_eq!(key["required"], true, "the demo's layer requires the key");
    assert_eq!(key["schema"]["maxLength"], 255);
    let said = key["description"].as_str().expect("a description");
    assert!(said.contains("for 1 day"), "the TTL in words: {said}");
    let facts = &create["x-idempotency"];
    assert_eq!(facts["ttl_seconds"], 86_400);
    assert_eq!(facts["required"], true);
    assert_eq!(
        create["responses"]["200"]["headers"]["Idempotent-Replayed"]["schema"]["enum"],
        json!(["true"])
    );
    // Issue 34: every operation that takes a key lists the layer's refusals, `409` and `422`
    // among them, as the demo renders them.
    let keyed = keyed_operations(&doc);
    assert_eq!(
        keyed,
        [("post", "/v1/charges"), ("post", "/v1/refunds")]
            .map(|(m, p)| (m.to_owned(), p.to_owned())),
        "the writes, and only they, take a key"
    );
    for (method, path) in &keyed {
        let responses = &doc["paths"][path.as_str()][method.as_str()]["responses"];
        for status in ["409", "413", "422", "503"] {
            assert_eq!(
                responses[status]["content"]["application/problem+json"]["schema"]["$ref"],
                "#/components/schemas/Refusal",
                "{method} {path} lists {status}"
            );
        }
    }
    // Refunds share the layer: the same contract, and one key per account across both.
    let create_refund = &doc["paths"]["/v1/refunds"]["post"];
    assert_eq!(create_refund["parameters"][0]["name"], "Idempotency-Key");
    assert_eq!(create_refund["parameters"][0]["required"], true);
    assert_eq!(create_refund["x-idempotency"], *facts);
    assert_eq!(facts["scope"], "principal", "keys reach across endpoints");
    // Reads are not idempotent writes: no key.
    for (path, method) in [
        ("/v1/charges", "get"),
        ("/v1/refunds", "get"),
        ("/v1/refunds/{id}", "get"),
    ] {
        let operation = &doc["paths"][path][method];
        assert!(operation.is_object(), "{method} {path} is described");
        assert!(
            operation["parameters"]
                .as_array()
                .is_none_or(|parameters| parameters.iter().all(|p| p["name"] != "Idempotency-Key")),
            "{method} {path}"
        );
    }

    // What it says, it does: no key, a reused key and a key in flight get the statuses listed.
    let refusals = facts["refusals"].as_object().expect("refusals by status");
    let listed = |status: StatusCode, kind: &str| {
        refusals[status.as_str()]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|k| k == kind))
    };
    let api_key = new_api_key();
    let missing = h
        .send(charge(&api_key, None, "amount=100&currency=usd"))
        .await;
    assert!(listed(missing.status, "key_missing"), "{}", missing.status);
    let key = new_key();
    h.send(charge(&api_key, Some(&key), "amount=100&currency=usd"))
        .await;
    let reused = h
        .send(charge(&api_key, Some(&key), "amount=200&currency=usd"))
        .await;
    assert!(listed(reused.status, "mismatch"), "{}", reused.status);
    let charge_id = h.charged(&api_key, 100).await;
    let on_a_refund = h
        .send(refund(&api_key, Some(&key), &format!("charge={charge_id}")))
        .await;
    assert!(
        listed(on_a_refund.status, "mismatch"),
        "another endpoint: {}",
        on_a_refund.status
    );
}

/// The `(method, path)` of every operation in `doc` with an `Idempotency-Key` parameter, sorted.
fn keyed_operations(doc: &serde_json::Value) -> Vec<(String, String)> {
    let paths = doc["paths"].as_object().expect("paths");
    let mut keyed: Vec<(String, String)> = paths
        .iter()
        .flat_map(|(path, item)| {
            let operations = item.as_object().expect("a path item");
            operations.iter().filter_map(move |(method, operation)| {
                let parameters = operation["parameters"].as_array()?;
                parameters
                    .iter()
                    .any(|p| p["name"] == "Idempotency-Key")
                    .then(|| (method.clone(), path.clone()))
            })
        })
        .collect();
    keyed.sort();
    keyed
}

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

async fn idempotency_key_is_required(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let reply = h
        .send(charge(&api_key, None, "amount=2000&currency=usd"))
        .await;
    let error = reply.problem(StatusCode::BAD_REQUEST, "KeyMissing");
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(reply.should_retry(), Some(false));
    assert_eq!(
        reply.header("idempotency-key"),
        None,
        "none sent, none echoed"
    );
    assert!(h.charges_of(&api_key).await.is_empty(), "nothing charged");

    // Reads are not covered by the layer: no key needed.
    let list = h.send(get(&api_key, "/v1/charges")).await;
    assert_eq!(list.status, StatusCode::OK);
}

async fn authentication_is_required_and_checked(backend: Backend) {
    let h = Harness::start(backend).await;
    let unauthenticated = |authorization: Option<&str>| {
        let mut request = Request::post("/v1/charges")
            .header("idempotency-key", new_key())
            .header("content-type", "application/x-www-form-urlencoded");
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        request
            .body(Body::from("amount=2000&currency=usd"))
            .unwrap()
    };
    for authorization in [
        None,
        Some("Bearer"),
        Some("Bearer pk_test_123"),
        Some("Bearer sk_live_1234567890abcdef"),
        Some("Bearer sk_test_has spaces"),
        Some("Token sk_test_123"),
        Some("Basic not-base64!"),
    ] {
        let reply = h.send(unauthenticated(authorization)).await;
        let error = reply.stripe_error(StatusCode::UNAUTHORIZED, "invalid_request_error");
        assert!(
            reply.headers.contains_key("www-authenticate"),
            "{authorization:?}"
        );
        if let Some(value) = authorization {
            let secret = value.rsplit(' ').next().unwrap();
            if secret.len() > 12 {
                assert!(
                    !error["message"].as_str().unwrap().contains(secret),
                    "the key is not echoed: {error}"
                );
            }
        }
    }
    // Reads too.
    let reply = h
        .send(Request::get("/v1/charges").body(Body::empty()).unwrap())
        .await;
    reply.stripe_error(StatusCode::UNAUTHORIZED, "invalid_request_error");
}

async fn basic_auth_with_the_key_as_user_name(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    // `curl -u sk_test_...:`
    let basic = format!("Basic {}", STANDARD.encode(format!("{api_key}:")));
    let request = Request::post("/v1/charges")
        .header("authorization", &basic)
        .header("idempotency-key", new_key())
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from("amount=700&currency=usd"))
        .unwrap();
    let reply = h.send(request).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let id = reply.json()["id"].as_str().unwrap().to_owned();

    // The same key over Bearer is the same account.
    let fetched = h.send(get(&api_key, &format!("/v1/charges/{id}"))).await;
    assert_eq!(fetched.status, StatusCode::OK);
    assert_eq!(fetched.json()["amount"], 700);
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

/// A key that is too long, has a space, or comes twice: Stripe's `invalid_request_error`, not to
/// be retried, and not echoed (it is not a key, and may be anything).
async fn a_malformed_key_is_400_and_not_echoed(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let too_long = format!("order-{}", "7".repeat(300));
    for key in [too_long.as_str(), "two words", ""] {
        let reply = h
            .send(charge(&api_key, Some(key), "amount=2000&currency=usd"))
            .await;
        let error = reply.problem(StatusCode::BAD_REQUEST, "KeyInvalid");
        assert_eq!(error["type"], "invalid_request_error", "{key:?}");
        assert_eq!(reply.should_retry(), Some(false), "{key:?}");
        assert_eq!(reply.header("idempotency-key"), None, "{key:?}");
        if !key.is_empty() {
            assert!(!reply.text().contains(key), "the key is not in the body");
        }
    }
    let twice = Request::post("/v1/charges")
        .header("authorization", format!("Bearer {api_key}"))
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from("amount=2000&currency=usd"))
        .unwrap();
    let reply = h.send(twice).await;
    reply.problem(StatusCode::BAD_REQUEST, "KeyInvalid");
    assert_eq!(reply.header("idempotency-key"), None);
    assert!(h.charges_of(&api_key).await.is_empty(), "nothing charged");
}

async fn a_body_over_the_limit_is_413(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let form = format!(
        "amount=2000&currency=usd&description={}",
        "x".repeat(charges_demo::MAX_CHARGE_BODY_BYTES)
    );
    let reply = h.send(charge(&api_key, Some(&new_key()), &form)).await;
    let error = reply.problem(StatusCode::PAYLOAD_TOO_LARGE, "BodyTooLarge");
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(reply.should_retry(), Some(false));
    assert!(h.charges_of(&api_key).await.is_empty(), "nothing charged");
}

/// A body that fails while it is read (a client that went away mid-request).
async fn an_unreadable_body_is_400(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let chunks: [Result<&'static str, std::io::Error>; 2] = [
        Ok("amount=2000&"),
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "gone",
        )),
    ];
    let request = Request::post("/v1/charges")
        .header("authorization", format!("Bearer {api_key}"))
        .header("idempotency-key", new_key())
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    let reply = h.send(request).await;
    let error = reply.problem(StatusCode::BAD_REQUEST, "BodyUnreadable");
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(reply.should_retry(), Some(false));
    assert!(h.charges_of(&api_key).await.is_empty(), "nothing charged");
}

/// Charges, replays, declines, refusals, errors, reads, unknown URLs: each answer has a
/// `Request-Id` of Stripe's form, and no two the same.
async fn every_response_has_a_request_id_of_its_own(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let key = new_key();
    let form = "amount=2000&currency=usd";
    let replies = [
        h.send(charge(&api_key, Some(&key), form)).await,
        h.send(charge(&api_key, Some(&key), form)).await,
        h.send(charge(&api_key, Some(&key), "amount=1&currency=usd"))
            .await,
        h.send(charge(&api_key, None, form)).await,
        h.send(charge(
            &api_key,
            Some(&new_key()),
            "amount=2000&currency=usd&source=tok_chargeDeclined",
        ))
        .await,
        h.send(charge(&api_key, Some(&new_key()), "amount=2000"))
            .await,
        h.send(charge("sk_live_nope", Some(&new_key()), form)).await,
        h.send(get(&api_key, "/v1/charges")).await,
        h.send(get(&api_key, "/v1/customers")).await,
    ];
    let statuses: Vec<u16> = replies.iter().map(|r| r.status.as_u16()).collect();
    assert_eq!(statuses, [200, 200, 422, 400, 402, 400, 401, 200, 404]);
    let mut ids: Vec<&str> = replies
        .iter()
        .map(|r| r.header("request-id").expect("a Request-Id"))
        .collect();
    assert!(ids.iter().all(|id| is_request_id(id)), "{ids:?}");
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), replies.len(), "each its own");
}

/// As Stripe's API does (stripe-node shows it as `lastResponse.idempotencyKey`): the key is
/// echoed as it was sent, on answers, replays and refusals alike.
async fn responses_to_keyed_requests_echo_the_key(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let key = new_key();
    let form = "amount=2000&currency=usd";
    for reply in [
        h.send(charge(&api_key, Some(&key), form)).await,
        h.send(charge(&api_key, Some(&key), form)).await,
        h.send(charge(&api_key, Some(&key), "amount=1&currency=usd"))
            .await,
    ] {
        assert_eq!(
            reply.header("idempotency-key"),
            Some(key.as_str()),
            "{}",
            reply.status
        );
    }
    // The draft's structured-field form names the same key, and is echoed as sent.
    let quoted = format!("\"{key}\"");
    let reply = h.send(charge(&api_key, Some(&quoted), form)).await;
    assert!(reply.replayed());
    assert_eq!(reply.header("idempotency-key"), Some(quoted.as_str()));

    let read = h.send(get(&api_key, "/v1/charges")).await;
    assert_eq!(read.header("idempotency-key"), None, "no key sent");
}

/// The first answer names its own request in `Original-Request`; a replay names that first
/// request there, with a `Request-Id` of its own. A replayed decline too.
async fn a_replay_names_its_original_request(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    for form in [
        "amount=2000&currency=usd",
        "amount=2000&currency=usd&source=tok_chargeDeclined",
    ] {
        let key = new_key();
        let first = h.send(charge(&api_key, Some(&key), form)).await;
        let first_id = first.header("request-id").expect("a Request-Id");
        assert_eq!(first.header("original-request"), Some(first_id), "{form}");

        let replay = h.send(charge(&api_key, Some(&key), form)).await;
        assert!(replay.replayed(), "{form}");
        assert_eq!(replay.header("original-request"), Some(first_id), "{form}");
        let replay_id = replay.header("request-id").expect("a Request-Id");
        assert!(is_request_id(replay_id));
        assert_ne!(replay_id, first_id, "the replay's own id");
        assert_eq!(replay.body, first.body, "{form}");
    }
    // A refusal ran nothing, so it names no original request.
    let key = new_key();
    h.send(charge(&api_key, Some(&key), "amount=1&currency=usd"))
        .await;
    let refused = h
        .send(charge(&api_key, Some(&key), "amount=2&currency=usd"))
        .await;
    refused.problem(StatusCode::UNPROCESSABLE_ENTITY, "Mismatch");
    assert_eq!(refused.header("original-request"), None);
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

async fn retrieve_and_list_are_scoped_per_account(backend: Backend) {
    let h = Harness::start(backend).await;
    let alice = new_api_key();
    let bob = new_api_key();
    let mut alices = Vec::new();
    for amount in [100, 200, 300] {
        let reply = h
            .send(charge(
                &alice,
                Some(&new_key()),
                &format!("amount={amount}&currency=usd"),
            ))
            .await;
        assert_eq!(reply.status, StatusCode::OK);
        alices.push(reply.json()["id"].as_str().unwrap().to_owned());
    }
    let reply = h
        .send(charge(&bob, Some(&new_key()), "amount=999&currency=usd"))
        .await;
    let bobs = reply.json()["id"].as_str().unwrap().to_owned();

    // Bob cannot see Alice's charge, and cannot tell it exists.
    let foreign = h
        .send(get(&bob, &format!("/v1/charges/{}", alices[0])))
        .await;
    let error = foreign.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert_eq!(error["code"], "resource_missing");
    let missing = h.send(get(&bob, "/v1/charges/ch_doesnotexist")).await;
    let missing_error = missing.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert_eq!(
        error["message"].as_str().unwrap().replace(&alices[0], "ID"),
        missing_error["message"]
            .as_str()
            .unwrap()
            .replace("ch_doesnotexist", "ID"),
        "a foreign charge and a missing one look the same"
    );

    // Each list holds its own charges only, newest first.
    let ids = |charges: Vec<serde_json::Value>| -> Vec<String> {
        charges
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let mut expected = alices.clone();
    expected.reverse();
    assert_eq!(ids(h.charges_of(&alice).await), expected);
    assert_eq!(ids(h.charges_of(&bob).await), [bobs.as_str()]);

    // A cursor of another account's is refused.
    let cursor = h
        .send(get(&alice, &format!("/v1/charges?starting_after={bobs}")))
        .await;
    let error = cursor.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["param"], "starting_after");
}

async fn list_pages_and_validates_its_parameters(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let mut ids = Vec::new();
    for amount in 1..=5 {
        let reply = h
            .send(charge(
                &api_key,
                Some(&new_key()),
                &format!("amount={amount}&currency=usd"),
            ))
            .await;
        ids.push(reply.json()["id"].as_str().unwrap().to_owned());
    }
    ids.reverse(); // newest first

    let page = h.send(get(&api_key, "/v1/charges?limit=2")).await;
    assert_eq!(page.status, StatusCode::OK);
    let list = page.json();
    assert_eq!(list["object"], "list");
    assert_eq!(list["url"], "/v1/charges");
    assert_eq!(list["has_more"], true);
    let data = list["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["id"], ids[0]);
    assert_eq!(data[1]["id"], ids[1]);
    assert_eq!(data[0]["object"], "charge");

    let next = h
        .send(get(
            &api_key,
            &format!("/v1/charges?limit=2&starting_after={}", ids[3]),
        ))
        .await
        .json();
    assert_eq!(next["has_more"], false);
    assert_eq!(next["data"].as_array().unwrap().len(), 1);
    assert_eq!(next["data"][0]["id"], ids[4]);

    let default = h.send(get(&api_key, "/v1/charges")).await.json();
    assert_eq!(default["data"].as_array().unwrap().len(), 5);
    assert_eq!(default["has_more"], false);

    for query in ["limit=0", "limit=101", "limit=ten"] {
        let reply = h.send(get(&api_key, &format!("/v1/charges?{query}"))).await;
        let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["param"], "limit", "{query}");
    }
    let reply = h.send(get(&api_key, "/v1/charges?customer=cus_1")).await;
    let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["code"], "parameter_unknown");
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

async fn unknown_urls_and_methods(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let reply = h.send(get(&api_key, "/v1/customers")).await;
    let error = reply.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert!(error["message"].as_str().unwrap().contains("/v1/customers"));

    let post_to_a_charge = Request::post("/v1/charges/ch_123")
        .header("authorization", format!("Bearer {api_key}"))
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        h.send(post_to_a_charge).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
}

/// A refund as Stripe's libraries see it: its object, and the charge it leaves.
fn refunded(reply: &Reply) -> serde_json::Value {
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

/// PostgreSQL only: the charge is locked while a refund reads it. A refund sent while another
/// transaction holds the charge (a refund of it in flight) waits, and then reads what that one
/// committed: here, the charge refunded in full, so `charge_already_refunded`. (Had it read
/// without the lock, it would have seen 0 refunded and asked for all of it; the table's CHECK
/// would then have refused it, as `amount_too_large`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_refund_waits_for_the_charge_and_reads_what_committed() {
    bounded(async {
        let h = Harness::start(Backend::Postgres).await;
        let pool = h.db.as_ref().unwrap().pool().clone();
        let api_key = new_api_key();
        let id = h.charged(&api_key, 1000).await;

        let mut other = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM charges WHERE id = $1 FOR UPDATE")
            .bind(&id)
            .execute(&mut *other)
            .await
            .unwrap();
        let waiting = tokio::spawn({
            let app = h.app.clone();
            let request = refund(&api_key, Some(&new_key()), &format!("charge={id}"));
            async move { tower::ServiceExt::oneshot(app, request).await }
        });
        wait_for_lock_waits(&pool, 1).await;
        sqlx::query("UPDATE charges SET amount_refunded = amount WHERE id = $1")
            .bind(&id)
            .execute(&mut *other)
            .await
            .unwrap();
        other.commit().await.unwrap();

        let response = waiting.await.unwrap().unwrap();
        let (parts, body) = response.into_parts();
        let body = http_body_util::BodyExt::collect(body)
            .await
            .unwrap()
            .to_bytes();
        let reply = Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        };
        let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["code"], "charge_already_refunded");
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM refunds")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 0);
    })
    .await
}

/// PostgreSQL only: the table's `CHECK (amount_refunded <= amount)` is the last line of
/// defence. A writer that skipped the lock is played by a trigger that adds another 1000 to
/// every refund; the refund then fails the CHECK inside the request's transaction. The handler
/// catches it and answers Stripe's `400 amount_too_large`, which the layer delivers without
/// storing it, rolling the transaction back: no refund row, nothing added, the key free, so the
/// retry (once the trigger is gone) refunds, fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_refund_past_the_check_is_amount_too_large_and_leaves_nothing() {
    bounded(async {
        let h = Harness::start(Backend::Postgres).await;
        let pool = h.db.as_ref().unwrap().pool().clone();
        let api_key = new_api_key();
        let id = h.charged(&api_key, 1000).await;
        sqlx::raw_sql(
            "CREATE FUNCTION unlocked_writer() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN NEW.amount_refunded := NEW.amount_refunded + 1000; RETURN NEW; END $$;
             CREATE TRIGGER unlocked_writer BEFORE UPDATE OF amount_refunded ON charges
             FOR EACH ROW EXECUTE FUNCTION unlocked_writer();",
        )
        .execute(&pool)
        .await
        .unwrap();
        let key = new_key();
        let form = format!("charge={id}&amount=100");
        let refused = h.send(refund(&api_key, Some(&key), &form)).await;
        let error = refused.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(
            (&error["code"], &error["param"]),
            (&json!("amount_too_large"), &json!("amount"))
        );
        let state = || async {
            sqlx::query_as::<_, (i64, i64, i64)>(
                "SELECT (SELECT amount_refunded FROM charges WHERE id = $1),
                        (SELECT count(*) FROM refunds),
                        (SELECT count(*) FROM idempotency.records)",
            )
            .bind(&id)
            .fetch_one(&pool)
            .await
            .unwrap()
        };
        // The charge's own record only.
        assert_eq!(
            state().await,
            (0, 0, 1),
            "rolled back, the refusal not stored"
        );

        sqlx::raw_sql("DROP TRIGGER unlocked_writer ON charges")
            .execute(&pool)
            .await
            .unwrap();
        let retry = h.send(refund(&api_key, Some(&key), &form)).await;
        assert!(!retry.replayed());
        assert_eq!(refunded(&retry)["amount"], 100);
        assert_eq!(state().await, (100, 1, 2));
    })
    .await
}

/// Waits until `n` sessions of the test's database wait for a lock (a row another transaction
/// holds).
async fn wait_for_lock_waits(pool: &sqlx::PgPool, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} lock wait(s), found {waiting}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// PostgreSQL only: the rows in `charges` and the idempotency records, as other connections
/// see them.
async fn charges_and_records(pool: &sqlx::PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM charges), (SELECT count(*) FROM idempotency.records)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// PostgreSQL only: the charge is written in the request's transaction. While it is processed,
/// neither its claim nor its row is visible; both appear with the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_charge_and_stored_response_commit_together() {
    bounded(async {
        let gate = Gate::new();
        let h = Harness::with_processor(Backend::Postgres, gate.processor(Duration::ZERO)).await;
        let pool = h.db.as_ref().unwrap().pool().clone();
        let counts = || charges_and_records(&pool);
        let api_key = new_api_key();
        let key = new_key();
        let first = tokio::spawn({
            let app = h.app.clone();
            let request = charge(&api_key, Some(&key), "amount=2000&currency=usd");
            async move { tower::ServiceExt::oneshot(app, request).await }
        });
        gate.started().await;
        assert_eq!(counts().await, (0, 0), "uncommitted while in flight");
        let duplicate = h
            .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
            .await;
        let error = duplicate.problem(StatusCode::CONFLICT, "InFlight");
        assert_eq!(error["code"], "idempotency_key_in_use");

        gate.release(1);
        assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
        assert_eq!(counts().await, (1, 1), "committed together");
    })
    .await
}

/// PostgreSQL only: the charge row is written through the request's transaction, after the
/// card is authorised. When the stored response cannot be written (a trigger makes it fail
/// here), the layer rolls everything back and answers `503`: no charge row is left behind, and
/// the retry with the same key charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_charge_whose_response_cannot_be_stored_leaves_no_row() {
    bounded(async {
        let h = Harness::start(Backend::Postgres).await;
        let pool = h.db.as_ref().unwrap().pool().clone();
        let counts = || charges_and_records(&pool);
        sqlx::raw_sql(
            "CREATE FUNCTION fail_completion() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'injected: the response cannot be stored'; END $$;
             CREATE TRIGGER fail_completion BEFORE UPDATE OF status ON idempotency.records
             FOR EACH ROW WHEN (NEW.status IS NOT NULL) EXECUTE FUNCTION fail_completion();",
        )
        .execute(&pool)
        .await
        .unwrap();
        let api_key = new_api_key();
        let key = new_key();
        let unavailable = h
            .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
            .await;
        let error = unavailable.problem(StatusCode::SERVICE_UNAVAILABLE, "StoreUnavailable");
        // An outage, as Stripe's libraries know it: `api_error`, to be retried with the same key.
        assert_eq!(error["type"], "api_error");
        assert_eq!(unavailable.should_retry(), Some(true));
        assert!(unavailable.headers.contains_key("retry-after"));
        assert_eq!(counts().await, (0, 0), "the charge row was rolled back");

        sqlx::raw_sql("DROP TRIGGER fail_completion ON idempotency.records")
            .execute(&pool)
            .await
            .unwrap();
        let retry = h
            .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
            .await;
        assert_eq!(retry.status, StatusCode::OK);
        assert!(!retry.replayed());
        assert_eq!(counts().await, (1, 1), "charged once");
    })
    .await
}

/// PostgreSQL only: both sets of migrations, each in its own table, re-runnable; and what a
/// charge leaves in the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migrations_live_apart_and_charges_are_rows() {
    bounded(async {
        let h = Harness::start(Backend::Postgres).await;
        let pool = h.db.as_ref().unwrap().pool();
        // Again: a restart applies nothing and fails on nothing.
        charges_demo::migrate(pool)
            .await
            .expect("migrations are re-runnable");

        let applied = |table: &'static str| async move {
            sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!(
                "SELECT description FROM {table} WHERE success ORDER BY version"
            )))
            .fetch_all(pool)
            .await
            .unwrap_or_else(|e| panic!("{table}: {e}"))
        };
        assert_eq!(
            applied("public._sqlx_migrations").await,
            ["create charges", "create refunds"]
        );
        // Every migration the store ships, in order, in the store's own table.
        let shipped: Vec<String> = tower_idempotency::store::PostgresStore::migrator()
            .iter()
            .map(|m| m.description.to_string())
            .collect();
        assert_eq!(shipped.first().map(String::as_str), Some("create records"));
        assert_eq!(applied("idempotency._sqlx_migrations").await, shipped);

        let api_key = new_api_key();
        let reply = h
            .send(charge(
                &api_key,
                Some(&new_key()),
                "amount=4200&currency=gbp&metadata[k]=v",
            ))
            .await;
        assert_eq!(reply.status, StatusCode::OK);
        let id = reply.json()["id"].as_str().unwrap().to_owned();
        let (amount, status, metadata): (i64, String, String) =
            sqlx::query_as("SELECT amount, status, metadata::text FROM charges WHERE id = $1")
                .bind(&id)
                .fetch_one(pool)
                .await
                .unwrap();
        assert_eq!((amount, status.as_str()), (4200, "succeeded"));
        assert_eq!(metadata, r#"{"k": "v"}"#);
        let completed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotency.records WHERE status = 200")
                .fetch_one(pool)
                .await
                .unwrap();
        assert_eq!(completed, 1, "the response is stored for replay");
    })
    .await
}
