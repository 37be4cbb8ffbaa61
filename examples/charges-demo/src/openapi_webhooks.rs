//! The OpenAPI operations of `GET /v1/balance` and `POST /v1/webhooks/acquirer`
//! ([`crate::webhooks`]), for [`crate::openapi::document`].

use utoipa::openapi::{
    ContentBuilder, ObjectBuilder, OpenApi, PathItem, Ref, Required, ResponseBuilder, Type,
    path::{HttpMethod, Operation, OperationBuilder, ParameterBuilder, ParameterIn},
    request_body::RequestBodyBuilder,
    security::SecurityRequirement,
};

fn error(description: &str) -> utoipa::openapi::Response {
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("Error")))
                .build(),
        )
        .build()
}

fn any_json(description: &str) -> utoipa::openapi::Response {
    let object = ObjectBuilder::new().schema_type(Type::Object).build();
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            ContentBuilder::new().schema(Some(object)).build(),
        )
        .build()
}

/// Adds `GET /v1/balance` and `POST /v1/webhooks/acquirer` to `doc`.
pub(crate) fn add_to(doc: &mut OpenApi) {
    let paths = &mut doc.paths.paths;
    paths.insert(
        "/v1/balance".into(),
        PathItem::new(HttpMethod::Get, balance()),
    );
    let webhook = PathItem::new(HttpMethod::Post, acquirer_webhook());
    paths.insert("/v1/webhooks/acquirer".into(), webhook);
}

/// `GET /v1/balance`.
fn balance() -> Operation {
    OperationBuilder::new()
        .operation_id(Some("retrieve_balance"))
        .summary(Some("Retrieve the balance"))
        .description(Some(
            "Stripe's balance object: `available` is what settled charges brought in less their \
             refunds; `pending` is succeeded charges not settled yet, less their refunds.",
        ))
        .response("200", any_json("The balance (`object: balance`)"))
        .response("401", error("No or an invalid API key"))
        .build()
}

/// `POST /v1/webhooks/acquirer`: authenticated by its signature, not by an API key.
fn acquirer_webhook() -> Operation {
    let header = |name: &str, description: &str| {
        ParameterBuilder::new()
            .name(name)
            .parameter_in(ParameterIn::Header)
            .required(Required::True)
            .description(Some(description))
            .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
            .build()
    };
    let event = ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            r#"{"id": "evt_...", "type": "charge.settled", "data": {"object": {"id": "ch_..."}}}"#,
        ))
        .build();
    OperationBuilder::new()
        .operation_id(Some("receive_acquirer_webhook"))
        .summary(Some("Receive the acquirer's events (Standard Webhooks)"))
        .description(Some(
            "Each webhook-id is handled once: a redelivery gets the first answer. \
             `charge.settled` moves the charge from pending to available, once per charge.",
        ))
        .parameter(header("webhook-id", "The event's id: the idempotency key"))
        .parameter(header(
            "webhook-timestamp",
            "Unix seconds, within five minutes",
        ))
        .parameter(header("webhook-signature", "`v1,<base64 HMAC-SHA256>`"))
        .request_body(Some(
            RequestBodyBuilder::new()
                .content(
                    "application/json",
                    ContentBuilder::new().schema(Some(event)).build(),
                )
                .required(Some(Required::True))
                .build(),
        ))
        .securities(Some(Vec::<SecurityRequirement>::new()))
        .response("200", any_json("Handled, or acknowledged and ignored"))
        .response("400", error("Bad signature, stale timestamp or bad event"))
        .response(
            "404",
            error("No such charge; not recorded, so a redelivery runs"),
        )
        .response(
            "409",
            error("Another delivery of the event is being handled"),
        )
        .response(
            "422",
            error("The webhook-id was delivered with another body"),
        )
        .build()
}
