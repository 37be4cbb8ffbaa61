//! The settings one [`IdempotentMiddleware`](crate::IdempotentMiddleware) or
//! [`IdempotentLayer`](crate::IdempotentLayer) follows: see [`Policy`].

use std::time::Duration;

use http::{HeaderName, Method};
use uuid::Uuid;

use crate::{
    backoff::Backoff,
    key::{DEFAULT_NAMESPACE, IDEMPOTENCY_KEY, IdempotencyKey, KeyFormat, OperationId},
};

/// The `Idempotent-Replayed` response header that marks a replay, by default.
pub static IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// How requests get keys and how they are retried; one value shared by the reqwest middleware
/// and the Tower layer.
///
/// | setting | default |
/// |---|---|
/// | [`with_methods`](Self::with_methods) | `POST`, `PATCH` get keys |
/// | [`with_key_header`](Self::with_key_header) | `Idempotency-Key` |
/// | [`with_key_format`](Self::with_key_format) | [`KeyFormat::SfString`] |
/// | [`with_namespace`](Self::with_namespace) | [`DEFAULT_NAMESPACE`] |
/// | [`with_replay_header`](Self::with_replay_header) | `Idempotent-Replayed` |
/// | [`with_max_attempts`](Self::with_max_attempts) | 5 |
/// | [`with_deadline`](Self::with_deadline) | 30 s for all attempts and waits together |
/// | [`with_backoff`](Self::with_backoff) | full jitter, 100 ms doubling up to 5 s |
/// | [`with_retry_on_500`](Self::with_retry_on_500) | `false` |
#[derive(Debug, Clone)]
pub struct Policy {
    methods: Vec<Method>,
    key_header: HeaderName,
    key_format: KeyFormat,
    namespace: Uuid,
    replay_header: HeaderName,
    max_attempts: u32,
    deadline: Duration,
    pub(crate) backoff: Backoff,
    retry_500: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            key_header: IDEMPOTENCY_KEY.clone(),
            key_format: KeyFormat::default(),
            namespace: DEFAULT_NAMESPACE,
            replay_header: IDEMPOTENT_REPLAYED.clone(),
            max_attempts: 5,
            deadline: Duration::from_secs(30),
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            retry_500: false,
        }
    }
}

/// A setting [`Policy`] refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A safe method (`GET`, `HEAD`, `OPTIONS`, `TRACE`) was given a key: it needs none.
    #[error("{0} is a safe method: it is retried without a key and never gets one")]
    SafeMethod(Method),
    /// No method was given: use a policy without the middleware instead.
    #[error("no method was given a key")]
    NoMethods,
    /// Zero attempts: every request is sent at least once.
    #[error("the maximum number of attempts must be at least 1")]
    ZeroAttempts,
    /// A zero deadline: nothing could be sent.
    #[error("the deadline must be longer than zero")]
    ZeroDeadline,
    /// A backoff whose first step is zero or over its cap.
    #[error("the backoff's first step ({base:?}) must be over zero and at most its cap ({cap:?})")]
    Backoff {
        /// The first step given.
        base: Duration,
        /// The cap given.
        cap: Duration,
    },
}

impl Policy {
    /// The defaults (the table above).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the methods whose requests get a key and are retried with it.
    ///
    /// # Errors
    ///
    /// [`ConfigError::SafeMethod`] for a safe method, [`ConfigError::NoMethods`] for none.
    pub fn with_methods(
        mut self,
        methods: impl IntoIterator<Item = Method>,
    ) -> Result<Self, ConfigError> {
        let methods: Vec<Method> = methods.into_iter().collect();
        if let Some(safe) = methods.iter().find(|m| m.is_safe()) {
            return Err(ConfigError::SafeMethod(safe.clone()));
        }
        if methods.is_empty() {
            return Err(ConfigError::NoMethods);
        }
        self.methods = methods;
        Ok(self)
    }

    /// Sets the header the key travels in (an API's own, such as `X-Idempotency-Key`).
    #[must_use]
    pub fn with_key_header(mut self, name: HeaderName) -> Self {
        self.key_header = name;
        self
    }

    /// Sets how minted and derived keys are written; a caller's key is sent as the caller set it.
    #[must_use]
    pub fn with_key_format(mut self, format: KeyFormat) -> Self {
        self.key_format = format;
        self
    }

    /// Sets the namespace keys are derived in from [`OperationId`]s: one per application, so two
    /// applications that number their orders alike do not share keys.
    #[must_use]
    pub fn with_namespace(mut self, namespace: Uuid) -> Self {
        self.namespace = namespace;
        self
    }

    /// Sets the response header that marks a replay, as the server names it.
    #[must_use]
    pub fn with_replay_header(mut self, name: HeaderName) -> Self {
        self.replay_header = name;
        self
    }

    /// Sets the most attempts one operation makes, the first included.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroAttempts`] for 0.
    pub fn with_max_attempts(mut self, attempts: u32) -> Result<Self, ConfigError> {
        if attempts == 0 {
            return Err(ConfigError::ZeroAttempts);
        }
        self.max_attempts = attempts;
        Ok(self)
    }

    /// Sets how long one operation may take, every attempt and wait included.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroDeadline`] for zero.
    pub fn with_deadline(mut self, deadline: Duration) -> Result<Self, ConfigError> {
        if deadline.is_zero() {
            return Err(ConfigError::ZeroDeadline);
        }
        self.deadline = deadline;
        Ok(self)
    }

    /// Sets the backoff: before retry `n` (from 0), a random wait up to `base * 2^n`, at most
    /// `cap` ("full jitter", so that clients failed together do not come back together).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Backoff`] when `base` is zero or over `cap`.
    pub fn with_backoff(mut self, base: Duration, cap: Duration) -> Result<Self, ConfigError> {
        if base.is_zero() || base > cap {
            return Err(ConfigError::Backoff { base, cap });
        }
        self.backoff = Backoff::new(base, cap);
        Ok(self)
    }

    /// Sets whether a `500` is retried; off by default, as a `500` is often a bug a retry
    /// meets again, but some servers answer it for a failure that passes.
    #[must_use]
    pub fn with_retry_on_500(mut self, retry: bool) -> Self {
        self.retry_500 = retry;
        self
    }

    /// The key an operation id gives under this policy's namespace: what will be sent.
    pub fn key_for(&self, operation: &OperationId) -> IdempotencyKey {
        IdempotencyKey::derive(self.namespace, operation)
    }

    /// The methods that get keys.
    pub fn methods(&self) -> &[Method] {
        &self.methods
    }

    /// The header the key travels in.
    pub fn key_header(&self) -> &HeaderName {
        &self.key_header
    }

    /// How minted and derived keys are written.
    pub fn key_format(&self) -> KeyFormat {
        self.key_format
    }

    /// The namespace of derived keys.
    pub fn namespace(&self) -> Uuid {
        self.namespace
    }

    /// The header that marks a replay.
    pub fn replay_header(&self) -> &HeaderName {
        &self.replay_header
    }

    /// The most attempts per operation.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The deadline of one operation.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Whether a `500` is retried.
    pub fn retries_500(&self) -> bool {
        self.retry_500
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_settings_are_refused() {
        let policy = Policy::new();
        assert_eq!(
            policy
                .clone()
                .with_methods([Method::POST, Method::GET])
                .err(),
            Some(ConfigError::SafeMethod(Method::GET))
        );
        assert_eq!(
            policy.clone().with_methods([]).err(),
            Some(ConfigError::NoMethods)
        );
        assert_eq!(
            policy.clone().with_max_attempts(0).err(),
            Some(ConfigError::ZeroAttempts)
        );
        assert_eq!(
            policy.clone().with_deadline(Duration::ZERO).err(),
            Some(ConfigError::ZeroDeadline)
        );
        let (base, cap) = (Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(
            policy.with_backoff(base, cap).err(),
            Some(ConfigError::Backoff { base, cap })
        );
    }

    #[test]
    fn put_and_delete_may_get_keys() {
        let policy = Policy::new()
            .with_methods([Method::POST, Method::PUT, Method::DELETE])
            .expect("unsafe methods");
        assert_eq!(policy.methods().len(), 3);
    }
}
