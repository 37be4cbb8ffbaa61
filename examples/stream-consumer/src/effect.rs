//! The effect of a message: credit an account and note the event, in the transaction that
//! `Once::run_in_transaction` commits with the event's record.

use std::time::Duration;

use serde_json::json;
use sqlx::{Executor, PgConnection, PgPool};
use tower_idempotency::{Once, OnceError, store::PostgresStore};

/// The example's own tables, beside the store's `idempotency` schema. Taken under an advisory
/// lock, so consumers starting together do not race to create them.
const SCHEMA: &str = "
    SELECT pg_advisory_xact_lock(7305101);
    CREATE SCHEMA IF NOT EXISTS stream_consumer;
    CREATE TABLE IF NOT EXISTS stream_consumer.accounts (
        id text PRIMARY KEY,
        balance bigint NOT NULL
    );
    -- No unique constraint on purpose: an event applied twice would show as two rows.
    CREATE TABLE IF NOT EXISTS stream_consumer.applied_events (
        seq bigserial PRIMARY KEY,
        event_id text NOT NULL,
        stream_id text NOT NULL,
        account text NOT NULL,
        amount bigint NOT NULL
    );
";

const CREDIT: &str = "INSERT INTO stream_consumer.accounts (id, balance) VALUES ($1, $2)
    ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance
    RETURNING balance";

const NOTE: &str = "INSERT INTO stream_consumer.applied_events
    (event_id, stream_id, account, amount) VALUES ($1, $2, $3, $4)";

/// A credit a message asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Credit {
    /// The producer's id of the event: the same on every copy it sends.
    pub(crate) event_id: String,
    /// The account credited.
    pub(crate) account: String,
    /// The amount, in minor units.
    pub(crate) amount: i64,
}

/// Creates the store's schema and the example's tables.
pub(crate) async fn migrate(
    pool: &PgPool,
    store: &PostgresStore,
) -> Result<(), Box<dyn std::error::Error>> {
    store.migrate().await?;
    let mut tx = pool.begin().await?;
    tx.execute(SCHEMA).await?;
    tx.commit().await?;
    Ok(())
}

/// Applies `credit` (delivered as stream entry `stream_id`) once per event id under `scope`:
/// the account's balance after it, and whether this call applied it (`false`: an earlier
/// delivery or copy did).
pub(crate) async fn apply(
    once: &Once<PostgresStore>,
    scope: &str,
    stream_id: &str,
    credit: &Credit,
    delay: Duration,
) -> Result<(i64, bool), OnceError<sqlx::Error>> {
    let payload = json!({ "account": credit.account, "amount": credit.amount });
    let mut applied = false;
    // Owned: the closure's future may borrow only the transaction.
    let (owned, stream_id) = (credit.clone(), stream_id.to_owned());
    let balance = once
        .run_in_transaction(
            scope,
            &credit.event_id,
            &payload,
            |tx: &mut PgConnection| {
                applied = true;
                let credit = owned;
                Box::pin(async move {
                    let balance: i64 = sqlx::query_scalar(CREDIT)
                        .bind(&credit.account)
                        .bind(credit.amount)
                        .fetch_one(&mut *tx)
                        .await?;
                    tracing::info!(event = %credit.event_id, %stream_id, "applying event");
                    // Widens the window in which a crash lands mid-effect, the row locked.
                    tokio::time::sleep(delay).await;
                    sqlx::query(NOTE)
                        .bind(&credit.event_id)
                        .bind(&stream_id)
                        .bind(&credit.account)
                        .bind(credit.amount)
                        .execute(&mut *tx)
                        .await?;
                    Ok(balance)
                })
            },
        )
        .await?;
    Ok((balance, applied))
}
