//! How much one request may cost the layer: see [`Limits`].

use std::time::Duration;

use super::{ConfigError, MAX_DURATION};

/// How much a request may take of the layer: its body's size and arrival time, the response
/// body kept for replay, the handler's time, and handlers finishing for clients that hung up;
/// given to [`IdempotencyLayer::with_limits`](crate::IdempotencyLayer::with_limits).
///
/// Every limit is positive: zero is refused when the layer is given the value
/// ([`ConfigError::Zero`]), and a duration longer than [`MAX_DURATION`] is taken as that.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, Limits};
///
/// # fn main() -> Result<(), tower_idempotency::ConfigError> {
/// let layer = IdempotencyLayer::memory().with_limits(
///     Limits::default()
///         .with_max_request_bytes(256 * 1024)
///         .with_max_handler_time(Duration::from_secs(60)),
/// )?;
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub(crate) max_request_bytes: usize,
    pub(crate) body_timeout: Duration,
    pub(crate) max_response_bytes: usize,
    pub(crate) max_handler_time: Duration,
    pub(crate) max_detached: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_request_bytes: 2 * 1024 * 1024,
            body_timeout: Duration::from_secs(30),
            max_response_bytes: 1024 * 1024,
            max_handler_time: Duration::from_secs(10 * 60),
            max_detached: 1024,
        }
    }
}

impl Limits {
    /// The largest request body buffered for fingerprinting (default 2 MiB); larger bodies get
    /// `413` and run nothing. A `Content-Length` over it is refused before any byte is read.
    #[must_use]
    pub fn with_max_request_bytes(mut self, limit: usize) -> Self {
        self.max_request_bytes = limit;
        self
    }

    /// How long a covered request's whole body may take to arrive (default 30 seconds); a
    /// slower one gets `408`, nothing claimed or run. Bounds what a stalled client can hold.
    #[must_use]
    pub fn with_body_timeout(mut self, timeout: Duration) -> Self {
        self.body_timeout = timeout;
        self
    }

    /// The largest response body stored for replay (default 1 MiB). A larger response is still
    /// delivered in full; its record keeps the status and headers but not the body, and a
    /// retry is told so (see [`Record`](crate::Record#responses-too-large-to-store)). The
    /// handler is never run again for that key.
    #[must_use]
    pub fn with_max_response_bytes(mut self, limit: usize) -> Self {
        self.max_response_bytes = limit;
        self
    }

    /// How long a handler may run (default 10 minutes). Past it the layer stops the handler
    /// (drops its future) and gives its claim up ([`Store::abandon`](crate::store::Store::abandon)),
    /// so a hung handler cannot hold its key forever: its client, if still there, gets `503`, and
    /// the next retry takes the key over at once, told so by
    /// [`IdempotencyContext::takeover`](crate::IdempotencyContext::takeover). In transactional
    /// mode its writes are rolled back instead.
    #[must_use]
    pub fn with_max_handler_time(mut self, max: Duration) -> Self {
        self.max_handler_time = max;
        self
    }

    /// How many handlers may run on for clients that hung up
    /// ([`Disconnect::RunToCompletion`](crate::Disconnect::RunToCompletion)) before the layer
    /// sheds new work (default 1,024): while that many run, a keyed request gets `503` with
    /// `Retry-After` at once, nothing claimed or run. Handlers already running always finish.
    ///
    /// The limit is the smaller of this and what the store can carry
    /// ([`Capabilities::detached_limit`](crate::store::Capabilities::detached_limit)): in
    /// transactional mode each detached handler holds a pooled connection.
    #[must_use]
    pub fn with_max_detached(mut self, max: usize) -> Self {
        self.max_detached = max;
        self
    }

    /// The limits as the layer keeps them: zero refused, durations capped at [`MAX_DURATION`].
    pub(crate) fn validated(self) -> Result<Self, ConfigError> {
        for (setting, zero) in [
            ("max_request_bytes", self.max_request_bytes == 0),
            ("body_timeout", self.body_timeout.is_zero()),
            ("max_response_bytes", self.max_response_bytes == 0),
            ("max_handler_time", self.max_handler_time.is_zero()),
            ("max_detached", self.max_detached == 0),
        ] {
            if zero {
                return Err(ConfigError::Zero(setting));
            }
        }
        Ok(Self {
            body_timeout: self.body_timeout.min(MAX_DURATION),
            max_handler_time: self.max_handler_time.min(MAX_DURATION),
            ..self
        })
    }
}
