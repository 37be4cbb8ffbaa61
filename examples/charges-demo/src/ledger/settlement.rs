//! Settlement: the acquirer's `charge.settled` moves a charge's money from pending to
//! available, once per charge ([`Settlement`]), and the [`Balance`] an account sees.
//!
//! Available is what settled charges brought in, less what was refunded of them; pending is
//! what succeeded charges not yet settled would bring in, less their refunds. A refund before
//! settlement lowers what the settlement adds; a refund after it takes its amount back from
//! available, which may then go below zero (Stripe's balances can too).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgExecutor, Row};

/// What settling a charge came to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Settlement {
    /// `amount` (the charge's, less its refunds) was added to the account's available balance.
    Settled {
        /// What was added.
        amount: i64,
        /// Its currency.
        currency: String,
    },
    /// The charge was settled before (by another event): nothing was added.
    AlreadySettled,
    /// The charge was declined: there is nothing to settle.
    NotPaid,
    /// No charge has this id: nothing was written.
    NoSuchCharge,
}

/// One amount of a balance: Stripe's `{"amount", "currency", "source_types"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Funds {
    /// In the currency's smallest unit; may be negative after refunds of settled charges.
    pub amount: i64,
    /// Three lowercase letters.
    pub currency: String,
    /// Where the funds came from: every charge here is a card charge.
    pub source_types: BTreeMap<&'static str, i64>,
}

/// An account's balance, in Stripe's shape: `{"object": "balance", "available": [...],
/// "livemode": false, "pending": [...]}`, one entry per currency the account has used (or
/// `usd` at zero when it has none, as Stripe shows a new account).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Balance {
    /// Per currency: what settled charges brought in, less their refunds.
    pub available: BTreeMap<String, i64>,
    /// Per currency: succeeded charges not settled yet, less their refunds.
    pub pending: BTreeMap<String, i64>,
}

impl Balance {
    fn funds(amounts: &BTreeMap<String, i64>, currencies: &[&String]) -> Vec<Funds> {
        currencies
            .iter()
            .map(|currency| {
                let amount = amounts.get(*currency).copied().unwrap_or(0);
                Funds {
                    amount,
                    currency: (*currency).clone(),
                    source_types: BTreeMap::from([("card", amount)]),
                }
            })
            .collect()
    }
}

impl Serialize for Balance {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct BalanceObject {
            object: &'static str,
            available: Vec<Funds>,
            livemode: bool,
            pending: Vec<Funds>,
        }
        let usd = "usd".to_owned();
        let mut currencies: Vec<&String> =
            self.available.keys().chain(self.pending.keys()).collect();
        currencies.sort();
        currencies.dedup();
        if currencies.is_empty() {
            currencies.push(&usd);
        }
        BalanceObject {
            object: "balance",
            available: Self::funds(&self.available, &currencies),
            livemode: false,
            pending: Self::funds(&self.pending, &currencies),
        }
        .serialize(serializer)
    }
}

/// Marks the charge settled if it is not yet, and adds what it brought in to its account's
/// available balance, in one statement: of two settlements of one charge, the second finds it
/// settled (the row lock orders them), so the balance moves once.
const SETTLE: &str = r#"
WITH settled AS (
    UPDATE charges SET settled = now()
     WHERE id = $1 AND settled IS NULL AND status = 'succeeded'
    RETURNING account, currency, amount - amount_refunded AS net
)
INSERT INTO balances (account, currency, available)
SELECT account, currency, net FROM settled
ON CONFLICT (account, currency) DO UPDATE SET available = balances.available + EXCLUDED.available
RETURNING (SELECT net FROM settled), currency
"#;

/// The charge to settle, locked first, so that what is decided from it holds when it is
/// written (a charge committed between two unlocked reads would look unpaid).
const LOCK_FOR_SETTLEMENT: &str =
    "SELECT status, settled IS NOT NULL AS settled FROM charges WHERE id = $1 FOR UPDATE";

/// A refund of a settled charge takes its amount back from available; the charge is locked by
/// the refund's transaction, so it cannot be settled meanwhile.
pub(super) const REFUND_SETTLED: &str = r#"
UPDATE balances SET available = available - $2
  FROM charges
 WHERE charges.id = $1 AND charges.settled IS NOT NULL
   AND balances.account = charges.account AND balances.currency = charges.currency
"#;

/// Both halves in one statement, so in one snapshot: a settlement moving money from pending to
/// available is seen whole or not at all.
const BALANCE: &str = r#"
SELECT true AS available, currency, available AS amount FROM balances WHERE account = $1
UNION ALL
SELECT false, currency, sum(amount - amount_refunded)::bigint
  FROM charges
 WHERE account = $1 AND status = 'succeeded' AND settled IS NULL
 GROUP BY currency
"#;

/// Settles charge `id` on `connection` (a transaction: the webhook's inbox). See the statement `SETTLE` above.
///
/// # Errors
///
/// The database's error.
pub async fn settle_charge(
    connection: &mut PgConnection,
    id: &str,
) -> Result<Settlement, sqlx::Error> {
    let found = sqlx::query(LOCK_FOR_SETTLEMENT)
        .bind(id)
        .fetch_optional(&mut *connection)
        .await?;
    match found {
        None => return Ok(Settlement::NoSuchCharge),
        Some(row) if row.try_get::<bool, _>("settled")? => return Ok(Settlement::AlreadySettled),
        Some(row) if row.try_get::<String, _>("status")? != "succeeded" => {
            return Ok(Settlement::NotPaid);
        }
        Some(_) => {}
    }
    let added = sqlx::query(SETTLE)
        .bind(id)
        .fetch_optional(&mut *connection)
        .await?;
    // Under the lock, the conditional update finds the charge as just read.
    Ok(match added {
        Some(row) => Settlement::Settled {
            amount: row.try_get(0)?,
            currency: row.try_get(1)?,
        },
        None => Settlement::AlreadySettled,
    })
}

/// The balance of `account`.
///
/// # Errors
///
/// The database's error.
pub async fn balance_of<'e>(
    executor: impl PgExecutor<'e>,
    account: &str,
) -> Result<Balance, sqlx::Error> {
    let mut balance = Balance {
        available: BTreeMap::new(),
        pending: BTreeMap::new(),
    };
    for row in sqlx::query(BALANCE)
        .bind(account)
        .fetch_all(executor)
        .await?
    {
        let into = if row.try_get(0)? {
            &mut balance.available
        } else {
            &mut balance.pending
        };
        into.insert(row.try_get(1)?, row.try_get(2)?);
    }
    Ok(balance)
}
