//! Transactional mode's handle on the request's transaction: see [`IdempotentTx`] and the
//! [modes guide](crate::guide::modes).

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::Arc,
};

use sqlx::PgConnection;

use crate::store::postgres::{LentTx, TxSlot};

/// The request's open transaction, in transactional mode: write through it with
/// `.execute(&mut *tx)`. See the [modes guide](crate::guide::modes).
pub struct IdempotentTx {
    tx: LentTx,
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
        let tx = slot.lend().ok_or(TxUnavailable::AlreadyTaken)?;
        Ok(Self { tx })
    }
}

impl Deref for IdempotentTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for IdempotentTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
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
