//! A duplicate of a key in flight waiting for the first answer: see [`InFlightWait`].

use std::time::Duration;

use super::{ConfigError, MAX_DURATION};

/// How long a duplicate of a key in flight waits for the first request to finish instead of
/// getting `409` at once, and how many may wait at once; given to
/// [`IdempotencyLayer::with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait).
///
/// A waiting duplicate gets the first request's replay as soon as it is stored, or runs itself
/// if the first was released (a `400`, a `5xx`...); after the wait, `409` as without it. Without
/// this setting the layer keeps the IETF draft's behaviour: `409` at once.
///
/// A waiting request holds no database connection: the store wakes it when the key settles
/// ([`Capabilities`](crate::store::Capabilities); the PostgreSQL store through
/// `LISTEN`/`NOTIFY`, across instances, started by the first request that waits), or it reads
/// the key again every so often. Past [`with_max_waiting`](Self::with_max_waiting) waiters, a
/// duplicate gets `409` at once.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, InFlightWait};
///
/// # fn main() -> Result<(), tower_idempotency::ConfigError> {
/// let layer = IdempotencyLayer::memory()
///     .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(5)).with_max_waiting(256))?;
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlightWait {
    pub(crate) wait: Duration,
    pub(crate) max_waiting: usize,
}

impl InFlightWait {
    /// Waits up to `wait`, with at most 1,024 requests waiting at once. A wait longer than
    /// [`MAX_DURATION`] is taken as that; a zero wait is refused ([`ConfigError::Zero`]).
    pub fn up_to(wait: Duration) -> Self {
        Self {
            wait,
            max_waiting: 1024,
        }
    }

    /// How many requests may wait at once; a zero is refused ([`ConfigError::Zero`]).
    #[must_use]
    pub fn with_max_waiting(mut self, max: usize) -> Self {
        self.max_waiting = max;
        self
    }

    /// The wait as the layer keeps it: zero refused, capped at [`MAX_DURATION`].
    pub(crate) fn validated(self) -> Result<Self, ConfigError> {
        if self.wait.is_zero() {
            return Err(ConfigError::Zero("in_flight_wait"));
        }
        if self.max_waiting == 0 {
            return Err(ConfigError::Zero("max_waiting"));
        }
        Ok(Self {
            wait: self.wait.min(MAX_DURATION),
            ..self
        })
    }
}
