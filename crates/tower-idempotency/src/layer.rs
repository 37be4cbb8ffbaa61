use std::{fmt, sync::Arc, time::Duration};

use http::Method;
use tower_layer::Layer;

use crate::{
    cache::ReplayCache,
    fingerprint::FingerprintMode,
    policy::{Disconnect, RetentionPolicy, StoreFailure},
    scope::Scope,
    service::Idempotency,
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
#[must_use]
pub struct IdempotencyLayer<St> {
    store: Arc<St>,
    config: Arc<Config>,
    cache: Arc<ReplayCache>,
}

/// The default size of the replay cache.
const DEFAULT_REPLAY_CACHE_BYTES: usize = 16 * 1024 * 1024;

/// The settings, shared by every clone of the service.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) methods: Vec<Method>,
    pub(crate) required: bool,
    pub(crate) max_body_bytes: usize,
    pub(crate) body_timeout: Duration,
    pub(crate) max_response_bytes: usize,
    pub(crate) scope: Scope,
    pub(crate) fingerprint: FingerprintMode,
    pub(crate) store_failure: StoreFailure,
    pub(crate) retention: RetentionPolicy,
    pub(crate) disconnect: Disconnect,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            methods: vec![Method::POST, Method::PATCH],
            required: false,
            max_body_bytes: 2 * 1024 * 1024,
            body_timeout: Duration::from_secs(30),
            max_response_bytes: 1024 * 1024,
            scope: Scope::default(),
            fingerprint: FingerprintMode::default(),
            store_failure: StoreFailure::default(),
            retention: RetentionPolicy::default(),
            disconnect: Disconnect::default(),
        }
    }
}

impl Config {
    pub(crate) fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }
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
    /// | [`with_fingerprint`](Self::with_fingerprint) | [`FingerprintMode::Semantic`] |
    /// | [`with_store_failure`](Self::with_store_failure) | fail closed: `503`, `Retry-After: 1` |
    /// | [`with_retention`](Self::with_retention) | [`RetentionPolicy::final_outcomes`] |
    /// | [`with_disconnect`](Self::with_disconnect) | [`Disconnect::RunToCompletion`] |
    /// | [`with_replay_cache`](Self::with_replay_cache) | 16 MiB of replayed records kept in process; none for a store that is itself in process ([`Store::in_process`]) |
    pub fn new(store: St) -> Self {
        let cache = if store.in_process() {
            0
        } else {
            DEFAULT_REPLAY_CACHE_BYTES
        };
        Self {
            store: Arc::new(store),
            config: Arc::new(Config::default()),
            cache: Arc::new(ReplayCache::new(cache)),
        }
    }

    /// The store, for spawning its expiry loop
    /// ([`continuously_delete_expired`](crate::store::continuously_delete_expired)).
    pub fn store(&self) -> &St {
        &self.store
    }

    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// How long a record lives, counted from the key's first claim. Retries after that run
    /// again. Choose it longer than your clients' retry horizon and your slowest handler. It is
    /// independent of the [lease](Self::with_lease): a claim in flight is never expired while
    /// its lease runs, but a completed record is replayed only until its TTL, however long the
    /// lease.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero TTL.
    pub fn with_ttl(mut self, ttl: Duration) -> Result<Self, ConfigError> {
        if ttl.is_zero() {
            return Err(ConfigError::Zero("ttl"));
        }
        self.config_mut().ttl = ttl;
        Ok(self)
    }

    /// How long a claim is held without renewal. The layer renews it every third of that while
    /// the handler runs, so it only lapses when the holder stops (a crash, a hung process);
    /// then a retry takes the key over after at most this long. Shorter means faster recovery
    /// from crashes, at the cost of more renewals for long handlers. Choose it longer than your
    /// slowest handler's usual pauses between polls of its future.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Zero`] for a zero lease.
    pub fn with_lease(mut self, lease: Duration) -> Result<Self, ConfigError> {
        if lease.is_zero() {
            return Err(ConfigError::Zero("lease"));
        }
        self.config_mut().lease = lease;
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
        self.config_mut().body_timeout = timeout;
        Ok(self)
    }

    /// The largest response body stored for replay. A larger response is still delivered in
    /// full; its record keeps the status and headers but not the body, and a retry gets the
    /// original status with a problem body saying so (see [`replay`](crate::replay)). The
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
        self.config_mut().fingerprint = mode;
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

    /// How many bytes of completed records to keep in this process for replays (default 16 MiB,
    /// or none when the store [keeps its records in process](Store::in_process), as
    /// [`MemoryStore`] does; `0` turns the cache off). A record is copied the first time the
    /// store answers a retry with it, and answers further retries reaching this instance without
    /// a store round trip. Completed records never change, and each copy expires with its
    /// record, so a cached replay is the same as the store's.
    pub fn with_replay_cache(mut self, max_bytes: usize) -> Self {
        self.cache = Arc::new(ReplayCache::new(max_bytes));
        self
    }

    /// What happens to a running handler when the client disconnects; see [`Disconnect`].
    pub fn with_disconnect(mut self, policy: Disconnect) -> Self {
        self.config_mut().disconnect = policy;
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
impl IdempotencyLayer<crate::store::PostgresStore> {
    /// A layer on a [`PostgresStore`](crate::store::PostgresStore) over `pool`. Apply the store's
    /// migrations once at start-up with
    /// [`PostgresStore::migrate`](crate::store::PostgresStore::migrate).
    pub fn postgres(pool: sqlx::PgPool) -> Self {
        Self::new(crate::store::PostgresStore::new(pool))
    }

    /// Switches the store to [transactional mode](crate::transaction): the handler's writes
    /// through [`IdempotentTx`](crate::IdempotentTx) and the stored response commit together.
    pub fn transactional(mut self) -> Self {
        let store = Arc::make_mut(&mut self.store);
        *store = store.clone().transactional();
        self
    }
}

impl<St> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            cache: Arc::clone(&self.cache),
        }
    }
}

impl<St> fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &std::any::type_name::<St>())
            .field("config", &self.config)
            .finish()
    }
}

impl<S, St> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(
            inner,
            Arc::clone(&self.store),
            Arc::clone(&self.config),
            Arc::clone(&self.cache),
        )
    }
}

/// An invalid [`IdempotencyLayer`] setting.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A duration or limit that must be positive was zero.
    Zero(&'static str),
    /// The layer must cover at least one method.
    NoMethods,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Zero(setting) => write!(f, "idempotency setting `{setting}` must not be zero"),
            Self::NoMethods => f.write_str("idempotency layer must cover at least one method"),
        }
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_settings_are_errors() {
        let layer = IdempotencyLayer::memory;
        assert_eq!(
            layer().with_ttl(Duration::ZERO).unwrap_err(),
            ConfigError::Zero("ttl")
        );
        assert_eq!(
            layer().with_lease(Duration::ZERO).unwrap_err(),
            ConfigError::Zero("lease")
        );
        assert_eq!(
            layer().with_methods([]).unwrap_err(),
            ConfigError::NoMethods
        );
        assert_eq!(
            layer().with_max_body_bytes(0).unwrap_err(),
            ConfigError::Zero("max_body_bytes")
        );
        assert_eq!(
            layer().with_body_timeout(Duration::ZERO).unwrap_err(),
            ConfigError::Zero("body_timeout")
        );
    }

    #[test]
    fn a_memory_store_gets_no_replay_cache_unless_asked() {
        let (key, fingerprint) = (
            crate::ScopeKey::from_bytes([1; 32]),
            crate::Fingerprint::from_bytes([2; 32]),
        );
        let record = crate::Record::from_parts(http::StatusCode::OK, Default::default(), None);
        let caches = |layer: IdempotencyLayer<MemoryStore>| {
            layer
                .cache
                .insert(key, fingerprint, &record, Duration::from_secs(60));
            layer.cache.get(&key, &fingerprint).is_some()
        };
        // Its records are in process already: a cache would be a second copy of them.
        assert!(!caches(IdempotencyLayer::memory()));
        assert!(!caches(IdempotencyLayer::new(MemoryStore::with_max_bytes(
            1 << 20
        ))));
        assert!(caches(
            IdempotencyLayer::memory().with_replay_cache(1 << 20)
        ));
    }

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
        assert_eq!((a.config.ttl, a.config.lease), (short, shorter));
        assert_eq!((b.config.ttl, b.config.lease), (short, shorter));
        // A lease longer than the TTL is valid too: records are kept while a claim is held.
        assert!(
            IdempotencyLayer::memory()
                .with_ttl(shorter)
                .and_then(|l| l.with_lease(short))
                .is_ok()
        );
    }
}
