//! API keys, as Stripe takes them, and the account each one acts for.
//!
//! A request authenticates with `Authorization: Bearer sk_test_...` (what Stripe's client libraries
//! send) or HTTP Basic with the key as the user name and any password (`curl -u sk_test_123:`).
//! The demo has no account database: any well-formed test key is accepted, and the key itself
//! names an account ([`Account::from_api_key`]), so two people using different keys never see each
//! other's charges.
//!
//! [`authenticate`] runs *outside* the idempotency layer: it inserts the account both as an
//! [`Account`] for the handlers and as the [`Principal`] the layer scopes keys to.

use std::sync::Arc;

use axum::{
    extract::Request,
    middleware::Next,
    response::{IntoResponse, Response},
};
use base64::{Engine, engine::general_purpose::STANDARD};
use http::{HeaderMap, header};
use sha2::{Digest, Sha256};
use tower_idempotency::Principal;

use crate::error::ApiError;

/// The prefix of the secret keys the demo accepts.
pub const TEST_KEY_PREFIX: &str = "sk_test_";

/// The longest API key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// The account an API key acts for: the owner of its charges and of its idempotency keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Account(Arc<str>);

impl Account {
    /// The account of `api_key`: `acct_` and 16 hex digits of a hash of the key. Stable (the same
    /// key always names the same account) and not reversible (logs and the ledger never hold the
    /// key).
    pub fn from_api_key(api_key: &str) -> Self {
        let digest = Sha256::new()
            .chain_update(b"charges-demo/account/v1\0")
            .chain_update(api_key.as_bytes())
            .finalize();
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        Self(format!("acct_{hex}").into())
    }

    /// An account by its identifier, as the ledger stores it.
    pub fn from_id(id: impl Into<Arc<str>>) -> Self {
        Self(id.into())
    }

    /// The identifier, `acct_...`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Middleware: finds the API key, refuses the request with `401` without a valid one, and
/// otherwise inserts the [`Account`] and its [`Principal`] into the request extensions.
pub async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = match api_key(request.headers()) {
        Ok(key) => Account::from_api_key(&key),
        Err(error) => return error.into_response(),
    };
    // `acct_` and a hash: never empty.
    let Ok(principal) = Principal::new(account.as_str()) else {
        return ApiError::unauthorized("the API key names no account").into_response();
    };
    let extensions = request.extensions_mut();
    extensions.insert(principal);
    extensions.insert(account);
    next.run(request).await
}

/// The API key of a request, checked for form.
///
/// # Errors
///
/// A `401` [`ApiError`] saying what is wrong: no `Authorization` header, an unknown scheme, a
/// Basic credential that does not decode, or a key that is not a test secret key.
pub fn api_key(headers: &HeaderMap) -> Result<String, ApiError> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Err(ApiError::unauthorized(
            "You did not provide an API key. Provide it in the Authorization header, using Bearer \
             auth (`Authorization: Bearer sk_test_...`) or HTTP Basic auth with the key as the \
             user name (`curl -u sk_test_...:`).",
        ));
    };
    if values.next().is_some() {
        return Err(ApiError::unauthorized(
            "The request has more than one Authorization header; send exactly one.",
        ));
    }
    let value = value.to_str().map_err(|_| malformed_header())?;
    let (scheme, credentials) = value.trim().split_once(' ').ok_or_else(malformed_header)?;
    let credentials = credentials.trim();
    let key = if scheme.eq_ignore_ascii_case("bearer") {
        credentials.to_owned()
    } else if scheme.eq_ignore_ascii_case("basic") {
        let decoded = STANDARD
            .decode(credentials)
            .ok()
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .ok_or_else(|| {
                ApiError::unauthorized(
                    "The Basic credentials are not valid base64 of `user:password`.",
                )
            })?;
        // The key is the user name; Stripe ignores the password, and so does the demo.
        match decoded.split_once(':') {
            Some((user, _password)) => user.to_owned(),
            None => decoded,
        }
    } else {
        return Err(malformed_header());
    };
    check_key(&key)?;
    Ok(key)
}

fn malformed_header() -> ApiError {
    ApiError::unauthorized(
        "Invalid Authorization header. Use `Authorization: Bearer sk_test_...`, or HTTP Basic \
         auth with the API key as the user name.",
    )
}

fn check_key(key: &str) -> Result<(), ApiError> {
    if key.starts_with("sk_live_") {
        return Err(ApiError::unauthorized(format!(
            "This demo runs in test mode only and refuses live keys ({}). Use any test key, such \
             as sk_test_123.",
            redact(key)
        )));
    }
    let well_formed = key
        .strip_prefix(TEST_KEY_PREFIX)
        .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(is_key_byte))
        && key.len() <= MAX_KEY_LEN;
    if !well_formed {
        return Err(ApiError::unauthorized(format!(
            "Invalid API Key provided: {}. Keys look like sk_test_ followed by letters, digits \
             and underscores; any such key works and names an account of its own.",
            redact(key)
        )));
    }
    Ok(())
}

fn is_key_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Shows a key the way Stripe does in errors: its start and its last four characters.
fn redact(key: &str) -> String {
    let chars: Vec<char> = key.chars().collect();
    if chars.len() <= 12 {
        return "*".repeat(chars.len().min(12));
    }
    let head: String = chars[..8].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}{}{tail}", "*".repeat(chars.len() - 12))
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(authorization: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(authorization).unwrap(),
        );
        headers
    }

    #[test]
    fn bearer_and_basic_name_the_same_key() {
        let bearer = api_key(&headers("Bearer sk_test_123")).unwrap();
        // `curl -u sk_test_123:`
        let basic = api_key(&headers(&format!(
            "Basic {}",
            STANDARD.encode("sk_test_123:")
        )))
        .unwrap();
        let basic_with_password = api_key(&headers(&format!(
            "basic {}",
            STANDARD.encode("sk_test_123:ignored")
        )))
        .unwrap();
        assert_eq!(bearer, "sk_test_123");
        assert_eq!(basic, bearer);
        assert_eq!(basic_with_password, bearer);
    }

    #[test]
    fn refuses_what_is_not_a_test_key() {
        for authorization in [
            "Bearer",
            "Bearer ",
            "Bearer sk_test_",
            "Bearer pk_test_123",
            "Bearer sk_test_12 3",
            "Bearer sk_test_1-2",
            "Bearer sk_live_123456789012",
            "Token sk_test_123",
            "sk_test_123",
            "Basic !!!",
        ] {
            let error = api_key(&headers(authorization)).unwrap_err();
            assert_eq!(
                error.status(),
                http::StatusCode::UNAUTHORIZED,
                "{authorization}"
            );
        }
        let too_long = format!("Bearer sk_test_{}", "a".repeat(MAX_KEY_LEN));
        assert!(api_key(&headers(&too_long)).is_err());
        assert!(api_key(&HeaderMap::new()).is_err());
    }

    #[test]
    fn errors_never_echo_a_whole_key() {
        let error = api_key(&headers("Bearer sk_live_abcdefghijklmnop")).unwrap_err();
        assert!(!error.message().contains("abcdefghijklmnop"));
        assert!(
            error
                .message()
                .contains(&format!("sk_live_{}mnop", "*".repeat(12)))
        );
    }

    #[test]
    fn accounts_are_stable_and_distinct() {
        let a = Account::from_api_key("sk_test_a");
        assert_eq!(a, Account::from_api_key("sk_test_a"));
        assert_ne!(a, Account::from_api_key("sk_test_b"));
        assert!(a.as_str().starts_with("acct_"));
        assert_eq!(a.as_str().len(), "acct_".len() + 16);
    }
}
