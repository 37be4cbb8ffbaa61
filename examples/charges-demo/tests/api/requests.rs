//! What every request meets before its handler: authentication, the key, the body's limits, request
//! ids and echoed headers, unknown URLs.

use axum::{body::Body, http::Request, http::StatusCode};
use base64::{Engine, engine::general_purpose::STANDARD};

use crate::common::{Backend, Harness, charge, get, is_request_id, new_api_key, new_key};

on_every_backend!(
    idempotency_key_is_required,
    authentication_is_required_and_checked,
    basic_auth_with_the_key_as_user_name,
    a_malformed_key_is_400_and_not_echoed,
    a_body_over_the_limit_is_413,
    an_unreadable_body_is_400,
    every_response_has_a_request_id_of_its_own,
    responses_to_keyed_requests_echo_the_key,
    a_replay_names_its_original_request,
    unknown_urls_and_methods,
);

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
