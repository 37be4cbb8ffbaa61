//! What the layer's own answers look like: see [`Rendering`].

use std::{fmt, sync::Arc};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, header};

use crate::{
    problem::{PROBLEM_JSON, Rejection, problem_bytes},
    record::IDEMPOTENT_REPLAYED,
};

/// How the layer words its own answers: refusals as RFC 9457 problem documents (their `type`
/// under your documentation's base, if you give one) or as your API's own errors, and the
/// header that marks a replay; given to
/// [`IdempotencyLayer::with_rendering`](crate::IdempotencyLayer::with_rendering).
///
/// Whatever renders a refusal, its response carries the [`Rejection`] in its extensions for
/// outer layers, and `Retry-After` and `Cache-Control: no-store` unless the rendering set them.
///
/// ```
/// use axum::http::{HeaderName, Response, header};
/// use bytes::Bytes;
/// use tower_idempotency::{IdempotencyLayer, Rendering};
///
/// // Problem documents whose `type` leads to the API's own pages.
/// let documented = Rendering::problem_details()
///     .with_type_base("https://api.example.com/docs/errors#")
///     .with_replayed_header(HeaderName::from_static("idempotency-replayed"));
///
/// // The app's envelope: `{"error": {"code": ..., "message": ...}}`.
/// let enveloped = Rendering::custom(|rejection| {
///     let body = serde_json::json!({
///         "error": { "code": rejection.kind().code(), "message": rejection.detail() }
///     });
///     Response::builder()
///         .status(rejection.kind().status())
///         .header(header::CONTENT_TYPE, "application/json")
///         .body(Bytes::from(body.to_string()))
///         .expect("a valid response")
/// });
/// # let _ = (IdempotencyLayer::memory().with_rendering(documented), enveloped);
/// ```
#[derive(Clone)]
pub struct Rendering {
    type_base: Option<Arc<str>>,
    custom: Option<Arc<RenderFn>>,
    replayed: HeaderName,
}

/// An app's rendering of the layer's refusals.
type RenderFn = dyn Fn(&Rejection) -> Response<Bytes> + Send + Sync;

impl Default for Rendering {
    fn default() -> Self {
        Self::problem_details()
    }
}

impl Rendering {
    /// Refusals as RFC 9457 problem documents whose `type` is this crate's documentation of
    /// each refusal, and replays marked `Idempotent-Replayed: true` (Stripe's spelling): the
    /// default.
    pub fn problem_details() -> Self {
        Self {
            type_base: None,
            custom: None,
            replayed: IDEMPOTENT_REPLAYED.clone(),
        }
    }

    /// Refusals (`400`, `408`, `409`, `413`, `422`, `500`, `503`) as `render` makes them from
    /// the typed [`Rejection`] (its kind, code, status, detail and `Retry-After`).
    pub fn custom<F>(render: F) -> Self
    where
        F: Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
    {
        Self {
            custom: Some(Arc::new(render)),
            ..Self::problem_details()
        }
    }

    /// Where problem `type` URIs point: `base` followed by the refusal's
    /// [`RejectionKind::label`](crate::RejectionKind::label), so
    /// `https://api.example.com/docs/errors#` gives `https://api.example.com/docs/errors#Mismatch`.
    /// Without effect on a [custom](Self::custom) rendering, which writes its own bodies.
    #[must_use]
    pub fn with_type_base(mut self, base: impl Into<String>) -> Self {
        self.type_base = Some(base.into().into());
        self
    }

    /// The header that marks a replay (value `true`), for APIs that spell it otherwise
    /// (`Idempotency-Replayed`); `Idempotent-Replayed` by default.
    #[must_use]
    pub fn with_replayed_header(mut self, name: HeaderName) -> Self {
        self.replayed = name;
        self
    }

    /// The header that marks a replay.
    pub(crate) fn replayed_header(&self) -> &HeaderName {
        &self.replayed
    }

    /// The response for `rejection`.
    pub(crate) fn render<B: From<Bytes>>(&self, rejection: Rejection) -> Response<B> {
        let mut response = match &self.custom {
            Some(render) => render(&rejection).map(B::from),
            None => {
                let problem = rejection.problem(self.type_base.as_deref());
                let mut response = Response::new(B::from(problem_bytes(&problem)));
                *response.status_mut() = rejection.kind().status();
                response
                    .headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
                response
            }
        };
        let headers = response.headers_mut();
        if !headers.contains_key(header::CACHE_CONTROL) {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        if let Some(seconds) = rejection.retry_after()
            && !headers.contains_key(header::RETRY_AFTER)
        {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response.extensions_mut().insert(rejection);
        response
    }
}

impl fmt::Debug for Rendering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendering")
            .field("type_base", &self.type_base)
            .field("custom", &self.custom.as_ref().map(|_| ".."))
            .field("replayed", &self.replayed)
            .finish()
    }
}
