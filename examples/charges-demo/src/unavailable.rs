//! Telling a server failure a retry can get past (the database or the key store unreachable,
//! a failover under way) from one it cannot: the first is `503` with `Retry-After` and
//! `Stripe-Should-Retry: true`, the second `500`.

use std::error::Error;

use http::StatusCode;
use tower_idempotency::store::PostgresStoreError;

use crate::error::{ApiError, ErrorType};

/// The answer to a failure of the server's own: `503` when a retry can get past it, else `500`.
pub(crate) fn server_failure(error: &(dyn Error + 'static)) -> ApiError {
    if transient(error) {
        tracing::warn!(error, "the database is unreachable; answered 503");
        unavailable()
    } else {
        tracing::error!(error, "a server failure");
        ApiError::internal()
    }
}

/// `503`: the database did not answer, or not for sure; a retry with the same key finds the
/// outcome or runs again.
pub(crate) fn unavailable() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::ApiError,
        "The database is unreachable for a moment; retry the request with the same \
         Idempotency-Key.",
    )
}

/// Whether `error`, or one of its sources, is a database or store failure a retry can get
/// past: a lost or refused connection, a server shutting down or read-only (a standby, a
/// demoted primary), a serialization failure, or a timeout.
pub(crate) fn transient(error: &(dyn Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(error) = error.downcast_ref::<sqlx::Error>() {
            return transient_sqlx(error);
        }
        if let Some(PostgresStoreError::Timeout { .. }) = error.downcast_ref() {
            return true;
        }
        next = error.source();
    }
    false
}

fn transient_sqlx(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(error) => error.code().is_some_and(|code| {
            // 08: connection exceptions; 57P0x: shutdown, crash, cannot connect now; 53:
            // insufficient resources; 25006: read-only transaction; 40001/40P01: retry.
            code.starts_with("08")
                || code.starts_with("57P0")
                || code.starts_with("53")
                || matches!(&*code, "25006" | "40001" | "40P01")
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_failures_are_transient_and_others_are_not() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(transient(&io));
        assert!(transient(&sqlx::Error::PoolTimedOut));
        assert!(!transient(&sqlx::Error::RowNotFound));
        let timeout = PostgresStoreError::Timeout {
            operation: "complete",
            after: std::time::Duration::from_secs(1),
        };
        assert!(transient(&timeout));
        let wrapped = PostgresStoreError::Database(sqlx::Error::PoolClosed);
        assert!(transient(&wrapped), "found through the source chain");
        assert!(!transient(&std::fmt::Error));
        assert_eq!(
            server_failure(&io).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            server_failure(&std::fmt::Error).status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
}
