//! Exactly-once effects: the handler's writes and the idempotency record in one PostgreSQL
//! transaction.
//!
//! ```no_run
//! # #[cfg(feature = "axum")] {
//! use axum::{Router, routing::post, http::StatusCode};
//! use tower_idempotency::{IdempotencyLayer, IdempotentTx};
//!
//! async fn create_charge(mut tx: IdempotentTx) -> Result<(StatusCode, String), StatusCode> {
//!     // Commits with the stored response, or not at all.
//!     sqlx::query("INSERT INTO charges (amount) VALUES (100)")
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok((StatusCode::CREATED, "charged".to_owned()))
//! }
//!
//! # async fn run(pool: sqlx::PgPool) {
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(create_charge))
//!     .layer(IdempotencyLayer::postgres(pool).transactional().required());
//! # }
//! # }
//! ```
//!
//! In transactional mode, [`PostgresStore`](crate::store::PostgresStore) opens a transaction for
//! each claimed key, claims the key inside it, and hands it to the handler as an
//! [`IdempotentTx`]: a `&mut PgConnection` the handler writes through but can neither commit nor
//! roll back. When the handler returns, the layer writes the response record into the same
//! transaction and commits. Claim, business writes and stored response become durable together,
//! or not at all:
//!
//! | what happens | lease mode | transactional mode |
//! |---|---|---|
//! | handler succeeds | record stored after the handler's own commits | writes and record commit together |
//! | handler panics | key released; writes it already committed stay | everything rolled back; key free |
//! | handler answers 5xx or a "nothing done" 4xx | key released; its writes stay | everything rolled back; key free |
//! | process killed (SIGKILL) mid-handler | key blocked until the lease lapses (30 s), then a retry runs again, possibly after partial writes | PostgreSQL aborts the transaction: no writes, key free at once |
//! | database lost before or at commit | response delivered, storing retried in the background with the claim kept alive, so a retry gets `409` until the record is stored, then the replay | `503`: the commit is in doubt, and the retry settles it (the stored response if it committed, a clean run if not). A handler that never took its `IdempotentTx` is answered as in lease mode: the key is claimed again to store its response |
//! | handler catches a failed statement of its own and answers | its answer is stored as usual | the transaction is aborted, so nothing can commit: a kept error status (`402`, `404`, `409`...) is delivered unstored and the key released; a success is a `500` problem (`TransactionAborted`) |
//! | handler hangs past [`with_max_handler_time`](crate::IdempotencyLayer::with_max_handler_time) | cancelled, `503`; its lease lapses, then a retry takes over | cancelled, `503`; rolled back, key free at once |
//! | client disconnects | handler finishes, record stored | handler finishes, everything commits |
//! | many clients disconnect | handlers finish detached; past [`with_max_detached`](crate::IdempotencyLayer::with_max_detached), keyed requests get a prompt `503` | the same, with the limit at most half the pool: detached handlers never starve the others of connections |
//! | duplicate while in flight | `409` | `409` at once (an advisory lock is tried first; nothing waits on the open transaction) |
//! | same key, another payload, while in flight | `422` | `409` (the uncommitted claim cannot be compared); `422` once it commits |
//!
//! Use it when the handler's side effects are writes to the same PostgreSQL database. When they
//! are calls to other systems (a card network, an email service), the transaction cannot undo
//! them: use lease mode and make those calls idempotent themselves.
//!
//! # Costs and limits
//!
//! * **One pooled connection per in-flight request**, held for the whole handler. Size the pool
//!   for your concurrency; when it is exhausted, requests get a `503` problem after the store's
//!   timeout ([`PostgresStore::with_timeout`](crate::store::PostgresStore::with_timeout), 5 s)
//!   rather than hanging. A handler must do all its database work through the [`IdempotentTx`]:
//!   taking a second connection from the same pool can deadlock a saturated pool.
//! * The transaction runs at `READ COMMITTED`.
//! * A handler that does not take the [`IdempotentTx`] still works, as in lease mode: the
//!   transaction then only carries the claim and the record.
//! * The handler must not keep the [`IdempotentTx`] beyond its return (moving it into a spawned
//!   task); the layer then cannot commit and answers `503`, and the transaction is rolled back
//!   when the task lets go of it.
//! * The handler must not end the transaction itself by sending `COMMIT` or `ROLLBACK` as SQL
//!   through the [`IdempotentTx`]. The type gives it no method to do so, but PostgreSQL cannot
//!   tell those statements from the handler's own. After a `COMMIT`, the rest of the request runs
//!   as in lease mode, and the writes no longer commit together with the record.
//! * Do not serve one endpoint in both modes at once.

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
/// `.execute(&mut *tx)`. See the [module documentation](self).
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
    /// `IdempotencyLayer::postgres(pool).transactional()`, the layer does not cover the
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
                 under one: put the route behind IdempotencyLayer::postgres(pool).transactional(), \
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
