//! What can go wrong in the PostgreSQL store.

use std::{fmt, time::Duration};

/// A [`PostgresStore`](super::PostgresStore) operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum PostgresStoreError {
    /// The database returned an error or could not be reached.
    Database(sqlx::Error),
    /// Applying the migrations failed.
    Migrate(sqlx::migrate::MigrateError),
    /// The store's tables do not exist in this database: run
    /// [`PostgresStore::migrate`](super::PostgresStore::migrate) at start-up (or apply [`PostgresStore::migrator`](super::PostgresStore::migrator)).
    NotMigrated(sqlx::Error),
    /// The operation did not finish within the store's timeout (see
    /// [`PostgresStore::with_timeout`](super::PostgresStore::with_timeout)), waiting for a pooled connection included.
    Timeout {
        /// Which operation: `claim`, `renew`, `complete`, `release` or `delete_expired`.
        operation: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// A stored row could not be read back as a response.
    Corrupt(String),
    /// Claim attempts kept racing with concurrent changes to the same key.
    Contended,
    /// Transactional mode: the handler still held its [`IdempotentTx`](crate::IdempotentTx)
    /// when it returned (it moved it into a task that outlived it), so the transaction could not
    /// be committed; it is rolled back when that task lets go.
    TransactionHeld,
    /// The store requires that an acknowledged record survive a failover
    /// ([`Durability::SynchronousStandby`](super::Durability::SynchronousStandby)), and the
    /// server, as last read, does not promise it: nothing was claimed.
    NotDurable(super::DurabilityReport),
}

impl fmt::Display for PostgresStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Database(_) => f.write_str("PostgreSQL idempotency store error"),
            Self::Migrate(_) => f.write_str("applying the idempotency store's migrations failed"),
            Self::NotMigrated(_) => f.write_str(
                "the idempotency schema is missing from this database: call \
                 PostgresStore::migrate() at start-up",
            ),
            Self::Timeout { operation, after } => {
                write!(
                    f,
                    "PostgreSQL idempotency store `{operation}` timed out after {after:?}"
                )
            }
            Self::Corrupt(what) => write!(f, "stored idempotency record is corrupt: {what}"),
            Self::Contended => f.write_str("idempotency key kept changing while being claimed"),
            Self::TransactionHeld => f.write_str(
                "the handler still held its IdempotentTx after returning, so its transaction could \
                 not be committed; it is rolled back (and the key freed) when the handler's task \
                 lets go of it",
            ),
            Self::NotDurable(report) => write!(
                f,
                "PostgreSQL does not promise that an acknowledged idempotency record survives a \
                 failover ({report}): configure a synchronous standby, or relax \
                 PostgresStore::with_durability"
            ),
        }
    }
}

impl PostgresStoreError {
    /// The SQLSTATE of a database error.
    pub(super) fn sqlstate(&self) -> Option<&str> {
        match self {
            Self::Database(error) => error.as_database_error()?.code().map(|code| match code {
                std::borrow::Cow::Borrowed(code) => code,
                // sqlx hands PostgreSQL's codes out borrowed.
                std::borrow::Cow::Owned(_) => "",
            }),
            _ => None,
        }
    }
}

impl std::error::Error for PostgresStoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Database(error) | Self::NotMigrated(error) => Some(error),
            Self::Migrate(error) => Some(error),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for PostgresStoreError {
    fn from(error: sqlx::Error) -> Self {
        // 42P01 undefined_table, 3F000 invalid_schema_name: the migrations never ran here.
        let code = error.as_database_error().and_then(|e| e.code());
        if matches!(code.as_deref(), Some("42P01" | "3F000")) {
            return Self::NotMigrated(error);
        }
        Self::Database(error)
    }
}
