//! What a handler can learn about the key it runs under.

use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    scope::ScopeKey,
    steps::{MissingSteps, Steps},
};

/// What a handler can learn about the key it runs under.
///
/// The layer inserts an [`IdempotencyContext`] into the request extensions of every request it
/// claimed a key for. With the `axum` feature it is an extractor; `Option<IdempotencyContext>`
/// is `None` for requests that run without a key.
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyContext, IdempotencyLayer, KeySource};
///
/// async fn create_charge(idempotency: IdempotencyContext) -> String {
///     if idempotency.takeover() {
///         // An earlier attempt with this key crashed mid-way: check for its partial effects.
///     }
///     format!("charged under key {}", idempotency.key().as_str())
/// }
///
/// // Behind the app's authentication layer, which supplies the `Principal` (see `scope`).
/// let app: Router = Router::new()
///     .route("/v1/charges", post(create_charge))
///     .layer(IdempotencyLayer::memory().with_key(KeySource::default().required()));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    pub(crate) key: IdempotencyKey,
    pub(crate) scope_key: ScopeKey,
    pub(crate) takeover: bool,
    /// The request's fingerprint, which binds its [`Steps`].
    pub(crate) fingerprint: Fingerprint,
    /// The handler's steps, or why it has none (set once the key is claimed).
    pub(crate) steps: Result<Steps, MissingSteps>,
}

impl IdempotencyContext {
    /// The key as the client sent it.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The hash that addresses the record: safe to log.
    pub fn scope_key(&self) -> &ScopeKey {
        &self.scope_key
    }

    /// `true` when this request took the key over from an earlier attempt whose lease lapsed
    /// before it finished (it crashed or hung), so that attempt may have had partial effects.
    pub fn takeover(&self) -> bool {
        self.takeover
    }

    /// The handler's [`Steps`] (with the `axum` feature, also an extractor), or why it has
    /// none.
    ///
    /// # Errors
    ///
    /// [`MissingSteps`] says what the app must set up for steps.
    pub fn steps(&self) -> Result<&Steps, MissingSteps> {
        self.steps.as_ref().map_err(|missing| *missing)
    }
}

#[cfg(feature = "axum")]
mod axum_impl {
    use std::convert::Infallible;

    use axum_core::{
        extract::{FromRequestParts, OptionalFromRequestParts},
        response::{IntoResponse, Response},
    };
    use http::{StatusCode, request::Parts};

    use super::IdempotencyContext;

    /// The handler asked for an [`IdempotencyContext`] on a request that runs without a key.
    #[derive(Debug, Clone, Copy)]
    pub struct MissingIdempotencyContext;

    impl IntoResponse for MissingIdempotencyContext {
        fn into_response(self) -> Response {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "this handler needs an Idempotency-Key, but the request was not run under one: \
                 put the route behind the IdempotencyLayer, make sure it covers this method \
                 (IdempotencyLayer::with_methods; POST and PATCH by default) and make the key \
                 required (KeySource::required)",
            )
                .into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
        type Rejection = MissingIdempotencyContext;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<IdempotencyContext>()
                .cloned()
                .ok_or(MissingIdempotencyContext)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyContext {
        type Rejection = Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<IdempotencyContext>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
pub use axum_impl::MissingIdempotencyContext;

#[cfg(all(test, feature = "axum"))]
mod tests {
    use axum::{Router, body::Body, routing::put};
    use http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::IdempotencyContext;
    use crate::{IdempotencyLayer, KeySource, Principal};

    /// A handler that needs the context, on a method the layer does not cover: the answer says
    /// so, rather than only "make the key required" (which it is).
    #[tokio::test]
    async fn a_missing_context_names_the_method_coverage_too() {
        let app = Router::new()
            .route("/", put(|_: IdempotencyContext| async { "ran" }))
            .layer(IdempotencyLayer::memory().with_key(KeySource::default().required()));
        let mut request = Request::put("/")
            .header("idempotency-key", "k1")
            .body(Body::empty())
            .unwrap();
        request
            .extensions_mut()
            .insert(Principal::new("acct").unwrap());
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body = std::str::from_utf8(&body).unwrap();
        assert!(body.contains("with_methods"), "{body}");
        assert!(body.contains("KeySource::required"), "{body}");
    }
}
