//! The idempotency layer's refusals, in the two languages the demo's clients speak.
//!
//! Every refusal keeps the layer's status code (those of the IETF draft) and is an RFC 9457
//! problem document (`application/problem+json` with `type`, `title`, `status` and `detail`)
//! whose extension member `error` is the error object Stripe's API sends in the same situation,
//! with a `Stripe-Should-Retry` header saying whether the same request may succeed later:
//!
//! | refusal | status | `error` | `Stripe-Should-Retry` |
//! |---|---|---|---|
//! | no key, a malformed key, an unreadable body | `400` | `invalid_request_error` | `false` |
//! | the body arrived too slowly | `408` | `invalid_request_error` | `true` |
//! | the key's first request is still running | `409` | `invalid_request_error`, code `idempotency_key_in_use` | `true` |
//! | the body is too large | `413` | `invalid_request_error` | `false` |
//! | the key was used with other parameters | `422` | `idempotency_error` | `false` |
//! | no account to scope the key to (a misconfiguration) | `500` | `api_error` | `false` |
//! | the handler panicked, or its transaction failed; nothing kept | `500` | `api_error` | `true` |
//! | the store is down, too many detached handlers, a handler stopped | `503` | `api_error` | `true` |
//!
//! Stripe's client libraries read `error`: without it stripe-node takes the body for a
//! successful response and stripe-python raises a generic "Invalid response object". Both retry
//! by `Stripe-Should-Retry` when it is present, and both pick the exception class by status
//! first: only a `400` or `404` becomes `IdempotencyError` or `InvalidRequestError`. So the
//! `422` for a reused key (Stripe's own API answers `400`) arrives as `APIError` /
//! `StripeAPIError` whose error object is of type `idempotency_error`, and the `409` as one
//! carrying the code above, as Stripe's own `409` does.
//!
//! The message is the layer's `detail`, which never contains the key: error messages end up
//! in logs and error trackers, where a key (often an order number) does not belong.

use axum::body::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};
use serde::Serialize;
use tower_idempotency::{PROBLEM_JSON, Rejection, RejectionKind};

use crate::error::{ApiError, ErrorType};

/// The `Stripe-Should-Retry` response header.
pub static STRIPE_SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");

/// Stripe's page on the `idempotency_key_in_use` error code.
pub const KEY_IN_USE_DOC_URL: &str = "https://docs.stripe.com/error-codes/idempotency-key-in-use";

/// Stripe's page on idempotent requests, for `idempotency_error` (which has no code).
pub const IDEMPOTENCY_DOC_URL: &str = "https://docs.stripe.com/api/idempotent_requests";

/// Renders a refusal of the layer (see the [module documentation](self)); the layer adds
/// `Retry-After` and `Cache-Control: no-store`.
pub fn render(rejection: &Rejection) -> Response<Bytes> {
    #[derive(Serialize)]
    struct Document<'a> {
        #[serde(flatten)]
        problem: serde_json::Map<String, serde_json::Value>,
        error: &'a ApiError,
    }
    let error = stripe_error(rejection);
    let document = Document {
        problem: rejection.problem(None),
        error: &error,
    };
    let body = match serde_json::to_vec_pretty(&document) {
        Ok(mut body) => {
            body.push(b'\n');
            Bytes::from(body)
        }
        Err(failure) => {
            // A map of JSON values and a struct of strings always serialise; the layer's own
            // document is the fallback all the same.
            tracing::error!(%failure, "a refusal could not be serialised");
            rejection.to_json()
        }
    };
    let mut response = Response::new(body);
    *response.status_mut() = rejection.kind().status();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    headers.insert(
        STRIPE_SHOULD_RETRY.clone(),
        HeaderValue::from_static(if should_retry(rejection) {
            "true"
        } else {
            "false"
        }),
    );
    response
}

/// The error object Stripe's API sends where the layer refuses with `rejection`.
pub fn stripe_error(rejection: &Rejection) -> ApiError {
    let kind = rejection.kind();
    let status = kind.status();
    let message = sentence(rejection.detail());
    match kind {
        RejectionKind::InFlight => ApiError::new(status, ErrorType::InvalidRequestError, message)
            .with_code("idempotency_key_in_use")
            .with_doc_url(KEY_IN_USE_DOC_URL),
        RejectionKind::Mismatch => ApiError::new(status, ErrorType::IdempotencyError, message)
            .with_doc_url(IDEMPOTENCY_DOC_URL),
        _ if status.is_client_error() => {
            ApiError::new(status, ErrorType::InvalidRequestError, message)
        }
        _ => ApiError::new(status, ErrorType::ApiError, message),
    }
}

/// Whether the same request, with the same key, may succeed when sent again unchanged.
pub fn should_retry(rejection: &Rejection) -> bool {
    match rejection.kind() {
        RejectionKind::KeyMissing
        | RejectionKind::KeyInvalid
        | RejectionKind::BodyUnreadable
        | RejectionKind::BodyTooLarge
        | RejectionKind::Mismatch
        | RejectionKind::PrincipalMissing => false,
        RejectionKind::BodyTimeout
        | RejectionKind::InFlight
        | RejectionKind::HandlerPanicked
        | RejectionKind::TransactionAborted
        | RejectionKind::StoreUnavailable
        | RejectionKind::Overloaded
        | RejectionKind::HandlerTimedOut => true,
        // A kind added later: retry what the layer asks to be retried, or a server's failure.
        _ => {
            rejection.retry_after().is_some()
                || rejection.kind().status() >= StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

/// The layer's detail as a sentence, as Stripe's messages are written.
fn sentence(detail: &str) -> String {
    let mut chars = detail.chars();
    let mut sentence: String = match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    };
    if !sentence.ends_with('.') {
        sentence.push('.');
    }
    sentence
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    const EVERY_KIND: [RejectionKind; 13] = [
        RejectionKind::KeyMissing,
        RejectionKind::KeyInvalid,
        RejectionKind::BodyUnreadable,
        RejectionKind::BodyTimeout,
        RejectionKind::InFlight,
        RejectionKind::BodyTooLarge,
        RejectionKind::Mismatch,
        RejectionKind::PrincipalMissing,
        RejectionKind::HandlerPanicked,
        RejectionKind::TransactionAborted,
        RejectionKind::StoreUnavailable,
        RejectionKind::Overloaded,
        RejectionKind::HandlerTimedOut,
    ];

    fn rendered(kind: RejectionKind) -> (Response<Bytes>, Value) {
        let response = render(&Rejection::new(kind, "what happened"));
        let body = serde_json::from_slice(response.body()).expect("JSON");
        (response, body)
    }

    /// The members RFC 9457 defines, with their types, and the status of the response.
    #[test]
    fn every_refusal_is_an_rfc9457_problem_document() {
        for kind in EVERY_KIND {
            let (response, document) = rendered(kind);
            assert_eq!(response.status(), kind.status(), "{kind:?}");
            assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
            let document = document.as_object().expect("a JSON object");
            let problem_type = document["type"].as_str().expect("type is a string");
            assert!(
                problem_type.starts_with("https://"),
                "type is an absolute URI: {problem_type}"
            );
            assert!(document["title"].as_str().is_some_and(|t| !t.is_empty()));
            assert_eq!(
                document["status"].as_u64(),
                Some(response.status().as_u16().into()),
                "the status member is the response's"
            );
            assert_eq!(document["detail"], "what happened");
            assert!(document["error"].is_object(), "{kind:?}");
        }
    }

    #[test]
    fn every_refusal_carries_a_stripe_error_and_says_whether_to_retry() {
        for kind in EVERY_KIND {
            let (response, document) = rendered(kind);
            let error = &document["error"];
            let expected_type = match kind {
                RejectionKind::Mismatch => "idempotency_error",
                _ if kind.status().is_client_error() => "invalid_request_error",
                _ => "api_error",
            };
            assert_eq!(error["type"], expected_type, "{kind:?}");
            assert_eq!(error["message"], "What happened.", "{kind:?}");
            let retry = &response.headers()[&STRIPE_SHOULD_RETRY];
            let retried = matches!(
                kind,
                RejectionKind::BodyTimeout
                    | RejectionKind::InFlight
                    | RejectionKind::HandlerPanicked
                    | RejectionKind::TransactionAborted
                    | RejectionKind::StoreUnavailable
                    | RejectionKind::Overloaded
                    | RejectionKind::HandlerTimedOut
            );
            assert_eq!(retry, if retried { "true" } else { "false" }, "{kind:?}");
        }
    }

    #[test]
    fn a_key_in_use_and_a_reused_key_are_stripes_own_errors() {
        let (_, in_flight) = rendered(RejectionKind::InFlight);
        assert_eq!(
            in_flight["error"],
            serde_json::json!({
                "code": "idempotency_key_in_use",
                "doc_url": KEY_IN_USE_DOC_URL,
                "message": "What happened.",
                "type": "invalid_request_error",
            })
        );
        let (response, mismatch) = rendered(RejectionKind::Mismatch);
        assert_eq!(
            response.status(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "the IETF draft's, not Stripe's 400"
        );
        assert_eq!(
            mismatch["error"],
            serde_json::json!({
                "doc_url": IDEMPOTENCY_DOC_URL,
                "message": "What happened.",
                "type": "idempotency_error",
            })
        );
    }

    #[test]
    fn messages_are_sentences() {
        assert_eq!(sentence("the key is in use"), "The key is in use.");
        assert_eq!(sentence("Done."), "Done.");
        assert_eq!(sentence(""), ".");
    }
}
