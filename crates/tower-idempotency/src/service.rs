//! The middleware, in the order a request meets it:
//! key → scope → body and fingerprint → claim → handler → record → replay.

use std::{
    error::Error as StdError,
    fmt,
    future::Future,
    marker::PhantomData,
    panic::AssertUnwindSafe,
    pin::{Pin, pin},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response, Uri, request::Parts};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::{
    body::{self, BoxError, Buffered, RequestBody, ResponseBody},
    cache::{Hit, ReplayCache},
    context::IdempotencyContext,
    fingerprint::Fingerprint,
    future::{Detached, ResponseFuture},
    key::IdempotencyKey,
    layer::Config,
    layer::KeySource,
    metrics,
    policy::{Disconnect, Retention, StoreFailure},
    problem::{Rejection, RejectionKind},
    record::Record,
    replay,
    scope::{Principal, ScopeKey},
    store::{Begin, ClaimRequest, ClaimStatus, InFlightWatch, Store},
};

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
    pub(crate) cache: Arc<ReplayCache>,
    pub(crate) detached: Arc<Detached>,
    pub(crate) waiting: Arc<Waiting>,
}

/// The requests waiting for keys in flight, and how the store wakes them.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    watch: Option<InFlightWatch>,
    count: AtomicUsize,
}

impl Waiting {
    pub(crate) fn new(watch: InFlightWatch) -> Self {
        Self {
            watch: Some(watch),
            count: AtomicUsize::new(0),
        }
    }

    /// A place among the waiters, unless `max` already wait.
    fn enter(&self, max: usize) -> Option<WaitingSlot<'_>> {
        self.count
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| WaitingSlot(self))
    }
}

struct WaitingSlot<'a>(&'a Waiting);

impl Drop for WaitingSlot<'_> {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<St> Clone for Shared<St> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            cache: Arc::clone(&self.cache),
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
        if !config.covers(request.method()) {
            return ResponseFuture::passthrough(
                self.inner.call(request.map(RequestBody::passthrough)),
            );
        }

        // Key, when a header holds it; a key taken from the request waits for its body.
        let key = match &config.key_source {
            KeySource::Header(name) => match IdempotencyKey::from_header(request.headers(), name) {
                Ok(Some(key)) => match config.follows_rule(&key) {
                    Ok(()) => Some(key),
                    Err(rejection) => {
                        return ResponseFuture::rejected(config.rendering.render(rejection));
                    }
                },
                Ok(None) if config.required => {
                    return ResponseFuture::rejected(config.rendering.render(Rejection::new(
                        RejectionKind::KeyMissing,
                        format!(
                            "{} {} requires an {} header",
                            request.method(),
                            request_uri(request.extensions(), request.uri()).path(),
                            crate::key::header_title(name.as_str())
                        ),
                    )));
                }
                Ok(None) => {
                    return ResponseFuture::passthrough(
                        self.inner.call(request.map(RequestBody::passthrough)),
                    );
                }
                Err(error) => {
                    return ResponseFuture::rejected(
                        config
                            .rendering
                            .render(Rejection::new(RejectionKind::KeyInvalid, error.to_string())),
                    );
                }
            },
            KeySource::Request(_) => None,
        };

        // Scope.
        let (parts, body) = request.into_parts();
        let Some(principal) = config.scope.principal(&parts) else {
            tracing::error!(
                "idempotent request without a principal: the authentication layer must insert a \
                 `tower_idempotency::Principal` before the idempotency layer runs (in axum, add it \
                 with `.layer(...)` after the idempotency layer), or configure \
                 `IdempotencyLayer::with_scope`"
            );
            return ResponseFuture::rejected(config.rendering.render(Rejection::new(
                RejectionKind::PrincipalMissing,
                "the server could not determine who this request is for, so its Idempotency-Key \
                 cannot be honoured; nothing was processed",
            )));
        };

        // The service that was polled ready is the one that runs the handler; a fresh clone
        // takes its place (see https://docs.rs/tower/latest/tower/trait.Service.html#be-careful-when-cloning-inner-services).
        let clone = self.inner.clone();
        let keyed = Keyed {
            inner: std::mem::replace(&mut self.inner, clone),
            shared: self.shared.clone(),
            key,
            principal,
            _request_body: PhantomData,
        };
        let span = tracing::debug_span!(
            "idempotency",
            key = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let detach = (config.disconnect == Disconnect::RunToCompletion)
            .then(|| Arc::clone(&self.shared.detached));
        // Boxed where it is made: moving this large state machine into the response future
        // would copy it, where moving the box copies a pointer.
        ResponseFuture::keyed(Box::pin(keyed.serve(parts, body).instrument(span)), detach)
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
    _request_body: PhantomData<fn(ReqBody)>,
}

impl Config {
    /// The key the app's function takes from the request: `Ok(None)` without one (`Err`, the
    /// `400`, when it is required, malformed or breaks the rule).
    fn key_from_request(
        &self,
        parts: &Parts,
        body: &Bytes,
    ) -> Result<Option<IdempotencyKey>, Rejection> {
        let KeySource::Request(key_of) = &self.key_source else {
            return Ok(None);
        };
        match key_of(parts, body) {
            Some(key) => {
                let key = IdempotencyKey::new(key).map_err(|error| {
                    Rejection::new(RejectionKind::KeyInvalid, error.to_string())
                })?;
                self.follows_rule(&key)?;
                Ok(Some(key))
            }
            None if self.required => Err(Rejection::new(
                RejectionKind::KeyMissing,
                format!(
                    "{} {} requires an idempotency key, and none was found in the request",
                    parts.method,
                    request_uri(&parts.extensions, &parts.uri).path()
                ),
            )),
            None => Ok(None),
        }
    }

    /// `Err` with the `400` to answer when `key` breaks the app's key rule.
    fn follows_rule(&self, key: &IdempotencyKey) -> Result<(), Rejection> {
        match &self.key_rule {
            Some(rule) if !rule.accepts(key.as_str()) => Err(Rejection::new(
                RejectionKind::KeyInvalid,
                format!(
                    "the idempotency key does not follow this API's key rule `{}`{}; nothing \
                     was processed",
                    rule.name(),
                    if rule.format() == Some("uuid") {
                        " (a UUID such as 8e03978e-40d5-43e8-bc93-6894a57f9324)"
                    } else {
                        ""
                    }
                ),
            )),
            _ => Ok(()),
        }
    }
}

type Served<B, E> = Result<Response<ResponseBody<B>>, E>;

impl<S, St, ReqBody, ResBody> Keyed<S, St, ReqBody>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    /// Body and fingerprint, then the claim. Unless the app chose [`Disconnect::Cancel`], the
    /// response future hands this future to a task of its own if it is dropped unfinished (the
    /// client hung up), so a handler is never stopped half-way.
    ///
    /// A function returning an `async` block rather than an `async fn`, whose arguments would be
    /// stored twice in the future (see rust-lang/rust#62958), and this future is allocated for
    /// every keyed request.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn would store its arguments twice"
    )]
    fn serve(
        mut self,
        parts: Parts,
        body: ReqBody,
    ) -> impl Future<Output = Served<ResBody, S::Error>> {
        async move {
            let config = &*self.shared.config;
            let limit = config.max_body_bytes;
            let timeout = config.body_timeout;
            let body = pin!(body);
            let mut buffering = pin!(body::buffer(body, limit));
            // A small body has usually arrived with the head: only a body still on its way gets a
            // timer (which costs a clock read and a count on the runtime handle shared by every
            // worker thread).
            let buffered = match poll_once(buffering.as_mut()).await {
                Poll::Ready(buffered) => buffered,
                Poll::Pending => match tokio::time::timeout(timeout, buffering).await {
                    Ok(buffered) => buffered,
                    Err(_) => {
                        return Ok(reject(
                            config,
                            Rejection::new(
                                RejectionKind::BodyTimeout,
                                format!(
                                    "the request body did not arrive within {timeout:?}; nothing was \
                             processed"
                                ),
                            ),
                        ));
                    }
                },
            };
            let body = match buffered {
                Buffered::Complete(body, _trailers) => body,
                Buffered::TooLarge { .. } => {
                    return Ok(reject(
                        config,
                        Rejection::new(
                            RejectionKind::BodyTooLarge,
                            format!(
                                "the request body exceeds {limit} bytes; nothing was processed"
                            ),
                        ),
                    ));
                }
                Buffered::Failed { error, .. } => {
                    tracing::debug!(error = %Chain(&*error), "request body could not be read");
                    return Ok(reject(
                        config,
                        Rejection::new(
                            RejectionKind::BodyUnreadable,
                            "the request body could not be read; nothing was processed",
                        ),
                    ));
                }
            };
            let key = match self.key.take() {
                Some(key) => key,
                None => match config.key_from_request(&parts, &body) {
                    Ok(Some(key)) => key,
                    Ok(None) => {
                        // No key, not required: the handler runs unprotected, as with no header.
                        let mut inner = self.inner;
                        let request = Request::from_parts(parts, RequestBody::buffered(body));
                        return Ok(inner.call(request).await?.map(ResponseBody::passthrough));
                    }
                    Err(rejection) => return Ok(reject(config, rejection)),
                },
            };
            let uri = request_uri(&parts.extensions, &parts.uri);
            let scope_key = config
                .scope
                .key(&self.principal, &parts.method, uri.path(), &key);
            tracing::Span::current().record("key", tracing::field::display(scope_key));
            let fingerprint = crate::fingerprint::compute_for_request(
                &config.fingerprint,
                &parts.method,
                uri,
                &parts.headers,
                &body,
            )
            .await;

            // Claim, then run, replay or refuse.
            let begin = match self.shared.cached(scope_key, fingerprint) {
                Some(begin) => begin,
                None if self.shared.overloaded() => {
                    // Handlers still finishing for clients that hung up may hold what any store
                    // work needs (in transactional mode, every pooled connection): refuse at
                    // once rather than queue behind them.
                    outcome(Outcome::Overloaded);
                    return Ok(reject(
                        config,
                        Rejection::new(
                            RejectionKind::Overloaded,
                            "too many requests are still finishing for clients that went away; \
                             nothing was processed, retry with the same Idempotency-Key",
                        )
                        .with_retry_after(1),
                    ));
                }
                None => match self.shared.claim(scope_key, fingerprint).await {
                    Ok(begin) => begin,
                    Err(error) => return self.store_failed(&error, parts, body).await,
                },
            };
            let begin = match begin {
                Begin::InFlight { .. } if !config.in_flight_wait.is_zero() => {
                    match self
                        .shared
                        .wait_while_in_flight(scope_key, fingerprint)
                        .await
                    {
                        Ok(begin) => begin,
                        Err(error) => return self.store_failed(&error, parts, body).await,
                    }
                }
                begin => begin,
            };
            match begin {
                Begin::Acquired { claim, takeover } => {
                    if takeover {
                        tracing::warn!(
                            "took over an idempotency key whose holder's lease lapsed; \
                         its handler may have run in part"
                        );
                    }
                    let context = IdempotencyContext {
                        key,
                        scope_key,
                        takeover,
                    };
                    self.run(claim, context, parts, body).await
                }
                Begin::Completed { record, .. } => Ok(replayed(&record)),
                Begin::InFlight { .. } => {
                    outcome(Outcome::Conflict);
                    Ok(reject(
                        config,
                        Rejection::new(
                            RejectionKind::InFlight,
                            "a request with this Idempotency-Key is still being processed; \
                     retry after the Retry-After delay to get its response",
                        ),
                    ))
                }
                Begin::Mismatch => Ok(mismatch(config)),
            }
        }
    }

    /// The handler, under a held claim kept alive by a heartbeat; then record or release.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn would store its arguments twice (see `serve`)"
    )]
    fn run(
        self,
        claim: St::Claim,
        context: IdempotencyContext,
        mut parts: Parts,
        body: Bytes,
    ) -> impl Future<Output = Served<ResBody, S::Error>> {
        async move {
            let Keyed {
                mut inner, shared, ..
            } = self;
            let takeover = context.takeover;
            let (store, config) = (shared.store, shared.config);
            let config = &*config;
            store.attach(&claim, &mut parts.extensions);
            let guard = ClaimGuard::new(Arc::clone(&store), claim);
            parts.extensions.insert(context);
            let request = Request::from_parts(parts, RequestBody::buffered(body));
            let max_response_bytes = config.max_response_bytes;
            let handler = async move {
                let response = inner.call(request).await?;
                let (parts, body) = response.into_parts();
                Ok((
                    parts,
                    body::buffer(Box::pin(body), max_response_bytes).await,
                ))
            };
            // Pinned here and lent to the heartbeat: an `async fn` taking the future by value
            // would keep two copies of it in its state (rust-lang/rust#62958).
            let handling = pin!(AssertUnwindSafe(handler).catch_unwind());
            let heartbeat = Heartbeat {
                lease: config.lease,
                max_time: config.max_handler_time,
            };
            let Some(handled) = heartbeat.run(&*store, guard.claim(), handling).await else {
                // Hung: no longer renewed. The claim is left to its lease (or, in
                // transactional mode, rolled back with the handler), so a retry takes over.
                tracing::error!(
                    max = ?config.max_handler_time,
                    "handler ran past its maximum time; cancelled, and its key left to lapse"
                );
                guard.abandon();
                outcome(Outcome::Abandoned);
                return Ok(reject(
                    config,
                    Rejection::new(
                        RejectionKind::HandlerTimedOut,
                        format!(
                            "the request did not finish within {:?} and was stopped; retry with \
                             the same Idempotency-Key once its lease of {:?} has lapsed",
                            config.max_handler_time, config.lease
                        ),
                    )
                    .with_retry_after(config.lease.as_secs().max(1)),
                ));
            };

            let (mut parts, buffered) = match handled {
                Ok(Ok(handled)) => handled,
                Ok(Err(error)) => {
                    outcome(Outcome::Released);
                    guard.release().await;
                    return Err(error);
                }
                Err(panic) => {
                    tracing::error!(
                        panic = panic_message(&*panic),
                        "handler panicked; key released"
                    );
                    outcome(Outcome::Released);
                    guard.release().await;
                    return Ok(reject(
                        config,
                        Rejection::new(
                            RejectionKind::HandlerPanicked,
                            "the request failed on the server and was not completed; \
                     it is safe to retry with the same Idempotency-Key",
                        ),
                    ));
                }
            };

            let mut retention = parts
                .extensions
                .remove::<Retention>()
                .unwrap_or_else(|| config.retention.decide(parts.status));
            let (kept_body, body) = match buffered {
                Buffered::Complete(bytes, trailers) => {
                    (Some(bytes.clone()), ResponseBody::full(bytes, trailers))
                }
                Buffered::TooLarge { prefix, rest } => {
                    tracing::warn!(
                        limit = max_response_bytes,
                        "response too large to store: delivered, but a retry gets its status only"
                    );
                    (None, ResponseBody::prefixed(prefix, rest))
                }
                Buffered::Failed { prefix, error } => {
                    // Its outcome is unknown: a retry runs again rather than replay half an answer.
                    tracing::warn!(error = %Chain(&*error), "response body failed; key released");
                    retention = Retention::Release;
                    (None, ResponseBody::failed(prefix, error))
                }
            };
            match retention {
                Retention::Keep => {
                    let record =
                        Record::capture_without(&parts, kept_body, &config.unstored_headers);
                    match guard.complete(record, config.lease, config.ttl).await {
                        Completion::Stored => outcome(if takeover {
                            Outcome::Takeover
                        } else {
                            Outcome::Acquired
                        }),
                        Completion::NotCommitted => {
                            // The handler's writes were to commit with the record, and may not have.
                            outcome(Outcome::StoreError);
                            return Ok(reject(
                                config,
                                Rejection::new(
                                    RejectionKind::StoreUnavailable,
                                    "the request could not be confirmed as committed; retry with the \
                                 same Idempotency-Key: if it was committed the retry gets its \
                                 response, otherwise it runs again",
                                ),
                            ));
                        }
                        Completion::RolledBack => {
                            outcome(Outcome::Released);
                            if parts.status.is_success() || parts.status.is_redirection() {
                                // A success nothing backs: answering it would be a lie.
                                tracing::error!(
                                    status = %parts.status,
                                    "the handler answered success over a failed transaction; \
                                     nothing was committed"
                                );
                                return Ok(reject(
                                    config,
                                    Rejection::new(
                                        RejectionKind::TransactionAborted,
                                        "the request failed on the server and nothing was \
                                     committed; it is safe to retry with the same \
                                     Idempotency-Key",
                                    ),
                                ));
                            }
                            tracing::info!(
                                status = %parts.status,
                                "the handler answered over a failed transaction: delivered, \
                                 nothing committed, key released"
                            );
                        }
                    }
                }
                Retention::Release => {
                    outcome(Outcome::Released);
                    guard.release().await;
                }
            }
            Ok(Response::from_parts(parts, body))
        }
    }

    /// The store failed at claim time: `503`, or the handler without protection (fail-open).
    async fn store_failed(
        mut self,
        error: &St::Error,
        parts: Parts,
        body: Bytes,
    ) -> Served<ResBody, S::Error> {
        outcome(Outcome::StoreError);
        tracing::error!(error = %Chain(error), "idempotency store unavailable");
        let config = Arc::clone(&self.shared.config);
        match config.store_failure {
            StoreFailure::FailClosed { retry_after_secs } => Ok(reject(
                &config,
                Rejection::new(
                    RejectionKind::StoreUnavailable,
                    "the idempotency store is unavailable, so the request was not processed; \
                     retry with the same Idempotency-Key",
                )
                .with_retry_after(retry_after_secs),
            )),
            StoreFailure::FailOpen => {
                tracing::warn!("failing open: running the handler without idempotency protection");
                let response = self
                    .inner
                    .call(Request::from_parts(parts, RequestBody::buffered(body)))
                    .await?;
                Ok(response.map(ResponseBody::passthrough))
            }
        }
    }
}

impl<St: Store> Shared<St> {
    /// Whether as many handlers run for clients that hung up as the layer allows: the smaller
    /// of [`with_max_detached`](crate::IdempotencyLayer::with_max_detached) and the store's
    /// [`detached_limit`](Store::detached_limit).
    fn overloaded(&self) -> bool {
        let configured = self.config.max_detached;
        let limit = self
            .store
            .detached_limit()
            .map_or(configured, |store| store.min(configured));
        self.detached.count() >= limit
    }

    /// Waits, up to the layer's in-flight wait, for a key in flight to settle: its replay once
    /// it completed, the claim if it was released, or still `InFlight` when the wait is over or
    /// too many wait already.
    async fn wait_while_in_flight(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
    ) -> Result<Begin<St::Claim>, St::Error> {
        let in_flight = Begin::InFlight {
            lease_remaining: None,
        };
        let Some(_slot) = self.waiting.enter(self.config.max_waiting) else {
            metrics::waited("full");
            return Ok(in_flight);
        };
        let deadline = later(tokio::time::Instant::now(), self.config.in_flight_wait);
        let (mut subscription, notifier, poll) = match &self.waiting.watch {
            Some(InFlightWatch::Notified(notifier)) => (
                Some(notifier.subscribe(&key)),
                Some(notifier),
                Duration::ZERO,
            ),
            Some(InFlightWatch::Polled(every)) => (None, None, *every),
            None => (None, None, Duration::from_millis(100)),
        };
        loop {
            // Read after subscribing: a settlement in between still wakes the next wait.
            let begin = self.claim(key, fingerprint).await?;
            let now = tokio::time::Instant::now();
            if !matches!(begin, Begin::InFlight { .. }) || now >= deadline {
                metrics::waited(match &begin {
                    Begin::InFlight { .. } => "timed_out",
                    Begin::Acquired { .. } => "acquired",
                    Begin::Completed { .. } => "replayed",
                    Begin::Mismatch => "mismatch",
                });
                return Ok(begin);
            }
            let poll = notifier.map_or(poll, |notifier| notifier.poll_interval());
            let next = later(now, poll).min(deadline);
            match &mut subscription {
                Some(subscription) => {
                    tokio::select! {
                        () = subscription.notified() => {}
                        () = tokio::time::sleep_until(next) => {}
                    }
                }
                None => tokio::time::sleep_until(next).await,
            }
        }
    }

    /// The key's state if the replay cache knows it.
    fn cached(&self, key: ScopeKey, fingerprint: Fingerprint) -> Option<Begin<St::Claim>> {
        match self.cache.get(&key, &fingerprint)? {
            Hit::Replay(record) => Some(Begin::Completed {
                record,
                expires_in: None,
            }),
            Hit::Mismatch => Some(Begin::Mismatch),
        }
    }

    /// The key's state from the store's atomic claim; a completed record it returns is cached
    /// for the next retry.
    async fn claim(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
    ) -> Result<Begin<St::Claim>, St::Error> {
        let request = ClaimRequest {
            key,
            fingerprint,
            lease: self.config.lease,
            ttl: self.config.ttl,
        };
        let begin = metrics::timed("begin", self.store.begin(&request)).await?;
        if let Begin::Completed {
            record,
            expires_in: Some(expires_in),
        } = &begin
        {
            self.cache.insert(key, fingerprint, record, *expires_in);
        }
        Ok(begin)
    }
}

/// The lease a running handler's claim keeps, and how long the handler may run.
struct Heartbeat {
    lease: Duration,
    max_time: Duration,
}

impl Heartbeat {
    /// Runs `future` while renewing `claim`'s lease every third of the lease; `None` when it
    /// runs past the maximum time (it is then dropped, and its claim no longer renewed).
    /// Renewal runs beside the handler, never blocking it; a renewal that fails or finds the
    /// claim lost is logged, and the handler goes on (fencing keeps a lost claim from writing
    /// its record). After a failed renewal the next comes sooner, so a lease outlives an outage
    /// shorter than itself.
    async fn run<St: Store, F: Future>(
        &self,
        store: &St,
        claim: &St::Claim,
        mut future: Pin<&mut F>,
    ) -> Option<F::Output> {
        // A handler that answers without waiting needs no heartbeat: don't even start the timer.
        if let Poll::Ready(output) = poll_once(future.as_mut()).await {
            return Some(output);
        }
        let period = self.lease / 3;
        let started = tokio::time::Instant::now();
        let deadline = later(started, self.max_time);
        let mut next = later(started, period);
        loop {
            tokio::select! {
                biased;
                output = &mut future => return Some(output),
                () = tokio::time::sleep_until(deadline) => return None,
                () = tokio::time::sleep_until(next) => {}
            }
            let renewal = pin!(metrics::timed("renew", store.renew(claim, self.lease)));
            let renewed = tokio::select! {
                biased;
                output = &mut future => return Some(output),
                renewed = renewal => renewed,
            };
            let now = tokio::time::Instant::now();
            next = match renewed {
                Ok(ClaimStatus::Held) => {
                    metrics::renewal("held");
                    later(now, period)
                }
                Ok(_) => {
                    metrics::renewal("lost");
                    tracing::warn!(
                        "lease lost while the handler runs (another request took the key over); \
                         this response will not be stored"
                    );
                    later(now, period)
                }
                Err(error) => {
                    metrics::renewal("error");
                    tracing::warn!(error = %Chain(&error), "lease renewal failed");
                    later(now, period.min(RETRY_WHILE_UNREACHABLE))
                }
            };
        }
    }
}

/// `at + span`, or far in the future where that would overflow.
fn later(at: tokio::time::Instant, span: Duration) -> tokio::time::Instant {
    at.checked_add(span)
        .unwrap_or_else(|| at + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// How soon a store that failed is tried again while a claim must be kept alive: an outage
/// shorter than the lease never lets the lease lapse.
const RETRY_WHILE_UNREACHABLE: Duration = Duration::from_millis(500);

/// Polls `future` once, in the task's context: `Pending` leaves it to be awaited on. Used to skip
/// setting up a timer for work that turns out to be done already.
async fn poll_once<F: Future>(mut future: Pin<&mut F>) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await
}

/// A held claim that is released if dropped unsettled: a cancelled request (see
/// [`Disconnect::Cancel`]) or a task torn down with its runtime frees its key instead of leaving
/// it to its lease.
struct ClaimGuard<St: Store> {
    store: Arc<St>,
    claim: Option<St::Claim>,
}

/// What became of storing a handler's response.
enum Completion {
    /// Stored (or storing goes on in the background while the claim is kept): deliver it.
    Stored,
    /// The handler's effects were to commit with the record and may not have: `503`.
    NotCommitted,
    /// The handler's transaction had failed: nothing committed, nothing stored, key free.
    RolledBack,
}

impl<St: Store> ClaimGuard<St> {
    fn new(store: Arc<St>, claim: St::Claim) -> Self {
        Self {
            store,
            claim: Some(claim),
        }
    }

    fn claim(&self) -> &St::Claim {
        self.claim.as_ref().expect("claim is present until settled")
    }

    /// Stores the record.
    ///
    /// When the handler's effects are bound to the claim ([`Store::commits_effects`]), a failure
    /// means they did not commit. Otherwise a store failure does not undo what the handler did:
    /// the response is delivered, and storing goes on in the background ([`keep_storing`])
    /// with the claim kept alive meanwhile, so no retry runs the handler again.
    async fn complete(mut self, record: Record, lease: Duration, ttl: Duration) -> Completion {
        let Some(claim) = self.claim.take() else {
            return Completion::Stored;
        };
        let atomic = self.store.commits_effects(&claim);
        if let Some(body) = record.body() {
            metrics::stored_body(body.len());
        }
        match metrics::timed("complete", self.store.complete(&claim, &record)).await {
            Ok(ClaimStatus::Held) => Completion::Stored,
            Ok(ClaimStatus::RolledBack) => Completion::RolledBack,
            Ok(status) => {
                log_fenced(status, "complete");
                if atomic {
                    Completion::NotCommitted
                } else {
                    Completion::Stored
                }
            }
            Err(error) if atomic => {
                tracing::error!(
                    error = %Chain(&error),
                    "committing the request failed; it was rolled back"
                );
                Completion::NotCommitted
            }
            Err(error) => {
                tracing::error!(error = %Chain(&error), "storing the response failed; retrying in the background");
                let store = Arc::clone(&self.store);
                tokio::spawn(keep_storing(store, claim, record, lease, ttl).in_current_span());
                Completion::Stored
            }
        }
    }

    /// Frees the key for the next request.
    async fn release(mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        match metrics::timed("release", self.store.release(&claim)).await {
            Ok(status) => log_fenced(status, "release"),
            Err(error) => tracing::warn!(
                error = %Chain(&error),
                "releasing the key failed; it frees itself when its lease lapses"
            ),
        }
    }

    /// Lets the claim go without releasing it: it lapses with its lease.
    fn abandon(mut self) {
        drop(self.claim.take());
    }
}

impl<St: Store> Drop for ClaimGuard<St> {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = Arc::clone(&self.store);
        tracing::debug!("request dropped while holding its key; releasing it");
        runtime.spawn(async move {
            if let Err(error) = store.release(&claim).await {
                tracing::warn!(error = %Chain(&error), "releasing a dropped request's key failed");
            }
        });
    }
}

/// Stores a delivered response the store did not take, keeping its claim alive meanwhile so that
/// no retry takes the key over and runs the handler again: a retry gets `409` until the record is
/// stored, then its replay. Retried promptly while the store is unreachable, with a growing
/// pause while it answers but refuses; given up once the record would have expired anyway.
async fn keep_storing<St: Store>(
    store: Arc<St>,
    claim: St::Claim,
    record: Record,
    lease: Duration,
    ttl: Duration,
) {
    let started = tokio::time::Instant::now();
    let renew_every = lease / 3;
    let mut renewed: Option<tokio::time::Instant> = None;
    let mut pause = Duration::from_millis(100);
    loop {
        tokio::time::sleep(pause).await;
        match metrics::timed("complete", store.complete(&claim, &record)).await {
            Ok(status) => {
                log_fenced(status, "complete");
                return;
            }
            Err(error) => {
                tracing::warn!(error = %Chain(&error), "storing the response failed again")
            }
        }
        if started.elapsed() >= ttl {
            tracing::error!(
                "gave up storing the response: its record would have expired by now, so a retry \
                 with this key runs the handler again"
            );
            return;
        }
        let due = renewed.is_none_or(|at| at.elapsed() >= renew_every);
        let reachable = if due {
            match metrics::timed("renew", store.renew(&claim, lease)).await {
                Ok(ClaimStatus::Held) => {
                    renewed = Some(tokio::time::Instant::now());
                    true
                }
                Ok(_) => {
                    tracing::error!(
                        "the key was taken over while its delivered response waited to be stored; \
                         the handler may run twice"
                    );
                    return;
                }
                Err(_) => false,
            }
        } else {
            true
        };
        pause = if reachable {
            (pause * 3).min(renew_every).min(Duration::from_secs(10))
        } else {
            RETRY_WHILE_UNREACHABLE
        };
    }
}

fn log_fenced(status: ClaimStatus, operation: &str) {
    if status == ClaimStatus::Lost {
        tracing::warn!(
            operation,
            "the claim was taken over while the handler ran (its lease lapsed); nothing was written"
        );
    }
}

fn replayed<B>(record: &Record) -> Response<ResponseBody<B>> {
    outcome(Outcome::Replayed);
    replay::response(record)
}

fn mismatch<B>(config: &Config) -> Response<ResponseBody<B>> {
    outcome(Outcome::Mismatch);
    let detail = if config.scope.is_across_endpoints() {
        "this idempotency key was already used with a different request (another endpoint, \
         query or body); use a new key for a new request"
    } else {
        "this idempotency key was already used with a different request to this endpoint \
         (its body or query differs); use a new key for a new request"
    };
    reject(config, Rejection::new(RejectionKind::Mismatch, detail))
}

fn reject<B>(config: &Config, rejection: Rejection) -> Response<ResponseBody<B>> {
    metrics::rejected(rejection.kind());
    config.rendering.render(rejection)
}

/// What became of a keyed request: the `outcome` field of the `idempotency` span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A new key: the handler ran and its response was stored.
    Acquired,
    /// A key taken over from a lapsed lease: the handler ran and its response was stored.
    Takeover,
    /// A completed key: the stored response was replayed.
    Replayed,
    /// The key is in flight: `409`.
    Conflict,
    /// The key belongs to another payload: `422`.
    Mismatch,
    /// The handler ran (or failed) and the key was freed without storing a response.
    Released,
    /// The handler ran past its maximum time: cancelled, its claim left to lapse.
    Abandoned,
    /// Too many handlers run for clients that hung up: `503`, nothing claimed.
    Overloaded,
    /// The store failed at claim time.
    StoreError,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::Takeover => "takeover",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::Released => "released",
            Self::Abandoned => "abandoned",
            Self::Overloaded => "overloaded",
            Self::StoreError => "store_error",
        }
    }
}

fn outcome(outcome: Outcome) {
    metrics::outcome(outcome.as_str());
    tracing::Span::current().record("outcome", outcome.as_str());
    tracing::debug!(outcome = outcome.as_str(), "idempotent request");
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("<non-string panic payload>")
}

/// Displays an error with its sources: `outer: inner: innermost`, skipping a source that only
/// repeats what its parent said (sqlx's database errors display their source's message).
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn StdError + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut said = self.0.to_string();
        f.write_str(&said)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            let message = error.to_string();
            if !said.ends_with(&message) {
                write!(f, ": {message}")?;
            }
            said = message;
            source = error.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A keyed request's future is allocated for every request and moved between its stages,
    /// so its size is a per-request cost. It was 37 KiB in lease mode while the store's timers
    /// held each statement's future twice and the transactional begin was inlined.
    ///
    /// Layouts are as shipped only when optimised (MIR inlining changes what an `.await`
    /// holds: without the boxed transactional begin the future is 4 KiB unoptimised but 10 KiB
    /// optimised), so it runs in release builds; CI runs it with `cargo test --release`.
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

    #[derive(Debug)]
    struct Layered(&'static str, Option<Box<Layered>>);

    impl fmt::Display for Layered {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl StdError for Layered {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            self.1.as_deref().map(|e| e as &(dyn StdError + 'static))
        }
    }

    #[test]
    fn error_chains_show_each_new_message_once() {
        let error = Layered(
            "store failed",
            Some(Box::new(Layered(
                "database said: relation missing",
                Some(Box::new(Layered("relation missing", None))),
            ))),
        );
        assert_eq!(
            Chain(&error).to_string(),
            "store failed: database said: relation missing"
        );
    }
}
