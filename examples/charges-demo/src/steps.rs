//! The recovery points of a charge and a refund, as [`Steps`]: a charge is authorized at the
//! acquirer once (step `authorize`), then written to the ledger once (step `ledger`); a refund
//! is written once (step `refund`). A request that takes a key over after a crash gets the
//! recorded steps back and goes on at the first unfinished one, so no database transaction is
//! held open across the acquirer call.
//!
//! With PostgreSQL, a ledger step's rows commit together with the step's record
//! ([`Steps::run_in_transaction`]); in memory, both are lost together on exit.

use std::sync::{Arc, Mutex, PoisonError};

use futures_util::{FutureExt, future::BoxFuture};
use http::StatusCode;
use sqlx::PgConnection;
use tower_idempotency::{DownstreamKey, IdempotencyContext, Retention, StepError, Steps};

use crate::{
    auth::Account,
    error::{ApiError, ErrorType, json_text},
    ledger::{Charge, Ledger, Refund, RefundRefusal},
    params::{ChargeParams, RefundParams},
    processor::{Authorized, CardProcessor, NetworkError},
    unavailable::server_failure,
};

/// The request's steps, or a `500` when the layer gives none (the app is set up wrong).
pub(crate) fn of(idempotency: &IdempotencyContext) -> Result<&Steps, ApiError> {
    idempotency.steps().map_err(|missing| {
        tracing::error!(%missing, "no steps for a charge");
        ApiError::internal()
    })
}

/// Step `authorize`: the acquirer's answer for this charge, asked for once per key.
///
/// A failed call records nothing and answers `503`, giving the key up part-way: the client's
/// retry (or the completer) sends the same downstream key, so the acquirer authorizes once.
pub(crate) async fn authorize(
    steps: &Steps,
    processor: &CardProcessor,
    params: &ChargeParams,
) -> Result<Authorized, ApiError> {
    let step =
        |key: DownstreamKey| async move { processor.authorize(params, &key.to_string()).await };
    steps
        .run("authorize", step)
        .await
        .map_err(|error| match error {
            StepError::Failed(network) => network_failed(&network),
            // The acquirer may have answered before the store failed to record it.
            other => step_failed("authorize", &other).with_retention(Retention::Abandon),
        })
}

/// A `503` for an authorization without an answer: the acquirer may have authorized it, so the
/// key is given up part-way ([`Retention::Abandon`]), not released. The client's retry takes it
/// over at once and sends the same downstream key; if it never comes, the completer does.
pub(crate) fn network_failed(error: &NetworkError) -> ApiError {
    tracing::warn!(
        error = error as &dyn std::error::Error,
        "the card network did not answer"
    );
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::ApiError,
        "The card network did not answer. Retry with the same Idempotency-Key: the card is \
         authorized once.",
    )
    .with_retention(Retention::Abandon)
}

/// Step `ledger`: records `charge` once per key, with the body of its answer. A later attempt
/// (a takeover, the completer) answers the body recorded, byte for byte, whatever happened to
/// the charge since (a refund), as a replay of the first answer would.
pub(crate) async fn record_charge<L: Ledger>(
    steps: &Steps,
    ledger: &L,
    charge: &Charge,
) -> Result<String, ApiError> {
    let body = json_text(charge).map_err(|error| step_failed("ledger", &error))?;
    let owned = (ledger.clone(), charge.clone(), body);
    let recorded = if L::IN_STORE_DATABASE {
        let write = in_transaction(move |tx, _key| {
            async move {
                let (ledger, charge, body) = owned;
                ledger.insert(&charge, Some(tx)).await.map(|()| body)
            }
            .boxed()
        });
        steps.run_in_transaction("ledger", write).await
    } else {
        let write = |_key| async move {
            let (ledger, charge, body) = owned;
            ledger.insert(&charge, None).await.map(|()| body)
        };
        steps.run("ledger", write).await
    };
    // The key holds the authorization: given up part-way, so that a retry or the completer
    // writes the charge, never released where neither would find it.
    recorded.map_err(|error| step_failed("ledger", &error).with_retention(Retention::Abandon))
}

/// Why a refund step recorded nothing.
#[derive(Debug)]
enum RefundFailure<E> {
    Refused(RefundRefusal),
    Ledger(E),
}

impl<E: std::fmt::Display> std::fmt::Display for RefundFailure<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(refusal) => write!(f, "refused: {refusal}"),
            Self::Ledger(error) => write!(f, "the ledger failed: {error}"),
        }
    }
}

impl<E: std::error::Error> std::error::Error for RefundFailure<E> {}

/// Step `refund`: records the refund once per key, with the charge's `amount_refunded`. A
/// refusal records nothing (the layer releases the key for its `400`).
pub(crate) async fn record_refund<L: Ledger>(
    steps: &Steps,
    ledger: &L,
    account: &Account,
    params: &RefundParams,
) -> Result<Result<Refund, RefundRefusal>, ApiError> {
    let made: Arc<Mutex<Option<Refund>>> = Arc::default();
    let owned = (
        ledger.clone(),
        account.clone(),
        params.clone(),
        made.clone(),
    );
    let refund = async move |tx: Option<&mut PgConnection>| {
        let (ledger, account, params, made) = owned;
        match ledger.refund(&account, &params, tx).await {
            Ok(Ok(refund)) => {
                let id = refund.id.clone();
                *made.lock().unwrap_or_else(PoisonError::into_inner) = Some(refund);
                Ok(id)
            }
            Ok(Err(refusal)) => Err(RefundFailure::Refused(refusal)),
            Err(error) => Err(RefundFailure::Ledger(error)),
        }
    };
    let recorded = if L::IN_STORE_DATABASE {
        let write = in_transaction(move |tx, _key| refund(Some(tx)).boxed());
        steps.run_in_transaction("refund", write).await
    } else {
        steps.run("refund", |_key| refund(None)).await
    };
    let id = match recorded {
        Ok(id) => id,
        Err(StepError::Failed(RefundFailure::Refused(refusal))) => return Ok(Err(refusal)),
        Err(error) => return Err(step_failed("refund", &error)),
    };
    if let Some(refund) = made.lock().unwrap_or_else(PoisonError::into_inner).take() {
        return Ok(Ok(refund));
    }
    match ledger.retrieve_refund(account, &id).await {
        Ok(Some(refund)) => Ok(Ok(refund)),
        Ok(None) => Err(internal("a recorded refund is not in the ledger")),
        Err(error) => Err(step_failed("refund", &error)),
    }
}

/// `write` as [`Steps::run_in_transaction`] takes it: the signature makes a closure's future
/// borrow the transaction for as long as it is handed, which inference alone does not.
fn in_transaction<T, E, F>(write: F) -> F
where
    F: for<'c> FnOnce(&'c mut PgConnection, DownstreamKey) -> BoxFuture<'c, Result<T, E>>,
{
    write
}

/// A step that failed on the server's side: `503` when the database or store was unreachable
/// (a retry gets past it), else `500`.
fn step_failed(step: &str, error: &(dyn std::error::Error + 'static)) -> ApiError {
    tracing::warn!(step, "a step failed");
    server_failure(error)
}

fn internal(message: &str) -> ApiError {
    tracing::error!("{message}");
    ApiError::internal()
}
