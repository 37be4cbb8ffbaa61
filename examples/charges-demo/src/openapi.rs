//! The demo's published API description, served at `GET /openapi.json`: its operations, and on
//! each that writes, the idempotency layer's contract as the layer is configured (the key
//! header, its refusals in the demo's Stripe shape, `Idempotent-Replayed`, the TTL in words).

use tower_idempotency::{IdempotencyLayer, store::Store};
use utoipa::openapi::{
    ComponentsBuilder, ContentBuilder, InfoBuilder, ObjectBuilder, OpenApi, OpenApiBuilder,
    PathItem, PathsBuilder, Ref, RefOr, Required, ResponseBuilder, Type,
    path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn},
    request_body::RequestBodyBuilder,
    security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme},
};

/// The paths whose `POST` runs under the idempotency layer.
pub const IDEMPOTENT_PATHS: [&str; 2] = ["/v1/charges", "/v1/refunds"];

/// The document for an app built with `idempotency`.
pub fn document<St: Store>(idempotency: &IdempotencyLayer<St>) -> OpenApi {
    let mut doc = OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("charges-demo")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "A Stripe-style payments API whose writes run once per Idempotency-Key",
                )),
        )
        .paths(
            PathsBuilder::new()
                .path(
                    "/v1/charges",
                    PathItem::new(HttpMethod::Post, create_charge()),
                )
                .path(
                    "/v1/charges/{id}",
                    PathItem::new(HttpMethod::Get, retrieve("charge", "Charge")),
                )
                .path(
                    "/v1/refunds",
                    PathItem::new(HttpMethod::Post, create_refund()),
                )
                .path(
                    "/v1/refunds/{id}",
                    PathItem::new(HttpMethod::Get, retrieve("refund", "Refund")),
                ),
        )
        .components(Some(
            ComponentsBuilder::new()
                .schema("Charge", charge_schema())
                .schema("Refund", refund_schema())
                .schema("StripeError", stripe_error_schema())
                .schema("Error", error_schema())
                .schema("Refusal", refusal_schema())
                .security_scheme(
                    "api_key",
                    SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
                )
                .build(),
        ))
        .security(Some([SecurityRequirement::new("api_key", [""; 0])]))
        .build();
    for (path, object) in [("/v1/charges", "charge"), ("/v1/refunds", "refund")] {
        if let Some(item) = doc.paths.paths.get_mut(path) {
            item.get = Some(list(object));
        }
    }
    crate::openapi_webhooks::add_to(&mut doc);
    idempotency
        .openapi()
        .with_refusal_schema(Ref::from_schema_name("Refusal"))
        .apply_to(&mut doc, IDEMPOTENT_PATHS);
    doc
}

fn json(schema: &str) -> utoipa::openapi::Content {
    ContentBuilder::new()
        .schema(Some(Ref::from_schema_name(schema)))
        .build()
}

fn error_response(description: &str) -> utoipa::openapi::Response {
    ResponseBuilder::new()
        .description(description)
        .content("application/json", json("Error"))
        .build()
}

fn create_charge() -> utoipa::openapi::path::Operation {
    let params = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property(
            "amount",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .description(Some("In the currency's smallest unit")),
        )
        .property("currency", ObjectBuilder::new().schema_type(Type::String))
        .property(
            "source",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some(
                    "A test card token (`tok_visa`, `tok_chargeDeclined`...)",
                )),
        )
        .property(
            "description",
            ObjectBuilder::new().schema_type(Type::String),
        )
        .property("metadata", ObjectBuilder::new().schema_type(Type::Object))
        .required("amount")
        .required("currency")
        .build();
    OperationBuilder::new()
        .operation_id(Some("create_charge"))
        .summary(Some("Create a charge"))
        .request_body(Some(form_or_json(params)))
        .response(
            "200",
            ResponseBuilder::new()
                .description("The charge")
                .content("application/json", json("Charge")),
        )
        .response(
            "400",
            error_response("Invalid parameters (`invalid_request_error`)"),
        )
        .response("401", error_response("No or an invalid API key"))
        .response(
            "402",
            error_response("The card was declined (`card_error`)"),
        )
        .build()
}

/// A request body of `params`, form-encoded (as Stripe's libraries send it) or JSON.
fn form_or_json(
    params: utoipa::openapi::schema::Object,
) -> utoipa::openapi::request_body::RequestBody {
    RequestBodyBuilder::new()
        .content(
            "application/x-www-form-urlencoded",
            ContentBuilder::new().schema(Some(params.clone())).build(),
        )
        .content(
            "application/json",
            ContentBuilder::new().schema(Some(params)).build(),
        )
        .required(Some(Required::True))
        .build()
}

fn create_refund() -> utoipa::openapi::path::Operation {
    let params = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property(
            "charge",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some("The charge to refund, `ch_...`")),
        )
        .property(
            "amount",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .description(Some(
                    "At most what is left of the charge; by default, all of it",
                )),
        )
        .property("metadata", ObjectBuilder::new().schema_type(Type::Object))
        .required("charge")
        .build();
    OperationBuilder::new()
        .operation_id(Some("create_refund"))
        .summary(Some("Refund a charge, in part or in full"))
        .request_body(Some(form_or_json(params)))
        .response(
            "200",
            ResponseBuilder::new()
                .description("The refund")
                .content("application/json", json("Refund")),
        )
        .response(
            "400",
            error_response(
                "Invalid parameters, or not refundable so (`amount_too_large`, \
                 `charge_already_refunded`, `charge_not_refundable`)",
            ),
        )
        .response("401", error_response("No or an invalid API key"))
        .response("404", error_response("No such charge on this account"))
        .build()
}

fn list(object: &str) -> utoipa::openapi::path::Operation {
    OperationBuilder::new()
        .operation_id(Some(format!("list_{object}s")))
        .summary(Some(format!("List the account's {object}s, newest first")))
        .parameter(
            ParameterBuilder::new()
                .name("limit")
                .parameter_in(ParameterIn::Query)
                .schema(Some(ObjectBuilder::new().schema_type(Type::Integer))),
        )
        .parameter(
            ParameterBuilder::new()
                .name("starting_after")
                .parameter_in(ParameterIn::Query)
                .schema(Some(ObjectBuilder::new().schema_type(Type::String))),
        )
        .response(
            "200",
            ResponseBuilder::new().description(format!("A page of {object}s (`object: list`)")),
        )
        .response("401", error_response("No or an invalid API key"))
        .build()
}

fn retrieve(object: &str, schema: &str) -> utoipa::openapi::path::Operation {
    OperationBuilder::new()
        .operation_id(Some(format!("retrieve_{object}")))
        .summary(Some(format!("Retrieve a {object} of the account")))
        .parameter(
            ParameterBuilder::new()
                .name("id")
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .schema(Some(ObjectBuilder::new().schema_type(Type::String))),
        )
        .response(
            "200",
            ResponseBuilder::new()
                .description(format!("The {object}"))
                .content("application/json", json(schema)),
        )
        .response("401", error_response("No or an invalid API key"))
        .response(
            "404",
            error_response(&format!("No such {object} on this account")),
        )
        .build()
}

fn charge_schema() -> RefOr<utoipa::openapi::Schema> {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some("A charge, in Stripe's wire format"))
        .property("id", ObjectBuilder::new().schema_type(Type::String))
        .property("object", ObjectBuilder::new().schema_type(Type::String))
        .property("amount", ObjectBuilder::new().schema_type(Type::Integer))
        .property("currency", ObjectBuilder::new().schema_type(Type::String))
        .property("status", ObjectBuilder::new().schema_type(Type::String))
        .property("paid", ObjectBuilder::new().schema_type(Type::Boolean))
        .property(
            "amount_refunded",
            ObjectBuilder::new().schema_type(Type::Integer),
        )
        .property(
            "refunded",
            ObjectBuilder::new()
                .schema_type(Type::Boolean)
                .description(Some("Whether it is refunded in full")),
        )
        .property("created", ObjectBuilder::new().schema_type(Type::Integer))
        .build()
        .into()
}

fn refund_schema() -> RefOr<utoipa::openapi::Schema> {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some("A refund, in Stripe's wire format"))
        .property("id", ObjectBuilder::new().schema_type(Type::String))
        .property("object", ObjectBuilder::new().schema_type(Type::String))
        .property("amount", ObjectBuilder::new().schema_type(Type::Integer))
        .property("charge", ObjectBuilder::new().schema_type(Type::String))
        .property("currency", ObjectBuilder::new().schema_type(Type::String))
        .property("status", ObjectBuilder::new().schema_type(Type::String))
        .property("created", ObjectBuilder::new().schema_type(Type::Integer))
        .build()
        .into()
}

fn stripe_error_schema() -> RefOr<utoipa::openapi::Schema> {
    let string = || ObjectBuilder::new().schema_type(Type::String);
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some("Stripe's error object"))
        .property("type", string())
        .property("code", string())
        .property("message", string())
        .property("param", string())
        .property("doc_url", string())
        .required("type")
        .required("message")
        .build()
        .into()
}

fn error_schema() -> RefOr<utoipa::openapi::Schema> {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some("Stripe's error envelope"))
        .property("error", Ref::from_schema_name("StripeError"))
        .required("error")
        .build()
        .into()
}

/// A refusal of the idempotency layer as the demo renders it: an RFC 9457 problem document
/// whose `error` member is Stripe's error object (see [`refusals`](crate::refusals)).
fn refusal_schema() -> RefOr<utoipa::openapi::Schema> {
    let string = || ObjectBuilder::new().schema_type(Type::String);
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "A refusal by the idempotency layer: an RFC 9457 problem document carrying Stripe's \
             error object in `error`",
        ))
        .property("type", string())
        .property("title", string())
        .property("status", ObjectBuilder::new().schema_type(Type::Integer))
        .property("detail", string())
        .property("error", Ref::from_schema_name("StripeError"))
        .required("type")
        .required("title")
        .required("status")
        .required("error")
        .build()
        .into()
}
