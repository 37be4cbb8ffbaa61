//! Errors in Stripe's wire format: `{"error": {"type": ..., "message": ..., ...}}`.
//!
//! Every error the demo's own handlers and authentication answer is an [`ApiError`], so Stripe's
//! client libraries raise their usual exceptions (`InvalidRequestError`, `CardError`,
//! `AuthenticationError`...). Refusals by the idempotency layer itself (a missing key, a request
//! still in flight, a key reused for another request) are RFC 9457 problem documents that carry
//! the same kind of error object in their `error` member; see [`crate::refusals`].

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;
use tower_idempotency::Retention;

use crate::refusals::STRIPE_SHOULD_RETRY;

/// Stripe's error `type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    /// The request was wrong: bad parameters, credentials or URL. Retrying it unchanged fails
    /// the same way.
    InvalidRequestError,
    /// The card was declined.
    CardError,
    /// An idempotency key was reused for a request with other parameters.
    IdempotencyError,
    /// Something went wrong on the server.
    ApiError,
}

/// A Stripe-style error response; see the [module documentation](self).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    status: StatusCode,
    /// Alphabetical, as Stripe orders the members. Boxed strings keep the error, which every
    /// handler's `Result` carries, small.
    #[serde(skip_serializing_if = "Option::is_none")]
    charge: Option<Box<str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decline_code: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    doc_url: Option<&'static str>,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<Box<str>>,
    #[serde(rename = "type")]
    kind: ErrorType,
    /// What the idempotency layer does with the key (default: its policy for the status).
    #[serde(skip)]
    retention: Option<Retention>,
}

impl ApiError {
    /// A `400 invalid_request_error` about parameter `param`, with Stripe's error `code`.
    pub fn invalid_param(
        param: impl Into<String>,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            ErrorType::InvalidRequestError,
            message,
        )
        .with_code(code)
        .with_param(param)
    }

    /// A `400 invalid_request_error` for a required parameter that is absent.
    pub fn missing_param(param: &str) -> Self {
        Self::invalid_param(
            param,
            "parameter_missing",
            format!("Missing required param: {param}."),
        )
    }

    /// A `400 invalid_request_error` for a parameter this endpoint does not take.
    pub fn unknown_param(param: &str) -> Self {
        Self::invalid_param(
            param,
            "parameter_unknown",
            format!("Received unknown parameter: {param}"),
        )
    }

    /// A `400 invalid_request_error` about the request as a whole (its body or content type).
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            ErrorType::InvalidRequestError,
            message,
        )
    }

    /// A `401 invalid_request_error`: no usable API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            ErrorType::InvalidRequestError,
            message,
        )
    }

    /// A `404 invalid_request_error` for an object that does not exist (for this account).
    pub fn no_such(object: &str, id: &str, param: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequestError,
            format!("No such {object}: '{id}'"),
        )
        .with_code("resource_missing")
        .with_param(param)
    }

    /// A `402 card_error` / `card_declined` for the declined charge `charge`.
    pub fn card_declined(
        charge: impl Into<String>,
        decline_code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        let mut error = Self::new(StatusCode::PAYMENT_REQUIRED, ErrorType::CardError, message)
            .with_code("card_declined");
        error.decline_code = Some(decline_code);
        error.charge = Some(charge.into().into_boxed_str());
        error
    }

    /// A `500 api_error`: the server failed; details are logged, not sent.
    pub fn internal() -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorType::ApiError,
            "An unexpected error occurred on the server; it is safe to retry the request with \
             the same Idempotency-Key.",
        )
    }

    /// An error with any status, type and message.
    pub fn new(status: StatusCode, kind: ErrorType, message: impl Into<String>) -> Self {
        Self {
            status,
            charge: None,
            code: None,
            decline_code: None,
            doc_url: None,
            message: message.into(),
            param: None,
            kind,
            retention: None,
        }
    }

    /// Tells the idempotency layer what to do with the key instead of its policy for the
    /// status ([`Retention`]).
    #[must_use]
    pub fn with_retention(mut self, retention: Retention) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Sets Stripe's machine-readable error `code`.
    #[must_use]
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// Sets the page of Stripe's documentation that explains the error.
    #[must_use]
    pub fn with_doc_url(mut self, url: &'static str) -> Self {
        self.doc_url = Some(url);
        self
    }

    /// Sets the parameter the error is about.
    #[must_use]
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into().into_boxed_str());
        self
    }

    /// Sets the HTTP status.
    #[must_use]
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The error `type`.
    pub fn kind(&self) -> ErrorType {
        self.kind
    }

    /// The error `code`, if any.
    pub fn code(&self) -> Option<&'static str> {
        self.code
    }

    /// The documentation page of the error, if any.
    pub fn doc_url(&self) -> Option<&'static str> {
        self.doc_url
    }

    /// The parameter the error is about, if any.
    pub fn param(&self) -> Option<&str> {
        self.param.as_deref()
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        #[derive(Serialize)]
        struct Envelope<'a> {
            error: &'a ApiError,
        }
        let mut response = json(self.status, &Envelope { error: &self });
        if let Some(retention) = self.retention {
            response.extensions_mut().insert(retention);
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // Stripe's libraries retry what this header marks; the pause is the client's floor.
            let headers = response.headers_mut();
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            headers.insert(
                STRIPE_SHOULD_RETRY.clone(),
                HeaderValue::from_static("true"),
            );
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(r#"Bearer realm="charges-demo""#),
            );
        }
        response
    }
}

/// `value` as [`json`] writes it in a body.
pub(crate) fn json_text<T: Serialize>(value: &T) -> Result<String, serde_json::Error> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    Ok(text)
}

/// A response of JSON `body` written already (by [`json_text`]).
pub(crate) fn json_response(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// A JSON response, pretty-printed as Stripe's API answers (readable under `curl`).
pub(crate) fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match json_text(value) {
        Ok(body) => json_response(status, body),
        Err(error) => {
            tracing::error!(%error, "response could not be serialised");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "response serialisation failed",
            )
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialises_in_stripes_shape() {
        let error = ApiError::card_declined("ch_1", "generic_decline", "Your card was declined.");
        assert_eq!(
            serde_json::to_value(&error).unwrap(),
            serde_json::json!({
                "charge": "ch_1",
                "code": "card_declined",
                "decline_code": "generic_decline",
                "message": "Your card was declined.",
                "type": "card_error",
            })
        );
        assert_eq!(error.status(), StatusCode::PAYMENT_REQUIRED);
    }

    #[test]
    fn parameter_errors_name_the_parameter() {
        let error = ApiError::missing_param("amount");
        assert_eq!(error.status(), StatusCode::BAD_REQUEST);
        assert_eq!(error.kind(), ErrorType::InvalidRequestError);
        assert_eq!(error.param(), Some("amount"));
        assert_eq!(error.code(), Some("parameter_missing"));
        assert_eq!(error.message(), "Missing required param: amount.");
    }

    #[test]
    fn unauthorized_carries_a_challenge() {
        let response = ApiError::unauthorized("no key").into_response();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert!(response.headers().contains_key(header::WWW_AUTHENTICATE));
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            HeaderValue::from_static("application/json")
        );
    }
}
