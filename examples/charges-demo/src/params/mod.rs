//! The parameters of `POST /v1/charges` and `POST /v1/refunds`, read from a form or JSON body and
//! validated.
//!
//! Stripe's client libraries send `application/x-www-form-urlencoded` bodies with nested fields in
//! brackets (`metadata[order_id]=6735`); JSON bodies (`{"metadata": {"order_id": "6735"}}`) are
//! accepted too. Both become the same list of named values before one validation, so both
//! formats give the same errors.
//!
//! ```
//! use charges_demo::params::{ChargeParams, RefundParams};
//!
//! let params = ChargeParams::parse(
//!     Some("application/x-www-form-urlencoded"),
//!     b"amount=2000&currency=USD&metadata[order_id]=6735",
//! )
//! .unwrap();
//! assert_eq!(params.amount, 2000);
//! assert_eq!(params.currency, "usd");
//! assert_eq!(params.source, "tok_visa");
//! assert_eq!(params.metadata["order_id"], "6735");
//!
//! let refund = RefundParams::parse(None, b"charge=ch_123&amount=500").unwrap();
//! assert_eq!((refund.charge.as_str(), refund.amount), ("ch_123", Some(500)));
//! ```

mod body;

use std::collections::BTreeMap;

use self::body::fields;
use crate::error::ApiError;

/// The largest amount accepted, in the currency's smallest unit (Stripe's limit).
pub const MAX_AMOUNT: i64 = 99_999_999;
/// The most metadata keys a charge can have.
pub const MAX_METADATA_KEYS: usize = 50;
/// The longest metadata key, in characters.
pub const MAX_METADATA_KEY_LEN: usize = 40;
/// The longest metadata value, in characters.
pub const MAX_METADATA_VALUE_LEN: usize = 500;
/// The longest `description`, in characters.
pub const MAX_DESCRIPTION_LEN: usize = 1000;
/// The longest `customer` or `source`, in characters.
pub const MAX_ID_LEN: usize = 255;
/// The source used when a request names none: Stripe's test Visa card.
pub const DEFAULT_SOURCE: &str = "tok_visa";

/// A valid request to create a charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeParams {
    /// A positive amount in the currency's smallest unit (cents for `usd`).
    pub amount: i64,
    /// A three-letter ISO currency code, lowercase.
    pub currency: String,
    /// The payment source: a card token such as `tok_visa` or `tok_chargeDeclined`.
    pub source: String,
    /// The customer the charge is for, if any.
    pub customer: Option<String>,
    /// A free-text description.
    pub description: Option<String>,
    /// Key-value pairs the client attaches.
    pub metadata: BTreeMap<String, String>,
}

impl ChargeParams {
    /// Reads and validates a request body of the given `Content-Type` (a missing one is read
    /// as a form, as Stripe does).
    ///
    /// # Errors
    ///
    /// A `400 invalid_request_error` [`ApiError`] naming the offending parameter in `param`.
    pub fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, ApiError> {
        Self::from_fields(fields(content_type, body)?)
    }

    /// Validates named values as a form sends them (`metadata[key]` for metadata).
    ///
    /// # Errors
    ///
    /// As [`parse`](Self::parse).
    pub fn from_fields(fields: Vec<(String, String)>) -> Result<Self, ApiError> {
        let mut raw = RawParams::default();
        for (name, value) in fields {
            raw.set(name, value)?;
        }
        raw.validate()
    }
}

/// A valid request to refund a charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundParams {
    /// The charge to refund, `ch_...`: one of the caller's.
    pub charge: String,
    /// A positive amount in the charge's currency; `None` refunds what is left of the charge.
    pub amount: Option<i64>,
    /// Key-value pairs the client attaches.
    pub metadata: BTreeMap<String, String>,
}

impl RefundParams {
    /// Reads and validates a request body, as [`ChargeParams::parse`] does.
    ///
    /// # Errors
    ///
    /// As [`ChargeParams::parse`]. Whether the charge exists, and has that much left to
    /// refund, is the ledger's to say.
    pub fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, ApiError> {
        Self::from_fields(fields(content_type, body)?)
    }

    /// Validates named values as a form sends them (`metadata[key]` for metadata).
    ///
    /// # Errors
    ///
    /// As [`parse`](Self::parse).
    pub fn from_fields(fields: Vec<(String, String)>) -> Result<Self, ApiError> {
        let (mut charge, mut amount) = (None, None);
        let mut metadata = Metadata::default();
        for (name, value) in fields {
            let slot = match name.as_str() {
                "charge" => &mut charge,
                "amount" => &mut amount,
                "metadata" if value.is_empty() => continue,
                _ => {
                    metadata.set(&name, value)?;
                    continue;
                }
            };
            set_once(slot, &name, value)?;
        }
        let charge: String = charge.ok_or_else(|| ApiError::missing_param("charge"))?;
        // Any other id is simply not found; one that cannot be echoed in that answer is refused
        // here.
        if charge.chars().count() > MAX_ID_LEN || charge.chars().any(char::is_control) {
            return Err(ApiError::invalid_param(
                "charge",
                "parameter_invalid_string",
                format!(
                    "Invalid charge: at most {MAX_ID_LEN} characters, without control characters."
                ),
            ));
        }
        Ok(Self {
            charge,
            amount: amount.as_deref().map(parse_amount).transpose()?,
            metadata: metadata.0,
        })
    }
}

/// Sets a parameter that may come once; an empty value is an absent one, as in Stripe's form
/// encoding.
fn set_once(slot: &mut Option<String>, name: &str, value: String) -> Result<(), ApiError> {
    if slot.is_some() {
        return Err(duplicate(name));
    }
    if !value.is_empty() {
        *slot = Some(value);
    }
    Ok(())
}

/// The fields as received, before validation.
#[derive(Default)]
struct RawParams {
    amount: Option<String>,
    currency: Option<String>,
    source: Option<String>,
    customer: Option<String>,
    description: Option<String>,
    metadata: Metadata,
}

impl RawParams {
    fn set(&mut self, name: String, value: String) -> Result<(), ApiError> {
        let slot = match name.as_str() {
            "amount" => &mut self.amount,
            "currency" => &mut self.currency,
            "source" => &mut self.source,
            "customer" => &mut self.customer,
            "description" => &mut self.description,
            // `metadata=` (empty) is Stripe's way of saying "no metadata".
            "metadata" if value.is_empty() => return Ok(()),
            _ => return self.metadata.set(&name, value),
        };
        set_once(slot, &name, value)
    }

    fn validate(self) -> Result<ChargeParams, ApiError> {
        let amount = self
            .amount
            .ok_or_else(|| ApiError::missing_param("amount"))?;
        let amount = parse_amount(&amount)?;

        let currency = self
            .currency
            .ok_or_else(|| ApiError::missing_param("currency"))?;
        if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(ApiError::invalid_param(
                "currency",
                "parameter_invalid_string",
                format!(
                    "Invalid currency: {currency}. Use a three-letter ISO currency code, such as \
                     usd or eur."
                ),
            ));
        }

        let source = self.source.unwrap_or_else(|| DEFAULT_SOURCE.to_owned());
        if !source.starts_with("tok_")
            || source.len() > MAX_ID_LEN
            || !source
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(ApiError::invalid_param(
                "source",
                "resource_missing",
                format!(
                    "No such token: '{source}'. Use a test token such as tok_visa or \
                     tok_chargeDeclined."
                ),
            ));
        }

        if let Some(customer) = &self.customer
            && (customer.chars().count() > MAX_ID_LEN || customer.chars().any(char::is_control))
        {
            return Err(ApiError::invalid_param(
                "customer",
                "parameter_invalid_string",
                format!(
                    "Invalid customer: at most {MAX_ID_LEN} characters, without control \
                     characters."
                ),
            ));
        }
        if let Some(description) = &self.description
            && description.chars().count() > MAX_DESCRIPTION_LEN
        {
            return Err(ApiError::invalid_param(
                "description",
                "parameter_invalid_string_too_long",
                format!(
                    "Descriptions can have a maximum length of {MAX_DESCRIPTION_LEN} characters."
                ),
            ));
        }

        Ok(ChargeParams {
            amount,
            currency: currency.to_ascii_lowercase(),
            source,
            customer: self.customer,
            description: self.description,
            metadata: self.metadata.0,
        })
    }
}

/// `metadata[key]` fields, checked against Stripe's limits.
#[derive(Default)]
struct Metadata(BTreeMap<String, String>);

impl Metadata {
    /// Takes the field `name`, which must be `metadata[key]`: any other is unknown.
    fn set(&mut self, name: &str, value: String) -> Result<(), ApiError> {
        let Some(key) = name
            .strip_prefix("metadata[")
            .and_then(|rest| rest.strip_suffix(']'))
        else {
            return Err(ApiError::unknown_param(name));
        };
        if key.is_empty() || key.contains(['[', ']']) {
            return Err(ApiError::invalid_param(
                name,
                "parameter_invalid_string",
                "Metadata keys must be non-empty strings without brackets, as in \
                 metadata[order_id]=6735.",
            ));
        }
        if key.chars().count() > MAX_METADATA_KEY_LEN {
            return Err(ApiError::invalid_param(
                name,
                "parameter_invalid_string",
                format!(
                    "Metadata keys can have a maximum length of {MAX_METADATA_KEY_LEN} characters."
                ),
            ));
        }
        if value.chars().count() > MAX_METADATA_VALUE_LEN {
            return Err(ApiError::invalid_param(
                name,
                "parameter_invalid_string",
                format!(
                    "Metadata values can have a maximum length of {MAX_METADATA_VALUE_LEN} \
                     characters."
                ),
            ));
        }
        if self.0.contains_key(key) {
            return Err(duplicate(name));
        }
        // An empty value unsets a key in Stripe; on a new object there is nothing to unset.
        if !value.is_empty() {
            if self.0.len() == MAX_METADATA_KEYS {
                return Err(ApiError::invalid_param(
                    "metadata",
                    "parameter_invalid_string",
                    format!("Metadata can have at most {MAX_METADATA_KEYS} keys."),
                ));
            }
            self.0.insert(key.to_owned(), value);
        }
        Ok(())
    }
}

fn parse_amount(text: &str) -> Result<i64, ApiError> {
    if text.is_empty() || text.len() > 18 || !text.bytes().all(|b| b.is_ascii_digit()) {
        // A sign, a decimal point or an exponent: Stripe wants whole smallest units.
        let message = if text.starts_with('-') {
            "This value must be greater than or equal to 1.".to_owned()
        } else {
            format!("Invalid integer: {text}")
        };
        return Err(ApiError::invalid_param(
            "amount",
            "parameter_invalid_integer",
            message,
        ));
    }
    let amount: i64 = text.parse().map_err(|_| {
        ApiError::invalid_param(
            "amount",
            "parameter_invalid_integer",
            format!("Invalid integer: {text}"),
        )
    })?;
    if amount < 1 {
        return Err(ApiError::invalid_param(
            "amount",
            "parameter_invalid_integer",
            "This value must be greater than or equal to 1.",
        ));
    }
    if amount > MAX_AMOUNT {
        return Err(ApiError::invalid_param(
            "amount",
            "amount_too_large",
            format!("Amount must be no more than {MAX_AMOUNT}."),
        ));
    }
    Ok(amount)
}

fn duplicate(name: &str) -> ApiError {
    ApiError::invalid_param(
        name,
        "parameter_invalid_string",
        format!("Received parameter {name} more than once."),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORM: Option<&str> = Some("application/x-www-form-urlencoded");
    const JSON: Option<&str> = Some("application/json; charset=utf-8");

    fn param_of(content_type: Option<&str>, body: &str) -> Option<String> {
        let error = ChargeParams::parse(content_type, body.as_bytes()).unwrap_err();
        assert_eq!(error.status(), http::StatusCode::BAD_REQUEST, "{body}");
        error.param().map(str::to_owned)
    }

    #[test]
    fn form_and_json_read_the_same() {
        let form = ChargeParams::parse(
            FORM,
            b"amount=2000&currency=EUR&source=tok_mastercard&customer=cus_1\
              &description=Order+%231&metadata[order_id]=6735&metadata[note]=a%26b",
        )
        .unwrap();
        let json = ChargeParams::parse(
            JSON,
            br##"{"amount": 2000, "currency": "EUR", "source": "tok_mastercard",
                 "customer": "cus_1", "description": "Order #1",
                 "metadata": {"order_id": 6735, "note": "a&b"}}"##,
        )
        .unwrap();
        assert_eq!(form, json);
        assert_eq!(form.currency, "eur");
        assert_eq!(form.description.as_deref(), Some("Order #1"));
        assert_eq!(form.metadata.len(), 2);
        assert_eq!(form.metadata["note"], "a&b");
    }

    #[test]
    fn defaults() {
        let params = ChargeParams::parse(None, b"amount=1&currency=usd").unwrap();
        assert_eq!(params.source, DEFAULT_SOURCE);
        assert_eq!(params.customer, None);
        assert_eq!(params.description, None);
        assert!(params.metadata.is_empty());
        let params = ChargeParams::parse(FORM, b"amount=1&currency=usd&metadata=").unwrap();
        assert!(params.metadata.is_empty());
    }

    #[test]
    fn invalid_parameters_are_named() {
        let cases = [
            (FORM, "currency=usd", "amount"),
            (FORM, "amount=&currency=usd", "amount"),
            (FORM, "amount=0&currency=usd", "amount"),
            (FORM, "amount=-5&currency=usd", "amount"),
            (FORM, "amount=12.5&currency=usd", "amount"),
            (FORM, "amount=abc&currency=usd", "amount"),
            (FORM, "amount=100000000&currency=usd", "amount"),
            (FORM, "amount=99999999999999999999&currency=usd", "amount"),
            (FORM, "amount=100", "currency"),
            (FORM, "amount=100&currency=us", "currency"),
            (FORM, "amount=100&currency=us1", "currency"),
            (FORM, "amount=100&currency=usd&source=card_123", "source"),
            (FORM, "amount=100&currency=usd&amount=200", "amount"),
            (FORM, "amount=100&currency=usd&capture=false", "capture"),
            (FORM, "amount=100&currency=usd&metadata[]=x", "metadata[]"),
            (
                FORM,
                "amount=100&currency=usd&metadata[a][b]=x",
                "metadata[a][b]",
            ),
            (JSON, r#"{"amount": 1.5, "currency": "usd"}"#, "amount"),
            (
                JSON,
                r#"{"amount": "100", "currency": ["usd"]}"#,
                "currency",
            ),
            (
                JSON,
                r#"{"amount": 100, "currency": "usd", "metadata": {"a": {}}}"#,
                "metadata[a]",
            ),
        ];
        for (content_type, body, param) in cases {
            assert_eq!(
                param_of(content_type, body).as_deref(),
                Some(param),
                "{body}"
            );
        }
        let long_key = format!("amount=1&currency=usd&metadata[{}]=x", "k".repeat(41));
        assert!(param_of(FORM, &long_key).is_some());
        let long_value = format!("amount=1&currency=usd&metadata[k]={}", "v".repeat(501));
        assert!(param_of(FORM, &long_value).is_some());
        let many: String = (0..=MAX_METADATA_KEYS)
            .map(|i| format!("&metadata[k{i}]=v"))
            .collect();
        assert_eq!(
            param_of(FORM, &format!("amount=1&currency=usd{many}")).as_deref(),
            Some("metadata")
        );
    }

    #[test]
    fn a_refund_names_its_charge_and_may_leave_the_amount_out() {
        let full = RefundParams::parse(FORM, b"charge=ch_1").unwrap();
        assert_eq!((full.charge.as_str(), full.amount), ("ch_1", None));
        let empty_amount = RefundParams::parse(FORM, b"charge=ch_1&amount=").unwrap();
        assert_eq!(empty_amount.amount, None, "an empty value is an absent one");
        let form = RefundParams::parse(FORM, b"charge=ch_1&amount=500&metadata[k]=v").unwrap();
        let json = RefundParams::parse(
            JSON,
            br#"{"charge": "ch_1", "amount": 500, "metadata": {"k": "v"}}"#,
        )
        .unwrap();
        assert_eq!(form, json);
        assert_eq!(form.amount, Some(500));
        assert_eq!(form.metadata["k"], "v");
    }

    #[test]
    fn invalid_refund_parameters_are_named() {
        let cases = [
            ("amount=100", "charge", "parameter_missing"),
            ("charge=", "charge", "parameter_missing"),
            (
                "charge=ch_1&amount=0",
                "amount",
                "parameter_invalid_integer",
            ),
            (
                "charge=ch_1&amount=-5",
                "amount",
                "parameter_invalid_integer",
            ),
            (
                "charge=ch_1&amount=1.5",
                "amount",
                "parameter_invalid_integer",
            ),
            ("charge=ch_1&amount=100000000", "amount", "amount_too_large"),
            (
                "charge=ch_1&charge=ch_2",
                "charge",
                "parameter_invalid_string",
            ),
            (
                "charge=ch_1&amount=1&amount=2",
                "amount",
                "parameter_invalid_string",
            ),
            (
                "charge=ch_1&reason=duplicate",
                "reason",
                "parameter_unknown",
            ),
            (
                "charge=ch_1&metadata[]=x",
                "metadata[]",
                "parameter_invalid_string",
            ),
            ("charge=ch_%0A1", "charge", "parameter_invalid_string"),
        ];
        for (body, param, code) in cases {
            let error = RefundParams::parse(FORM, body.as_bytes()).unwrap_err();
            assert_eq!(error.status(), http::StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(
                (error.param(), error.code()),
                (Some(param), Some(code)),
                "{body}"
            );
        }
        let long = format!("charge=ch_{}", "1".repeat(MAX_ID_LEN));
        let error = RefundParams::parse(FORM, long.as_bytes()).unwrap_err();
        assert_eq!(error.param(), Some("charge"));
        let error = RefundParams::parse(Some("text/plain"), b"charge=ch_1").unwrap_err();
        assert_eq!(error.param(), None, "an unsupported body, as for a charge");
    }

    #[test]
    fn malformed_bodies_are_request_errors() {
        assert_eq!(param_of(JSON, "{not json"), None);
        assert_eq!(param_of(JSON, "[1, 2]"), None);
        assert_eq!(param_of(Some("text/plain"), "amount=1&currency=usd"), None);
    }
}
