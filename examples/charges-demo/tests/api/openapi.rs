//! The published OpenAPI description of the layer's contract, against what the API does.

use axum::{body::Body, http::Request, http::StatusCode};
use serde_json::json;

use crate::common::{Backend, Harness, charge, new_api_key, new_key, refund};

on_every_backend!(the_published_description_says_what_the_layer_does);

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
    assert!(listed(missing.status, "missing-key"), "{}", missing.status);
    let key = new_key();
    h.send(charge(&api_key, Some(&key), "amount=100&currency=usd"))
        .await;
    let reused = h
        .send(charge(&api_key, Some(&key), "amount=200&currency=usd"))
        .await;
    assert!(
        listed(reused.status, "fingerprint-mismatch"),
        "{}",
        reused.status
    );
    let charge_id = h.charged(&api_key, 100).await;
    let on_a_refund = h
        .send(refund(&api_key, Some(&key), &format!("charge={charge_id}")))
        .await;
    assert!(
        listed(on_a_refund.status, "fingerprint-mismatch"),
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
