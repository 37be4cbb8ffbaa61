//! The operation's failures: see [`Error`].

use std::time::Duration;

use bytes::Bytes;

use crate::{key::IdempotencyKey, outcome::StopReason};

/// A boxed error of the transport under the middleware.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why an operation has no answer to return. Each carries the key, so that the caller can
/// send the operation again later with it (or with the same [`OperationId`](crate::OperationId)).
///
/// With reqwest-middleware it arrives as `reqwest_middleware::Error::Middleware`; find it with
/// `anyhow::Error::downcast_ref::<Error>()`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `422`: the server has seen this key with another payload. No retry can succeed: the
    /// first request stands, and a new operation needs a new key.
    #[error(
        "the server refused idempotency key {key} (422): it was already used with another \
         request payload; the first request stands, and a new request needs a new key"
    )]
    KeyReused {
        /// The key the server refused.
        key: IdempotencyKey,
        /// Attempts sent, the refused one included.
        attempts: u32,
        /// The server's answer body (its problem document), at most 64 KiB; `None` where the
        /// transport's body was not read (the Tower layer).
        problem: Option<Bytes>,
    },
    /// The last attempt failed in transport and no other was made, for `reason`. The outcome
    /// is unknown: send again with the same key to learn it.
    #[error("attempt {attempts} failed and was the last ({reason})")]
    Transport {
        /// The operation's key; `None` for a method that gets none.
        key: Option<IdempotencyKey>,
        /// Attempts sent.
        attempts: u32,
        /// Why no other attempt was made.
        reason: StopReason,
        /// The last attempt's failure.
        #[source]
        source: BoxError,
    },
    /// The deadline passed while an attempt was in flight; that attempt was abandoned.
    #[error("the deadline of {deadline:?} passed during attempt {attempts}")]
    DeadlineExceeded {
        /// The operation's key; `None` for a method that gets none.
        key: Option<IdempotencyKey>,
        /// Attempts sent, the abandoned one included.
        attempts: u32,
        /// The policy's deadline.
        deadline: Duration,
    },
    /// The Tower service under the layer failed before a retry could be sent.
    #[error("the service failed while getting ready to send attempt {attempts}")]
    NotReady {
        /// The operation's key; `None` for a method that gets none.
        key: Option<IdempotencyKey>,
        /// Attempts sent before.
        attempts: u32,
        /// The service's failure.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// The operation's key, to send it again later; `None` for a method that gets none.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        match self {
            Self::KeyReused { key, .. } => Some(key),
            Self::Transport { key, .. }
            | Self::DeadlineExceeded { key, .. }
            | Self::NotReady { key, .. } => key.as_ref(),
        }
    }

    /// How many attempts were sent.
    pub fn attempts(&self) -> u32 {
        match self {
            Self::KeyReused { attempts, .. }
            | Self::Transport { attempts, .. }
            | Self::DeadlineExceeded { attempts, .. }
            | Self::NotReady { attempts, .. } => *attempts,
        }
    }
}
