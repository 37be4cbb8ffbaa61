//! Running a store statement: prepared with bound parameters, or inlined as one simple query
//! for PgBouncer; bounded by the store's timeout.

use std::time::Duration;

use futures_util::FutureExt;
use sqlx::{
    AssertSqlSafe, PgPool, Postgres,
    postgres::{PgQueryResult, PgRow},
    types::Uuid,
};

use super::{PostgresStore, PostgresStoreError};
use crate::{scope::ScopeKey, settings::MAX_DURATION, store::ClaimStatus};

/// The key a record is stored under: the first 128 bits of its scope key, as a `uuid` (see
/// the migration `20261123000001_uuid_scope_keys.sql` for why and why that is enough).
pub(super) fn stored_key(key: &ScopeKey) -> Uuid {
    let mut prefix = [0; 16];
    prefix.copy_from_slice(&key.as_bytes()[..16]);
    Uuid::from_bytes(prefix)
}

/// The longest interval the store writes: the longest setting, far from the bounds of
/// PostgreSQL's `timestamptz`.
pub(super) const MAX_INTERVAL: Duration = MAX_DURATION;

/// `d` as PostgreSQL can take it: whole microseconds (rounded up, so a positive duration stays
/// positive), at most [`MAX_INTERVAL`].
pub(super) fn interval(d: Duration) -> Duration {
    let micros = d.as_nanos().div_ceil(1000);
    Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX)).min(MAX_INTERVAL)
}

/// A store statement with its parameters.
///
/// Run as a cached prepared statement with bound parameters (the default), or as one
/// simple-protocol query with the parameters written in as literals
/// ([`PostgresStore::without_prepared_statements`]). Every literal is a number, a `uuid`'s hex
/// digits and hyphens in quotes, or `decode('<hex>', 'hex')`, so no parameter can change the
/// statement.
pub(super) struct Statement<'a> {
    pub(super) sql: &'static str,
    pub(super) params: Vec<Param<'a>>,
}

pub(super) enum Param<'a> {
    Key(Uuid),
    Digest([u8; 32]),
    OptionalBytes(Option<&'a [u8]>),
    Int(i64),
    SmallInt(i16),
    Bool(bool),
    Interval(Duration),
    Text(&'a str),
    Texts(Vec<&'a str>),
    BytesList(Vec<&'a [u8]>),
}

impl<'a> Statement<'a> {
    pub(super) fn new(sql: &'static str) -> Self {
        Self {
            sql,
            params: Vec::with_capacity(6),
        }
    }

    pub(super) fn with(mut self, param: Param<'a>) -> Self {
        self.params.push(param);
        self
    }

    pub(super) fn prepared(self) -> sqlx::query::Query<'a, Postgres, sqlx::postgres::PgArguments> {
        self.params
            .into_iter()
            .fold(sqlx::query(self.sql), |query, param| match param {
                Param::Key(key) => query.bind(key),
                Param::Digest(digest) => query.bind(digest.to_vec()),
                Param::OptionalBytes(bytes) => query.bind(bytes),
                Param::Int(n) => query.bind(n),
                Param::Bool(b) => query.bind(b),
                Param::SmallInt(n) => query.bind(n),
                Param::Interval(d) => query.bind(interval(d)),
                Param::Text(text) => query.bind(text),
                Param::Texts(texts) => query.bind(texts),
                Param::BytesList(list) => query.bind(list),
            })
    }

    /// The statement with `$n` replaced by literals (last first, so `$1` never eats `$10`).
    pub(super) fn inlined(&self) -> String {
        fn bytes(out: &mut String, bytes: &[u8]) {
            out.push_str("decode('");
            for b in bytes {
                out.push_str(&format!("{b:02x}"));
            }
            out.push_str("', 'hex')");
        }
        let mut sql = self.sql.to_owned();
        for (i, param) in self.params.iter().enumerate().rev() {
            let mut literal = String::new();
            match param {
                Param::Key(key) => literal.push_str(&format!("'{key}'::uuid")),
                Param::Digest(b) => bytes(&mut literal, b),
                Param::OptionalBytes(Some(b)) => bytes(&mut literal, b),
                Param::OptionalBytes(None) => literal.push_str("NULL::bytea"),
                Param::Int(n) => literal.push_str(&format!("({n})::int8")),
                Param::Bool(b) => literal.push_str(if *b { "true" } else { "false" }),
                Param::SmallInt(n) => literal.push_str(&format!("({n})::int2")),
                Param::Interval(d) => literal.push_str(&format!(
                    "({}::int8 * interval '1 microsecond')",
                    interval(*d).as_micros()
                )),
                Param::Text(text) => {
                    literal.push_str("convert_from(");
                    bytes(&mut literal, text.as_bytes());
                    literal.push_str(", 'UTF8')");
                }
                Param::Texts(texts) => {
                    literal.push_str("ARRAY[");
                    for (j, text) in texts.iter().enumerate() {
                        literal.push_str(if j == 0 {
                            "convert_from("
                        } else {
                            ", convert_from("
                        });
                        bytes(&mut literal, text.as_bytes());
                        literal.push_str(", 'UTF8')");
                    }
                    literal.push_str("]::text[]");
                }
                Param::BytesList(list) => {
                    literal.push_str("ARRAY[");
                    for (j, b) in list.iter().enumerate() {
                        if j > 0 {
                            literal.push_str(", ");
                        }
                        bytes(&mut literal, b);
                    }
                    literal.push_str("]::bytea[]");
                }
            }
            sql = sql.replace(&format!("${}", i + 1), &literal);
        }
        sql
    }

    pub(super) async fn fetch_optional<'c>(
        self,
        prepared: bool,
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        if prepared {
            self.prepared().fetch_optional(conn).await
        } else {
            sqlx::raw_sql(AssertSqlSafe(self.inlined()))
                .fetch_optional(conn)
                .await
        }
    }

    pub(super) async fn fetch_all<'c>(
        self,
        prepared: bool,
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        if prepared {
            self.prepared().fetch_all(conn).await
        } else {
            sqlx::raw_sql(AssertSqlSafe(self.inlined()))
                .fetch_all(conn)
                .await
        }
    }

    pub(super) async fn execute<'c>(
        self,
        prepared: bool,
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<sqlx::postgres::PgQueryResult, sqlx::Error> {
        if prepared {
            self.prepared().execute(conn).await
        } else {
            sqlx::raw_sql(AssertSqlSafe(self.inlined()))
                .execute(conn)
                .await
        }
    }
}

impl Statement<'_> {
    /// [`fetch_optional`](Self::fetch_optional) on a connection of `pool` (see [`leaves_pool`]).
    pub(super) async fn fetch_optional_pooled(
        self,
        prepared: bool,
        pool: &PgPool,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        let mut connection = pool.acquire().await?;
        let fetched = self.fetch_optional(prepared, &mut *connection).await;
        if fetched.as_ref().is_err_and(leaves_pool) {
            connection.close_on_drop();
        }
        fetched
    }

    /// [`execute`](Self::execute) on a connection of `pool` (see [`leaves_pool`]).
    pub(super) async fn execute_pooled(
        self,
        prepared: bool,
        pool: &PgPool,
    ) -> Result<PgQueryResult, sqlx::Error> {
        let mut connection = pool.acquire().await?;
        let done = self.execute(prepared, &mut *connection).await;
        if done.as_ref().is_err_and(leaves_pool) {
            connection.close_on_drop();
        }
        done
    }
}

/// Whether a connection that answered `error` is closed rather than pooled again: a standby or
/// a demoted primary (`25006`, read-only), or a server shutting down or refusing, so that the
/// pool's next connection reaches the new primary through the endpoint.
pub(super) fn leaves_pool(error: &sqlx::Error) -> bool {
    let Some(database) = error.as_database_error() else {
        return false;
    };
    database
        .code()
        .is_some_and(|code| code == "25006" || code.starts_with("57P") || code.starts_with("08"))
}

impl PostgresStore {
    /// `future` under the store's timeout; a combinator, to keep requests' futures small (see
    /// the service module).
    pub(super) fn timed<T>(
        &self,
        operation: &'static str,
        future: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> impl Future<Output = Result<T, PostgresStoreError>> {
        tokio::time::timeout(self.timeout, future).map(move |timed| match timed {
            Ok(result) => result.map_err(PostgresStoreError::from),
            Err(_) => Err(self.timeout_error(operation)),
        })
    }

    pub(super) fn timeout_error(&self, operation: &'static str) -> PostgresStoreError {
        PostgresStoreError::Timeout {
            operation,
            after: self.timeout,
        }
    }

    /// [`fenced`](Self::fenced) on a connection of the store's pool, which leaves the pool if
    /// it answers as a standby or a server going away ([`leaves_pool`]).
    pub(super) async fn fenced_pooled(
        &self,
        operation: &'static str,
        statement: Statement<'_>,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        // Boxed: an acquire and a statement in turn would otherwise make every request's future
        // (which holds its renewals and its completion) larger; see the service module.
        let execute = Box::pin(statement.execute_pooled(self.prepared, &self.pool));
        let done = self.timed(operation, execute).await?;
        Ok(ClaimStatus::from_rows(done.rows_affected()))
    }

    /// Runs a fenced `UPDATE`/`DELETE` on `conn`: `Held` if it touched the claim's row.
    pub(super) async fn fenced<'c>(
        &self,
        operation: &'static str,
        statement: Statement<'_>,
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<ClaimStatus, PostgresStoreError> {
        let done = self
            .timed(operation, statement.execute(self.prepared, conn))
            .await?;
        Ok(ClaimStatus::from_rows(done.rows_affected()))
    }
}

impl ClaimStatus {
    /// What a fenced statement that touched `rows` rows says of the claim.
    fn from_rows(rows: u64) -> Self {
        if rows == 1 { Self::Held } else { Self::Lost }
    }
}
