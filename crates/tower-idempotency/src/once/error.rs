//! Why [`Once::run`](super::Once::run) returned no value ([`OnceError`]), and why a scope was
//! refused ([`ScopeError`]).

use std::{error::Error as StdError, fmt};

use crate::key::KeyError;

/// The longest scope [`Once`](super::Once) takes, in bytes.
pub const MAX_SCOPE_LEN: usize = 255;

/// Why [`Once::run`](super::Once::run) or
/// [`run_in_transaction`](super::Once::run_in_transaction) returned no value.
///
/// Only [`Failed`](Self::Failed) means the closure ran and its key was freed; every other
/// variant leaves the key as it was, or (for [`Output`](Self::Output) after a run) completed.
#[derive(Debug)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// The scope is empty or longer than [`MAX_SCOPE_LEN`]: nothing was claimed.
    InvalidScope(ScopeError),
    /// The key is empty, too long or holds a character a key may not: nothing was claimed.
    InvalidKey(KeyError),
    /// The payload could not be serialized to JSON to be fingerprinted: nothing was claimed.
    Payload(serde_json::Error),
    /// Another call holds the key and did not finish within the configured wait.
    InFlight,
    /// The key was used with another payload.
    Mismatch,
    /// The closure failed: the key was released (in a transaction, with its writes rolled
    /// back), and the next call runs it again.
    Failed(E),
    /// The store could not be reached or answered nonsense: the state of the key is unknown,
    /// and the closure did not run.
    Store(Box<dyn StdError + Send + Sync + 'static>),
    /// The stored result does not decode into the type asked for, or the closure's result could
    /// not be encoded (its effects stand, and later calls get this error too). Never a rerun.
    Output(serde_json::Error),
    /// [`run_in_transaction`](super::Once::run_in_transaction) on a store not in
    /// transactional mode: nothing was claimed.
    NotTransactional,
    /// The closure's transaction, with its result, could not commit (the store's error is
    /// logged): nothing happened if the commit failed, but a lost connection leaves it unknown.
    /// A retry finds the result or runs again.
    NotCommitted,
    /// The closure returned `Ok` over a transaction that had failed (it caught a database
    /// error): nothing it wrote was kept, and the key is free again.
    RolledBack,
}

impl<E> OnceError<E> {
    /// The closure's own error, if that is what stopped the call.
    pub fn into_inner(self) -> Option<E> {
        match self {
            Self::Failed(error) => Some(error),
            _ => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for OnceError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidScope(_) => f.write_str("the idempotency scope is invalid"),
            Self::InvalidKey(_) => f.write_str("the idempotency key is invalid"),
            Self::Payload(_) => f.write_str("the payload could not be serialized to JSON"),
            Self::InFlight => f.write_str("another call with this idempotency key is in flight"),
            Self::Mismatch => {
                f.write_str("the idempotency key was already used with another payload")
            }
            Self::Failed(error) => write!(f, "the idempotent call failed: {error}"),
            Self::Store(_) => f.write_str("the idempotency store failed"),
            Self::Output(_) => {
                f.write_str("the idempotent call's result could not be encoded or decoded")
            }
            Self::NotTransactional => f.write_str(
                "run_in_transaction needs a store in transactional mode: \
                 PostgresStore::new(pool).transactional()",
            ),
            Self::NotCommitted => f.write_str("the idempotent call's transaction did not commit"),
            Self::RolledBack => f.write_str(
                "the idempotent call returned success over a failed transaction; nothing was \
                 committed",
            ),
        }
    }
}

impl<E: StdError + 'static> StdError for OnceError<E> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::InvalidScope(error) => Some(error),
            Self::InvalidKey(error) => Some(error),
            Self::Payload(error) | Self::Output(error) => Some(error),
            Self::Failed(error) => Some(error),
            Self::Store(error) => Some(&**error),
            Self::InFlight
            | Self::Mismatch
            | Self::NotTransactional
            | Self::NotCommitted
            | Self::RolledBack => None,
        }
    }
}

/// Why a scope given to [`Once`](super::Once) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ScopeError {
    /// The scope is empty.
    Empty,
    /// The scope is this many bytes long, more than [`MAX_SCOPE_LEN`].
    TooLong(usize),
}

impl ScopeError {
    /// `scope` if it is a valid scope.
    pub(crate) fn check(scope: &str) -> Result<&str, Self> {
        match scope.len() {
            0 => Err(Self::Empty),
            len if len > MAX_SCOPE_LEN => Err(Self::TooLong(len)),
            _ => Ok(scope),
        }
    }
}

impl fmt::Display for ScopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("the idempotency scope is empty"),
            Self::TooLong(len) => write!(
                f,
                "the idempotency scope is {len} bytes long; at most {MAX_SCOPE_LEN} are allowed"
            ),
        }
    }
}

impl StdError for ScopeError {}
