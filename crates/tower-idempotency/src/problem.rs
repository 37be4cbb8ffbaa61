//! Refusals: see [`Rejection`].

use std::{borrow::Cow, fmt, time::Duration};

use bytes::Bytes;
use http::{Response, StatusCode};

use crate::rendering::Rendering;

/// Base of the problem `type` URIs: the documentation of each [`RejectionKind`] variant.
pub const PROBLEM_TYPE_BASE: &str =
    "https://docs.rs/tower-idempotency/latest/tower_idempotency/enum.RejectionKind.html#variant.";

/// The media type of problem bodies.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Why the layer answered instead of the handler; see [`Rejection`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectionKind {
    /// `400`: a covered request without the `Idempotency-Key` the layer requires.
    KeyMissing,
    /// `400`: the `Idempotency-Key` header is malformed, empty, too long or repeated.
    KeyInvalid,
    /// `400`: the request body could not be read (the client went away or sent a broken body).
    BodyUnreadable,
    /// `408`: the request body did not arrive in time (a stalled or very slow client).
    BodyTimeout,
    /// `409`: a request with this key is still being processed. Retry after `Retry-After`.
    InFlight,
    /// `413`: the request body is larger than the layer buffers.
    BodyTooLarge,
    /// `422`: the key was already used for a different request.
    Mismatch,
    /// `500`: no principal was found to scope the key to; the server is misconfigured.
    PrincipalMissing,
    /// `500`: the handler panicked. Nothing was stored and the key is free again.
    HandlerPanicked,
    /// `500`: transactional mode, the handler answered success although one of its statements
    /// had failed in the request's transaction. Nothing was committed and the key is free again.
    TransactionAborted,
    /// `500`: the key's stored response could not be opened (it is sealed under a key the
    /// server lacks, or was altered); the request had run, so it is neither replayed nor rerun.
    RecordUnopenable,
    /// `503`: the idempotency store could not be reached. Retry after `Retry-After`.
    StoreUnavailable,
    /// `503`: too many handlers are still finishing for clients that hung up; nothing was run.
    /// Retry after `Retry-After`.
    Overloaded,
    /// `503`: the handler ran past its maximum time and was stopped, and its key given up: the
    /// retry (after `Retry-After`) takes it over at once.
    HandlerTimedOut,
}

impl RejectionKind {
    /// Every kind, in the order of the [`Rejection`] table.
    #[cfg(any(test, feature = "utoipa"))]
    pub(crate) const ALL: [Self; 14] = [
        Self::KeyMissing,
        Self::KeyInvalid,
        Self::BodyUnreadable,
        Self::BodyTimeout,
        Self::InFlight,
        Self::BodyTooLarge,
        Self::Mismatch,
        Self::PrincipalMissing,
        Self::HandlerPanicked,
        Self::TransactionAborted,
        Self::RecordUnopenable,
        Self::StoreUnavailable,
        Self::Overloaded,
        Self::HandlerTimedOut,
    ];

    /// The HTTP status of this kind of rejection.
    pub fn status(self) -> StatusCode {
        match self {
            Self::KeyMissing | Self::KeyInvalid | Self::BodyUnreadable => StatusCode::BAD_REQUEST,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::InFlight => StatusCode::CONFLICT,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::PrincipalMissing
            | Self::HandlerPanicked
            | Self::TransactionAborted
            | Self::RecordUnopenable => StatusCode::INTERNAL_SERVER_ERROR,
            Self::StoreUnavailable | Self::Overloaded | Self::HandlerTimedOut => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The problem `title`: the same for every occurrence of this kind.
    pub fn title(self) -> &'static str {
        match self {
            Self::KeyMissing => "Idempotency-Key is missing",
            Self::KeyInvalid => "Idempotency-Key is invalid",
            Self::BodyUnreadable => "Request body could not be read",
            Self::BodyTimeout => "Request body timed out",
            Self::InFlight => "A request with this Idempotency-Key is being processed",
            Self::BodyTooLarge => "Request body is too large",
            Self::Mismatch => "Idempotency-Key was used for a different request",
            Self::PrincipalMissing => "Idempotency scope is unavailable",
            Self::HandlerPanicked => "The request failed",
            Self::TransactionAborted => "The request failed and nothing was committed",
            Self::RecordUnopenable => "The stored response could not be opened",
            Self::StoreUnavailable => "Idempotency store is unavailable",
            Self::Overloaded => "Too many requests are still finishing",
            Self::HandlerTimedOut => "The request took too long and was stopped",
        }
    }

    /// The variant in snake case (`key_missing`...): the `kind` label of the rejection metric.
    pub fn label(self) -> &'static str {
        match self {
            Self::KeyMissing => "key_missing",
            Self::KeyInvalid => "key_invalid",
            Self::BodyUnreadable => "body_unreadable",
            Self::BodyTimeout => "body_timeout",
            Self::InFlight => "in_flight",
            Self::BodyTooLarge => "body_too_large",
            Self::Mismatch => "mismatch",
            Self::PrincipalMissing => "principal_missing",
            Self::HandlerPanicked => "handler_panicked",
            Self::TransactionAborted => "transaction_aborted",
            Self::RecordUnopenable => "record_unopenable",
            Self::StoreUnavailable => "store_unavailable",
            Self::Overloaded => "overloaded",
            Self::HandlerTimedOut => "handler_timed_out",
        }
    }

    /// The stable `code` member of the problem document (`missing-key`, `in-flight`...): a
    /// short string a client switches on instead of parsing the `type` URI. Part of the public
    /// API; the codes are listed in the [`Rejection`] table.
    pub fn code(self) -> &'static str {
        match self {
            Self::KeyMissing => "missing-key",
            Self::KeyInvalid => "invalid-key",
            Self::BodyUnreadable => "body-unreadable",
            Self::BodyTimeout => "body-timeout",
            Self::InFlight => "in-flight",
            Self::BodyTooLarge => "body-too-large",
            Self::Mismatch => "fingerprint-mismatch",
            Self::PrincipalMissing => "principal-missing",
            Self::HandlerPanicked => "handler-panicked",
            Self::TransactionAborted => "transaction-aborted",
            Self::RecordUnopenable => "record-unopenable",
            Self::StoreUnavailable => "store-unavailable",
            Self::Overloaded => "overloaded",
            Self::HandlerTimedOut => "handler-timed-out",
        }
    }

    /// The variant name: the anchor of the problem `type` URI.
    pub fn name(self) -> &'static str {
        match self {
            Self::KeyMissing => "KeyMissing",
            Self::KeyInvalid => "KeyInvalid",
            Self::BodyUnreadable => "BodyUnreadable",
            Self::BodyTimeout => "BodyTimeout",
            Self::InFlight => "InFlight",
            Self::BodyTooLarge => "BodyTooLarge",
            Self::Mismatch => "Mismatch",
            Self::PrincipalMissing => "PrincipalMissing",
            Self::HandlerPanicked => "HandlerPanicked",
            Self::TransactionAborted => "TransactionAborted",
            Self::RecordUnopenable => "RecordUnopenable",
            Self::StoreUnavailable => "StoreUnavailable",
            Self::Overloaded => "Overloaded",
            Self::HandlerTimedOut => "HandlerTimedOut",
        }
    }
}

/// A refusal by the layer: rendered as a problem response and kept in its extensions.
///
/// Every answer the layer gives instead of running the handler is a [`Rejection`]: a problem
/// body with `type`, `code`, `title`, `status` and `detail`, and a copy of the rejection in the
/// response extensions so outer layers (metrics, logging, a custom error renderer) can tell it apart from
/// the handler's own responses.
///
/// ```
/// use tower_idempotency::{Rejection, RejectionKind};
///
/// let response = Rejection::new(RejectionKind::InFlight, "the original request is still running")
///     .into_response::<http_body_util::Full<bytes::Bytes>>();
/// assert_eq!(response.status(), 409);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// assert_eq!(response.headers()["retry-after"], "1");
/// let rejection = response.extensions().get::<Rejection>().unwrap();
/// assert_eq!(rejection.kind(), RejectionKind::InFlight);
/// ```
///
/// A client tells refusals apart by their `code` ([`RejectionKind::code`]), which stays the
/// same across releases; `title` and `detail` are for people and may change.
///
/// | kind | status | `code` | when |
/// |---|---|---|---|
/// | [`KeyMissing`](RejectionKind::KeyMissing) | 400 | `missing-key` | the key is [required](crate::KeySource::required) and absent |
/// | [`KeyInvalid`](RejectionKind::KeyInvalid) | 400 | `invalid-key` | the header is malformed, empty, too long or repeated |
/// | [`BodyUnreadable`](RejectionKind::BodyUnreadable) | 400 | `body-unreadable` | the request body failed while being read |
/// | [`BodyTimeout`](RejectionKind::BodyTimeout) | 408 | `body-timeout` | the body did not arrive within `body_timeout` |
/// | [`InFlight`](RejectionKind::InFlight) | 409 | `in-flight` | the first request with this key is still running (`Retry-After: 1`) |
/// | [`BodyTooLarge`](RejectionKind::BodyTooLarge) | 413 | `body-too-large` | the body exceeds `max_body_bytes` |
/// | [`Mismatch`](RejectionKind::Mismatch) | 422 | `fingerprint-mismatch` | the key was used with another request to the endpoint (query or body; also method or path with [`Scope::across_endpoints`](crate::Scope::across_endpoints)) |
/// | [`PrincipalMissing`](RejectionKind::PrincipalMissing) | 500 | `principal-missing` | no principal to scope the key to (a misconfiguration) |
/// | [`HandlerPanicked`](RejectionKind::HandlerPanicked) | 500 | `handler-panicked` | the handler panicked; the key is released |
/// | [`TransactionAborted`](RejectionKind::TransactionAborted) | 500 | `transaction-aborted` | transactional mode: the handler answered success over a transaction one of its statements had failed; nothing committed, the key is released |
/// | [`RecordUnopenable`](RejectionKind::RecordUnopenable) | 500 | `record-unopenable` | the key's stored response does not open ([`RecordUnopenable`](crate::store::RecordUnopenable)): sealed under an unknown key, altered, or moved; nothing replayed or run |
/// | [`StoreUnavailable`](RejectionKind::StoreUnavailable) | 503 | `store-unavailable` | the store failed and the layer fails closed (`Retry-After`) |
/// | [`Overloaded`](RejectionKind::Overloaded) | 503 | `overloaded` | too many handlers still run for clients that hung up ([`Limits::with_max_detached`](crate::Limits::with_max_detached)); nothing run (`Retry-After`) |
/// | [`HandlerTimedOut`](RejectionKind::HandlerTimedOut) | 503 | `handler-timed-out` | the handler ran past [`Limits::with_max_handler_time`](crate::Limits::with_max_handler_time) and was stopped; its key is given up (`Retry-After: 1`) |
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    kind: RejectionKind,
    detail: Cow<'static, str>,
    retry_after: Option<u64>,
}

impl Rejection {
    /// A rejection of `kind` with a `detail` for this occurrence. `409`, and `503` for a store
    /// outage or overload, carry `Retry-After: 1` unless
    /// [`with_retry_after`](Self::with_retry_after) says otherwise.
    pub fn new(kind: RejectionKind, detail: impl Into<Cow<'static, str>>) -> Self {
        let retry_after = matches!(
            kind,
            RejectionKind::InFlight | RejectionKind::StoreUnavailable | RejectionKind::Overloaded
        )
        .then_some(1);
        Self {
            kind,
            detail: detail.into(),
            retry_after,
        }
    }

    /// Sets the `Retry-After` seconds.
    #[must_use]
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// What kind of rejection this is.
    pub fn kind(&self) -> RejectionKind {
        self.kind
    }

    /// The human-readable explanation of this occurrence.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The `Retry-After` seconds, if the client should retry.
    pub fn retry_after(&self) -> Option<u64> {
        self.retry_after
    }

    /// The problem `type` URI: `base` followed by the kind's [`label`](RejectionKind::label)
    /// (an app's own documentation, see
    /// [`Rendering::with_type_base`](crate::Rendering::with_type_base)), or without
    /// a base this crate's documentation of the kind.
    pub fn problem_type(&self, base: Option<&str>) -> String {
        match base {
            Some(base) => format!("{base}{}", self.kind.label()),
            None => format!("{PROBLEM_TYPE_BASE}{}", self.kind.name()),
        }
    }

    /// The members of the problem document (RFC 9457's `type`, `title`, `status`, `detail`,
    /// and the extension member `code`), for an app that renders its refusals itself and adds
    /// members of its own.
    pub fn problem(&self, type_base: Option<&str>) -> serde_json::Map<String, serde_json::Value> {
        let mut problem = serde_json::Map::new();
        problem.insert("type".into(), self.problem_type(type_base).into());
        problem.insert("code".into(), self.kind.code().into());
        problem.insert("title".into(), self.kind.title().into());
        problem.insert("status".into(), self.kind.status().as_u16().into());
        problem.insert("detail".into(), self.detail.as_ref().into());
        problem
    }

    /// The problem document, as JSON bytes.
    pub fn to_json(&self) -> Bytes {
        problem_bytes(&self.problem(None))
    }

    /// The problem response, with a copy of `self` in its extensions.
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        Rendering::default().render(self)
    }
}

/// The refusals the layer gives, one constructor per occasion, so the prose a client reads is
/// written here once and the service's control flow says only which refusal it is.
impl Rejection {
    /// `400`: `method path` requires a key and the request has none; `source` says where the
    /// key was looked for (`an Idempotency-Key header`, `an idempotency key in the request`).
    pub(crate) fn key_missing(method: &http::Method, path: &str, source: &str) -> Self {
        Self::new(
            RejectionKind::KeyMissing,
            format!("{method} {path} requires {source}; nothing was processed"),
        )
    }

    /// `400`: the key is malformed (`error` says how).
    pub(crate) fn key_invalid(error: &crate::key::KeyError) -> Self {
        Self::new(RejectionKind::KeyInvalid, error.to_string())
    }

    /// `400`: the key does not follow the app's rule `rule` (with an example when it asks for
    /// UUIDs).
    pub(crate) fn key_breaks_rule(rule: &str, uuid: bool) -> Self {
        let example = if uuid {
            " (a UUID such as 8e03978e-40d5-43e8-bc93-6894a57f9324)"
        } else {
            ""
        };
        Self::new(
            RejectionKind::KeyInvalid,
            format!(
                "the idempotency key does not follow this API's key rule `{rule}`{example}; \
                 nothing was processed"
            ),
        )
    }

    /// `500`: no principal to scope the key to.
    pub(crate) fn principal_missing() -> Self {
        Self::new(
            RejectionKind::PrincipalMissing,
            "the server could not determine who this request is for, so its Idempotency-Key \
             cannot be honoured; nothing was processed",
        )
    }

    /// `408`: the body did not arrive within `timeout`.
    pub(crate) fn body_timed_out(timeout: Duration) -> Self {
        Self::new(
            RejectionKind::BodyTimeout,
            format!("the request body did not arrive within {timeout:?}; nothing was processed"),
        )
    }

    /// `413`: the body exceeds `limit` bytes.
    pub(crate) fn body_too_large(limit: usize) -> Self {
        Self::new(
            RejectionKind::BodyTooLarge,
            format!("the request body exceeds {limit} bytes; nothing was processed"),
        )
    }

    /// `400`: the body failed while being read.
    pub(crate) fn body_unreadable() -> Self {
        Self::new(
            RejectionKind::BodyUnreadable,
            "the request body could not be read; nothing was processed",
        )
    }

    /// `409`: the key's first request is still running.
    pub(crate) fn in_flight() -> Self {
        Self::new(
            RejectionKind::InFlight,
            "a request with this Idempotency-Key is still being processed; retry after the \
             Retry-After delay to get its response",
        )
    }

    /// `422`: the key was used with another request (`across_endpoints`: keys reach every
    /// endpoint of the principal).
    pub(crate) fn mismatch(across_endpoints: bool) -> Self {
        let detail = if across_endpoints {
            "this idempotency key was already used with a different request (another endpoint, \
             query or body); use a new key for a new request"
        } else {
            "this idempotency key was already used with a different request to this endpoint \
             (its body or query differs); use a new key for a new request"
        };
        Self::new(RejectionKind::Mismatch, detail)
    }

    /// `503`: too many handlers still run for clients that hung up.
    pub(crate) fn overloaded() -> Self {
        Self::new(
            RejectionKind::Overloaded,
            "too many requests are still finishing for clients that went away; nothing was \
             processed, retry with the same Idempotency-Key",
        )
        .with_retry_after(1)
    }

    /// `503`: the store failed when the key was claimed.
    pub(crate) fn store_unavailable(retry_after_secs: u64) -> Self {
        Self::new(
            RejectionKind::StoreUnavailable,
            "the idempotency store is unavailable, so the request was not processed; retry with \
             the same Idempotency-Key",
        )
        .with_retry_after(retry_after_secs)
    }

    /// `503`: the record, and with it the handler's writes, may not have been committed.
    pub(crate) fn not_committed() -> Self {
        Self::new(
            RejectionKind::StoreUnavailable,
            "the request could not be confirmed as committed; retry with the same \
             Idempotency-Key: if it was committed the retry gets its response, otherwise it \
             runs again",
        )
    }

    /// `500`: the handler panicked.
    pub(crate) fn handler_panicked() -> Self {
        Self::new(
            RejectionKind::HandlerPanicked,
            "the request failed on the server and was not completed; it is safe to retry with \
             the same Idempotency-Key",
        )
    }

    /// `500`: transactional mode, a success answered over a failed transaction.
    pub(crate) fn transaction_aborted() -> Self {
        Self::new(
            RejectionKind::TransactionAborted,
            "the request failed on the server and nothing was committed; it is safe to retry \
             with the same Idempotency-Key",
        )
    }

    /// `500`: the key completed but its stored response does not open.
    pub(crate) fn record_unopenable() -> Self {
        Self::new(
            RejectionKind::RecordUnopenable,
            "this Idempotency-Key's request was processed, but its stored response could not be \
             opened, so it is not replayed and the request was not processed again; contact the \
             API provider",
        )
    }

    /// `503`: the handler ran past `max_time` and was stopped.
    pub(crate) fn handler_timed_out(max_time: Duration) -> Self {
        Self::new(
            RejectionKind::HandlerTimedOut,
            format!(
                "the request did not finish within {max_time:?} and was stopped; it may have \
                 done part of its work. Retry with the same Idempotency-Key"
            ),
        )
        .with_retry_after(1)
    }
}

/// A JSON object as bytes, with a final newline, as curl users expect.
pub(crate) fn problem_bytes(problem: &serde_json::Map<String, serde_json::Value>) -> Bytes {
    // Serialising a map of JSON values cannot fail.
    let mut json = serde_json::to_vec(problem).unwrap_or_default();
    json.push(b'\n');
    Bytes::from(json)
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.title(), self.detail)
    }
}

impl std::error::Error for Rejection {}

#[cfg(test)]
mod tests {
    use http::header;
    use http_body_util::{BodyExt, Full};

    use super::*;

    #[tokio::test]
    async fn renders_rfc9457_members() {
        let response: Response<Full<Bytes>> =
            Rejection::new(RejectionKind::Mismatch, "different body").into_response();
        assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "type": format!("{PROBLEM_TYPE_BASE}Mismatch"),
                "code": "fingerprint-mismatch",
                "title": "Idempotency-Key was used for a different request",
                "status": 422,
                "detail": "different body",
            })
        );
    }

    /// Codes are what clients switch on: one per kind, never shared.
    #[test]
    fn every_kind_has_its_own_code() {
        let codes: std::collections::HashSet<_> =
            RejectionKind::ALL.iter().map(|kind| kind.code()).collect();
        assert_eq!(codes.len(), RejectionKind::ALL.len());
    }

    #[test]
    fn store_unavailable_retry_after_is_configurable() {
        let response: Response<Full<Bytes>> =
            Rejection::new(RejectionKind::StoreUnavailable, "down")
                .with_retry_after(7)
                .into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "7");
    }
}
