//! The handlers: authorize, list.

use axum::{
    Json,
    body::Bytes,
    extract::State,
    response::{IntoResponse, Response},
};
use http::{HeaderMap, StatusCode, header};
use serde_json::json;
use tower_idempotency::IdempotencyContext;

use crate::{Acquirer, Authorization, Decision, decide, params::AuthorizeParams};

/// `POST /v1/authorizations`, under the idempotency layer: decide the card, keep the
/// authorization, answer it. Bad input is a `400`, which the layer releases.
pub(crate) async fn authorize(
    State(acquirer): State<Acquirer>,
    idempotency: IdempotencyContext,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok());
    let params = match AuthorizeParams::parse(content_type, &body) {
        Ok(params) => params,
        Err(error) => {
            let body = json!({"error": {"type": "invalid_request_error", "param": error.param,
                                        "message": error.message}});
            return (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
    };
    if !acquirer.settings.delay.is_zero() {
        tokio::time::sleep(acquirer.settings.delay).await;
    }
    let decision = decide(&params.source);
    let authorization = Authorization {
        id: format!("auth_{}", uuid::Uuid::new_v4().simple()),
        object: "authorization",
        amount: params.amount,
        currency: params.currency,
        status: decision.status(),
        decline_code: match decision {
            Decision::Approved => None,
            Decision::Declined(decline) => Some(decline.code),
        },
        idempotency_key: idempotency.key().as_str().to_owned(),
        reference: params.reference,
    };
    tracing::info!(
        id = %authorization.id,
        amount = authorization.amount,
        status = authorization.status,
        key = %authorization.idempotency_key,
        "authorized"
    );
    acquirer.push(authorization.clone());
    if let (Some(sender), Some(charge), Decision::Approved) =
        (&acquirer.webhooks, &authorization.reference, decision)
    {
        sender.settle_later(charge.clone());
    }
    (StatusCode::OK, Json(authorization)).into_response()
}

/// `GET /v1/authorizations`: every authorization made, oldest first.
pub(crate) async fn list(State(acquirer): State<Acquirer>) -> Response {
    Json(json!({"object": "list", "data": acquirer.authorizations()})).into_response()
}
