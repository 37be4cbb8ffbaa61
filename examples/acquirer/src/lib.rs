//! A small card network for the charges demo: `POST /v1/authorizations` authorizes a card once
//! per `Idempotency-Key` (the key the demo's [`Steps`](tower_idempotency::Steps) derive), and
//! `GET /v1/authorizations` lists every authorization it made, so a run can count them.
//!
//! ```
//! use acquirer::{Acquirer, Settings, app};
//! use axum::{body::Body, http::Request};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let acquirer = Acquirer::new(Settings::default());
//! let router = app(acquirer.clone());
//! let authorize = || {
//!     Request::post("/v1/authorizations")
//!         .header("idempotency-key", "9b2f6f1e-0d7c-4a43-8a8e-3f0c2b1d5e77")
//!         .header("content-type", "application/x-www-form-urlencoded")
//!         .body(Body::from("amount=2000&currency=usd&source=tok_visa"))
//!         .unwrap()
//! };
//! assert_eq!(router.clone().oneshot(authorize()).await.unwrap().status(), 200);
//! // Sent again with the same key: the first answer, and still one authorization.
//! assert_eq!(router.oneshot(authorize()).await.unwrap().status(), 200);
//! assert_eq!(acquirer.authorizations().len(), 1);
//! # }
//! ```
//!
//! Declined test tokens ([`decision`]) are answered `200` with `"status": "declined"`: the
//! network made a decision, which the key keeps. `--fail-rate` ([`Settings::fail_rate`]) makes
//! some calls fail with `503`, half of them before anything is done and half after the
//! authorization was made and kept (a lost answer): both are retried with the same key.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod decision;
mod faults;
pub mod params;
mod routes;
pub mod webhooks;

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use axum::{Router, middleware, routing::post};
use serde::Serialize;
use tower_idempotency::{IdempotencyLayer, KeySource, Scope};

pub use decision::{Decision, Decline, decide};
pub use webhooks::{WebhookSender, WebhookSettings};

/// The webhook secret of development, known to everyone: the acquirer signs with it and the
/// charges demo checks with it when neither is given another (`--webhook-secret`).
pub const DEV_WEBHOOK_SECRET: &str = "whsec_Y2hhcmdlcy1kZW1vIGRldiB3ZWJob29rIHNlY3JldCE=";

/// How the network behaves (the command line's `--delay-ms`, `--fail-rate` and `--seed`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Settings {
    /// How long each authorization takes.
    pub delay: Duration,
    /// The share of calls answered `503`, from 0 to 1.
    pub fail_rate: f64,
    /// The seed of the failures' random choices (none: from the clock).
    pub seed: Option<u64>,
}

/// One authorization the network made; `GET /v1/authorizations` lists them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Authorization {
    /// `auth_...`.
    pub id: String,
    /// Always `authorization`.
    pub object: &'static str,
    /// In the currency's smallest unit.
    pub amount: i64,
    /// Three lowercase letters.
    pub currency: String,
    /// `approved` or `declined`.
    pub status: &'static str,
    /// For a declined card, Stripe's `decline_code`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decline_code: Option<&'static str>,
    /// The key it was made under.
    pub idempotency_key: String,
    /// The merchant's id for the charge (`reference`), named in its `charge.settled` event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

/// The network's state: its settings and every authorization it made. Clones share it.
#[derive(Debug, Clone)]
pub struct Acquirer {
    settings: Arc<Settings>,
    made: Arc<Mutex<Vec<Authorization>>>,
    faults: faults::Faults,
    webhooks: Option<WebhookSender>,
}

impl Acquirer {
    /// A network with no authorizations yet.
    pub fn new(settings: Settings) -> Self {
        Self {
            faults: faults::Faults::new(settings.fail_rate, settings.seed),
            settings: Arc::new(settings),
            made: Arc::default(),
            webhooks: None,
        }
    }

    /// The same network, reporting each approved authorization with a `reference` as a
    /// `charge.settled` webhook ([`webhooks`]).
    #[must_use]
    pub fn with_webhooks(mut self, sender: WebhookSender) -> Self {
        self.webhooks = Some(sender);
        self
    }

    /// Every authorization made so far, oldest first.
    pub fn authorizations(&self) -> Vec<Authorization> {
        self.made
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn push(&self, authorization: Authorization) {
        self.made
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(authorization);
    }
}

/// The network's API; see the [crate documentation](crate).
pub fn app(acquirer: Acquirer) -> Router {
    let idempotency = IdempotencyLayer::memory()
        .with_scope(Scope::single_tenant())
        .with_key(KeySource::default().required());
    let faults = acquirer.faults.clone();
    Router::new()
        .route(
            "/v1/authorizations",
            post(routes::authorize)
                .layer(idempotency)
                // Outside the layer: a lost answer is lost after the layer kept it.
                .layer(middleware::from_fn_with_state(faults, faults::inject))
                .get(routes::list),
        )
        .with_state(acquirer)
}
