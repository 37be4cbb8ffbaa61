//! Checking a delivery before anything is claimed: [`WebhookVerifier`], the
//! [`VerifiedWebhook`] it hands back, and why it refuses ([`VerifyError`], [`SecretError`]).

use std::{
    error::Error as StdError,
    fmt,
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use base64::{Engine, engine::general_purpose::STANDARD};
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use standardwebhooks::{HEADER_WEBHOOK_ID, HEADER_WEBHOOK_TIMESTAMP, Webhook, WebhookError};

use crate::key::{IdempotencyKey, KeyError};

/// The prefix of a Standard Webhooks secret: `whsec_` and the key in base64.
pub const SECRET_PREFIX: &str = "whsec_";

/// How far `webhook-timestamp` may be from this host's clock, either way: the
/// `standardwebhooks` crate's own tolerance, checked here first.
const TOLERANCE_SECS: u64 = 5 * 60;

/// The shortest signing key accepted, in bytes (Standard Webhooks asks for 24 to 64).
pub const MIN_SECRET_BYTES: usize = 24;

/// Checks Standard Webhooks deliveries (`webhook-id`, `webhook-timestamp`,
/// `webhook-signature`) signed with one secret; cheap to clone. See the [module
/// documentation](super).
///
/// The timestamp must be within five minutes either side of this host's clock, checked here
/// before the `standardwebhooks` crate checks the signature.
#[derive(Clone)]
pub struct WebhookVerifier {
    webhook: Arc<Webhook>,
}

impl fmt::Debug for WebhookVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WebhookVerifier(..)")
    }
}

impl WebhookVerifier {
    /// A verifier for the secret `whsec_<base64>`, as Standard Webhooks writes it.
    ///
    /// # Errors
    ///
    /// [`SecretError`] when the prefix is missing, the rest is not base64, or the key is shorter
    /// than [`MIN_SECRET_BYTES`].
    pub fn new(secret: &str) -> Result<Self, SecretError> {
        let encoded = secret
            .strip_prefix(SECRET_PREFIX)
            .ok_or(SecretError::MissingPrefix)?;
        let key = STANDARD
            .decode(encoded)
            .map_err(|error| SecretError::NotBase64(Box::new(error)))?;
        if key.len() < MIN_SECRET_BYTES {
            return Err(SecretError::TooShort(key.len()));
        }
        let webhook = Webhook::new(secret).map_err(|error| match error {
            WebhookError::InvalidSecret(error) => SecretError::NotBase64(Box::new(error)),
            _ => SecretError::MissingPrefix,
        })?;
        Ok(Self {
            webhook: Arc::new(webhook),
        })
    }

    /// Checks `body` as received, byte for byte, against `headers`: all three headers present,
    /// the timestamp within tolerance, a `v1` signature of this secret among those sent, and a
    /// `webhook-id` usable as an idempotency key.
    ///
    /// # Errors
    ///
    /// [`VerifyError`]: nothing may be done with such a delivery but answer `400`.
    pub fn verify(&self, headers: &HeaderMap, body: Bytes) -> Result<VerifiedWebhook, VerifyError> {
        check_timestamp(headers)?;
        self.webhook
            .verify(&body, headers)
            .map_err(VerifyError::from_crate)?;
        // Present and text: the crate checked it before the signature.
        let id = headers
            .get(HEADER_WEBHOOK_ID)
            .and_then(|value| value.to_str().ok())
            .ok_or(VerifyError::InvalidHeader(HEADER_WEBHOOK_ID))?;
        let id = IdempotencyKey::new(id).map_err(VerifyError::InvalidId)?;
        // Signed text: the crate refuses a body that is not UTF-8 before it signs.
        let text = std::str::from_utf8(&body).map_err(|_| VerifyError::NotUtf8)?;
        let text = text.to_owned();
        Ok(VerifiedWebhook { id, body, text })
    }
}

/// Refuses a `webhook-timestamp` out of tolerance before the crate sees it: the crate
/// subtracts it from the clock unchecked, which panics (or wraps, in release builds, and
/// passes) near `i64::MIN`. A missing or unparsable header is left to the crate to name.
fn check_timestamp(headers: &HeaderMap) -> Result<(), VerifyError> {
    let sent = headers
        .get(HEADER_WEBHOOK_TIMESTAMP)
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.parse::<i64>().ok());
    match sent {
        Some(sent) => within_tolerance(sent, unix_now()),
        None => Ok(()),
    }
}

/// `sent` against `now`, both Unix seconds, with no arithmetic that can overflow.
fn within_tolerance(sent: i64, now: i64) -> Result<(), VerifyError> {
    if sent.abs_diff(now) <= TOLERANCE_SECS {
        Ok(())
    } else if sent < now {
        Err(VerifyError::Stale)
    } else {
        Err(VerifyError::FromTheFuture)
    }
}

/// This host's clock in Unix seconds (negative before 1970), saturated at the ends of `i64`.
fn unix_now() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(since) => i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
        Err(before) => i64::try_from(before.duration().as_secs()).map_or(i64::MIN, |secs| -secs),
    }
}

/// A delivery whose signature and timestamp were checked: the only thing
/// [`WebhookReceiver`](super::WebhookReceiver) will claim a key for.
#[derive(Debug, Clone)]
pub struct VerifiedWebhook {
    id: IdempotencyKey,
    body: Bytes,
    text: String,
}

impl VerifiedWebhook {
    /// The `webhook-id`: the same for every delivery of one event.
    pub fn id(&self) -> &str {
        self.id.as_str()
    }

    /// The body as received, the bytes that were signed.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The body as text (a signed body is UTF-8).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The body parsed as JSON into `T`.
    ///
    /// # Errors
    ///
    /// When the body is not JSON of that shape.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }
}

/// Why a delivery was refused before anything was claimed: answer `400`
/// ([`status`](Self::status)), and change nothing.
#[derive(Debug)]
#[non_exhaustive]
pub enum VerifyError {
    /// A header (`webhook-id`, `webhook-timestamp` or `webhook-signature`) is missing.
    MissingHeader(&'static str),
    /// A header is not visible ASCII text.
    InvalidHeader(&'static str),
    /// `webhook-timestamp` is not whole Unix seconds.
    InvalidTimestamp,
    /// `webhook-timestamp` is more than five minutes old: a replay, or a clock far behind.
    Stale,
    /// `webhook-timestamp` is more than five minutes ahead of this host's clock.
    FromTheFuture,
    /// No `v1` signature of this secret matches the id, timestamp and body.
    BadSignature,
    /// The body is not UTF-8, so it cannot have been signed.
    NotUtf8,
    /// The `webhook-id` cannot be an idempotency key (too long, or a character a key may not
    /// hold).
    InvalidId(KeyError),
}

impl VerifyError {
    /// `400 Bad Request`, for every refusal: the sender must fix the delivery, not repeat it.
    pub fn status(&self) -> StatusCode {
        StatusCode::BAD_REQUEST
    }

    fn from_crate(error: WebhookError) -> Self {
        match error {
            WebhookError::MissingHeader(name) => Self::MissingHeader(header_name(name)),
            WebhookError::InvalidHeader(name) => Self::InvalidHeader(header_name(name)),
            WebhookError::InvalidTimestamp => Self::InvalidTimestamp,
            WebhookError::TimestampTooOldError => Self::Stale,
            WebhookError::FutureTimestampError => Self::FromTheFuture,
            WebhookError::InvalidPayload => Self::NotUtf8,
            // Also `InvalidSecret`, which a built verifier cannot meet.
            _ => Self::BadSignature,
        }
    }
}

/// The crate names a header by its last word; say the header's own name.
fn header_name(short: &'static str) -> &'static str {
    match short {
        "id" => "webhook-id",
        "timestamp" => "webhook-timestamp",
        _ => "webhook-signature",
    }
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingHeader(name) => write!(f, "the {name} header is missing"),
            Self::InvalidHeader(name) => write!(f, "the {name} header is not valid text"),
            Self::InvalidTimestamp => f.write_str("webhook-timestamp is not Unix seconds"),
            Self::Stale => f.write_str("webhook-timestamp is more than five minutes old"),
            Self::FromTheFuture => {
                f.write_str("webhook-timestamp is more than five minutes in the future")
            }
            Self::BadSignature => f.write_str("no webhook-signature matches this delivery"),
            Self::NotUtf8 => f.write_str("the webhook body is not UTF-8"),
            Self::InvalidId(_) => f.write_str("webhook-id cannot be an idempotency key"),
        }
    }
}

impl StdError for VerifyError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::InvalidId(error) => Some(error),
            _ => None,
        }
    }
}

/// Why a webhook secret was refused: a configuration error, found at start-up.
#[derive(Debug)]
#[non_exhaustive]
pub enum SecretError {
    /// The secret does not start with [`SECRET_PREFIX`].
    MissingPrefix,
    /// What follows the prefix is not standard base64.
    NotBase64(Box<dyn StdError + Send + Sync + 'static>),
    /// The key is this many bytes, fewer than [`MIN_SECRET_BYTES`].
    TooShort(usize),
}

impl fmt::Display for SecretError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingPrefix => write!(f, "a webhook secret starts with {SECRET_PREFIX}"),
            Self::NotBase64(_) => write!(f, "a webhook secret is {SECRET_PREFIX} and base64"),
            Self::TooShort(len) => write!(
                f,
                "the webhook secret's key is {len} bytes; at least {MIN_SECRET_BYTES} are needed"
            ),
        }
    }
}

impl StdError for SecretError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::NotBase64(error) => Some(&**error),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

    fn now() -> i64 {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970");
        i64::try_from(since.as_secs()).expect("in range")
    }

    /// A delivery validly signed at `timestamp` (any text), so only the timestamp is at fault.
    fn delivery(timestamp: &str) -> (HeaderMap, Bytes) {
        let body = Bytes::from_static(br#"{"id":"evt_1"}"#);
        let signed_at = timestamp.parse().unwrap_or(0);
        let signer = Webhook::new(SECRET).expect("a valid secret");
        let signature = signer.sign("evt_1", signed_at, &body).expect("signed");
        let mut headers = HeaderMap::new();
        headers.insert("webhook-id", "evt_1".parse().expect("a header"));
        headers.insert("webhook-timestamp", timestamp.parse().expect("a header"));
        headers.insert("webhook-signature", signature.parse().expect("a header"));
        (headers, body)
    }

    /// Timestamps at the ends of `i64` are refused as out of tolerance (400), not a panic in
    /// the crate's subtraction (issue 44).
    #[test]
    fn extreme_timestamps_are_refused_not_a_panic() {
        let verifier = WebhookVerifier::new(SECRET).expect("a valid secret");
        let day = 86_400;
        let cases = [
            (i64::MIN.to_string(), "stale"),
            ((i64::MIN + 1).to_string(), "stale"),
            ((now() - 1_000 * day).to_string(), "stale"),
            (i64::MAX.to_string(), "future"),
            ((i64::MAX - 1).to_string(), "future"),
            ((now() + 1_000 * day).to_string(), "future"),
            ("12e9".to_owned(), "invalid"),
            ("99999999999999999999".to_owned(), "invalid"),
        ];
        for (timestamp, expected) in cases {
            let (headers, body) = delivery(&timestamp);
            let refused = verifier.verify(&headers, body).expect_err(&timestamp);
            let kind = match refused {
                VerifyError::Stale => "stale",
                VerifyError::FromTheFuture => "future",
                VerifyError::InvalidTimestamp => "invalid",
                _ => "other",
            };
            assert_eq!((timestamp.as_str(), kind), (timestamp.as_str(), expected));
            assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        }
        let (headers, body) = delivery(&now().to_string());
        assert!(
            verifier.verify(&headers, body).is_ok(),
            "a current delivery"
        );
    }

    #[test]
    fn the_tolerance_is_five_minutes_either_way() {
        let now = 1_700_000_000;
        assert!(within_tolerance(now - 300, now).is_ok());
        assert!(within_tolerance(now + 300, now).is_ok());
        assert!(matches!(
            within_tolerance(now - 301, now),
            Err(VerifyError::Stale)
        ));
        assert!(matches!(
            within_tolerance(now + 301, now),
            Err(VerifyError::FromTheFuture)
        ));
        assert!(matches!(
            within_tolerance(i64::MIN, i64::MAX),
            Err(VerifyError::Stale)
        ));
        assert!(matches!(
            within_tolerance(i64::MAX, i64::MIN),
            Err(VerifyError::FromTheFuture)
        ));
    }
}
