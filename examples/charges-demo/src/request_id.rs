//! Request ids and the headers Stripe's API sends with them.
//!
//! | header | on | holds |
//! |---|---|---|
//! | `Request-Id` | every response | this request's id, `req_` and 22 letters and digits |
//! | `Idempotency-Key` | responses to requests that sent a valid key | the key, as sent |
//! | `Original-Request` | `POST /v1/charges` answers, first or replayed | the id of the request that produced the answer |
//!
//! [`request_ids`] runs outside everything else: it gives the request its [`RequestId`] and sets
//! `Request-Id` and `Idempotency-Key` on the way out. [`original_request`] runs inside the
//! idempotency layer, so `Original-Request` is stored with the response and a replay names the
//! first request while its `Request-Id` is its own. Stripe's libraries read these headers
//! (stripe-node as `lastResponse.requestId` and `lastResponse.idempotencyKey`, stripe-python as
//! `error.request_id`).

use std::sync::Arc;

use axum::{extract::Request, middleware::Next, response::Response};
use http::{HeaderName, HeaderValue};
use tower_idempotency::{IDEMPOTENCY_KEY, IdempotencyKey};

use crate::ledger::new_id;

/// The `Request-Id` response header.
pub static REQUEST_ID: HeaderName = HeaderName::from_static("request-id");

/// The `Original-Request` response header.
pub static ORIGINAL_REQUEST: HeaderName = HeaderName::from_static("original-request");

/// A request's id, in the request's extensions.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestId(Arc<str>);

impl RequestId {
    /// A new id: `req_` and 22 base62 characters of 122 random bits.
    pub fn new() -> Self {
        Self(new_id("req").into())
    }

    /// The id, `req_...`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn header_value(&self) -> HeaderValue {
        HeaderValue::from_str(&self.0).expect("req_ and base62 characters are a valid header")
    }
}

impl Default for RequestId {
    fn default() -> Self {
        Self::new()
    }
}

/// Middleware, outermost: gives the request a [`RequestId`], answers with it in `Request-Id`,
/// and echoes a valid `Idempotency-Key`.
pub async fn request_ids(mut request: Request, next: Next) -> Response {
    let id = RequestId::new();
    request.extensions_mut().insert(id.clone());
    // A malformed or repeated key is not echoed: it is not a key, and may be anything.
    let key = IdempotencyKey::from_headers(request.headers())
        .ok()
        .flatten()
        .and_then(|_| request.headers().get(&IDEMPOTENCY_KEY).cloned());
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(REQUEST_ID.clone(), id.header_value());
    if let Some(key) = key {
        headers.insert(IDEMPOTENCY_KEY.clone(), key);
    }
    response
}

/// Middleware, inside the idempotency layer: names the request in `Original-Request`, which
/// the layer then stores with the response and replays.
pub async fn original_request(request: Request, next: Next) -> Response {
    let id = request.extensions().get::<RequestId>().cloned();
    let mut response = next.run(request).await;
    if let Some(id) = id {
        response
            .headers_mut()
            .insert(ORIGINAL_REQUEST.clone(), id.header_value());
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_look_like_stripes_and_differ() {
        let a = RequestId::new();
        let b = RequestId::new();
        assert_ne!(a, b);
        let rest = a.as_str().strip_prefix("req_").expect("req_ prefix");
        assert_eq!(rest.len(), 22);
        assert!(rest.bytes().all(|b| b.is_ascii_alphanumeric()), "{a:?}");
        assert_eq!(a.header_value(), a.as_str());
    }
}
