//! The middleware, in the order a request meets it:
//! key → scope (here) → body, fingerprint and claim ([`keyed`]) → handler ([`run`]) → record or
//! release ([`held`]) → replay or refusal ([`outcome`]).
//!
//! A keyed request's future is allocated for every request, so its size is a per-request cost.
//! An `async fn` stores its arguments in its state and again where it awaits them
//! (rust-lang/rust#62958), so the stages here are functions returning `async` blocks, the
//! handler's future is pinned once and lent, and the store's timers are combinators.

use std::{
    fmt,
    marker::PhantomData,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response, Uri, request::Parts};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use completing::{Refusal, refuse};

use crate::{
    body::{BoxError, RequestBody, ResponseBody},
    completion::Completing,
    future::{Detach, Detached, HangUp, ResponseFuture},
    key::{IdempotencyKey, KeyLookup},
    policy::Disconnect,
    problem::Rejection,
    scope::Principal,
    settings::Config,
    store::Store,
};

mod completing;
mod held;
mod keyed;
mod outcome;
mod reads;
#[cfg(test)]
mod refusal_tests;
mod run;
mod wait;

pub(crate) use held::{Completion, HeldKey};
pub(crate) use run::Heartbeat;
pub(crate) use wait::Waiting;

/// What the stages of a keyed request ask of the service the middleware wraps (the bounds of
/// [`Idempotency`]'s `Service` impl), said once for all of them.
pub(crate) trait Inner<ReqBody>:
    Service<
        Request<RequestBody<ReqBody>>,
        Response = Response<<Self as Inner<ReqBody>>::ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
    /// The body of the service's responses.
    type ResBody: HttpBody;
}

impl<S, ReqBody, ResBody: HttpBody> Inner<ReqBody> for S
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type ResBody = ResBody;
}

/// What the middleware asks of request and response bodies alike.
pub(crate) trait HttpBody:
    Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<B: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static> HttpBody for B {}

/// Middleware that runs each keyed request once and replays its response to retries.
///
/// Made by [`IdempotencyLayer`](crate::IdempotencyLayer); see the [crate documentation](crate).
pub struct Idempotency<S, St> {
    inner: S,
    shared: Shared<St>,
}

/// What every clone of the service, and every request, shares.
pub(crate) struct Shared<St> {
    pub(crate) store: Arc<St>,
    pub(crate) config: Arc<Config>,
    pub(crate) detached: Arc<Detached>,
    pub(crate) waiting: Arc<Waiting>,
}

impl<St> Clone for Shared<St> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            detached: Arc::clone(&self.detached),
            waiting: Arc::clone(&self.waiting),
        }
    }
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(inner: S, shared: Shared<St>) -> Self {
        Self { inner, shared }
    }
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for Idempotency<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &std::any::type_name::<St>())
            .field("config", &self.shared.config)
            .finish()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let config = &self.shared.config;
        let completing = request.extensions().get::<Completing>().is_some();
        if !config.covers(request.method()) {
            if completing {
                return ResponseFuture::rejected(config.rendering.render(refuse(Refusal::Unkeyed)));
            }
            return ResponseFuture::passthrough(
                self.inner.call(request.map(RequestBody::passthrough)),
            );
        }
        // Key, when a header holds it; a key taken from the request waits for its body.
        let path = request_uri(request.extensions(), request.uri()).path();
        let key = match config
            .key
            .find_in_head(request.method(), path, request.headers())
        {
            Ok(KeyLookup::Found(key)) => Some(key),
            Ok(KeyLookup::InBody) => None,
            Ok(KeyLookup::Absent) if completing => {
                return ResponseFuture::rejected(config.rendering.render(refuse(Refusal::Unkeyed)));
            }
            Ok(KeyLookup::Absent) => {
                return ResponseFuture::passthrough(
                    self.inner.call(request.map(RequestBody::passthrough)),
                );
            }
            Err(rejection) => return ResponseFuture::rejected(config.rendering.render(rejection)),
        };
        let (parts, body) = request.into_parts();
        let principal = match config.principal(&parts) {
            Ok(principal) => principal,
            Err(rejection) => return ResponseFuture::rejected(config.rendering.render(rejection)),
        };
        let (keyed, detach) = self.keyed(key, principal);
        let span = tracing::debug_span!(
            "idempotency",
            key = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        // Boxed where it is made: moving this large state machine into the response future
        // would copy it, where moving the box copies a pointer.
        ResponseFuture::keyed(Box::pin(keyed.serve(parts, body).instrument(span)), detach)
    }
}

impl<S: Clone, St> Idempotency<S, St> {
    /// The keyed request, and how its response future hands it to a task of its own if its
    /// client hangs up (`None` under [`Disconnect::Cancel`]).
    fn keyed<ReqBody>(
        &mut self,
        key: Option<IdempotencyKey>,
        principal: Principal,
    ) -> (Keyed<S, St, ReqBody>, Option<Detach>) {
        let config = &self.shared.config;
        // The service that was polled ready is the one that runs the handler; a fresh clone
        // takes its place (see https://docs.rs/tower/latest/tower/trait.Service.html#be-careful-when-cloning-inner-services).
        let clone = self.inner.clone();
        let detach = (config.disconnect == Disconnect::RunToCompletion).then(|| Detach {
            detached: Arc::clone(&self.shared.detached),
            hang_up: config.in_flight_wait.is_some().then(Arc::default),
        });
        let keyed = Keyed {
            inner: std::mem::replace(&mut self.inner, clone),
            shared: self.shared.clone(),
            key,
            principal,
            hang_up: detach.as_ref().and_then(|detach| detach.hang_up.clone()),
            _request_body: PhantomData,
        };
        (keyed, detach)
    }
}

/// The URI the client sent. Axum's `Router::nest` strips its prefix from the request's URI
/// before inner layers see it; the original, which scopes and fingerprints a key, is then in
/// axum's `OriginalUri` extension.
fn request_uri<'a>(extensions: &'a http::Extensions, uri: &'a Uri) -> &'a Uri {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::OriginalUri(original)) = extensions.get() {
        return original;
    }
    let _ = extensions;
    uri
}

/// A covered request with its principal (and its key, when a header held it), on its way
/// through the store.
struct Keyed<S, St, ReqBody> {
    inner: S,
    shared: Shared<St>,
    key: Option<IdempotencyKey>,
    principal: Principal,
    /// Where the request stands, for its response future to tell what a hang-up means; only
    /// for requests that may wait for a key in flight and are finished when their client leaves.
    hang_up: Option<Arc<HangUp>>,
    _request_body: PhantomData<fn(ReqBody)>,
}

impl Config {
    /// Who the key is scoped to (`Err`, the `500`, when no principal was found).
    fn principal(&self, parts: &Parts) -> Result<Principal, Rejection> {
        self.scope.principal(parts).ok_or_else(|| {
            tracing::error!(
                "idempotent request without a principal: the authentication layer must insert a \
                 `tower_idempotency::Principal` before the idempotency layer runs (in axum, add it \
                 with `.layer(...)` after the idempotency layer), or configure \
                 `IdempotencyLayer::with_scope`"
            );
            Rejection::principal_missing()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keyed request's future stays small (see the module documentation). Layouts are as
    /// shipped only when optimised, so this runs in release builds (CI: `cargo test --release`).
    #[cfg(feature = "postgres")]
    #[cfg_attr(
        debug_assertions,
        ignore = "future layouts are as shipped only in release builds"
    )]
    #[tokio::test]
    async fn a_lease_mode_request_future_stays_small() {
        use http_body_util::Full;
        use tower_layer::Layer;

        let pool = sqlx::PgPool::connect_lazy("postgres://127.0.0.1/unused").expect("lazy pool");
        let handler = tower::service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
        });
        let service = crate::IdempotencyLayer::postgres(pool).layer(handler);
        let keyed = Keyed {
            inner: service.inner,
            shared: service.shared.clone(),
            key: Some(IdempotencyKey::parse(&http::HeaderValue::from_static("k")).expect("key")),
            principal: Principal::new("acct").expect("principal"),
            hang_up: None,
            _request_body: PhantomData,
        };
        let (parts, body) = Request::new(Full::new(Bytes::new())).into_parts();
        let size = std::mem::size_of_val(&keyed.serve(parts, body));
        assert!(
            size <= 8 * 1024,
            "a lease-mode request's future is {size} bytes"
        );
    }

    /// Issue 28.10: a response's trailers (gRPC's status is one) reach its client; a replay
    /// carries none (see `replay`).
    #[tokio::test]
    async fn trailers_reach_the_client_and_replays_carry_none() {
        use http_body::Frame;
        use http_body_util::{BodyExt, Full, StreamBody};
        use tower::ServiceExt;
        use tower_layer::Layer;

        let handler = tower::service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            let frames = vec![
                Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"ok"))),
                Ok(Frame::trailers(trailers)),
            ];
            Ok::<_, std::convert::Infallible>(Response::new(StreamBody::new(
                futures_util::stream::iter(frames),
            )))
        });
        let service = crate::IdempotencyLayer::memory()
            .with_scope(crate::Scope::single_tenant())
            .layer(handler);
        let request = || {
            Request::post("/")
                .header("idempotency-key", "k")
                .body(Full::new(Bytes::new()))
                .unwrap()
        };
        let first = service.clone().oneshot(request()).await.unwrap();
        let first = first.into_body().collect().await.unwrap();
        assert_eq!(first.trailers().unwrap()["grpc-status"], "0");
        assert_eq!(first.to_bytes(), "ok");
        let replay = service.oneshot(request()).await.unwrap();
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        let replay = replay.into_body().collect().await.unwrap();
        assert!(replay.trailers().is_none());
        assert_eq!(replay.to_bytes(), "ok");
    }
}
