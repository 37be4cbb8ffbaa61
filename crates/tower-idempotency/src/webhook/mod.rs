//! Webhooks received exactly once: [`WebhookReceiver`] checks a Standard Webhooks delivery
//! (`webhook-id`, `webhook-timestamp`, `webhook-signature`) before anything is claimed, then
//! runs its effect once per `webhook-id`, scoped to the sender, with [`Once`].
//!
//! ```
//! use bytes::Bytes;
//! use http::HeaderMap;
//! use tower_idempotency::{
//!     Once,
//!     store::MemoryStore,
//!     webhook::{ReceiveError, WebhookReceiver, WebhookVerifier},
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
//! let verifier = WebhookVerifier::new(SECRET)?;
//! let receiver = WebhookReceiver::new(Once::new(MemoryStore::new()), "acquirer", verifier)?;
//!
//! // What the sender does, with the `standardwebhooks` crate.
//! let body = Bytes::from_static(br#"{"id":"evt_1","type":"charge.settled"}"#);
//! let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
//! let signature = standardwebhooks::Webhook::new(SECRET)?.sign("evt_1", now as i64, &body)?;
//! let mut headers = HeaderMap::new();
//! headers.insert("webhook-id", "evt_1".parse()?);
//! headers.insert("webhook-timestamp", now.to_string().parse()?);
//! headers.insert("webhook-signature", signature.parse()?);
//!
//! // The receiver: verify, then the effect once per webhook-id.
//! let delivery = receiver.verify(&headers, body.clone())?;
//! let settled: u64 = receiver.run(&delivery, || async { Ok::<_, std::io::Error>(2000) }).await?;
//! // A redelivery gets the stored result; its closure does not run.
//! let again = receiver.verify(&headers, body)?;
//! let ran_again = || async { Err(std::io::Error::other("settled twice")) };
//! let replayed: u64 = receiver.run(&again, ran_again).await?;
//! assert_eq!((settled, replayed), (2000, 2000));
//!
//! // A forged delivery is refused before anything is claimed: 400.
//! let forged = receiver.verify(&headers, Bytes::from_static(b"{}"));
//! let refused = ReceiveError::<std::io::Error>::from(forged.unwrap_err());
//! assert_eq!(refused.status(), Some(http::StatusCode::BAD_REQUEST));
//! # Ok(()) }
//! ```
//!
//! | outcome | [`ReceiveError`] | [`status`](ReceiveError::status) |
//! |---|---|---|
//! | signature, timestamp (five minutes either way) or headers wrong | [`Refused`](ReceiveError::Refused) | `400` |
//! | another delivery of the id is being handled | [`OnceError::InFlight`] | `409`: the sender retries |
//! | the id came again with another body | [`OnceError::Mismatch`] | `422` |
//! | the handler's own error: the key is released, a later delivery runs it | [`OnceError::Failed`] | the handler's |
//! | the store failed | [`OnceError::Store`] and the rest | `500` |
//!
//! The fingerprint of a delivery is its raw body, so a redelivery must carry the same bytes,
//! as Standard Webhooks senders do; only the timestamp and the signature change.

use std::{fmt, future::Future};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde::{Serialize, de::DeserializeOwned};

use crate::{
    once::{Once, OnceError, ScopeError},
    store::Store,
};

#[cfg(feature = "postgres")]
mod transaction;
mod verify;

pub use verify::{
    MIN_SECRET_BYTES, SECRET_PREFIX, SecretError, VerifiedWebhook, VerifyError, WebhookVerifier,
};

/// Receives one sender's webhooks: verifies each delivery, then runs its effect once per
/// `webhook-id`; cheap to clone. See the [module documentation](self).
#[derive(Debug, Clone)]
pub struct WebhookReceiver<St> {
    scope: String,
    verifier: WebhookVerifier,
    once: Once<St>,
}

impl<St: Store> WebhookReceiver<St> {
    /// A receiver of `sender`'s deliveries, checked by `verifier`, their effects run by `once`
    /// (its settings: lease, TTL, in-flight wait) under a scope of their own.
    ///
    /// # Errors
    ///
    /// [`ScopeError`] when `sender` is empty or too long.
    pub fn new(
        once: Once<St>,
        sender: &str,
        verifier: WebhookVerifier,
    ) -> Result<Self, ScopeError> {
        if sender.is_empty() {
            return Err(ScopeError::Empty);
        }
        let scope = format!("webhook/{sender}");
        ScopeError::check(&scope)?;
        Ok(Self {
            scope,
            verifier,
            once,
        })
    }

    /// Checks a delivery, as [`WebhookVerifier::verify`].
    ///
    /// # Errors
    ///
    /// [`VerifyError`]: answer `400` and do nothing.
    pub fn verify(&self, headers: &HeaderMap, body: Bytes) -> Result<VerifiedWebhook, VerifyError> {
        self.verifier.verify(headers, body)
    }

    /// Runs `f` once for the delivery's `webhook-id`, as [`Once::run`] with the raw body as
    /// the payload: a redelivery gets the stored result.
    ///
    /// # Errors
    ///
    /// As [`Once::run`]; [`OnceError::Mismatch`] for the id with another body.
    pub async fn run<T, E, F, Fut>(
        &self,
        webhook: &VerifiedWebhook,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.once
            .run(&self.scope, webhook.id(), webhook.text(), f)
            .await
    }

    /// The [`Once`] that runs the effects.
    pub fn once(&self) -> &Once<St> {
        &self.once
    }
}

/// Why a delivery got no result: refused unverified, or what [`Once`] said.
#[derive(Debug)]
#[non_exhaustive]
pub enum ReceiveError<E> {
    /// The delivery failed verification: nothing was claimed.
    Refused(VerifyError),
    /// The verified delivery's effect did not complete (or its key was busy or reused).
    Once(OnceError<E>),
}

impl<E> ReceiveError<E> {
    /// The HTTP status to answer, or `None` for the handler's own error
    /// ([`OnceError::Failed`]), which the application maps.
    pub fn status(&self) -> Option<StatusCode> {
        Some(match self {
            Self::Refused(error) => error.status(),
            Self::Once(OnceError::Failed(_)) => return None,
            Self::Once(OnceError::InFlight) => StatusCode::CONFLICT,
            Self::Once(OnceError::Mismatch) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Once(OnceError::InvalidKey(_)) => StatusCode::BAD_REQUEST,
            Self::Once(_) => StatusCode::INTERNAL_SERVER_ERROR,
        })
    }
}

impl<E> From<VerifyError> for ReceiveError<E> {
    fn from(error: VerifyError) -> Self {
        Self::Refused(error)
    }
}

impl<E> From<OnceError<E>> for ReceiveError<E> {
    fn from(error: OnceError<E>) -> Self {
        Self::Once(error)
    }
}

impl<E: fmt::Display> fmt::Display for ReceiveError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused(_) => f.write_str("the webhook delivery was refused"),
            Self::Once(error) => error.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for ReceiveError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Refused(error) => Some(error),
            Self::Once(error) => error.source(),
        }
    }
}
