//! The two-step apps ([`App::AcquirerLease`](super::App::AcquirerLease),
//! [`App::AcquirerSteps`](super::App::AcquirerSteps)): a charge that authorizes at a card
//! network over loopback HTTP (the `acquirer` example, served by this process) and then writes
//! its row, in lease mode, without and with [`Steps`].
//!
//! Without steps the handler sends the request's own key to the acquirer and writes through the
//! pool; with steps each call is a step (`authorize`, then `ledger` in a transaction with its
//! record), which costs one store round trip per step.

use std::sync::atomic::{AtomicBool, Ordering};

use axum::{
    Extension, Json, Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tower_idempotency::{IdempotencyLayer, Principal, StepError, Steps};

use super::{CHARGES_PATH, Charge, NewCharge, created, insert_charge};

/// The step secret of [`App::AcquirerSteps`](super::App::AcquirerSteps): a benchmark's, not a
/// secret.
const STEP_SECRET: &[u8; 32] = b"idempotency-bench step secret 32";

/// What the handlers share: the pool and the acquirer's client.
#[derive(Clone)]
struct TwoStep {
    pool: PgPool,
    client: reqwest::Client,
    url: String,
}

/// The two-step app behind `IdempotencyLayer::postgres(pool)`, with `steps` or without; starts
/// its acquirer on a loopback port of its own. Called inside the server's runtime.
pub(super) fn router(pool: PgPool, steps: bool) -> Router {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let url = format!(
        "http://{}/v1/authorizations",
        listener.local_addr().expect("its address")
    );
    listener.set_nonblocking(true).expect("non-blocking");
    tokio::spawn(async move {
        let listener = TcpListener::from_std(listener).expect("in the runtime");
        let acquirer = acquirer::Acquirer::new(acquirer::Settings::default());
        axum::serve(listener, acquirer::app(acquirer)).await
    });
    let state = TwoStep {
        client: reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("a client"),
        pool: pool.clone(),
        url,
    };
    let layer = IdempotencyLayer::postgres(pool);
    if steps {
        let layer = layer
            .with_step_secret(STEP_SECRET.to_vec())
            .expect("32 bytes");
        Router::new()
            .route(CHARGES_PATH, post(charge_with_steps))
            .with_state(state)
            .layer(layer)
    } else {
        Router::new()
            .route(CHARGES_PATH, post(charge_without_steps))
            .with_state(state)
            .layer(layer)
    }
}

impl TwoStep {
    /// Authorizes `new` at the acquirer under `key`: the authorization's id.
    async fn authorize(&self, key: &str, new: &NewCharge) -> Result<String, Failed> {
        let amount = new.amount.to_string();
        let form = [
            ("amount", amount.as_str()),
            ("currency", new.currency.as_str()),
            ("source", "tok_visa"),
        ];
        let response = self
            .client
            .post(&self.url)
            .header("idempotency-key", key)
            .form(&form)
            .send()
            .await
            .map_err(|error| Failed::new(error.to_string()))?;
        if response.status() != StatusCode::OK {
            return Err(Failed::new(format!(
                "the acquirer answered {}",
                response.status()
            )));
        }
        let body: serde_json::Value = response
            .json()
            .await
            .map_err(|error| Failed::new(error.to_string()))?;
        Ok(body["id"].as_str().unwrap_or_default().to_owned())
    }
}

/// Authorize under the request's own key, then `INSERT` through the pool.
async fn charge_without_steps(
    State(app): State<TwoStep>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    Json(new): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), Failed> {
    let key = headers
        .get("idempotency-key")
        .and_then(|key| key.to_str().ok())
        .unwrap_or_default();
    app.authorize(key, &new).await?;
    let id = insert_charge(&app.pool, &principal, &new)
        .await
        .map_err(|error| Failed::new(error.0.to_string()))?;
    Ok(created(id, &principal, new))
}

/// Step `authorize` under its downstream key, then step `ledger`: the `INSERT` committed with
/// the step's record.
async fn charge_with_steps(
    State(app): State<TwoStep>,
    Extension(principal): Extension<Principal>,
    steps: Steps,
    Json(new): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), Failed> {
    let authorize = |key: tower_idempotency::DownstreamKey| {
        let app = app.clone();
        let new = &new;
        async move { app.authorize(&key.to_string(), new).await }
    };
    let _: String = steps
        .run("authorize", authorize)
        .await
        .map_err(Failed::step)?;
    let (owner, row) = (principal.clone(), new.copy());
    let id: i64 = steps
        .run_in_transaction("ledger", move |tx: &mut sqlx::PgConnection, _key| {
            Box::pin(async move {
                insert_charge(tx, &owner, &row)
                    .await
                    .map_err(|error| Failed::new(error.0.to_string()))
            })
        })
        .await
        .map_err(Failed::step)?;
    Ok(created(id, &principal, new))
}

impl NewCharge {
    fn copy(&self) -> Self {
        Self {
            amount: self.amount,
            currency: self.currency.clone(),
        }
    }
}

/// A failed charge: `502`. The first one is logged; the load generator counts them all.
#[derive(Debug)]
struct Failed(String);

impl Failed {
    fn new(message: String) -> Self {
        Self(message)
    }

    fn step(error: StepError<Self>) -> Self {
        match error {
            StepError::Failed(failed) => failed,
            other => Self(other.to_string()),
        }
    }
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        static LOGGED: AtomicBool = AtomicBool::new(false);
        if !LOGGED.swap(true, Ordering::Relaxed) {
            tracing::error!(error = %self.0, "two-step charge failed (further failures are not logged)");
        }
        (StatusCode::BAD_GATEWAY, "charge failed").into_response()
    }
}
