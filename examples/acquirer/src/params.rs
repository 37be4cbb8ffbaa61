//! The body of `POST /v1/authorizations`: `amount`, `currency` and `source`, as a form or JSON.

use std::collections::HashMap;

/// A valid authorization request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthorizeParams {
    /// A positive amount in the currency's smallest unit.
    pub amount: i64,
    /// Three lowercase letters.
    pub currency: String,
    /// A card token, `tok_...`.
    pub source: String,
    /// The merchant's own id for the payment (optional), at most 255 bytes.
    pub reference: Option<String>,
}

/// Why a request body was refused: the parameter and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamError {
    /// The parameter, or `body`.
    pub param: &'static str,
    /// What is wrong.
    pub message: String,
}

impl AuthorizeParams {
    /// Reads a body of `content_type` (a form unless it says JSON).
    ///
    /// # Errors
    ///
    /// A [`ParamError`] naming the missing or invalid parameter.
    pub fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, ParamError> {
        let json = content_type.is_some_and(|value| value.starts_with("application/json"));
        let fields = if json {
            json_fields(body)?
        } else {
            form_fields(body)
        };
        let field = |param: &'static str| {
            fields.get(param).ok_or_else(|| ParamError {
                param,
                message: format!("Missing required param: {param}."),
            })
        };
        let amount = field("amount")?
            .parse::<i64>()
            .ok()
            .filter(|amount| *amount > 0)
            .ok_or_else(|| invalid("amount", "a positive integer"))?;
        let currency = field("currency")?.to_ascii_lowercase();
        if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_lowercase()) {
            return Err(invalid("currency", "three letters"));
        }
        let source = field("source")?.clone();
        if !source.starts_with("tok_") || source.len() > 255 {
            return Err(invalid("source", "a card token, tok_..."));
        }
        let reference = fields.get("reference").cloned();
        if reference
            .as_ref()
            .is_some_and(|r| r.is_empty() || r.len() > 255)
        {
            return Err(invalid("reference", "1 to 255 bytes"));
        }
        Ok(Self {
            amount,
            currency,
            source,
            reference,
        })
    }
}

fn invalid(param: &'static str, expected: &str) -> ParamError {
    ParamError {
        param,
        message: format!("Invalid {param}: it must be {expected}."),
    }
}

fn form_fields(body: &[u8]) -> HashMap<String, String> {
    form_urlencoded::parse(body).into_owned().collect()
}

fn json_fields(body: &[u8]) -> Result<HashMap<String, String>, ParamError> {
    let object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).map_err(|error| ParamError {
            param: "body",
            message: format!("The body is not a JSON object: {error}."),
        })?;
    Ok(object
        .into_iter()
        .filter_map(|(name, value)| match value {
            serde_json::Value::String(text) => Some((name, text)),
            serde_json::Value::Number(number) => Some((name, number.to_string())),
            _ => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_and_json_read_the_same() {
        let form = AuthorizeParams::parse(None, b"amount=500&currency=USD&source=tok_visa");
        let json = AuthorizeParams::parse(
            Some("application/json"),
            br#"{"amount": 500, "currency": "usd", "source": "tok_visa"}"#,
        );
        assert_eq!(form, json);
        assert_eq!(form.unwrap().currency, "usd");
    }

    #[test]
    fn bad_input_names_its_parameter() {
        let param = |body: &[u8]| AuthorizeParams::parse(None, body).unwrap_err().param;
        assert_eq!(param(b"currency=usd&source=tok_visa"), "amount");
        assert_eq!(param(b"amount=-1&currency=usd&source=tok_visa"), "amount");
        assert_eq!(
            param(b"amount=1&currency=dollars&source=tok_visa"),
            "currency"
        );
        assert_eq!(param(b"amount=1&currency=usd&source=card"), "source");
        let base = "amount=1&currency=usd&source=tok_visa&reference=";
        assert_eq!(param(base.as_bytes()), "reference");
        let long = format!("{base}{}", "c".repeat(256));
        assert_eq!(param(long.as_bytes()), "reference");
        let told = AuthorizeParams::parse(None, format!("{base}ch_1").as_bytes()).unwrap();
        assert_eq!(told.reference.as_deref(), Some("ch_1"));
        let error = AuthorizeParams::parse(Some("application/json"), b"[1]").unwrap_err();
        assert_eq!(error.param, "body");
    }
}
