//! The API in process (`app()` with `oneshot`), every scenario on both backends: memory, and
//! PostgreSQL with a database of its own per test.

mod common;

use std::time::{Duration, Instant};

use axum::{body::Body, http::Request, http::StatusCode};
use base64::{Engine, engine::general_purpose::STANDARD};
use common::{
    Backend, Gate, Harness, bounded, charge, charge_json, get, is_request_id, new_api_key, new_key,
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
    for status in ["409", "413", "503"] {
        assert_eq!(
            create["responses"][status]["content"]["application/problem+json"]["schema"]["$ref"],
            "#/components/schemas/Refusal",
            "{status}"
        );
    }
    // Reads are not idempotent writes: no key.
    assert!(
        doc["paths"]["/v1/charges"]["get"]["parameters"]
            .as_array()
            .is_none_or(|parameters| parameters.iter().all(|p| p["name"] != "Idempotency-Key"))
    );

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
    // Stripe's status for it (the layer's own is 422), so that its libraries raise their
    // idempotency error.
    let error = changed.problem(StatusCode::BAD_REQUEST, "Mismatch");
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
        h.send(get(&api_key, "/v1/refunds")).await,
    ];
    let statuses: Vec<u16> = replies.iter().map(|r| r.status.as_u16()).collect();
    assert_eq!(statuses, [200, 200, 400, 400, 402, 400, 401, 200, 404]);
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
    refused.problem(StatusCode::BAD_REQUEST, "Mismatch");
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
    let reply = h.send(get(&api_key, "/v1/refunds")).await;
    let error = reply.stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
    assert!(error["message"].as_str().unwrap().contains("/v1/refunds"));

    let post_to_a_charge = Request::post("/v1/charges/ch_123")
        .header("authorization", format!("Bearer {api_key}"))
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        h.send(post_to_a_charge).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
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
        assert_eq!(applied("public._sqlx_migrations").await, ["create charges"]);
        assert_eq!(
            applied("idempotency._sqlx_migrations").await,
            [
                "create records",
                "partitioned records",
                "uuid scope keys",
                "complete many",
                "autovacuum thresholds",
                "claimants and ttl",
                "settled notifications"
            ]
        );

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
