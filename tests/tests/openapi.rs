//! Issue 30.6: the layer's contract in an app's OpenAPI document follows its configuration.

use std::time::Duration;

use http::HeaderName;
use serde_json::Value;
use tower_idempotency::{
    IdempotencyLayer, KeyRule, KeySource, Rendering, Scope, store::MemoryStore,
};
use utoipa::openapi::{
    HttpMethod, OpenApi, OpenApiBuilder, PathItem, PathsBuilder, ResponseBuilder,
    path::OperationBuilder,
};

/// An app's document: `POST /v1/orders`, `GET /v1/orders`, `POST /v1/internal`.
fn app_document() -> OpenApi {
    let operation = || {
        OperationBuilder::new()
            .response("200", ResponseBuilder::new().description("ok"))
            .build()
    };
    let mut doc = OpenApiBuilder::new()
        .paths(
            PathsBuilder::new()
                .path("/v1/orders", PathItem::new(HttpMethod::Post, operation()))
                .path("/v1/internal", PathItem::new(HttpMethod::Post, operation())),
        )
        .build();
    doc.paths.paths.get_mut("/v1/orders").expect("path").get = Some(operation());
    doc
}

fn as_json(doc: &OpenApi) -> Value {
    serde_json::to_value(doc).expect("serialises")
}

#[test]
fn the_defaults_are_published() {
    let mut doc = app_document();
    IdempotencyLayer::new(MemoryStore::new())
        .openapi()
        .apply(&mut doc);
    let doc = as_json(&doc);
    let post = &doc["paths"]["/v1/orders"]["post"];
    let key = &post["parameters"][0];
    assert_eq!(key["name"], "Idempotency-Key");
    assert_eq!(key["required"], false, "optional unless required()");
    assert!(key["schema"].get("format").is_none());
    assert!(key["description"].as_str().unwrap().contains("for 1 day"));
    assert!(
        key["description"]
            .as_str()
            .unwrap()
            .contains("account and this endpoint")
    );
    for status in ["400", "409", "413", "422", "503"] {
        assert_eq!(
            post["responses"][status]["content"]["application/problem+json"]["schema"]["$ref"],
            "#/components/schemas/IdempotencyProblem",
            "{status}"
        );
    }
    assert!(
        doc["components"]["schemas"]["IdempotencyProblem"]["required"]
            .as_array()
            .unwrap()
            .contains(&Value::from("status"))
    );
    assert_eq!(
        post["responses"]["200"]["headers"]["Idempotent-Replayed"]["schema"]["enum"][0],
        "true"
    );
    // GET is not covered by default.
    assert!(
        doc["paths"]["/v1/orders"]["get"]
            .get("parameters")
            .is_none()
    );
    // Every covered path, when applied everywhere.
    assert_eq!(
        doc["paths"]["/v1/internal"]["post"]["parameters"][0]["name"],
        "Idempotency-Key"
    );
}

#[test]
fn the_settings_are_published() {
    let mut doc = app_document();
    IdempotencyLayer::new(MemoryStore::new())
        .with_key(
            KeySource::header(HeaderName::from_static("x-request-id"))
                .required()
                .with_rule(KeyRule::uuid()),
        )
        .with_ttl(Duration::from_secs(7 * 24 * 3600))
        .expect("ttl")
        .with_scope(Scope::principal_extension().across_endpoints())
        .with_rendering(
            Rendering::problem_details()
                .with_replayed_header(HeaderName::from_static("idempotency-replayed")),
        )
        .openapi()
        .apply_to(&mut doc, ["/v1/orders"]);
    let doc = as_json(&doc);
    let post = &doc["paths"]["/v1/orders"]["post"];
    let key = &post["parameters"][0];
    assert_eq!(key["name"], "X-Request-Id");
    assert_eq!(key["required"], true);
    assert_eq!(key["schema"]["format"], "uuid");
    let said = key["description"].as_str().unwrap();
    assert!(said.contains("for 7 days"), "{said}");
    assert!(said.contains("another endpoint"), "{said}");
    assert!(said.contains("UUIDs"), "{said}");
    assert_eq!(post["x-idempotency"]["ttl_seconds"], 7 * 24 * 3600);
    assert_eq!(post["x-idempotency"]["scope"], "principal");
    assert_eq!(
        post["x-idempotency"]["replayed_header"],
        "Idempotency-Replayed"
    );
    assert_eq!(
        post["x-idempotency"]["refusals"]["422"][0],
        "fingerprint-mismatch"
    );
    let replayed = &post["responses"]["200"]["headers"]["Idempotency-Replayed"];
    assert_eq!(replayed["schema"]["enum"][0], "true");
    // Only the paths named.
    assert!(
        doc["paths"]["/v1/internal"]["post"]
            .get("parameters")
            .is_none()
    );
}
