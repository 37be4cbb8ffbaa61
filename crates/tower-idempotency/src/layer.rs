use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderName, Method};
use tower_layer::Layer;

#[cfg(feature = "postgres")]
use crate::store::{CachingStore, PostgresStore};
use crate::{
    fingerprint::Fingerprinting,
    key::KeySource,
    policy::{Disconnect, RetentionPolicy, StoreFailure},
    rendering::Rendering,
    scope::Scope,
    service::{Idempotency, Shared, Waiting},
    settings::{Config, ConfigError, InFlightWait, Limits, MAX_DURATION, MIN_LEASE, StepSecret},
    store::{InFlightWatch, MemoryStore, Store},
};

/// Applies [`Idempotency`] to a service: the entry point of the crate.
///
/// `IdempotencyLayer::new(store)` is the constructor; [`postgres`](Self::postgres) and
/// [`memory`](Self::memory) are shorthands for the two bundled stores. Settings are `with_*`
/// methods, one a concern, each taking a value ([`KeySource`], [`Fingerprinting`], [`Limits`],
/// [`InFlightWait`], [`Rendering`]...) that holds related settings together. A value that can
/// be invalid is checked whole when it is given, so `with_*` returns `Result<Self, ConfigError>`,
/// and the order of the calls never matters. Zero is never a limit: it is refused. Building a
/// layer starts no task and opens no connection.
///
/// ```
/// use std::time::Duration;
/// use http::Method;
/// use tower_idempotency::{IdempotencyLayer, KeySource, Limits, RetentionPolicy};
///
/// # fn main() -> Result<(), tower_idempotency::ConfigError> {
/// let layer = IdempotencyLayer::memory()
///     .with_key(KeySource::default().required())
///     .with_ttl(Duration::from_secs(24 * 3600))?
///     .with_lease(Duration::from_secs(30))?
///     .with_methods([Method::POST])?
///     .with_limits(Limits::default().with_max_request_bytes(256 * 1024))?
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
/// use tower_idempotency::{IdempotencyLayer, KeySource};
/// # async fn authenticate(request: Request, next: Next) -> axum::response::Response {
/// #     next.run(request).await
/// # }
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(|| async { StatusCode::CREATED }))
///     .layer(IdempotencyLayer::memory().with_key(KeySource::default().required()))
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
    /// | [`with_key`](Self::with_key) | the `Idempotency-Key` header, optional: requests without one pass through unprotected; no rule beyond the header's syntax |
    /// | [`with_scope`](Self::with_scope) | the [`Principal`](crate::Principal) request extension |
    /// | [`with_fingerprint`](Self::with_fingerprint) | [`Fingerprinting::semantic`]: the method, path, query and whole body by meaning; no header |
    /// | [`with_limits`](Self::with_limits) | [`Limits::default`]: bodies up to 2 MiB arriving within 30 seconds, responses up to 1 MiB stored, handlers stopped after 10 minutes, 1,024 finishing for clients that hung up |
    /// | [`with_retention`](Self::with_retention) | [`RetentionPolicy::final_outcomes`] |
    /// | [`with_unstored_headers`](Self::with_unstored_headers) | none besides those [`Record::capture`](crate::Record::capture) always drops |
    /// | [`with_store_failure`](Self::with_store_failure) | fail closed: `503`, `Retry-After: 1` |
    /// | [`with_disconnect`](Self::with_disconnect) | [`Disconnect::RunToCompletion`] |
    /// | [`with_rendering`](Self::with_rendering) | [`Rendering::problem_details`]: RFC 9457 problem documents, replays marked `Idempotent-Replayed: true` |
    /// | [`with_in_flight_wait`](Self::with_in_flight_wait) | none: a duplicate of a key in flight gets `409` at once |
    /// | [`with_step_secret`](Self::with_step_secret) | none: handlers get no [`Steps`](crate::Steps) |
    /// | [`with_completion`](Self::with_completion) | none: no request is kept for a [`Completer`](crate::Completer) |
    pub fn new(store: St) -> Self {
        // The store's watch is only cloned here: a store that wakes waiters from a task of its
        // own starts it when the first request waits.
        let waiting = Waiting::new(store.capabilities().in_flight_watch().clone());
        let shared = Shared {
            store: Arc::new(store),
            config: Arc::new(Config::default()),
            detached: Arc::default(),
            waiting: Arc::new(waiting),
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
    /// lease. A TTL longer than [`MAX_DURATION`] is taken as that.
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
    /// from crashes, at the cost of more renewals for long handlers. A lease longer than
    /// [`MAX_DURATION`] is taken as that.
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

    /// Where keys come from, whether a covered request must carry one, and the rule keys follow;
    /// see [`KeySource`].
    pub fn with_key(mut self, key: KeySource) -> Self {
        self.config_mut().key = key;
        self
    }

    /// Where the principal that owns a key comes from; see [`Scope`].
    pub fn with_scope(mut self, scope: Scope) -> Self {
        self.config_mut().scope = scope;
        self
    }

    /// What a request's fingerprint covers; see [`Fingerprinting`].
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidPointer`] for a field pointer that does not start with `/`,
    /// [`ConfigError::RawExcluding`] for fields left out of a raw fingerprint,
    /// [`ConfigError::CredentialKept`] for a credential header taken in while requests are kept
    /// for completion (see [`with_completion`](Self::with_completion)).
    pub fn with_fingerprint(mut self, fingerprinting: Fingerprinting) -> Result<Self, ConfigError> {
        self.config_mut().fingerprinting = fingerprinting.validated()?;
        self.shared.config.completion_checked()?;
        Ok(self)
    }

    /// How much a request may take of the layer: body size and time, stored response size,
    /// handler time, detached handlers; see [`Limits`].
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero limit.
    pub fn with_limits(mut self, limits: Limits) -> Result<Self, ConfigError> {
        self.config_mut().limits = limits.validated()?;
        Ok(self)
    }

    /// Which responses are kept; see [`RetentionPolicy`].
    pub fn with_retention(mut self, policy: RetentionPolicy) -> Self {
        self.config_mut().retention = policy;
        self
    }

    /// Response headers never stored (so never replayed), besides those
    /// [`Record::capture`](crate::Record::capture) always drops: headers that describe one
    /// delivery or carry a secret in your app.
    pub fn with_unstored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config_mut().unstored_headers.extend(names);
        self
    }

    /// What a request gets when the store fails; see [`StoreFailure`].
    pub fn with_store_failure(mut self, policy: StoreFailure) -> Self {
        self.config_mut().store_failure = policy;
        self
    }

    /// What happens to a running handler when the client disconnects; see [`Disconnect`].
    pub fn with_disconnect(mut self, policy: Disconnect) -> Self {
        self.config_mut().disconnect = policy;
        self
    }

    /// How refusals and replays are worded; see [`Rendering`].
    pub fn with_rendering(mut self, rendering: Rendering) -> Self {
        self.config_mut().rendering = rendering;
        self
    }

    /// Makes a duplicate of a key in flight wait for the first request's answer instead of
    /// getting `409` at once; see [`InFlightWait`].
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero wait or a zero number of waiters.
    pub fn with_in_flight_wait(mut self, wait: InFlightWait) -> Result<Self, ConfigError> {
        self.config_mut().in_flight_wait = Some(wait.validated()?);
        if let InFlightWatch::Notified(notifier) =
            self.shared.store.capabilities().in_flight_watch()
        {
            notifier.expect_waiters();
        }
        Ok(self)
    }

    /// The secret [`Steps`](crate::Steps) derives downstream keys with, which makes the
    /// extractor available: the same on every instance and across restarts, or keys change
    /// and downstream services no longer deduplicate a step's retries. Load it from your
    /// secret store; see the [modes guide](crate::guide::modes#steps).
    ///
    /// # Errors
    ///
    /// [`ConfigError::ShortSecret`] for fewer than
    /// [`MIN_STEP_SECRET_BYTES`](crate::MIN_STEP_SECRET_BYTES) bytes.
    pub fn with_step_secret(mut self, secret: impl Into<Vec<u8>>) -> Result<Self, ConfigError> {
        self.config_mut().step_secret = Some(StepSecret::new(secret.into())?);
        Ok(self)
    }

    /// Keeps each keyed request (method, URI, the key's header, the headers the fingerprint
    /// covers and those `completion` names, body, principal) with its claim, so that a
    /// [`Completer`](crate::Completer) finishes keys whose client never came back; see the
    /// [completion guide](crate::guide::completion).
    ///
    /// # Errors
    ///
    /// [`ConfigError::CompletionUnsupported`] when the store keeps no requests (no
    /// [`PendingLog`](crate::store::PendingLog)): the memory store, PostgreSQL in transactional
    /// mode. [`ConfigError::CredentialKept`] when a credential header would be kept without
    /// [`Completion::storing_credentials`](crate::Completion::storing_credentials).
    pub fn with_completion(mut self, completion: crate::Completion) -> Result<Self, ConfigError> {
        if self.shared.store.capabilities().pending_log().is_none() {
            return Err(ConfigError::CompletionUnsupported);
        }
        self.config_mut().completion = Some(completion);
        self.shared.config.completion_checked()?;
        Ok(self)
    }

    /// What this layer's configuration says to an OpenAPI document (feature `utoipa`): the key
    /// header, the refusals, the replay header and the TTL; see [`openapi`](crate::openapi).
    #[cfg(feature = "utoipa")]
    pub fn openapi(&self) -> crate::openapi::IdempotencyApi {
        crate::openapi::IdempotencyApi::new(&self.shared.config)
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
