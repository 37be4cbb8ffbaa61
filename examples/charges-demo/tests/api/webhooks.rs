//! Issue 37.2: the acquirer's `charge.settled` webhooks settle a charge exactly once, and
//! `GET /v1/balance` shows it: redeliveries (twenty at once), a second event for one charge,
//! forged, stale and future deliveries, an unknown charge, refunds before and after settlement.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::{body::Body, http::Request, http::StatusCode};
use charges_demo::webhooks::DEV_WEBHOOK_SECRET;
use serde_json::json;

use crate::common::{Backend, Harness, Reply, get, new_api_key, new_key, refund};

on_every_backend!(
    settling_moves_pending_to_available_once,
    twenty_concurrent_redeliveries_settle_once,
    refused_deliveries_change_nothing,
    an_unknown_charge_is_404_and_not_recorded,
    refunds_before_and_after_settlement,
    other_event_types_are_acknowledged,
    the_acquirer_settles_every_charge_once_despite_duplicates,
);

const FORGED_SECRET: &str = "whsec_Zm9yZ2VkIHNlY3JldCBmb3IgdGhlIHRlc3RzIQ==";

fn now() -> i64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    i64::try_from(since.as_secs()).unwrap()
}

fn settled(event: &str, charge: &str) -> String {
    json!({"id": event, "type": "charge.settled", "data": {"object": {"id": charge}}}).to_string()
}

/// `POST /v1/webhooks/acquirer` of `body` as `event`, signed with `secret` at `timestamp`.
fn delivery(secret: &str, event: &str, timestamp: i64, body: &str) -> Request<Body> {
    let signer = standardwebhooks::Webhook::new(secret).unwrap();
    let signature = signer.sign(event, timestamp, body.as_bytes()).unwrap();
    Request::post("/v1/webhooks/acquirer")
        .header("content-type", "application/json")
        .header("webhook-id", event)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn signed(event: &str, body: &str) -> Request<Body> {
    delivery(DEV_WEBHOOK_SECRET, event, now(), body)
}

/// The account's balance as `(available, pending)` in usd.
async fn balance(h: &Harness, api_key: &str) -> (i64, i64) {
    let reply = h.send(get(api_key, "/v1/balance")).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let balance = reply.json();
    assert_eq!(balance["object"], "balance", "{balance}");
    let usd = |side: &str| {
        let funds = &balance[side][0];
        assert_eq!(funds["currency"], "usd", "{balance}");
        funds["amount"].as_i64().unwrap()
    };
    (usd("available"), usd("pending"))
}

fn settlement(reply: &Reply) -> serde_json::Value {
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let receipt = reply.json();
    assert_eq!(receipt["received"], true, "{receipt}");
    receipt["settlement"].clone()
}

/// A settled charge moves from pending to available once: a redelivery gets the first answer,
/// another event for the same charge adds nothing.
async fn settling_moves_pending_to_available_once(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    assert_eq!(balance(&h, &api_key).await, (0, 0));
    let id = h.charged(&api_key, 2000).await;
    assert_eq!(balance(&h, &api_key).await, (0, 2000));

    let first = settlement(&h.send(signed("evt_1", &settled("evt_1", &id))).await);
    assert_eq!(
        first,
        json!({"outcome": "settled", "amount": 2000, "currency": "usd"})
    );
    assert_eq!(balance(&h, &api_key).await, (2000, 0));
    let again = settlement(&h.send(signed("evt_1", &settled("evt_1", &id))).await);
    assert_eq!(again, first, "a redelivery gets the first answer");
    let second = settlement(&h.send(signed("evt_2", &settled("evt_2", &id))).await);
    assert_eq!(second, json!({"outcome": "already_settled"}));
    assert_eq!(balance(&h, &api_key).await, (2000, 0));
    // The balance is the account's own.
    assert_eq!(balance(&h, &new_api_key()).await, (0, 0));
    let anonymous = Request::get("/v1/balance").body(Body::empty()).unwrap();
    assert_eq!(h.send(anonymous).await.status, StatusCode::UNAUTHORIZED);
}

/// Twenty deliveries of one event at once: all answered `200` with one settlement.
async fn twenty_concurrent_redeliveries_settle_once(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let id = h.charged(&api_key, 700).await;
    let body = settled("evt_20", &id);
    let replies =
        futures_util::future::join_all((0..20).map(|_| h.send(signed("evt_20", &body)))).await;
    for reply in &replies {
        let answer = settlement(reply);
        assert_eq!(
            answer,
            json!({"outcome": "settled", "amount": 700, "currency": "usd"})
        );
    }
    assert_eq!(balance(&h, &api_key).await, (700, 0));
}

/// Forged, stale, future (up to the ends of `i64`) and incomplete deliveries are `400` Stripe
/// errors and claim nothing: the genuine delivery of the same event then settles.
async fn refused_deliveries_change_nothing(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let id = h.charged(&api_key, 900).await;
    let body = settled("evt_3", &id);
    let cases = [
        (
            delivery(FORGED_SECRET, "evt_3", now(), &body),
            "webhook_signature_invalid",
        ),
        (
            delivery(DEV_WEBHOOK_SECRET, "evt_3", now() - 301, &body),
            "webhook_timestamp_out_of_tolerance",
        ),
        (
            delivery(DEV_WEBHOOK_SECRET, "evt_3", now() + 301, &body),
            "webhook_timestamp_out_of_tolerance",
        ),
        // Forged at the ends of i64: refused, never a panic in the verifier (issue 44).
        (
            delivery(DEV_WEBHOOK_SECRET, "evt_3", i64::MIN, &body),
            "webhook_timestamp_out_of_tolerance",
        ),
        (
            delivery(DEV_WEBHOOK_SECRET, "evt_3", i64::MIN + 1, &body),
            "webhook_timestamp_out_of_tolerance",
        ),
        (
            delivery(DEV_WEBHOOK_SECRET, "evt_3", i64::MAX, &body),
            "webhook_timestamp_out_of_tolerance",
        ),
    ];
    for (request, code) in cases {
        let error = h
            .send(request)
            .await
            .stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["code"], code, "{error}");
    }
    let mut unsigned = signed("evt_3", &body);
    unsigned.headers_mut().remove("webhook-signature");
    let error = h
        .send(unsigned)
        .await
        .stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(error["code"], "webhook_invalid", "{error}");
    let not_json = signed("evt_3", "settle everything");
    h.send(not_json)
        .await
        .stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
    assert_eq!(balance(&h, &api_key).await, (0, 900), "nothing changed");

    let genuine = settlement(&h.send(signed("evt_3", &body)).await);
    assert_eq!(genuine["outcome"], "settled");
    assert_eq!(balance(&h, &api_key).await, (900, 0));
}

/// An event for a charge the demo does not have is `404` and not recorded as handled: the same
/// `webhook-id` runs again (a recorded one would replay, or refuse another body as `422`).
async fn an_unknown_charge_is_404_and_not_recorded(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let unknown = settled("evt_4", "ch_unknown");
    for _ in 0..2 {
        let error = h
            .send(signed("evt_4", &unknown))
            .await
            .stripe_error(StatusCode::NOT_FOUND, "invalid_request_error");
        assert_eq!(error["code"], "resource_missing", "{error}");
    }
    let id = h.charged(&api_key, 300).await;
    let known = settlement(&h.send(signed("evt_4", &settled("evt_4", &id))).await);
    assert_eq!(known["outcome"], "settled");
    // Now recorded: the id with another body is refused.
    let reused = h.send(signed("evt_4", &unknown)).await;
    reused.stripe_error(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_error");
    assert_eq!(balance(&h, &api_key).await, (300, 0));
}

/// A refund before settlement lowers what it adds; one after takes its amount back from
/// available.
async fn refunds_before_and_after_settlement(backend: Backend) {
    let h = Harness::start(backend).await;
    let api_key = new_api_key();
    let id = h.charged(&api_key, 2000).await;
    let refunded = |amount: i64| {
        refund(
            &api_key,
            Some(&new_key()),
            &format!("charge={id}&amount={amount}"),
        )
    };
    assert_eq!(h.send(refunded(500)).await.status, StatusCode::OK);
    assert_eq!(balance(&h, &api_key).await, (0, 1500));
    let settled_amount = settlement(&h.send(signed("evt_5", &settled("evt_5", &id))).await);
    assert_eq!(settled_amount["amount"], 1500);
    assert_eq!(balance(&h, &api_key).await, (1500, 0));
    assert_eq!(h.send(refunded(300)).await.status, StatusCode::OK);
    assert_eq!(balance(&h, &api_key).await, (1200, 0));
}

/// Event types the demo does not handle are acknowledged, so the sender stops retrying them.
async fn other_event_types_are_acknowledged(backend: Backend) {
    let h = Harness::start(backend).await;
    let body =
        json!({"id": "evt_6", "type": "charge.disputed", "data": {"object": {"id": "ch_1"}}});
    let reply = h.send(signed("evt_6", &body.to_string())).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(reply.json(), json!({"received": true, "ignored": true}));
}

/// End to end: the acquirer, told each charge's id with its authorization, sends every
/// `charge.settled` event three times (two at once, one redelivery) to the demo over HTTP; the
/// balance ends at the sum of the charges, settled once each.
async fn the_acquirer_settles_every_charge_once_despite_duplicates(backend: Backend) {
    idempotency_tests::init_tracing();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/v1/webhooks/acquirer",
        listener.local_addr().unwrap()
    );
    let sender = acquirer::WebhookSender::new(acquirer::WebhookSettings {
        url,
        secret: DEV_WEBHOOK_SECRET.to_owned(),
        settle_after: std::time::Duration::ZERO,
        duplicate_rate: 1.0,
    })
    .unwrap();
    let network = acquirer::Acquirer::new(acquirer::Settings::default()).with_webhooks(sender);
    let processor = charges_demo::processor::CardProcessor::in_process(
        network.clone(),
        std::time::Duration::ZERO,
    );
    let h = Harness::with_processor(backend, processor).await;
    tokio::spawn(axum::serve(listener, h.app.clone()).into_future());

    let api_key = new_api_key();
    let mut ids = Vec::new();
    for amount in [100, 200, 300] {
        ids.push(h.charged(&api_key, amount).await);
    }
    let references: Vec<_> = network
        .authorizations()
        .into_iter()
        .filter_map(|a| a.reference)
        .collect();
    assert_eq!(references, ids, "the acquirer was told each charge's id");
    // Nothing signals the acquirer's last delivery: poll the balance, bounded.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while balance(&h, &api_key).await != (600, 0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            balance(&h, &api_key).await
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
