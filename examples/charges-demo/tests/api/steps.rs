//! Charges through the acquirer as steps: a failing acquirer is an outage the client retries
//! with the same key, never a decline, and every charge is one authorization.

use std::time::Duration;

use acquirer::{Acquirer, Settings};
use axum::http::StatusCode;
use charges_demo::processor::CardProcessor;

use crate::common::{Backend, Harness, charge, new_api_key, new_key};

on_every_backend!(
    a_failing_acquirer_is_a_503_and_the_retry_authorizes_once,
    a_declined_card_is_one_authorization_and_replayed,
);

async fn harness(backend: Backend, acquirer: &Acquirer) -> Harness {
    let processor = CardProcessor::in_process(acquirer.clone(), Duration::ZERO);
    Harness::with_processor(backend, processor).await
}

async fn a_failing_acquirer_is_a_503_and_the_retry_authorizes_once(backend: Backend) {
    let acquirer = Acquirer::new(Settings {
        fail_rate: 0.6,
        seed: Some(3),
        ..Settings::default()
    });
    let h = harness(backend, &acquirer).await;
    let (api_key, key) = (new_api_key(), new_key());
    let mut outages = 0;
    let answer = loop {
        let reply = h
            .send(charge(&api_key, Some(&key), "amount=700&currency=usd"))
            .await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE {
            break reply;
        }
        let error = reply.stripe_error(StatusCode::SERVICE_UNAVAILABLE, "api_error");
        assert!(
            error["message"]
                .as_str()
                .unwrap()
                .contains("same Idempotency-Key")
        );
        outages += 1;
        assert!(outages < 50, "the acquirer never answered");
    };
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.json());
    assert!(outages > 0, "the seed makes the first calls fail");
    assert_eq!(acquirer.authorizations().len(), 1, "authorized once");
    assert_eq!(h.charges_of(&api_key).await.len(), 1, "charged once");
}

async fn a_declined_card_is_one_authorization_and_replayed(backend: Backend) {
    let acquirer = Acquirer::new(Settings::default());
    let h = harness(backend, &acquirer).await;
    let (api_key, key) = (new_api_key(), new_key());
    let form = "amount=700&currency=usd&source=tok_chargeDeclined";
    let first = h.send(charge(&api_key, Some(&key), form)).await;
    let error = first.stripe_error(StatusCode::PAYMENT_REQUIRED, "card_error");
    assert_eq!(error["decline_code"], "generic_decline");
    let again = h.send(charge(&api_key, Some(&key), form)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    let made = acquirer.authorizations();
    assert_eq!(made.len(), 1);
    assert_eq!(made[0].status, "declined");
}
