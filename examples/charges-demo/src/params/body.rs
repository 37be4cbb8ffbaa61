//! From a body to named values: a form as it is, JSON flattened to the same fields.

use serde_json::Value;

use crate::error::ApiError;

/// The named values of a body of the given `Content-Type` (a missing one is read as a form, as
/// Stripe does).
pub(super) fn fields(
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Vec<(String, String)>, ApiError> {
    match media_type(content_type) {
        Media::Form => Ok(form_fields(body)),
        Media::Json => json_fields(body),
        Media::Other(other) => Err(ApiError::invalid_request(format!(
            "Unsupported Content-Type `{other}`: send application/x-www-form-urlencoded (as \
             Stripe's libraries do) or application/json."
        ))),
    }
}

enum Media {
    Form,
    Json,
    Other(String),
}

fn media_type(content_type: Option<&str>) -> Media {
    let Some(content_type) = content_type else {
        return Media::Form;
    };
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match essence.as_str() {
        "" | "application/x-www-form-urlencoded" => Media::Form,
        "application/json" => Media::Json,
        other if other.starts_with("application/") && other.ends_with("+json") => Media::Json,
        _ => Media::Other(essence),
    }
}

fn form_fields(body: &[u8]) -> Vec<(String, String)> {
    form_urlencoded::parse(body)
        .map(|(name, value)| (name.into_owned(), value.into_owned()))
        .collect()
}

/// Flattens a JSON object into form-style fields: scalars as their text, `metadata` members as
/// `metadata[key]`. `null` leaves a field out.
fn json_fields(body: &[u8]) -> Result<Vec<(String, String)>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|error| ApiError::invalid_request(format!("Invalid JSON body: {error}.")))?;
    let Value::Object(object) = value else {
        return Err(ApiError::invalid_request(
            "The JSON body must be an object of parameters.",
        ));
    };
    let mut fields = Vec::with_capacity(object.len());
    for (name, value) in object {
        match value {
            Value::Null => {}
            Value::Object(members) if name == "metadata" => {
                for (key, value) in members {
                    let param = format!("metadata[{key}]");
                    match value {
                        Value::Null => {}
                        Value::String(text) => fields.push((param, text)),
                        Value::Number(n) => fields.push((param, n.to_string())),
                        Value::Bool(b) => fields.push((param, b.to_string())),
                        Value::Array(_) | Value::Object(_) => {
                            return Err(ApiError::invalid_param(
                                param,
                                "parameter_invalid_string",
                                "Metadata values must be strings.",
                            ));
                        }
                    }
                }
            }
            Value::String(text) => fields.push((name, text)),
            Value::Number(n) => fields.push((name, n.to_string())),
            Value::Bool(b) => fields.push((name, b.to_string())),
            Value::Array(_) | Value::Object(_) => {
                return Err(ApiError::invalid_param(
                    name.clone(),
                    "parameter_invalid_string",
                    format!("Invalid value for {name}: expected a string or a number."),
                ));
            }
        }
    }
    Ok(fields)
}
