//! A small Stripe-style payments API whose `POST /v1/charges` and `POST /v1/refunds` are
//! protected by [`tower_idempotency`]: a retried payment charges once, a retried refund refunds
//! once, and every retry gets the first answer back, byte for byte.
//!
//! ```
//! use axum::{body::Body, http::Request};
//! use charges_demo::{AppState, Settings, app};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = app(AppState::memory(&Settings::default()).unwrap());
//! let charge = || {
//!     Request::post("/v1/charges")
//!         .header("authorization", "Bearer sk_test_123")
//!         .header("idempotency-key", "order-1042")
//!         .header("content-type", "application/x-www-form-urlencoded")
//!         .body(Body::from("amount=2000&currency=usd"))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(charge()).await.unwrap();
//! let retry = app.oneshot(charge()).await.unwrap();
//! assert_eq!(first.status(), 200);
//! assert_eq!(retry.status(), 200);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # }
//! ```
//!
//! # How a request flows
//!
//! 1. [`request_id::request_ids`] gives the request its `req_...` id, answered in `Request-Id`.
//! 2. [`auth::authenticate`] reads the API key, derives the [`Account`](auth::Account) and
//!    inserts it with its [`Principal`](tower_idempotency::Principal): outside the idempotency
//!    layer, so keys are scoped per account.
//! 3. On `POST /v1/charges` and `POST /v1/refunds` the [`IdempotencyLayer`] claims the
//!    `Idempotency-Key` (required there; one key space per account across both endpoints), or
//!    replays, or refuses (`409` in flight, `422` reused for another request, another endpoint's
//!    included) with a problem document that carries Stripe's error object ([`refusals`]).
//! 4. The handler validates the [`params`], authorizes the card at the [`acquirer`] through the
//!    [`processor`] (step `authorize`, with the step's downstream key as the acquirer's
//!    `Idempotency-Key`), takes `--processing-delay-ms`, records the charge or the refund in the
//!    [`ledger`] (step `ledger` or `refund`), and answers with the object, a `402` card error,
//!    or a `400` (or `404`) Stripe error.
//! 5. The layer stores the answer for replay (with the request's id in `Original-Request`), or
//!    releases the key for a `400` or a `5xx`. The layer runs in [lease
//!    mode](tower_idempotency::guide::modes) with [`Steps`](tower_idempotency::Steps)
//!    (`src/steps.rs`): no database transaction is held across the acquirer call, and a retry after
//!    a crash goes on at the first unfinished step, so the card is authorized once and the
//!    charge recorded once. With PostgreSQL a ledger step's rows commit with its record.
//!
//! The binary (`src/main.rs`) parses [`server::Args`] and calls [`server::run`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod auth;
pub mod completer;
pub mod error;
pub mod ledger;
pub mod openapi;
mod openapi_webhooks;
pub mod params;
pub mod processor;
pub mod refusals;
pub mod request_id;
mod routes;
pub mod server;
mod steps;
mod unavailable;
pub mod webhooks;

use std::{convert::Infallible, time::Duration};

use axum::{
    Json, Router, middleware,
    routing::{get, post},
};
use http::Method;
use sqlx::PgPool;
use tower_idempotency::{
    Completion, ConfigError, IdempotencyLayer, InFlightWait, KeySource, Limits, Rendering, Scope,
    store::{CachingStore, MemoryStore, PostgresStore, SealingKeys, SealingStore, Store},
};

pub use routes::{DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT};

use crate::{
    ledger::{Ledger, MemoryLedger, PostgresLedger},
    processor::CardProcessor,
    webhooks::{Inbox, WebhookSecret},
};

/// The largest `POST /v1/charges` or `POST /v1/refunds` body accepted (larger: the layer's `413`
/// problem).
pub const MAX_CHARGE_BODY_BYTES: usize = 64 * 1024;

/// The demo's settings (the command line's `--key-ttl-secs`, `--lease-secs` and
/// `--processing-delay-ms`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// How long an idempotency key and its stored response live (default 24 hours).
    pub key_ttl: Duration,
    /// How long a key is held without renewal before a retry may take it over (default 30 s).
    pub lease: Duration,
    /// The simulated card-processor latency of every charge (default none).
    pub processing_delay: Duration,
    /// How long a duplicate of a charge in flight waits for its answer (default none: `409`).
    pub in_flight_wait: Option<Duration>,
    /// The acquirer's base URL (default none: an acquirer in this process).
    pub acquirer_url: Option<String>,
    /// The secret the steps' downstream keys are derived from (default
    /// [`DEV_STEP_SECRET`]).
    pub step_secret: StepSecret,
    /// The secret the acquirer signs its webhooks with (default
    /// [`DEV_WEBHOOK_SECRET`](webhooks::DEV_WEBHOOK_SECRET)).
    pub webhook_secret: WebhookSecret,
    /// With the [`completer`] on, how long a client has to retry a charge left mid-way after
    /// its lease lapsed (default none: off).
    pub completer_grace: Option<Duration>,
}

/// The step secret used when none is given: for development only, as everyone knows it.
pub const DEV_STEP_SECRET: &[u8] = b"charges-demo development step secret, not for production";

/// The secret of the steps' downstream keys, at least
/// [`MIN_STEP_SECRET_BYTES`](tower_idempotency::MIN_STEP_SECRET_BYTES) long; its `Debug` does
/// not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct StepSecret(pub Vec<u8>);

impl Default for StepSecret {
    fn default() -> Self {
        Self(DEV_STEP_SECRET.to_vec())
    }
}

impl std::fmt::Debug for StepSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dev = self.0 == DEV_STEP_SECRET;
        f.write_str(if dev {
            "StepSecret(development)"
        } else {
            "StepSecret(..)"
        })
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            key_ttl: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            processing_delay: Duration::ZERO,
            in_flight_wait: None,
            acquirer_url: None,
            step_secret: StepSecret::default(),
            webhook_secret: WebhookSecret::default(),
            completer_grace: None,
        }
    }
}

impl Settings {
    /// The card processor these settings describe: the acquirer at `acquirer_url`, else one in
    /// this process.
    pub fn processor(&self) -> CardProcessor {
        match &self.acquirer_url {
            Some(url) => CardProcessor::remote(url, self.processing_delay),
            None => CardProcessor::new(self.processing_delay),
        }
    }
}

/// The idempotency layer of `POST /v1/charges` and `POST /v1/refunds` on `store`: the key is
/// required, only `POST` is covered, TTL and lease come from `settings`, and refusals speak
/// Stripe's errors too ([`refusals`]).
///
/// A key belongs to the account across endpoints, as Stripe's keys do: a charge's key sent on a
/// refund is a key reused for another request, refused as `422 idempotency_error`, never run.
///
/// # Errors
///
/// [`ConfigError`] when the TTL, the lease or the in-flight wait is zero, or the step secret is
/// too short.
pub fn idempotency_layer<St: Store>(
    store: St,
    settings: &Settings,
) -> Result<IdempotencyLayer<St>, ConfigError> {
    let layer = IdempotencyLayer::new(store)
        .with_rendering(Rendering::custom(refusals::render))
        .with_scope(Scope::principal_extension().across_endpoints())
        .with_key(KeySource::default().required())
        .with_methods([Method::POST])?
        .with_limits(Limits::default().with_max_request_bytes(MAX_CHARGE_BODY_BYTES))?
        .with_ttl(settings.key_ttl)?
        .with_lease(settings.lease)?
        .with_step_secret(settings.step_secret.0.clone())?;
    let layer = match settings.completer_grace {
        // The handlers read no header beyond those always kept.
        Some(_) => layer.with_completion(Completion::new())?,
        None => layer,
    };
    match settings.in_flight_wait {
        Some(wait) => layer.with_in_flight_wait(InFlightWait::up_to(wait)),
        None => Ok(layer),
    }
}

/// Everything [`app`] serves from: the ledger, the card processor, the idempotency layer
/// (with its store) and the webhooks' inbox.
#[derive(Debug)]
pub struct AppState<L, St> {
    ledger: L,
    processor: CardProcessor,
    idempotency: IdempotencyLayer<St>,
    inbox: Inbox,
}

impl<L: Ledger, St: Store> AppState<L, St> {
    /// The state from its parts, with webhooks signed with the development secret kept in
    /// memory ([`with_inbox`](Self::with_inbox) to change that).
    pub fn new(ledger: L, idempotency: IdempotencyLayer<St>, processor: CardProcessor) -> Self {
        Self {
            ledger,
            processor,
            idempotency,
            inbox: Inbox::memory(&WebhookSecret::default()),
        }
    }

    /// Replaces the webhooks' inbox (its store and secret).
    #[must_use]
    pub fn with_inbox(mut self, inbox: Inbox) -> Self {
        self.inbox = inbox;
        self
    }

    /// Replaces the card processor (to set a delay, or a hook that observes charges in flight).
    #[must_use]
    pub fn with_processor(mut self, processor: CardProcessor) -> Self {
        self.processor = processor;
        self
    }

    /// The ledger.
    pub fn ledger(&self) -> &L {
        &self.ledger
    }

    /// The idempotency layer's store, to spawn its expiry loop
    /// ([`continuously_delete_expired`](tower_idempotency::store::continuously_delete_expired)).
    pub fn idempotency_store(&self) -> &St {
        self.idempotency.store()
    }

    /// The same app with its stored responses sealed with `keys` (`--seal-key`).
    ///
    /// # Errors
    ///
    /// As [`idempotency_layer`].
    pub fn sealed(
        self,
        keys: SealingKeys,
        settings: &Settings,
    ) -> Result<AppState<L, SealingStore<St>>, ConfigError>
    where
        St: Clone,
    {
        let store = SealingStore::new(self.idempotency.store().clone(), keys);
        let sealed = AppState::new(
            self.ledger,
            idempotency_layer(store, settings)?,
            self.processor,
        );
        Ok(sealed.with_inbox(self.inbox))
    }
}

impl AppState<MemoryLedger, MemoryStore> {
    /// The embedded mode: keys and charges in this process's memory.
    ///
    /// # Errors
    ///
    /// As [`idempotency_layer`].
    pub fn memory(settings: &Settings) -> Result<Self, ConfigError> {
        let state = Self::new(
            MemoryLedger::new(),
            idempotency_layer(MemoryStore::new(), settings)?,
            settings.processor(),
        );
        Ok(state.with_inbox(Inbox::memory(&settings.webhook_secret)))
    }
}

impl AppState<PostgresLedger, CachingStore<PostgresStore>> {
    /// Keys, charges and refunds in PostgreSQL, on `pool`. Apply [`migrate`] first.
    ///
    /// The store runs in tower-idempotency's [lease mode](tower_idempotency::guide::modes)
    /// with steps: a charge holds no connection while the acquirer answers, and each ledger
    /// write commits with its step's record. Completed records are kept in process too
    /// ([`CachingStore`]), so a retry reaching this instance again is answered without a query.
    ///
    /// # Errors
    ///
    /// As [`idempotency_layer`].
    pub fn postgres(pool: PgPool, settings: &Settings) -> Result<Self, ConfigError> {
        let inbox = Inbox::postgres(pool.clone(), &settings.webhook_secret);
        let state = Self::new(
            PostgresLedger::new(pool.clone()),
            idempotency_layer(CachingStore::new(PostgresStore::new(pool)), settings)?,
            settings.processor(),
        );
        Ok(state.with_inbox(inbox))
    }
}

/// Applies both sets of migrations to the database of `pool`: tower-idempotency's (schema
/// `idempotency`, tracked in `idempotency._sqlx_migrations`) and the demo's own
/// ([`ledger::MIGRATOR`]: tables `charges` and `refunds`, tracked in the default
/// `_sqlx_migrations`). Both are
/// idempotent and safe to run from several instances at once.
///
/// # Errors
///
/// When the database cannot be reached or a migration fails.
pub async fn migrate(pool: &PgPool) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    PostgresStore::new(pool.clone()).migrate().await?;
    ledger::MIGRATOR.run(pool).await?;
    Ok(())
}

/// The API: `POST /v1/charges` and `POST /v1/refunds` under the idempotency layer (one layer,
/// so one key space), their lists and `GET /v1/charges/{id}`, `GET /v1/refunds/{id}`,
/// `GET /v1/balance`, all behind [`auth::authenticate`]; `POST /v1/webhooks/acquirer`
/// ([`webhooks`]), authenticated by its signature; and, outermost,
/// [`request_id::request_ids`].
pub fn app<L: Ledger, St: Store>(state: AppState<L, St>) -> Router {
    Routers::new(state).app
}

/// The routers [`app`] is made of.
pub(crate) struct Routers {
    /// What is served.
    pub(crate) app: Router,
    /// The charges and refunds API without its authentication, for the [`completer`], whose
    /// kept principal stands for it.
    pub(crate) completing: Router,
}

impl Routers {
    pub(crate) fn new<L: Ledger, St: Store>(state: AppState<L, St>) -> Self {
        let AppState {
            ledger,
            processor,
            idempotency,
            inbox,
        } = state;
        let hooks = webhooks::Webhooks {
            ledger: ledger.clone(),
            inbox,
        };
        let balance = Router::new()
            .route("/v1/balance", get(webhooks::balance::<L>))
            .with_state(hooks.clone());
        // Authenticated by its signature, not an API key.
        let acquirer_webhooks = Router::new()
            .route("/v1/webhooks/acquirer", post(webhooks::receive::<L>))
            .with_state(hooks);
        // Built from the layer as configured, so it cannot say other than what the layer does.
        let described = Json(openapi::document(&idempotency));
        let api = api(idempotency, routes::Api { ledger, processor }).merge(balance);
        let completing = api
            .clone()
            .layer(middleware::from_fn(request_id::request_ids));
        let app = Router::new()
            // Public: the description needs no API key.
            .route(
                "/openapi.json",
                get(move || std::future::ready(described.clone())),
            )
            .merge(acquirer_webhooks)
            // Outside the idempotency layer, so the principal is in place when it looks for it.
            .merge(api.layer(middleware::from_fn(auth::authenticate)))
            // Outermost, so every response has a `Request-Id`, a `401` too.
            .layer(middleware::from_fn(request_id::request_ids));
        Self { app, completing }
    }
}

/// The charges and refunds, unauthenticated: `POST`s under the idempotency layer.
fn api<L: Ledger, St: Store>(idempotency: IdempotencyLayer<St>, state: routes::Api<L>) -> Router {
    Router::new()
        .route(
            "/v1/charges",
            // Only the POST handler is wrapped: reads need no key. `Original-Request` is set
            // inside the layer, so it is stored with the response and replayed.
            post(routes::create_charge::<L>)
                .layer::<_, Infallible>(middleware::from_fn(request_id::original_request))
                .layer(idempotency.clone())
                .get(routes::list_charges::<L>),
        )
        .route("/v1/charges/{id}", get(routes::retrieve_charge::<L>))
        .route(
            "/v1/refunds",
            post(routes::create_refund::<L>)
                .layer::<_, Infallible>(middleware::from_fn(request_id::original_request))
                .layer(idempotency)
                .get(routes::list_refunds::<L>),
        )
        .route("/v1/refunds/{id}", get(routes::retrieve_refund::<L>))
        .fallback(routes::not_found)
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_and_lease_apply_in_either_order() {
        let short = Settings {
            key_ttl: Duration::from_secs(10),
            lease: Duration::from_secs(5),
            ..Settings::default()
        };
        assert!(idempotency_layer(MemoryStore::new(), &short).is_ok());
        let long = Settings {
            key_ttl: Duration::from_secs(7 * 24 * 3600),
            lease: Duration::from_secs(2 * 24 * 3600),
            ..Settings::default()
        };
        assert!(idempotency_layer(MemoryStore::new(), &long).is_ok());
        let lease_beyond_ttl = Settings {
            key_ttl: Duration::from_secs(5),
            lease: Duration::from_secs(10),
            ..Settings::default()
        };
        assert!(idempotency_layer(MemoryStore::new(), &lease_beyond_ttl).is_ok());
        let zero = Settings {
            lease: Duration::ZERO,
            ..Settings::default()
        };
        assert_eq!(
            idempotency_layer(MemoryStore::new(), &zero).unwrap_err(),
            ConfigError::Zero("lease")
        );
    }
}
