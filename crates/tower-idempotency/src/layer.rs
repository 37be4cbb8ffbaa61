use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderName, Method};
use tower_layer::Layer;

#[cfg(feature = "postgres")]
use crate::store::{CachingStore, PostgresStore};
use crate::{
    config::{Config, ConfigError, KeySource, MAX_DURATION, MIN_LEASE},
    fingerprint::FingerprintMode,
    key::KeyRule,
    policy::{Disconnect, RetentionPolicy, StoreFailure},
    problem::Rejection,
    scope::Scope,
    service::{Idempotency, Shared, Waiting},
    store::{MemoryStore, Store},
};

/// Applies [`Idempotency`] to a service: the entry point of the crate.
///
/// `IdempotencyLayer::new(store)` is the constructor; [`postgres`](Self::postgres) and
/// [`memory`](Self::memory) are shorthands for the two bundled stores. Settings are `with_*`
/// methods; those that can be given an invalid value return `Result<Self, ConfigError>`.
///
/// ```
/// use std::time::Duration;
/// use http::Method;
/// use tower_idempotency::{IdempotencyLayer, RetentionPolicy};
///
/// # fn main() -> Result<(), tower_idempotency::ConfigError> {
/// let layer = IdempotencyLayer::memory()
///     .required()
///     .with_ttl(Duration::from_secs(24 * 3600))?
///     .with_lease(Duration::from_secs(30))?
///     .with_methods([Method::POST])?
///     .with_max_body_bytes(256 * 1024)?
///     .with_retention(RetentionPolicy::keep_server_errors());
/// # let _ = layer; Ok(()) }
/// ```
///
/// # Among other layers
///
/// In axum the last `.layer(...)` is the outermost. Authentication goes outside this layer (it
/// supplies the [`Principal`](crate::Principal)), and so do a timeout and compression:
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use std::time::Duration;
/// use axum::{Router, http::StatusCode, middleware::{self, Next}, extract::Request, routing::post};
/// use tower_http::{compression::CompressionLayer, timeout::TimeoutLayer};
/// use tower_idempotency::IdempotencyLayer;
/// # async fn authenticate(request: Request, next: Next) -> axum::response::Response {
/// #     next.run(request).await
/// # }
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(|| async { StatusCode::CREATED }))
///     .layer(IdempotencyLayer::memory().required())
///     .layer(middleware::from_fn(authenticate))
///     .layer(CompressionLayer::new())
///     .layer(TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, Duration::from_secs(10)));
/// # }
/// ```
///
/// A timeout outside ends the client's wait, not the handler: the handler finishes in the
/// layer's own task and its response is stored, so the retry gets `409` and then the replay.
/// Inside, it would drop the handler half-way, and its `408` would release the key for a rerun
/// after a partial run. Compression outside encodes each response, replays included, for the
/// client that asked; inside, the first client's encoding would be replayed to every retry.
#[must_use]
pub struct IdempotencyLayer<St> {
    pub(crate) shared: Shared<St>,
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer keeping its keys in `store`, with the default settings:
    ///
    /// | setting | default |
    /// |---|---|
    /// | [`with_ttl`](Self::with_ttl) | 24 hours from the first request |
    /// | [`with_lease`](Self::with_lease) | 30 seconds, renewed every 10 while the handler runs |
    /// | [`with_methods`](Self::with_methods) | `POST`, `PATCH` |
    /// | [`required`](Self::required) | no: requests without a key pass through unprotected |
    /// | [`with_max_body_bytes`](Self::with_max_body_bytes) | 2 MiB (larger: `413`) |
    /// | [`with_body_timeout`](Self::with_body_timeout) | 30 seconds to receive the whole body (slower: `408`) |
    /// | [`with_max_response_bytes`](Self::with_max_response_bytes) | 1 MiB (larger: delivered, body not stored) |
    /// | [`with_scope`](Self::with_scope) | the [`Principal`](crate::Principal) request extension |
    /// | [`with_header`](Self::with_header), [`with_key_from_request`](Self::with_key_from_request) | the `Idempotency-Key` header |
    /// | [`with_key_rule`](Self::with_key_rule) | none: any key the header's syntax allows |
    /// | [`with_fingerprint`](Self::with_fingerprint) | [`FingerprintMode::Semantic`] |
    /// | [`with_fingerprint_excluding`](Self::with_fingerprint_excluding), [`with_fingerprint_headers`](Self::with_fingerprint_headers) | the method, path, query and whole body; no header |
    /// | [`with_store_failure`](Self::with_store_failure) | fail closed: `503`, `Retry-After: 1` |
    /// | [`with_retention`](Self::with_retention) | [`RetentionPolicy::final_outcomes`] |
    /// | [`with_disconnect`](Self::with_disconnect) | [`Disconnect::RunToCompletion`] |
    /// | [`with_max_detached`](Self::with_max_detached) | 1,024 handlers finishing for clients that hung up (fewer if the store says so: [`Capabilities::detached_limit`](crate::store::Capabilities::detached_limit)); past it keyed requests get `503` |
    /// | [`with_max_handler_time`](Self::with_max_handler_time) | 10 minutes, then the handler is cancelled and its key free at once for the retry (a takeover) |
    /// | [`with_unstored_headers`](Self::with_unstored_headers) | none besides those [`Record::capture`](crate::Record::capture) always drops |
    /// | [`with_rejection_response`](Self::with_rejection_response), [`with_problem_type_base`](Self::with_problem_type_base) | RFC 9457 problem documents whose `type` is this crate's documentation of the refusal |
    /// | [`with_in_flight_wait`](Self::with_in_flight_wait) | none: a duplicate of a key in flight gets `409` at once |
    /// | [`with_max_waiting`](Self::with_max_waiting) | 1,024 requests waiting at once |
    pub fn new(store: St) -> Self {
        let shared = Shared {
            store: Arc::new(store),
            config: Arc::new(Config::default()),
            detached: Arc::default(),
            waiting: Arc::default(),
        };
        Self { shared }
    }

    /// The store, for spawning its expiry loop
    /// ([`continuously_delete_expired`](crate::store::continuously_delete_expired)).
    pub fn store(&self) -> &St {
        &self.shared.store
    }

    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.shared.config)
    }

    /// How long a record lives, counted from the key's first claim. Retries after that run
    /// again. Choose it longer than your clients' retry horizon and your slowest handler. It is
    /// independent of the [lease](Self::with_lease): a claim in flight is never expired while
    /// its lease runs, but a completed record is replayed only until its TTL, however long the
    /// lease.
    ///
    /// A TTL longer than [`MAX_DURATION`] is taken as that.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero TTL.
    pub fn with_ttl(mut self, ttl: Duration) -> Result<Self, ConfigError> {
        if ttl.is_zero() {
            return Err(ConfigError::Zero("ttl"));
        }
        self.config_mut().ttl = ttl.min(MAX_DURATION);
        Ok(self)
    }

    /// How long a claim is held without renewal. The layer renews it every third of that while
    /// the handler runs, so it only lapses when the holder stops (a crash, a hung process);
    /// then a retry takes the key over after at most this long. Shorter means faster recovery
    /// from crashes, at the cost of more renewals for long handlers. Choose it longer than your
    /// slowest handler's usual pauses between polls of its future.
    ///
    /// A lease longer than [`MAX_DURATION`] is taken as that.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero lease, [`ConfigError::TooShort`] for one under
    /// [`MIN_LEASE`].
    pub fn with_lease(mut self, lease: Duration) -> Result<Self, ConfigError> {
        if lease.is_zero() {
            return Err(ConfigError::Zero("lease"));
        }
        if lease < MIN_LEASE {
            return Err(ConfigError::TooShort {
                setting: "lease",
                min: MIN_LEASE,
            });
        }
        self.config_mut().lease = lease.min(MAX_DURATION);
        Ok(self)
    }

    /// The methods the layer covers; requests with other methods pass through untouched.
    ///
    /// # Errors
    ///
    /// [`ConfigError::NoMethods`] when `methods` is empty.
    pub fn with_methods(
        mut self,
        methods: impl IntoIterator<Item = Method>,
    ) -> Result<Self, ConfigError> {
        let methods: Vec<Method> = methods.into_iter().collect();
        if methods.is_empty() {
            return Err(ConfigError::NoMethods);
        }
        self.config_mut().methods = methods;
        Ok(self)
    }

    /// Makes the key mandatory on covered methods: a request without one gets `400`.
    pub fn required(mut self) -> Self {
        self.config_mut().required = true;
        self
    }

    /// The largest request body buffered for fingerprinting; larger bodies get `413` and run
    /// nothing. A `Content-Length` over the limit is refused before any byte is read.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for zero.
    pub fn with_max_body_bytes(mut self, limit: usize) -> Result<Self, ConfigError> {
        if limit == 0 {
            return Err(ConfigError::Zero("max_body_bytes"));
        }
        self.config_mut().max_body_bytes = limit;
        Ok(self)
    }

    /// How long the layer waits for a covered request's whole body before answering `408`
    /// (nothing claimed, nothing run). Bounds what a stalled or deliberately slow client can hold.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for zero.
    pub fn with_body_timeout(mut self, timeout: Duration) -> Result<Self, ConfigError> {
        if timeout.is_zero() {
            return Err(ConfigError::Zero("body_timeout"));
        }
        self.config_mut().body_timeout = timeout.min(MAX_DURATION);
        Ok(self)
    }

    /// The largest response body stored for replay. A larger response is still delivered in
    /// full; its record keeps the status and headers but not the body, and a retry gets the
    /// original status with a problem body saying so (see [`Record`](crate::Record#responses-too-large-to-store)). The
    /// handler is never run again for that key.
    pub fn with_max_response_bytes(mut self, limit: usize) -> Self {
        self.config_mut().max_response_bytes = limit;
        self
    }

    /// Where the principal that owns a key comes from; see [`Scope`].
    pub fn with_scope(mut self, scope: Scope) -> Self {
        self.config_mut().scope = scope;
        self
    }

    /// How request payloads are compared; see [`FingerprintMode`].
    pub fn with_fingerprint(mut self, mode: FingerprintMode) -> Self {
        self.config_mut().fingerprint.mode = mode;
        self
    }

    /// Leaves body fields out of the fingerprint, by JSON Pointer (RFC 6901): `/client_sent_at`,
    /// `/metadata/trace_id`; for a form body, a top-level pointer names a field. A retry that
    /// differs only in them is the same request. See [`Fingerprint`](crate::Fingerprint#what-it-covers).
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidPointer`] for a pointer that does not start with `/`.
    pub fn with_fingerprint_excluding(
        mut self,
        pointers: impl IntoIterator<Item = impl Into<String>>,
    ) -> Result<Self, ConfigError> {
        for pointer in pointers {
            let pointer = pointer.into();
            if !pointer.starts_with('/') {
                return Err(ConfigError::InvalidPointer(pointer));
            }
            self.config_mut().fingerprint.excluded.push(pointer);
        }
        Ok(self)
    }

    /// Takes request headers into the fingerprint (an API version such as `Stripe-Version`,
    /// `Accept`): a retry whose values differ is another request, `422`. See
    /// [`Fingerprint`](crate::Fingerprint#what-it-covers).
    pub fn with_fingerprint_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config_mut().fingerprint.headers.extend(names);
        self
    }

    /// Reads the key from the header `name` instead of `Idempotency-Key` (`X-Idempotency-Key`, or
    /// a vendor's such as PayPal's `PayPal-Request-Id`), by the same parsing rules and limits.
    pub fn with_header(mut self, name: HeaderName) -> Self {
        self.config_mut().key_source = KeySource::Header(name);
        self
    }

    /// Takes the key from the request with `key`, which sees the request head and its whole
    /// body: a webhook receiver deduplicates deliveries by the event's id in the JSON body, as
    /// Stripe, GitHub and Shopify redeliver them. `None` is a request without a key (`400` if
    /// [`required`](Self::required), else run unprotected). The key is checked as a header's
    /// would be (length, characters, [`with_key_rule`](Self::with_key_rule)).
    ///
    /// Every covered request's body is then read before the key is known, so requests without
    /// a key are bound by [`with_max_body_bytes`](Self::with_max_body_bytes) too.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, Scope};
    ///
    /// // Stripe's events carry their id at the top of the body.
    /// let layer = IdempotencyLayer::memory()
    ///     .with_scope(Scope::single_tenant())
    ///     .with_key_from_request(|_, body| {
    ///         let event: serde_json::Value = serde_json::from_slice(body).ok()?;
    ///         Some(event.get("id")?.as_str()?.to_owned())
    ///     });
    /// # let _ = layer;
    /// ```
    pub fn with_key_from_request<F>(mut self, key: F) -> Self
    where
        F: Fn(&http::request::Parts, &bytes::Bytes) -> Option<String> + Send + Sync + 'static,
    {
        self.config_mut().key_source = KeySource::Request(Arc::new(key));
        self
    }

    /// A rule every key must follow ([`KeyRule::uuid`], or one of the app's); a key that breaks
    /// it gets `400` naming the rule, and nothing is stored.
    pub fn with_key_rule(mut self, rule: KeyRule) -> Self {
        self.config_mut().key_rule = Some(rule);
        self
    }

    /// What a request gets when the store fails; see [`StoreFailure`].
    pub fn with_store_failure(mut self, policy: StoreFailure) -> Self {
        self.config_mut().store_failure = policy;
        self
    }

    /// Which responses are kept; see [`RetentionPolicy`].
    pub fn with_retention(mut self, policy: RetentionPolicy) -> Self {
        self.config_mut().retention = policy;
        self
    }

    /// What happens to a running handler when the client disconnects; see [`Disconnect`].
    pub fn with_disconnect(mut self, policy: Disconnect) -> Self {
        self.config_mut().disconnect = policy;
        self
    }

    /// How many handlers may run on for clients that hung up ([`Disconnect::RunToCompletion`])
    /// before the layer sheds new work: while that many are still running, a keyed request gets
    /// `503` with `Retry-After` at once, without touching the store (nothing run, nothing
    /// claimed). Handlers already detached always finish:
    /// none is cancelled to make room.
    ///
    /// The limit is the smaller of this and what the store can carry
    /// ([`Capabilities::detached_limit`](crate::store::Capabilities::detached_limit)): in transactional mode each detached handler holds a pooled
    /// connection, and the store keeps half its pool for everyone else.
    pub fn with_max_detached(mut self, max: usize) -> Self {
        self.config_mut().max_detached = max;
        self
    }

    /// How long a handler may run. Past it the layer stops renewing its lease and stops the
    /// handler (drops its future): a hung handler would otherwise hold its key forever, answering
    /// `409` to every retry. Its client, if still there, gets `503`. The claim is given up
    /// ([`Store::abandon`]): the next retry takes the key over at once and is told so
    /// ([`IdempotencyContext::takeover`](crate::IdempotencyContext::takeover)), so it can look
    /// for the stopped attempt's partial effects; in transactional mode its writes are rolled
    /// back instead, and the retry starts clean. A duration longer than [`MAX_DURATION`] is taken
    /// as that.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for zero.
    pub fn with_max_handler_time(mut self, max: Duration) -> Result<Self, ConfigError> {
        if max.is_zero() {
            return Err(ConfigError::Zero("max_handler_time"));
        }
        self.config_mut().max_handler_time = max.min(MAX_DURATION);
        Ok(self)
    }

    /// Where the `type` URIs of the layer's problem documents point: `base` followed by the
    /// refusal's [`RejectionKind::label`](crate::RejectionKind::label) (`in_flight`,
    /// `mismatch`...), so they lead to your API's own documentation
    /// (`https://api.example.com/docs/errors#` gives `https://api.example.com/docs/errors#mismatch`).
    /// By default they point at this crate's documentation of each kind.
    pub fn with_problem_type_base(mut self, base: impl Into<String>) -> Self {
        self.config_mut().rendering.type_base = Some(base.into().into());
        self
    }

    /// Renders the layer's refusals (`400`, `408`, `409`, `413`, `422`, `500`, `503`) as your
    /// API's own errors instead of RFC 9457 problem documents. `render` gets the typed
    /// [`Rejection`] (its kind, status, detail and `Retry-After`) and returns the response;
    /// the layer adds `Retry-After` and `Cache-Control: no-store` when it did not set them,
    /// and keeps the rejection in the response's extensions for outer layers.
    ///
    /// ```
    /// use axum::http::{Response, header};
    /// use bytes::Bytes;
    /// use tower_idempotency::{IdempotencyLayer, RejectionKind};
    ///
    /// // The app's envelope: `{"error": {"code": ..., "message": ...}}`.
    /// let layer = IdempotencyLayer::memory().with_rejection_response(|rejection| {
    ///     let code = match rejection.kind() {
    ///         RejectionKind::InFlight => "request_in_progress",
    ///         RejectionKind::Mismatch => "idempotency_key_reused",
    ///         other => other.label(),
    ///     };
    ///     let body = serde_json::json!({
    ///         "error": { "code": code, "message": rejection.detail() }
    ///     });
    ///     Response::builder()
    ///         .status(rejection.kind().status())
    ///         .header(header::CONTENT_TYPE, "application/json")
    ///         .body(Bytes::from(body.to_string()))
    ///         .expect("a valid response")
    /// });
    /// # let _ = layer;
    /// ```
    pub fn with_rejection_response<F>(mut self, render: F) -> Self
    where
        F: Fn(&Rejection) -> http::Response<bytes::Bytes> + Send + Sync + 'static,
    {
        self.config_mut().rendering.custom = Some(Arc::new(render));
        self
    }

    /// How long a duplicate of a key in flight waits for the first request to finish instead of
    /// getting `409` at once: it then gets the first request's replay as soon as it is stored, or
    /// runs itself if the first was released (a `400`, a `5xx`...). After `wait`, `409` as
    /// without it. Zero, the default, is the IETF draft's behaviour: `409` at once.
    ///
    /// A waiting request holds no database connection: the store wakes it when the key settles
    /// ([`Store::capabilities`]; the PostgreSQL store through `LISTEN`/`NOTIFY`, across
    /// instances), or it reads the key again every so often. At most
    /// [`with_max_waiting`](Self::with_max_waiting) requests wait at once; past that, `409`.
    pub fn with_in_flight_wait(mut self, wait: Duration) -> Self {
        let wait = wait.min(MAX_DURATION);
        if !wait.is_zero() {
            let watch = self.shared.store.capabilities().in_flight_watch().clone();
            watch.start();
            self.shared.waiting = Arc::new(Waiting::new(watch));
        }
        self.config_mut().in_flight_wait = wait;
        self
    }

    /// How many requests may wait for keys in flight at once (default 1,024); see
    /// [`with_in_flight_wait`](Self::with_in_flight_wait).
    pub fn with_max_waiting(mut self, max: usize) -> Self {
        self.config_mut().max_waiting = max;
        self
    }

    /// What this layer's configuration says to an OpenAPI document (feature `utoipa`): the key
    /// header, the refusals, `Idempotent-Replayed` and the TTL; see [`openapi`](crate::openapi).
    #[cfg(feature = "utoipa")]
    pub fn openapi(&self) -> crate::openapi::IdempotencyApi {
        crate::openapi::IdempotencyApi::new(&self.shared.config)
    }

    /// Response headers never stored (so never replayed), besides those
    /// [`Record::capture`](crate::Record::capture) always drops: headers that describe one
    /// delivery or carry a secret in your app.
    pub fn with_unstored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config_mut().unstored_headers.extend(names);
        self
    }
}

impl IdempotencyLayer<MemoryStore> {
    /// A layer on a new in-process [`MemoryStore`].
    pub fn memory() -> Self {
        Self::new(MemoryStore::new())
    }
}

#[cfg(feature = "postgres")]
impl IdempotencyLayer<CachingStore<PostgresStore>> {
    /// A layer on a [`PostgresStore`] over `pool`, behind a [`CachingStore`] of 16 MiB so that
    /// retries reaching this instance again are answered without a round trip. Apply the
    /// store's migrations once at start-up: `layer.store().inner().migrate()`
    /// ([`PostgresStore::migrate`]).
    pub fn postgres(pool: sqlx::PgPool) -> Self {
        Self::new(CachingStore::new(PostgresStore::new(pool)))
    }
}

impl<St> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<St> fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &std::any::type_name::<St>())
            .field("config", &self.shared.config)
            .finish()
    }
}

impl<S, St> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.shared.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_and_lease_apply_in_either_order() {
        let short = Duration::from_secs(10);
        let shorter = Duration::from_secs(5);
        let a = IdempotencyLayer::memory()
            .with_ttl(short)
            .and_then(|l| l.with_lease(shorter))
            .unwrap();
        let b = IdempotencyLayer::memory()
            .with_lease(shorter)
            .and_then(|l| l.with_ttl(short))
            .unwrap();
        assert_eq!(
            (a.shared.config.ttl, a.shared.config.lease),
            (short, shorter)
        );
        assert_eq!(
            (b.shared.config.ttl, b.shared.config.lease),
            (short, shorter)
        );
        // A lease longer than the TTL is valid too: records are kept while a claim is held.
        assert!(
            IdempotencyLayer::memory()
                .with_ttl(shorter)
                .and_then(|l| l.with_lease(short))
                .is_ok()
        );
    }
}
