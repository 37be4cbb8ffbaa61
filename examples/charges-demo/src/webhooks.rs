//! `POST /v1/webhooks/acquirer`: the acquirer's `charge.settled` events, received exactly once
//! ([`WebhookReceiver`]), and `GET /v1/balance`.
//!
//! The route is not behind the API key: a delivery is authenticated by its Standard Webhooks
//! signature, checked (with its timestamp, five minutes either way) before anything is claimed.
//! Each `webhook-id` is then handled once, scoped to the sender `acquirer`: with PostgreSQL the
//! charge's settlement and the inbox record commit in one transaction
//! ([`WebhookReceiver::run_in_transaction`]); in memory both live in the process. A charge is
//! settled once whatever the events ([`Ledger::settle`]), so two events for one charge add its
//! amount once.
//!
//! | delivery | answer |
//! |---|---|
//! | bad signature, stale or future timestamp, missing header, bad JSON | `400` Stripe error, nothing changed |
//! | `charge.settled` for a charge | `200` `{"received": true, "settlement": ...}`, replayed for redeliveries |
//! | `charge.settled` for an unknown charge | `404` Stripe error, not recorded: a later delivery runs |
//! | the same `webhook-id` with another body | `422` `idempotency_error` |
//! | another event type | `200` `{"received": true, "ignored": true}`, so the sender stops retrying |

use axum::{
    Extension,
    body::Bytes,
    extract::State,
    response::{IntoResponse, Response},
};
use futures_util::{FutureExt, future::BoxFuture};
use http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tower_idempotency::{
    InFlightWait, Once, OnceError,
    store::{MemoryStore, PostgresStore},
    webhook::{SecretError, VerifiedWebhook, VerifyError, WebhookReceiver, WebhookVerifier},
};

use crate::{
    auth::Account,
    error::{ApiError, ErrorType, json},
    ledger::{Ledger, Settlement},
    unavailable::{server_failure, unavailable},
};

/// The webhook secret used when none is given: for development only, printed at start-up.
pub const DEV_WEBHOOK_SECRET: &str = acquirer::DEV_WEBHOOK_SECRET;

/// The sender the acquirer's `webhook-id`s are scoped to.
pub const SENDER: &str = "acquirer";

/// How long a redelivery that meets its first delivery in flight waits for its answer.
const IN_FLIGHT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The `whsec_...` secret of `--webhook-secret`, checked when parsed; its `Debug` hides it.
#[derive(Clone)]
pub struct WebhookSecret {
    text: String,
    verifier: WebhookVerifier,
}

impl WebhookSecret {
    /// Checks `text` as a Standard Webhooks secret.
    ///
    /// # Errors
    ///
    /// [`SecretError`] when it is not `whsec_` and a base64 key of 24 bytes or more.
    pub fn parse(text: &str) -> Result<Self, SecretError> {
        Ok(Self {
            verifier: WebhookVerifier::new(text)?,
            text: text.to_owned(),
        })
    }

    /// Whether this is [`DEV_WEBHOOK_SECRET`].
    pub fn is_development(&self) -> bool {
        self.text == DEV_WEBHOOK_SECRET
    }
}

impl Default for WebhookSecret {
    fn default() -> Self {
        Self::parse(DEV_WEBHOOK_SECRET).expect("the development secret is a valid secret")
    }
}

impl PartialEq for WebhookSecret {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for WebhookSecret {}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_development() {
            "WebhookSecret(development)"
        } else {
            "WebhookSecret(..)"
        })
    }
}

/// Where the handled `webhook-id`s are kept: beside the ledger.
#[derive(Debug, Clone)]
pub enum Inbox {
    /// In this process (the embedded mode).
    Memory(WebhookReceiver<MemoryStore>),
    /// In PostgreSQL, in transactional mode: a settlement commits with its record.
    Postgres(WebhookReceiver<PostgresStore>),
}

impl Inbox {
    /// An inbox in memory for deliveries signed with `secret`.
    pub fn memory(secret: &WebhookSecret) -> Self {
        Self::Memory(receiver(MemoryStore::new(), secret))
    }

    /// An inbox in the idempotency tables of `pool` (migrated) for deliveries signed with
    /// `secret`.
    pub fn postgres(pool: PgPool, secret: &WebhookSecret) -> Self {
        Self::Postgres(receiver(PostgresStore::new(pool).transactional(), secret))
    }

    fn verify(&self, headers: &HeaderMap, body: Bytes) -> Result<VerifiedWebhook, VerifyError> {
        match self {
            Self::Memory(receiver) => receiver.verify(headers, body),
            Self::Postgres(receiver) => receiver.verify(headers, body),
        }
    }

    /// Settles `charge` once for `delivery`: a ledger failure or an unknown charge fails the
    /// run, so the key is released and nothing is recorded.
    async fn settle<L: Ledger>(
        &self,
        ledger: &L,
        delivery: &VerifiedWebhook,
        charge: String,
    ) -> Result<Settlement, OnceError<SettleFailure<L::Error>>> {
        let ledger = ledger.clone();
        match self {
            Self::Memory(receiver) => {
                let settle = || async move { settled(ledger.settle(&charge, None).await) };
                receiver.run(delivery, settle).await
            }
            Self::Postgres(receiver) => {
                let settle = in_transaction(ledger, charge);
                receiver.run_in_transaction(delivery, settle).await
            }
        }
    }
}

/// Settles `charge` on the inbox's transaction.
fn in_transaction<L: Ledger>(
    ledger: L,
    charge: String,
) -> impl for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, SettleResult<L::Error>> {
    move |tx| async move { settled(ledger.settle(&charge, Some(tx)).await) }.boxed()
}

type SettleResult<E> = Result<Settlement, SettleFailure<E>>;

fn receiver<St: tower_idempotency::store::Store>(
    store: St,
    secret: &WebhookSecret,
) -> WebhookReceiver<St> {
    let once = Once::new(store)
        .with_in_flight_wait(InFlightWait::up_to(IN_FLIGHT_WAIT))
        .expect("the wait is not zero");
    WebhookReceiver::new(once, SENDER, secret.verifier.clone()).expect("the sender is valid")
}

/// Why settling failed, so the delivery is not recorded as handled.
#[derive(Debug)]
enum SettleFailure<E> {
    NoSuchCharge,
    Ledger(E),
}

impl<E: std::fmt::Display> std::fmt::Display for SettleFailure<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoSuchCharge => f.write_str("no such charge"),
            Self::Ledger(error) => write!(f, "the ledger failed: {error}"),
        }
    }
}

fn settled<E>(result: Result<Settlement, E>) -> Result<Settlement, SettleFailure<E>> {
    match result {
        Ok(Settlement::NoSuchCharge) => Err(SettleFailure::NoSuchCharge),
        Ok(settlement) => Ok(settlement),
        Err(error) => Err(SettleFailure::Ledger(error)),
    }
}

/// The acquirer's event: `{"id", "type", "data": {"object": {"id"}}}`.
#[derive(Debug, Deserialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
    data: EventData,
}

#[derive(Debug, Deserialize)]
struct EventData {
    object: EventObject,
}

#[derive(Debug, Deserialize)]
struct EventObject {
    id: String,
}

/// What a handled delivery answers (and a redelivery gets again).
#[derive(Debug, Serialize)]
struct Receipt<'a> {
    received: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    ignored: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    settlement: Option<&'a Settlement>,
}

/// What the webhook route reads.
#[derive(Clone)]
pub(crate) struct Webhooks<L> {
    pub(crate) ledger: L,
    pub(crate) inbox: Inbox,
}

/// `POST /v1/webhooks/acquirer`; see the [module documentation](self).
pub(crate) async fn receive<L: Ledger>(
    State(hooks): State<Webhooks<L>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let delivery = hooks.inbox.verify(&headers, body).map_err(refused)?;
    let event: Event = delivery.json().map_err(|error| {
        ApiError::invalid_request(format!("The event is not a webhook event: {error}."))
    })?;
    if event.kind != "charge.settled" {
        let receipt = Receipt {
            received: true,
            ignored: Some(true),
            settlement: None,
        };
        return Ok(json(StatusCode::OK, &receipt));
    }
    let charge = event.data.object.id;
    let settlement = hooks
        .inbox
        .settle(&hooks.ledger, &delivery, charge.clone())
        .await
        .map_err(|error| not_settled(error, &charge))?;
    tracing::info!(event = delivery.id(), %charge, ?settlement, "charge.settled handled");
    let receipt = Receipt {
        received: true,
        ignored: None,
        settlement: Some(&settlement),
    };
    Ok(json(StatusCode::OK, &receipt))
}

/// A delivery that failed verification: `400`, and nothing was claimed.
fn refused(error: VerifyError) -> ApiError {
    tracing::warn!(%error, "webhook delivery refused");
    let code = match error {
        VerifyError::Stale | VerifyError::FromTheFuture => "webhook_timestamp_out_of_tolerance",
        VerifyError::BadSignature => "webhook_signature_invalid",
        _ => "webhook_invalid",
    };
    ApiError::invalid_request(format!("Webhook refused: {error}.")).with_code(code)
}

fn not_settled<E: std::error::Error + 'static>(
    error: OnceError<SettleFailure<E>>,
    charge: &str,
) -> ApiError {
    match error {
        OnceError::Failed(SettleFailure::NoSuchCharge) => {
            ApiError::no_such("charge", charge, "data.object.id")
        }
        OnceError::InFlight => ApiError::new(
            StatusCode::CONFLICT,
            ErrorType::IdempotencyError,
            "This event is being handled by another delivery; retry it.",
        )
        .with_code("idempotency_key_in_use"),
        OnceError::Mismatch => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorType::IdempotencyError,
            "This webhook-id was delivered before with another body.",
        ),
        OnceError::Failed(SettleFailure::Ledger(error)) => {
            tracing::warn!("settling failed");
            server_failure(&error)
        }
        OnceError::Store(error) => {
            tracing::warn!("the webhook inbox failed");
            server_failure(&*error)
        }
        OnceError::NotCommitted => unavailable(),
        other => {
            tracing::error!(error = %other, "the webhook inbox failed");
            ApiError::internal()
        }
    }
}

/// `GET /v1/balance`: the caller's balance, in Stripe's shape ([`Balance`](crate::ledger::Balance)).
pub(crate) async fn balance<L: Ledger>(
    State(hooks): State<Webhooks<L>>,
    Extension(account): Extension<Account>,
) -> Response {
    match hooks.ledger.balance(&account).await {
        Ok(balance) => json(StatusCode::OK, &balance),
        Err(error) => {
            tracing::warn!("reading the balance failed");
            server_failure(&error).into_response()
        }
    }
}
