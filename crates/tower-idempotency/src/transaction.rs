//! Transactional mode's handle on the request's transaction: see [`IdempotentTx`] and the
//! [modes guide](crate::guide::modes).

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use sqlx::PgConnection;
use tokio::sync::{Mutex, OwnedMutexGuard};

/// The transaction a transactional claim holds.
pub(crate) type PgTransaction = sqlx::Transaction<'static, sqlx::Postgres>;

/// The open transaction of a transactionally claimed key, shared by the claim and the handler.
#[derive(Debug)]
pub(crate) struct TxSlot {
    tx: Arc<Mutex<Option<PgTransaction>>>,
    used: AtomicBool,
}

impl TxSlot {
    pub(crate) fn new(tx: PgTransaction) -> Self {
        Self {
            tx: Arc::new(Mutex::new(Some(tx))),
            used: AtomicBool::new(false),
        }
    }

    /// Takes the transaction back from the handler to commit or roll it back: `Err` while the
    /// handler still holds it, `Ok(None)` once the claim was settled.
    pub(crate) fn take(&self) -> Result<Option<PgTransaction>, HandlerHoldsTx> {
        Ok(self.tx.try_lock().map_err(|_| HandlerHoldsTx)?.take())
    }

    /// Whether the claim was committed or rolled back already.
    pub(crate) fn is_settled(&self) -> bool {
        self.tx.try_lock().is_ok_and(|tx| tx.is_none())
    }

    /// Whether the handler took the transaction.
    pub(crate) fn was_used(&self) -> bool {
        self.used.load(Ordering::Acquire)
    }
}

/// The handler still holds the transaction.
#[derive(Debug)]
pub(crate) struct HandlerHoldsTx;

/// The request's open transaction, in transactional mode: write through it with
/// `.execute(&mut *tx)`. See the [modes guide](crate::guide::modes).
pub struct IdempotentTx {
    guard: OwnedMutexGuard<Option<PgTransaction>>,
}

impl IdempotentTx {
    /// Takes the transaction from a request's extensions (what the axum extractor does).
    ///
    /// # Errors
    ///
    /// [`TxUnavailable`] when the request is not running under a transactional claim, or its
    /// transaction was already taken.
    pub fn from_extensions(extensions: &http::Extensions) -> Result<Self, TxUnavailable> {
        let slot = extensions
            .get::<Arc<TxSlot>>()
            .ok_or(TxUnavailable::NotTransactional)?;
        let guard = Arc::clone(&slot.tx)
            .try_lock_owned()
            .map_err(|_| TxUnavailable::AlreadyTaken)?;
        if guard.is_none() {
            return Err(TxUnavailable::AlreadyTaken);
        }
        slot.used.store(true, Ordering::Release);
        Ok(Self { guard })
    }
}

impl Deref for IdempotentTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        // Present from construction until the layer takes it back, which it can only do once
        // this guard is dropped.
        self.guard.as_ref().expect("transaction present while held")
    }
}

impl DerefMut for IdempotentTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.guard.as_mut().expect("transaction present while held")
    }
}

impl fmt::Debug for IdempotentTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

/// Why an [`IdempotentTx`] could not be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TxUnavailable {
    /// The request is not running under a transactional claim: the route is not behind
    /// a layer on `PostgresStore::new(pool).transactional()`, the layer does not cover the
    /// request's method, or the request had no key.
    NotTransactional,
    /// The handler already took the transaction (extract it once per request).
    AlreadyTaken,
}

impl fmt::Display for TxUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotTransactional => {
                "this handler needs an idempotent transaction, but the request is not running \
                 under one: put the route behind a layer on PostgresStore::new(pool).transactional(), \
                 make sure it covers this method (with_methods; POST and PATCH by default) and \
                 make the key required"
            }
            Self::AlreadyTaken => "the idempotent transaction was already taken by this request",
        })
    }
}

impl std::error::Error for TxUnavailable {}

#[cfg(feature = "axum")]
mod axum_impl {
    use axum_core::{
        extract::{FromRequestParts, OptionalFromRequestParts},
        response::{IntoResponse, Response},
    };
    use http::{StatusCode, request::Parts};

    use super::{IdempotentTx, TxUnavailable};

    impl IntoResponse for TxUnavailable {
        fn into_response(self) -> Response {
            tracing::error!(error = %self, "IdempotentTx extractor failed");
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for IdempotentTx {
        type Rejection = TxUnavailable;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            IdempotentTx::from_extensions(&parts.extensions)
        }
    }

    /// `None` when the request is not running under a transactional claim.
    impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotentTx {
        type Rejection = TxUnavailable;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            match IdempotentTx::from_extensions(&parts.extensions) {
                Ok(tx) => Ok(Some(tx)),
                Err(TxUnavailable::NotTransactional) => Ok(None),
                Err(other) => Err(other),
            }
        }
    }
}
