use std::{collections::BTreeMap, fmt};

use http::StatusCode;
use serde::{Serialize, Serializer};

use super::{Charge, new_id, unix_now};
use crate::{
    auth::Account,
    error::{ApiError, ErrorType},
};

/// A refund as the ledger keeps it. Serialises as Stripe's refund object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refund {
    /// `re_...`.
    pub id: String,
    /// The account that made it, the charge's; not part of the wire object.
    pub account: Account,
    /// The refunded charge, `ch_...`.
    pub charge: String,
    /// In the charge's currency's smallest unit, positive.
    pub amount: i64,
    /// The charge's currency.
    pub currency: String,
    /// The client's key-value pairs.
    pub metadata: BTreeMap<String, String>,
    /// When it was created, in Unix seconds.
    pub created: i64,
}

impl Refund {
    /// A new refund of `amount` of `charge` (which [`Charge::refundable`] allowed), with a
    /// fresh id and the current time.
    pub fn new(charge: &Charge, amount: i64, metadata: BTreeMap<String, String>) -> Self {
        Self {
            id: new_id("re"),
            account: charge.account.clone(),
            charge: charge.id.clone(),
            amount,
            currency: charge.currency.clone(),
            metadata,
            created: unix_now(),
        }
    }
}

/// Stripe's refund object, alphabetical after `id` and `object` as Stripe orders it. Refunds
/// succeed at once here: the simulated card network takes them all.
impl Serialize for Refund {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct RefundObject<'a> {
            id: &'a str,
            object: &'static str,
            amount: i64,
            charge: &'a str,
            created: i64,
            currency: &'a str,
            metadata: &'a BTreeMap<String, String>,
            reason: Option<&'static str>,
            status: &'static str,
        }
        RefundObject {
            id: &self.id,
            object: "refund",
            amount: self.amount,
            charge: &self.charge,
            created: self.created,
            currency: &self.currency,
            metadata: &self.metadata,
            reason: None,
            status: "succeeded",
        }
        .serialize(serializer)
    }
}

/// Why a charge cannot be refunded as asked. Nothing was written.
///
/// The codes are Stripe's: its list of error codes (<https://docs.stripe.com/error-codes>),
/// which stripe-node 23.1.0 carries as the `Code` union of `PaymentIntents.d.ts`
/// (`amount_too_large`, `charge_already_refunded`, `charge_not_refundable`, `resource_missing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundRefusal {
    /// No such charge on this account: `404 resource_missing`, as for a charge of another.
    NoSuchCharge,
    /// The charge failed (its card was declined), so nothing was paid to refund:
    /// `400 charge_not_refundable`.
    ChargeFailed,
    /// The charge is refunded in full already: `400 charge_already_refunded`.
    AlreadyRefunded,
    /// More than is left of the charge: `400 amount_too_large`, on `amount`.
    AmountTooLarge {
        /// The amount asked for.
        requested: i64,
        /// What was left, when known (not when only the database's `CHECK` caught it).
        left: Option<i64>,
    },
}

impl RefundRefusal {
    /// The answer to a refund of `charge` refused so.
    pub fn error(self, charge: &str) -> ApiError {
        let refused = |code, param, message: String| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                ErrorType::InvalidRequestError,
                message,
            )
            .with_code(code)
            .with_param(param)
        };
        match self {
            Self::NoSuchCharge => ApiError::no_such("charge", charge, "charge"),
            Self::ChargeFailed => refused(
                "charge_not_refundable",
                "charge",
                format!(
                    "Charge {charge} failed (its card was declined): it has nothing to refund."
                ),
            ),
            Self::AlreadyRefunded => refused(
                "charge_already_refunded",
                "charge",
                format!("Charge {charge} has already been refunded."),
            ),
            Self::AmountTooLarge { requested, left } => refused(
                "amount_too_large",
                "amount",
                match left {
                    Some(left) => format!(
                        "Refund amount ({requested}) is greater than the unrefunded amount of \
                         charge {charge} ({left})."
                    ),
                    None => format!(
                        "Refund amount ({requested}) is greater than the unrefunded amount of \
                         charge {charge}."
                    ),
                },
            ),
        }
    }
}

impl fmt::Display for RefundRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoSuchCharge => "no such charge",
            Self::ChargeFailed => "the charge failed",
            Self::AlreadyRefunded => "the charge is refunded in full",
            Self::AmountTooLarge { .. } => "more than is left of the charge",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{params::ChargeParams, processor::Authorization};

    #[test]
    fn serialises_as_a_stripe_refund() {
        let account = Account::from_api_key("sk_test_1");
        let params = ChargeParams::parse(None, b"amount=2000&currency=eur").unwrap();
        let charge = Charge::new(&account, params, Authorization::Approved);
        let metadata = BTreeMap::from([("k".to_owned(), "v".to_owned())]);
        let refund = Refund::new(&charge, 500, metadata);
        let text = serde_json::to_string(&refund).unwrap();
        assert!(
            text.starts_with(&format!(r#"{{"id":"{}","object":"refund","#, refund.id)),
            "{text}"
        );
        assert!(refund.id.starts_with("re_"));
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["amount"], 500);
        assert_eq!(json["charge"], charge.id.as_str());
        assert_eq!(json["currency"], "eur");
        assert_eq!(json["status"], "succeeded");
        assert_eq!(json["metadata"], serde_json::json!({"k": "v"}));
        assert!(
            json.get("account").is_none(),
            "the account is not on the wire"
        );
    }

    #[test]
    fn refusals_are_stripes_errors() {
        let cases = [
            (
                RefundRefusal::NoSuchCharge,
                404,
                "resource_missing",
                "charge",
            ),
            (
                RefundRefusal::ChargeFailed,
                400,
                "charge_not_refundable",
                "charge",
            ),
            (
                RefundRefusal::AlreadyRefunded,
                400,
                "charge_already_refunded",
                "charge",
            ),
            (
                RefundRefusal::AmountTooLarge {
                    requested: 3,
                    left: Some(2),
                },
                400,
                "amount_too_large",
                "amount",
            ),
            (
                RefundRefusal::AmountTooLarge {
                    requested: 3,
                    left: None,
                },
                400,
                "amount_too_large",
                "amount",
            ),
        ];
        for (refusal, status, code, param) in cases {
            let error = refusal.error("ch_1");
            assert_eq!(error.status().as_u16(), status, "{refusal}");
            assert_eq!(error.kind(), ErrorType::InvalidRequestError, "{refusal}");
            assert_eq!((error.code(), error.param()), (Some(code), Some(param)));
            assert!(error.message().contains("ch_1"), "{}", error.message());
        }
    }
}
