use std::{collections::BTreeMap, fmt};

use sqlx::{PgConnection, PgExecutor, PgPool, Row, migrate::Migrator, postgres::PgRow};

use super::{
    Balance, Charge, ChargePage, ChargeStatus, Failure, Ledger, Page, Refund, RefundRefusal,
    Settlement, balance_of, settle_charge, settlement::REFUND_SETTLED,
};
use crate::{auth::Account, params::RefundParams};

/// The demo's own migrations (`examples/charges-demo/migrations`): the `charges` and `refunds`
/// tables, tracked in sqlx's default `_sqlx_migrations` table. tower-idempotency's migrations
/// live apart, in the `idempotency` schema with their own `idempotency._sqlx_migrations`, so
/// applying both sets to one database never mixes them up.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// A [`Ledger`] in the `charges` and `refunds` tables of a PostgreSQL database.
///
/// Apply [`MIGRATOR`] first (the server does at start-up).
#[derive(Debug, Clone)]
pub struct PostgresLedger {
    pool: PgPool,
}

impl PostgresLedger {
    /// A ledger on `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// The pool it uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

const INSERT: &str = r#"
INSERT INTO charges
    (id, account, amount, currency, status, source, customer, description, metadata,
     failure_code, failure_message, created)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, to_timestamp($12))
"#;

/// The columns of [`decode`], shared by both reads.
macro_rules! charge_columns {
    () => {
        "id, account, amount, amount_refunded, currency, status, source, customer, description, \
         metadata::text AS metadata, failure_code, failure_message, \
         extract(epoch FROM created)::bigint AS created"
    };
}

const RETRIEVE: &str = concat!(
    "SELECT ",
    charge_columns!(),
    " FROM charges WHERE account = $1 AND id = $2"
);

/// Newest first, after the cursor `$2` when given. A cursor of another account (or of no charge
/// at all) makes the subquery NULL, so the page is empty.
const LIST: &str = concat!(
    "SELECT ",
    charge_columns!(),
    " FROM charges
      WHERE account = $1
        AND ($2::text IS NULL
             OR seq < (SELECT seq FROM charges WHERE account = $1 AND id = $2))
      ORDER BY seq DESC
      LIMIT $3"
);

/// The charge a refund is for, locked until the transaction ends: a concurrent refund of it
/// waits here, and then reads what this one left.
const LOCK_CHARGE: &str = concat!(
    "SELECT ",
    charge_columns!(),
    " FROM charges WHERE account = $1 AND id = $2 FOR UPDATE"
);

/// Relative, so that even a writer that skipped the lock cannot lose an update; the table's
/// `CHECK` ([`REFUNDED_WITHIN_AMOUNT`]) bounds the sum.
const ADD_REFUNDED: &str =
    "UPDATE charges SET amount_refunded = amount_refunded + $2 WHERE id = $1";

const INSERT_REFUND: &str = r#"
INSERT INTO refunds (id, account, charge, amount, currency, metadata, created)
VALUES ($1, $2, $3, $4, $5, $6::jsonb, to_timestamp($7))
"#;

/// The `CHECK (amount_refunded <= amount)` of `charges`, the last line of defence against an
/// over-refund: a refund that meets it is refused as `amount_too_large`.
pub const REFUNDED_WITHIN_AMOUNT: &str = "charges_refunded_within_amount";

/// SQLSTATE `check_violation`.
const CHECK_VIOLATION: &str = "23514";

macro_rules! refund_columns {
    () => {
        "id, account, charge, amount, currency, metadata::text AS metadata, \
         extract(epoch FROM created)::bigint AS created"
    };
}

const RETRIEVE_REFUND: &str = concat!(
    "SELECT ",
    refund_columns!(),
    " FROM refunds WHERE account = $1 AND id = $2"
);

/// As [`LIST`], for refunds.
const LIST_REFUNDS: &str = concat!(
    "SELECT ",
    refund_columns!(),
    " FROM refunds
      WHERE account = $1
        AND ($2::text IS NULL
             OR seq < (SELECT seq FROM refunds WHERE account = $1 AND id = $2))
      ORDER BY seq DESC
      LIMIT $3"
);

/// Writes one charge row: the only statement that writes a new charge.
///
/// It takes any executor so that it runs inside the request's transaction: behind
/// tower-idempotency's transactional mode, [`PostgresLedger::insert`] is given the request's
/// [`IdempotentTx`](tower_idempotency::IdempotentTx), and the row commits together with the stored
/// response (a crash, a panic or a lost database before that commit leaves neither). Without a
/// transaction (lease mode) it runs on the pool.
///
/// # Errors
///
/// The database's error, such as a unique violation on `id` or a lost connection.
pub async fn insert_charge<'e>(
    executor: impl PgExecutor<'e>,
    charge: &Charge,
) -> Result<(), sqlx::Error> {
    let metadata = serde_json::to_string(&charge.metadata)
        .map_err(|error| sqlx::Error::Encode(Box::new(error)))?;
    sqlx::query(INSERT)
        .bind(&charge.id)
        .bind(charge.account.as_str())
        .bind(charge.amount)
        .bind(&charge.currency)
        .bind(charge.status.as_str())
        .bind(&charge.source)
        .bind(charge.customer.as_deref())
        .bind(charge.description.as_deref())
        .bind(metadata)
        .bind(charge.failure.as_ref().map(|f| f.code.as_str()))
        .bind(charge.failure.as_ref().map(|f| f.message.as_str()))
        // `to_timestamp` takes double precision; Unix seconds are exact in it.
        .bind(charge.created as f64)
        .execute(executor)
        .await?;
    Ok(())
}

/// Refunds on `connection`, which must be inside a transaction: the charge's lock lasts until
/// it ends. See [`Ledger::refund`].
///
/// # Errors
///
/// The database's error; a refund past the table's `CHECK` is not one, but
/// [`RefundRefusal::AmountTooLarge`] (the transaction is then aborted, so nothing it wrote can
/// commit).
pub async fn refund_charge(
    connection: &mut PgConnection,
    account: &Account,
    params: &RefundParams,
) -> Result<Result<Refund, RefundRefusal>, PostgresLedgerError> {
    let row = sqlx::query(LOCK_CHARGE)
        .bind(account.as_str())
        .bind(&params.charge)
        .fetch_optional(&mut *connection)
        .await?;
    let Some(charge) = row.as_ref().map(decode).transpose()? else {
        return Ok(Err(RefundRefusal::NoSuchCharge));
    };
    let amount = match charge.refundable(params.amount) {
        Ok(amount) => amount,
        Err(refusal) => return Ok(Err(refusal)),
    };
    let added = sqlx::query(ADD_REFUNDED)
        .bind(&charge.id)
        .bind(amount)
        .execute(&mut *connection)
        .await;
    match added {
        Err(sqlx::Error::Database(error))
            if error.code().as_deref() == Some(CHECK_VIOLATION)
                && error.constraint() == Some(REFUNDED_WITHIN_AMOUNT) =>
        {
            tracing::error!(
                charge = %charge.id,
                amount,
                "a refund passed the lock's check but not the table's: refused"
            );
            return Ok(Err(RefundRefusal::AmountTooLarge {
                requested: amount,
                left: None,
            }));
        }
        added => added?,
    };
    sqlx::query(REFUND_SETTLED)
        .bind(&charge.id)
        .bind(amount)
        .execute(&mut *connection)
        .await?;
    let refund = Refund::new(&charge, amount, params.metadata.clone());
    let metadata = serde_json::to_string(&refund.metadata)
        .map_err(|error| sqlx::Error::Encode(Box::new(error)))?;
    sqlx::query(INSERT_REFUND)
        .bind(&refund.id)
        .bind(refund.account.as_str())
        .bind(&refund.charge)
        .bind(refund.amount)
        .bind(&refund.currency)
        .bind(metadata)
        .bind(refund.created as f64)
        .execute(&mut *connection)
        .await?;
    Ok(Ok(refund))
}

impl Ledger for PostgresLedger {
    const IN_STORE_DATABASE: bool = true;

    type Error = PostgresLedgerError;

    async fn insert(
        &self,
        charge: &Charge,
        transaction: Option<&mut PgConnection>,
    ) -> Result<(), PostgresLedgerError> {
        match transaction {
            Some(connection) => insert_charge(connection, charge).await?,
            None => insert_charge(&self.pool, charge).await?,
        }
        Ok(())
    }

    async fn retrieve(
        &self,
        account: &Account,
        id: &str,
    ) -> Result<Option<Charge>, PostgresLedgerError> {
        let row = sqlx::query(RETRIEVE)
            .bind(account.as_str())
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(decode).transpose()
    }

    async fn list(
        &self,
        account: &Account,
        limit: usize,
        starting_after: Option<&str>,
    ) -> Result<ChargePage, PostgresLedgerError> {
        let fetch = i64::try_from(limit).unwrap_or(i64::MAX - 1) + 1;
        let rows = sqlx::query(LIST)
            .bind(account.as_str())
            .bind(starting_after)
            .bind(fetch)
            .fetch_all(&self.pool)
            .await?;
        let has_more = rows.len() > limit;
        let data = rows
            .iter()
            .take(limit)
            .map(decode)
            .collect::<Result<_, _>>()?;
        Ok(ChargePage { data, has_more })
    }

    /// Without a transaction the settlement runs in one of its own.
    async fn settle(
        &self,
        id: &str,
        transaction: Option<&mut PgConnection>,
    ) -> Result<Settlement, PostgresLedgerError> {
        if let Some(connection) = transaction {
            return Ok(settle_charge(connection, id).await?);
        }
        let mut own = self.pool.begin().await?;
        let settled = settle_charge(&mut own, id).await?;
        own.commit().await?;
        Ok(settled)
    }

    async fn balance(&self, account: &Account) -> Result<Balance, PostgresLedgerError> {
        Ok(balance_of(&self.pool, account.as_str()).await?)
    }

    /// Without a transaction (lease mode) the refund runs in one of its own.
    async fn refund(
        &self,
        account: &Account,
        params: &RefundParams,
        transaction: Option<&mut PgConnection>,
    ) -> Result<Result<Refund, RefundRefusal>, PostgresLedgerError> {
        if let Some(connection) = transaction {
            return refund_charge(connection, account, params).await;
        }
        let mut own = self.pool.begin().await?;
        let refunded = refund_charge(&mut own, account, params).await?;
        if refunded.is_ok() {
            own.commit().await?;
        }
        Ok(refunded)
    }

    async fn retrieve_refund(
        &self,
        account: &Account,
        id: &str,
    ) -> Result<Option<Refund>, PostgresLedgerError> {
        let row = sqlx::query(RETRIEVE_REFUND)
            .bind(account.as_str())
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(decode_refund).transpose()
    }

    async fn list_refunds(
        &self,
        account: &Account,
        limit: usize,
        starting_after: Option<&str>,
    ) -> Result<Page<Refund>, PostgresLedgerError> {
        let fetch = i64::try_from(limit).unwrap_or(i64::MAX - 1) + 1;
        let rows = sqlx::query(LIST_REFUNDS)
            .bind(account.as_str())
            .bind(starting_after)
            .bind(fetch)
            .fetch_all(&self.pool)
            .await?;
        let has_more = rows.len() > limit;
        let data = rows
            .iter()
            .take(limit)
            .map(decode_refund)
            .collect::<Result<_, _>>()?;
        Ok(Page { data, has_more })
    }
}

fn decode_refund(row: &PgRow) -> Result<Refund, PostgresLedgerError> {
    let id: String = row.try_get("id")?;
    let metadata: String = row.try_get("metadata")?;
    let metadata =
        serde_json::from_str(&metadata).map_err(|error| PostgresLedgerError::Corrupt {
            id: id.clone(),
            what: format!("metadata: {error}"),
        })?;
    Ok(Refund {
        account: Account::from_id(row.try_get::<String, _>("account")?),
        charge: row.try_get("charge")?,
        amount: row.try_get("amount")?,
        currency: row.try_get("currency")?,
        metadata,
        created: row.try_get("created")?,
        id,
    })
}

fn decode(row: &PgRow) -> Result<Charge, PostgresLedgerError> {
    let id: String = row.try_get("id")?;
    let corrupt = |what: String| PostgresLedgerError::Corrupt {
        id: id.clone(),
        what,
    };
    let status: String = row.try_get("status")?;
    let status =
        ChargeStatus::parse(&status).ok_or_else(|| corrupt(format!("status `{status}`")))?;
    let metadata: String = row.try_get("metadata")?;
    let metadata: BTreeMap<String, String> =
        serde_json::from_str(&metadata).map_err(|error| corrupt(format!("metadata: {error}")))?;
    let failure = match (
        row.try_get::<Option<String>, _>("failure_code")?,
        row.try_get::<Option<String>, _>("failure_message")?,
    ) {
        (Some(code), message) => Some(Failure {
            code,
            message: message.unwrap_or_default(),
        }),
        (None, _) => None,
    };
    Ok(Charge {
        account: Account::from_id(row.try_get::<String, _>("account")?),
        amount: row.try_get("amount")?,
        amount_refunded: row.try_get("amount_refunded")?,
        currency: row.try_get("currency")?,
        status,
        source: row.try_get("source")?,
        customer: row.try_get("customer")?,
        description: row.try_get("description")?,
        metadata,
        failure,
        created: row.try_get("created")?,
        id,
    })
}

/// A [`PostgresLedger`] operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum PostgresLedgerError {
    /// The database returned an error or could not be reached.
    Database(sqlx::Error),
    /// A stored row could not be read back as a charge or a refund.
    Corrupt {
        /// The object's id.
        id: String,
        /// What was wrong with it.
        what: String,
    },
}

impl fmt::Display for PostgresLedgerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Database(_) => f.write_str("ledger database error"),
            Self::Corrupt { id, what } => write!(f, "stored object {id} is corrupt: {what}"),
        }
    }
}

impl std::error::Error for PostgresLedgerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Database(error) => Some(error),
            Self::Corrupt { .. } => None,
        }
    }
}

impl From<sqlx::Error> for PostgresLedgerError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}
