//! Where charges and their refunds are kept: the [`Ledger`] seam and its two implementations.
//!
//! * [`MemoryLedger`]: in the process, for the embedded mode (no `DATABASE_URL`).
//! * [`PostgresLedger`]: the `charges` and `refunds` tables of the demo's own migrations
//!   ([`MIGRATOR`]). Behind tower-idempotency's [transactional
//!   mode](tower_idempotency::guide::modes), the handler hands it the request's transaction, and
//!   the rows commit with the stored response.
//!
//! A refund is recorded atomically with the charge's `amount_refunded` ([`Ledger::refund`]):
//! whatever the concurrency, the refunds of a charge never add up to more than its amount.
//!
//! ```
//! use charges_demo::{
//!     auth::Account,
//!     ledger::{Charge, ChargeStatus, Ledger, MemoryLedger},
//!     params::{ChargeParams, RefundParams},
//!     processor::Authorization,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let ledger = MemoryLedger::new();
//! let account = Account::from_api_key("sk_test_123");
//! let params = ChargeParams::parse(None, b"amount=500&currency=usd").unwrap();
//! let charge = Charge::new(&account, params, Authorization::Approved);
//! ledger.insert(&charge, None).await.unwrap();
//!
//! let found = ledger.retrieve(&account, &charge.id).await.unwrap();
//! assert_eq!(found.map(|c| c.status), Some(ChargeStatus::Succeeded));
//! let other = Account::from_api_key("sk_test_456");
//! assert_eq!(ledger.retrieve(&other, &charge.id).await.unwrap(), None);
//!
//! let params = RefundParams::parse(None, format!("charge={}&amount=200", charge.id).as_bytes());
//! let refund = ledger.refund(&account, &params.unwrap(), None).await.unwrap().unwrap();
//! assert_eq!(refund.amount, 200);
//! let found = ledger.retrieve(&account, &charge.id).await.unwrap().unwrap();
//! assert_eq!(found.amount_refunded, 200);
//! # }
//! ```

use std::{
    collections::BTreeMap,
    future::Future,
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Serialize, Serializer};
use sqlx::PgConnection;

use crate::{
    auth::Account,
    params::{ChargeParams, RefundParams},
    processor::Authorization,
};

mod memory;
mod postgres;
mod refund;
mod settlement;

pub use memory::MemoryLedger;
pub use postgres::{
    MIGRATOR, PostgresLedger, PostgresLedgerError, REFUNDED_WITHIN_AMOUNT, insert_charge,
    refund_charge,
};
pub use refund::{Refund, RefundRefusal};
pub use settlement::{Balance, Funds, Settlement, balance_of, settle_charge};

/// Stripe's `failure_code` of a declined charge.
pub const CARD_DECLINED: &str = "card_declined";

/// A charge as the ledger keeps it. Serialises as Stripe's charge object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// `ch_...`.
    pub id: String,
    /// The account that created it; not part of the wire object.
    pub account: Account,
    /// In the currency's smallest unit.
    pub amount: i64,
    /// How much of it was refunded: from 0 to `amount`, and 0 for a failed charge.
    pub amount_refunded: i64,
    /// Three lowercase letters.
    pub currency: String,
    /// Whether it succeeded.
    pub status: ChargeStatus,
    /// The token it was made with; not part of the wire object.
    pub source: String,
    /// The customer it is for.
    pub customer: Option<String>,
    /// A free-text description.
    pub description: Option<String>,
    /// The client's key-value pairs.
    pub metadata: BTreeMap<String, String>,
    /// For a failed charge, why: Stripe's `failure_code` and `failure_message`.
    pub failure: Option<Failure>,
    /// When it was created, in Unix seconds.
    pub created: i64,
}

/// Why a charge failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Stripe's `failure_code`: [`CARD_DECLINED`].
    pub code: String,
    /// The message for the customer.
    pub message: String,
}

/// A charge's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChargeStatus {
    /// The card was charged.
    Succeeded,
    /// The card was declined.
    Failed,
}

impl ChargeStatus {
    /// The wire (and database) spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
        }
    }

    /// Reads the spelling back.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "succeeded" => Some(Self::Succeeded),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }
}

impl Charge {
    /// A new charge for `account`, with a fresh id and the current time, in the state the
    /// processor's `authorization` decided.
    pub fn new(account: &Account, params: ChargeParams, authorization: Authorization) -> Self {
        let (status, failure) = match authorization {
            Authorization::Approved => (ChargeStatus::Succeeded, None),
            Authorization::Declined(decline) => (
                ChargeStatus::Failed,
                Some(Failure {
                    code: CARD_DECLINED.to_owned(),
                    message: decline.message.to_owned(),
                }),
            ),
        };
        Self {
            id: new_id("ch"),
            account: account.clone(),
            amount: params.amount,
            amount_refunded: 0,
            currency: params.currency,
            status,
            source: params.source,
            customer: params.customer,
            description: params.description,
            metadata: params.metadata,
            failure,
            created: unix_now(),
        }
    }

    /// How much a refund of `requested` (`None`: what is left) takes from this charge, or why
    /// it cannot be refunded. Both ledgers decide by this, holding the charge so that no other
    /// refund of it runs in between.
    ///
    /// # Errors
    ///
    /// The [`RefundRefusal`]: the charge failed, is fully refunded, or has less left.
    pub fn refundable(&self, requested: Option<i64>) -> Result<i64, RefundRefusal> {
        if self.status != ChargeStatus::Succeeded {
            return Err(RefundRefusal::ChargeFailed);
        }
        let left = self.amount - self.amount_refunded;
        match requested {
            _ if left <= 0 => Err(RefundRefusal::AlreadyRefunded),
            None => Ok(left),
            Some(amount) if amount <= left => Ok(amount),
            Some(amount) => Err(RefundRefusal::AmountTooLarge {
                requested: amount,
                left: Some(left),
            }),
        }
    }
}

/// Stripe's charge object, alphabetical after `id` and `object` as Stripe orders it.
impl Serialize for Charge {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct ChargeObject<'a> {
            id: &'a str,
            object: &'static str,
            amount: i64,
            amount_captured: i64,
            amount_refunded: i64,
            captured: bool,
            created: i64,
            currency: &'a str,
            customer: Option<&'a str>,
            description: Option<&'a str>,
            failure_code: Option<&'a str>,
            failure_message: Option<&'a str>,
            livemode: bool,
            metadata: &'a BTreeMap<String, String>,
            paid: bool,
            refunded: bool,
            status: ChargeStatus,
        }
        let succeeded = self.status == ChargeStatus::Succeeded;
        ChargeObject {
            id: &self.id,
            object: "charge",
            amount: self.amount,
            amount_captured: if succeeded { self.amount } else { 0 },
            amount_refunded: self.amount_refunded,
            captured: succeeded,
            created: self.created,
            currency: &self.currency,
            customer: self.customer.as_deref(),
            description: self.description.as_deref(),
            failure_code: self.failure.as_ref().map(|f| f.code.as_str()),
            failure_message: self.failure.as_ref().map(|f| f.message.as_str()),
            livemode: false,
            metadata: &self.metadata,
            paid: succeeded,
            // Stripe's meaning: fully refunded.
            refunded: self.amount_refunded == self.amount,
            status: self.status,
        }
        .serialize(serializer)
    }
}

/// One page of an account's charges or refunds, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    /// At most the requested number of objects.
    pub data: Vec<T>,
    /// Whether older objects follow the last one.
    pub has_more: bool,
}

/// A page of charges.
pub type ChargePage = Page<Charge>;

/// A store of charges and refunds, each visible only to the account that made it.
///
/// Implementations answer every read for one account only: a charge id of another account is
/// "not found", never "forbidden".
pub trait Ledger: Clone + Send + Sync + 'static {
    /// The error of every operation.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Whether the ledger lives in the idempotency store's PostgreSQL database, so that a
    /// step's ledger write can commit with the step's record
    /// ([`Steps::run_in_transaction`](tower_idempotency::Steps::run_in_transaction)).
    const IN_STORE_DATABASE: bool = false;

    /// Records a new charge; inside `transaction` when one is given (a step's transaction, see
    /// [`IN_STORE_DATABASE`](Self::IN_STORE_DATABASE)), so that the charge commits together
    /// with the step's record, or not at all.
    fn insert(
        &self,
        charge: &Charge,
        transaction: Option<&mut PgConnection>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The charge `id` of `account`, if it exists.
    fn retrieve(
        &self,
        account: &Account,
        id: &str,
    ) -> impl Future<Output = Result<Option<Charge>, Self::Error>> + Send;

    /// Up to `limit` charges of `account`, newest first, starting after the charge
    /// `starting_after` when given (an id of `account`'s: check it exists first).
    fn list(
        &self,
        account: &Account,
        limit: usize,
        starting_after: Option<&str>,
    ) -> impl Future<Output = Result<ChargePage, Self::Error>> + Send;

    /// Refunds `params.amount` (or what is left) of `account`'s charge `params.charge`: checks
    /// it by [`Charge::refundable`], records the refund and adds its amount to the charge's
    /// `amount_refunded`, as one atomic step, holding the charge so that concurrent refunds of
    /// it take turns. Inside `transaction` when one is given, as [`insert`](Self::insert).
    ///
    /// `Ok(Err(refusal))` when the charge cannot be refunded so: nothing was written.
    fn refund(
        &self,
        account: &Account,
        params: &RefundParams,
        transaction: Option<&mut PgConnection>,
    ) -> impl Future<Output = Result<Result<Refund, RefundRefusal>, Self::Error>> + Send;

    /// Settles the charge `id`, whichever account's (the acquirer names charges, not
    /// accounts): marks it settled and adds its amount, less its refunds, to its account's
    /// available balance, once per charge however often it is called ([`Settlement`]). Inside
    /// `transaction` when one is given: the webhook's inbox record commits with it.
    fn settle(
        &self,
        id: &str,
        transaction: Option<&mut PgConnection>,
    ) -> impl Future<Output = Result<Settlement, Self::Error>> + Send;

    /// The balance of `account` ([`Balance`]).
    fn balance(
        &self,
        account: &Account,
    ) -> impl Future<Output = Result<Balance, Self::Error>> + Send;

    /// The refund `id` of `account`, if it exists.
    fn retrieve_refund(
        &self,
        account: &Account,
        id: &str,
    ) -> impl Future<Output = Result<Option<Refund>, Self::Error>> + Send;

    /// Up to `limit` refunds of `account`, newest first, as [`list`](Self::list) pages charges.
    fn list_refunds(
        &self,
        account: &Account,
        limit: usize,
        starting_after: Option<&str>,
    ) -> impl Future<Output = Result<Page<Refund>, Self::Error>> + Send;
}

/// A new object id: `prefix`, `_`, and 22 base62 characters of 122 random bits.
pub fn new_id(prefix: &str) -> String {
    id_of(prefix, uuid::Uuid::new_v4().as_u128())
}

/// The id of the charge authorized under the downstream key `key` (a UUID): `ch_` and the key
/// in base62. Known before the charge is recorded, so the acquirer is told it with the
/// authorization and names it in its `charge.settled` events; the same on every attempt.
pub fn charge_id_for(key: &str) -> Option<String> {
    let key = uuid::Uuid::parse_str(key).ok()?;
    Some(id_of("ch", key.as_u128()))
}

fn id_of(prefix: &str, mut n: u128) -> String {
    const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut digits = [b'0'; 22];
    for digit in digits.iter_mut().rev() {
        *digit = ALPHABET[(n % 62) as usize];
        n /= 62;
    }
    let mut id = String::with_capacity(prefix.len() + 1 + digits.len());
    id.push_str(prefix);
    id.push('_');
    id.extend(digits.iter().map(|&b| char::from(b)));
    id
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::Decline;

    fn params() -> ChargeParams {
        ChargeParams::parse(None, b"amount=2000&currency=usd&metadata[k]=v").unwrap()
    }

    #[test]
    fn ids_are_prefixed_base62_and_distinct() {
        let a = new_id("ch");
        assert_eq!(a.len(), 3 + 22);
        assert!(a.starts_with("ch_"));
        assert!(a[3..].bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_ne!(a, new_id("ch"));
    }

    #[test]
    fn serialises_as_a_stripe_charge() {
        let account = Account::from_api_key("sk_test_1");
        let charge = Charge::new(&account, params(), Authorization::Approved);
        let json = serde_json::to_value(&charge).unwrap();
        assert_eq!(json["id"], charge.id.as_str());
        assert_eq!(json["object"], "charge");
        assert_eq!(json["amount"], 2000);
        assert_eq!(json["currency"], "usd");
        assert_eq!(json["status"], "succeeded");
        assert_eq!(json["paid"], true);
        assert_eq!(json["captured"], true);
        assert_eq!(json["livemode"], false);
        assert_eq!(json["metadata"], serde_json::json!({"k": "v"}));
        assert!(json["created"].as_i64().unwrap() > 1_700_000_000);
        assert!(json["description"].is_null());
        assert!(
            json.get("account").is_none(),
            "the account is not on the wire"
        );
        let text = serde_json::to_string(&charge).unwrap();
        assert!(
            text.starts_with(&format!(r#"{{"id":"{}","object":"charge","#, charge.id)),
            "{text}"
        );
    }

    #[test]
    fn refunds_take_at_most_what_is_left() {
        let account = Account::from_api_key("sk_test_1");
        let mut charge = Charge::new(&account, params(), Authorization::Approved);
        assert_eq!(charge.refundable(Some(500)), Ok(500));
        assert_eq!(
            charge.refundable(None),
            Ok(2000),
            "the default is what is left"
        );
        charge.amount_refunded = 1500;
        assert_eq!(charge.refundable(None), Ok(500));
        assert_eq!(
            charge.refundable(Some(501)),
            Err(RefundRefusal::AmountTooLarge {
                requested: 501,
                left: Some(500)
            })
        );
        let json = serde_json::to_value(&charge).unwrap();
        assert_eq!(
            (json["amount_refunded"].as_i64(), json["refunded"].as_bool()),
            (Some(1500), Some(false))
        );
        charge.amount_refunded = 2000;
        assert_eq!(
            charge.refundable(Some(1)),
            Err(RefundRefusal::AlreadyRefunded)
        );
        assert_eq!(charge.refundable(None), Err(RefundRefusal::AlreadyRefunded));
        assert_eq!(serde_json::to_value(&charge).unwrap()["refunded"], true);

        let decline = Decline {
            code: "generic_decline",
            message: "Your card was declined.",
        };
        let failed = Charge::new(&account, params(), Authorization::Declined(decline));
        assert_eq!(failed.refundable(None), Err(RefundRefusal::ChargeFailed));
    }

    #[test]
    fn a_declined_charge_failed() {
        let account = Account::from_api_key("sk_test_1");
        let decline = Decline {
            code: "generic_decline",
            message: "Your card was declined.",
        };
        let charge = Charge::new(&account, params(), Authorization::Declined(decline));
        let json = serde_json::to_value(&charge).unwrap();
        assert_eq!(json["status"], "failed");
        assert_eq!(json["paid"], false);
        assert_eq!(json["captured"], false);
        assert_eq!(json["failure_code"], CARD_DECLINED);
        assert_eq!(json["failure_message"], "Your card was declined.");
    }
}
