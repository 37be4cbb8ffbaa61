//! Handlers that catch a database error (issue 28.2), in the `chaos serve` instances.
//!
//! A charge whose requests carry [`HEADER`] is not handled by the demo's handler but by
//! [`caught`], under the same idempotency layer (a clone of it: same store, settings, replay
//! cache and count of detached handlers): it records the charge through the request's
//! [`IdempotentTx`] with an amount the `charges` table refuses, catches the refusal, and answers
//! a card error, [`BODY`], with `402`, a status the layer keeps. The statement failed inside
//! the transaction, so the layer must deliver that answer unstored, roll the transaction back
//! and release the key: no charge row, no record, and every retry runs again and gets the same
//! answer, never a replay.
//!
//! Requests without the header go to the demo's own router, untouched.

use axum::{
    Extension, Form, Router,
    extract::Request,
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use charges_demo::{
    auth::{self, Account},
    error::ApiError,
};
use http::{StatusCode, header};
use std::collections::HashMap;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, IdempotentTx, store::Store};

/// The header that marks a charge whose handler catches a database error.
pub(crate) const HEADER: &str = "x-chaos-catch";

/// The answer to such a charge: Stripe's card error for a failure on the processor's side.
pub(crate) const BODY: &str = r#"{"error":{"code":"processing_error","message":"An error occurred while processing your card. Try again in a little bit.","type":"card_error"}}"#;

/// Its status: one the layer keeps, so only the failed transaction keeps it from being stored.
pub(crate) const STATUS: StatusCode = StatusCode::PAYMENT_REQUIRED;

/// The demo's charge, but with an amount of 0, which the table's `CHECK (amount > 0)` refuses.
const INSERT_REFUSED: &str = "INSERT INTO charges
        (id, account, amount, currency, status, source, metadata, created)
    VALUES ('ch_' || replace(gen_random_uuid()::text, '-', ''), $1, 0, 'usd', 'succeeded',
        'tok_visa', jsonb_build_object('order_id', $2::text), now())";

/// SQLSTATE `check_violation`.
const CHECK_VIOLATION: &str = "23514";

/// `demo`, with the requests that carry [`HEADER`] sent to [`caught`] under `layer`.
pub(crate) fn route<St: Store>(demo: Router, layer: IdempotencyLayer<St>) -> Router {
    let catching = Router::new()
        .route("/v1/charges", post(caught).layer(layer))
        .layer(middleware::from_fn(auth::authenticate));
    demo.layer(middleware::from_fn(move |request: Request, next: Next| {
        let catching = catching.clone();
        async move {
            if request.headers().contains_key(HEADER) {
                match catching.oneshot(request).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                }
            } else {
                next.run(request).await
            }
        }
    }))
}

/// The handler that catches a database error and answers anyway; see the
/// [module documentation](self).
async fn caught(
    Extension(account): Extension<Account>,
    mut tx: IdempotentTx,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    let order_id = form.get("metadata[order_id]").cloned().unwrap_or_default();
    let inserted = sqlx::query(INSERT_REFUSED)
        .bind(account.as_str())
        .bind(&order_id)
        .execute(&mut *tx)
        .await;
    drop(tx);
    match inserted {
        Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some(CHECK_VIOLATION) => {
            (STATUS, [(header::CONTENT_TYPE, "application/json")], BODY).into_response()
        }
        // The database was away (a restart): a 500 releases the key and the client retries.
        Err(error) => {
            tracing::warn!(%error, "the chaos handler's statement failed otherwise");
            ApiError::internal().into_response()
        }
        Ok(_) => {
            tracing::error!("the chaos handler's statement was meant to fail and did not");
            ApiError::internal().into_response()
        }
    }
}
