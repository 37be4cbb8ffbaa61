//! The middleware, in the order a request meets it:
//! key → scope → body and fingerprint → claim → handler → record → replay.

use std::{
    error::Error as StdError,
    fmt,
    future::Future,
    marker::PhantomData,
    panic::AssertUnwindSafe,
    pin::{Pin, pin},
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response, request::Parts};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::{
    body::{self, BoxError, Buffered, RequestBody, ResponseBody},
    cache::{Hit, ReplayCache},
    context::IdempotencyContext,
    fingerprint::Fingerprint,
    future::ResponseFuture,
    key::IdempotencyKey,
    layer::Config,
    metrics,
    policy::{Disconnect, Retention, StoreFailure},
    problem::{Rejection, RejectionKind},
    record::Record,
    replay,
    scope::ScopeKey,
    store::{Begin, ClaimRequest, ClaimStatus, Store},
};

/// Middleware that runs each keyed request once and replays its response to retries.
///
/// Made by [`IdempotencyLayer`](crate::IdempotencyLayer); see the [crate documentation](crate).
pub struct Idempotency<S, St> {
    inner: S,
    store: Arc<St>,
    config: Arc<Config>,
    cache: Arc<ReplayCache>,
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(
        inner: S,
        store: Arc<St>,
        config: Arc<Config>,
        cache: Arc<ReplayCache>,
    ) -> Self {
        Self {
            inner,
            store,
            config,
            cache,
        }
    }
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            cache: Arc::clone(&self.cache),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for Idempotency<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &std::any::type_name::<St>())
            .field("config", &self.config)
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
        if !self.config.covers(request.method()) {
            return ResponseFuture::passthrough(
                self.inner.call(request.map(RequestBody::passthrough)),
            );
        }

        // Key.
        let key = match IdempotencyKey::from_headers(request.headers()) {
            Ok(Some(key)) => key,
            Ok(None) if self.config.required => {
                return ResponseFuture::rejected(Rejection::new(
                    RejectionKind::KeyMissing,
                    format!(
                        "{} {} requires an Idempotency-Key header",
                        request.method(),
                        request.uri().path()
                    ),
                ));
            }
            Ok(None) => {
                return ResponseFuture::passthrough(
                    self.inner.call(request.map(RequestBody::passthrough)),
                );
            }
            Err(error) => {
                return ResponseFuture::rejected(Rejection::new(
                    RejectionKind::KeyInvalid,
                    error.to_string(),
                ));
            }
        };

        // Scope.
        let (parts, body) = request.into_parts();
        let Some(principal) = self.config.scope.principal(&parts) else {
            tracing::error!(
                "idempotent request without a principal: the authentication layer must insert a \
                 `tower_idempotency::Principal` before the idempotency layer runs (in axum, add it \
                 with `.layer(...)` after the idempotency layer), or configure \
                 `IdempotencyLayer::with_scope`"
            );
            return ResponseFuture::rejected(Rejection::new(
                RejectionKind::PrincipalMissing,
                "the server could not determine who this request is for, so its Idempotency-Key \
                 cannot be honoured; nothing was processed",
            ));
        };
        let scope_key = ScopeKey::new(&principal, &parts.method, parts.uri.path(), &key);

        // The service that was polled ready is the one that runs the handler; a fresh clone
        // takes its place (see https://docs.rs/tower/latest/tower/trait.Service.html#be-careful-when-cloning-inner-services).
        let clone = self.inner.clone();
        let keyed = Keyed {
            inner: std::mem::replace(&mut self.inner, clone),
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            cache: Arc::clone(&self.cache),
            key,
            scope_key,
            _request_body: PhantomData,
        };
        let span = tracing::debug_span!(
            "idempotency",
            key = %scope_key,
            outcome = tracing::field::Empty,
        );
        let detach = self.config.disconnect == Disconnect::RunToCompletion;
        // Boxed where it is made: moving this large state machine into the response future
        // would copy it, where moving the box copies a pointer.
        ResponseFuture::keyed(Box::pin(keyed.serve(parts, body).instrument(span)), detach)
    }
}

/// A covered request with a valid key and scope, on its way through the store.
struct Keyed<S, St, ReqBody> {
    inner: S,
    store: Arc<St>,
    config: Arc<Config>,
    cache: Arc<ReplayCache>,
    key: IdempotencyKey,
    scope_key: ScopeKey,
    _request_body: PhantomData<fn(ReqBody)>,
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
    fn serve(self, parts: Parts, body: ReqBody) -> impl Future<Output = Served<ResBody, S::Error>> {
        async move {
            let limit = self.config.max_body_bytes;
            let timeout = self.config.body_timeout;
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
                        return Ok(reject(Rejection::new(
                            RejectionKind::BodyTimeout,
                            format!(
                                "the request body did not arrive within {timeout:?}; nothing was \
                             processed"
                            ),
                        )));
                    }
                },
            };
            let body = match buffered {
                Buffered::Complete(body) => body,
                Buffered::TooLarge { .. } => {
                    return Ok(reject(Rejection::new(
                        RejectionKind::BodyTooLarge,
                        format!("the request body exceeds {limit} bytes; nothing was processed"),
                    )));
                }
                Buffered::Failed { error, .. } => {
                    tracing::debug!(error = %Chain(&*error), "request body could not be read");
                    return Ok(reject(Rejection::new(
                        RejectionKind::BodyUnreadable,
                        "the request body could not be read; nothing was processed",
                    )));
                }
            };
            let fingerprint = crate::fingerprint::compute_for_request(
                self.config.fingerprint,
                parts.method.clone(),
                parts.uri.clone(),
                parts.headers.get(http::header::CONTENT_TYPE).cloned(),
                body.clone(),
            )
            .await;

            // Claim, then run, replay or refuse.
            let begin = match claim(
                &*self.store,
                &self.cache,
                &self.config,
                self.scope_key,
                fingerprint,
            )
            .await
            {
                Ok(begin) => begin,
                Err(error) => return self.store_failed(&error, parts, body).await,
            };
            match begin {
                Begin::Acquired { claim, takeover } => {
                    if takeover {
                        tracing::warn!(
                            "took over an idempotency key whose holder's lease lapsed; \
                         its handler may have run in part"
                        );
                    }
                    self.run(claim, takeover, parts, body).await
                }
                Begin::Completed { record, .. } => Ok(replayed(&record)),
                Begin::InFlight { .. } => {
                    outcome(Outcome::Conflict);
                    Ok(reject(Rejection::new(
                        RejectionKind::InFlight,
                        "a request with this Idempotency-Key is still being processed; \
                     retry after the Retry-After delay to get its response",
                    )))
                }
                Begin::Mismatch => Ok(mismatch()),
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
        takeover: bool,
        mut parts: Parts,
        body: Bytes,
    ) -> impl Future<Output = Served<ResBody, S::Error>> {
        async move {
            let Keyed {
                mut inner,
                store,
                config,
                key,
                scope_key,
                ..
            } = self;
            store.attach(&claim, &mut parts.extensions);
            let guard = ClaimGuard::new(Arc::clone(&store), claim);
            parts.extensions.insert(IdempotencyContext {
                key,
                scope_key,
                takeover,
            });
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
            let handled = with_heartbeat(&*store, guard.claim(), config.lease, handling).await;

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
                    return Ok(reject(Rejection::new(
                        RejectionKind::HandlerPanicked,
                        "the request failed on the server and was not completed; \
                     it is safe to retry with the same Idempotency-Key",
                    )));
                }
            };

            let retention = parts
                .extensions
                .remove::<Retention>()
                .unwrap_or_else(|| config.retention.decide(parts.status));
            let (kept_body, body) = match buffered {
                Buffered::Complete(bytes) => (Some(bytes.clone()), ResponseBody::full(bytes)),
                Buffered::TooLarge { prefix, rest } => {
                    tracing::warn!(
                        limit = max_response_bytes,
                        "response too large to store: delivered, but a retry gets its status only"
                    );
                    (None, ResponseBody::prefixed(prefix, rest))
                }
                Buffered::Failed { prefix, error } => {
                    tracing::warn!(error = %Chain(&*error), "response body failed while being stored");
                    (None, ResponseBody::failed(prefix, error))
                }
            };
            match retention {
                Retention::Keep => {
                    let record = Record::capture(&parts, kept_body);
                    if !guard.complete(record).await {
                        // The handler's writes were to commit with the record, and may not have.
                        outcome(Outcome::StoreError);
                        return Ok(reject(Rejection::new(
                            RejectionKind::StoreUnavailable,
                            "the request could not be confirmed as committed; retry with the same \
                         Idempotency-Key: if it was committed the retry gets its response, \
                         otherwise it runs again",
                        )));
                    }
                    outcome(if takeover {
                        Outcome::Takeover
                    } else {
                        Outcome::Acquired
                    });
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
        match self.config.store_failure {
            StoreFailure::FailClosed { retry_after_secs } => Ok(reject(
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

/// The key's state: from the replay cache if it holds the key's record, otherwise from the
/// store's atomic claim (a completed record it returns is cached for the next retry).
async fn claim<St: Store>(
    store: &St,
    cache: &ReplayCache,
    config: &Config,
    key: ScopeKey,
    fingerprint: Fingerprint,
) -> Result<Begin<St::Claim>, St::Error> {
    match cache.get(&key, &fingerprint) {
        Some(Hit::Replay(record)) => {
            return Ok(Begin::Completed {
                record,
                expires_in: None,
            });
        }
        Some(Hit::Mismatch) => return Ok(Begin::Mismatch),
        None => {}
    }
    let request = ClaimRequest {
        key,
        fingerprint,
        lease: config.lease,
        ttl: config.ttl,
    };
    let begin = metrics::timed("begin", store.begin(&request)).await?;
    if let Begin::Completed {
        record,
        expires_in: Some(expires_in),
    } = &begin
    {
        cache.insert(key, fingerprint, record, *expires_in);
    }
    Ok(begin)
}

/// Runs `future` while renewing `claim`'s lease every third of `lease`. Renewal runs beside the
/// handler, never blocking it; a renewal that fails or finds the claim lost is logged, and the
/// handler goes on (fencing keeps a lost claim from writing its record).
async fn with_heartbeat<St: Store, F: Future>(
    store: &St,
    claim: &St::Claim,
    lease: Duration,
    mut future: Pin<&mut F>,
) -> F::Output {
    // A handler that answers without waiting needs no heartbeat: don't even start the timer.
    if let Poll::Ready(output) = poll_once(future.as_mut()).await {
        return output;
    }
    let period = lease / 3;
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            output = &mut future => return output,
            _ = ticker.tick() => {}
        }
        let renewal = pin!(metrics::timed("renew", store.renew(claim, lease)));
        tokio::select! {
            biased;
            output = &mut future => return output,
            renewed = renewal => match renewed {
                Ok(ClaimStatus::Held) => metrics::renewal("held"),
                Ok(ClaimStatus::Lost) => {
                    metrics::renewal("lost");
                    tracing::warn!(
                        "lease lost while the handler runs (another request took the key over); \
                         this response will not be stored"
                    );
                }
                Err(error) => {
                    metrics::renewal("error");
                    tracing::warn!(error = %Chain(&error), "lease renewal failed");
                }
            },
        }
    }
}

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

/// How long the layer keeps trying to store a response after the store failed to take it.
const COMPLETE_RETRY_DELAYS: [Duration; 6] = [
    Duration::from_millis(100),
    Duration::from_millis(300),
    Duration::from_secs(1),
    Duration::from_secs(3),
    Duration::from_secs(10),
    Duration::from_secs(30),
];

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

    /// Stores the record; `false` when the handler's effects were bound to the claim
    /// ([`Store::commits_effects`]) and did not commit, so the response must not be delivered.
    ///
    /// Otherwise a store failure does not undo what the handler did: the response is delivered
    /// and storing is retried in the background; the claim stays held meanwhile, so no retry
    /// runs the handler.
    async fn complete(mut self, record: Record) -> bool {
        let Some(claim) = self.claim.take() else {
            return true;
        };
        let atomic = self.store.commits_effects(&claim);
        if let Some(body) = record.body() {
            metrics::stored_body(body.len());
        }
        match metrics::timed("complete", self.store.complete(&claim, &record)).await {
            Ok(ClaimStatus::Held) => true,
            Ok(ClaimStatus::Lost) => {
                log_fenced(ClaimStatus::Lost, "complete");
                !atomic
            }
            Err(error) if atomic => {
                tracing::error!(
                    error = %Chain(&error),
                    "committing the request failed; it was rolled back"
                );
                false
            }
            Err(error) => {
                tracing::error!(error = %Chain(&error), "storing the response failed; retrying in the background");
                let store = Arc::clone(&self.store);
                tokio::spawn(
                    async move {
                        for delay in COMPLETE_RETRY_DELAYS {
                            tokio::time::sleep(delay).await;
                            match store.complete(&claim, &record).await {
                                Ok(status) => return log_fenced(status, "complete"),
                                Err(error) => tracing::warn!(error = %Chain(&error), "storing the response failed again"),
                            }
                        }
                        tracing::error!(
                            "gave up storing the response: once its lease lapses, a retry with \
                             this key will run the handler again"
                        );
                    }
                    .in_current_span(),
                );
                true
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

fn mismatch<B>() -> Response<ResponseBody<B>> {
    outcome(Outcome::Mismatch);
    reject(Rejection::new(
        RejectionKind::Mismatch,
        "this Idempotency-Key was already used with a different request \
         (method, path, query or body); use a new key for a new request",
    ))
}

fn reject<B>(rejection: Rejection) -> Response<ResponseBody<B>> {
    metrics::rejected(rejection.kind());
    rejection.into_response()
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
            store: Arc::clone(&service.store),
            config: Arc::clone(&service.config),
            cache: Arc::clone(&service.cache),
            key: IdempotencyKey::parse(&http::HeaderValue::from_static("k")).expect("key"),
            scope_key: ScopeKey::from_bytes([0; 32]),
            _request_body: PhantomData,
        };
        let (parts, body) = Request::new(Full::new(Bytes::new())).into_parts();
        let size = std::mem::size_of_val(&keyed.serve(parts, body));
        assert!(
            size <= 8 * 1024,
            "a lease-mode request's future is {size} bytes"
        );
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
