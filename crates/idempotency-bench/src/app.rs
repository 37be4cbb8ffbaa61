//! The applications the benchmark serves: one charge API, with and without the layer.
//!
//! Every app has the same shape as a real one: an authentication middleware (outermost) turns
//! `Authorization: Bearer <account>` into a [`Principal`], then — in the layered apps — the
//! idempotency layer, then the handler. The apps differ only in the layer, so a ratio between
//! two of them is the layer's cost.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Extension, Json, Router,
    body::Bytes,
    extract::{Request, State},
    http::{StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tower_idempotency::{
    IdempotencyLayer, IdempotentTx, InFlightWait, Principal,
    store::{MemoryStore, PostgresStore, SealingKeys, SealingStore},
};

mod two_step;

/// The path every app serves.
pub(crate) const CHARGES_PATH: &str = "/v1/charges";

/// The table the charge handler writes to, created in the run's database before any server
/// starts (shared with the `pgbench` scripts beside this crate's sources).
pub(crate) const CHARGES_SCHEMA: &str = include_str!("../pgbench/charges.sql");

const INSERT_CHARGE: &str =
    "INSERT INTO charges (account, amount, currency) VALUES ($1, $2, $3) RETURNING id";

/// How long a duplicate of a key in flight waits for it in the apps that wait
/// ([`App::LeaseWait`], [`App::SlowLeaseWait`]).
pub(crate) const IN_FLIGHT_WAIT: Duration = Duration::from_secs(5);

/// How long the slow apps' handler takes ([`App::SlowLease`], [`App::SlowLeaseWait`]): long
/// enough that every duplicate of a storm arrives while the first request runs.
pub(crate) const SLOW_HANDLER: Duration = Duration::from_millis(200);

/// The width of partitioned mode's partitions: a quarter of the layer's default 24 h TTL, as
/// `PostgresStore::partitioned` advises.
pub(crate) const PARTITION_WIDTH: Duration = Duration::from_secs(6 * 60 * 60);

/// Which application a server process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum App {
    /// The charge handler (one `INSERT` through the pool), no idempotency layer.
    Bare,
    /// The charge handler behind `IdempotencyLayer::postgres(pool)`, on the same pool.
    Lease,
    /// The same with duplicates waiting for a key in flight
    /// (`with_in_flight_wait(IN_FLIGHT_WAIT)`): every completion also notifies the store's
    /// listeners.
    LeaseWait,
    /// [`Lease`](Self::Lease) with a handler that sleeps [`SLOW_HANDLER`] before its
    /// `INSERT`: duplicates get `409` while it runs.
    SlowLease,
    /// [`SlowLease`](Self::SlowLease) with duplicates waiting for the first request
    /// (`with_in_flight_wait(IN_FLIGHT_WAIT)`).
    SlowLeaseWait,
    /// The same without the `CachingStore` in front
    /// (`IdempotencyLayer::new(PostgresStore::new(pool))`): every replay reads the store.
    LeaseNoCache,
    /// The same as [`Lease`](Self::Lease) on a store in partitioned mode
    /// (`PostgresStore::partitioned(PARTITION_WIDTH)`).
    LeasePartitioned,
    /// The charge handler writing its `INSERT` through the [`IdempotentTx`] of
    /// `IdempotencyLayer::new(PostgresStore::new(pool).transactional())`: the claim, the charge and the record
    /// commit together.
    Transactional,
    /// A handler that does no I/O, no idempotency layer.
    MemoryBare,
    /// The no-I/O handler behind `IdempotencyLayer::memory()`.
    Memory,
    /// The no-I/O handler spending [`BUSY`] on the CPU first, no idempotency layer: what a
    /// microsecond of work per request costs in this benchmark.
    MemoryBareBusy,
    /// A no-I/O handler that reads a body of any type and parses none of it, no idempotency
    /// layer: what receiving a hostile body costs without the layer.
    AnyBodyBare,
    /// That handler behind `IdempotencyLayer::memory()`: the layer's own cost for the body.
    AnyBodyMemory,
    /// A no-I/O handler answering [`KIB`] of JSON, behind `IdempotencyLayer::memory()`.
    MemoryKib,
    /// The same behind a `SealingStore` over the memory store: every replay opens its record.
    MemoryKibSealed,
    /// 1 KiB answers on the PostgreSQL store with no cache in front: every replay reads a row.
    KibNoCache,
    /// The same behind a `SealingStore`: every replay reads a row and opens it.
    KibNoCacheSealed,
    /// A charge that authorizes at an acquirer over loopback HTTP, then `INSERT`s through the
    /// pool, behind `IdempotencyLayer::postgres(pool)` ([`two_step`]).
    AcquirerLease,
    /// The same two calls as [`Steps`](tower_idempotency::Steps): `authorize`, then `ledger`
    /// in a transaction with its record.
    AcquirerSteps,
}

impl App {
    /// Whether the app needs the run's database.
    pub(crate) fn uses_database(self) -> bool {
        match self {
            Self::Bare
            | Self::Lease
            | Self::LeaseWait
            | Self::SlowLease
            | Self::SlowLeaseWait
            | Self::LeaseNoCache
            | Self::LeasePartitioned
            | Self::Transactional
            | Self::KibNoCache
            | Self::KibNoCacheSealed
            | Self::AcquirerLease
            | Self::AcquirerSteps => true,
            Self::MemoryBare
            | Self::Memory
            | Self::MemoryBareBusy
            | Self::AnyBodyBare
            | Self::AnyBodyMemory
            | Self::MemoryKib
            | Self::MemoryKibSealed => false,
        }
    }

    /// The name of the app on the `serve` command line.
    pub(crate) fn as_arg(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::Lease => "lease",
            Self::LeaseWait => "lease-wait",
            Self::SlowLease => "slow-lease",
            Self::SlowLeaseWait => "slow-lease-wait",
            Self::LeaseNoCache => "lease-no-cache",
            Self::LeasePartitioned => "lease-partitioned",
            Self::Transactional => "transactional",
            Self::MemoryBare => "memory-bare",
            Self::Memory => "memory",
            Self::MemoryBareBusy => "memory-bare-busy",
            Self::AnyBodyBare => "any-body-bare",
            Self::AnyBodyMemory => "any-body-memory",
            Self::MemoryKib => "memory-kib",
            Self::MemoryKibSealed => "memory-kib-sealed",
            Self::KibNoCache => "kib-no-cache",
            Self::KibNoCacheSealed => "kib-no-cache-sealed",
            Self::AcquirerLease => "acquirer-lease",
            Self::AcquirerSteps => "acquirer-steps",
        }
    }

    /// The store the app's layer uses (and its expiry loop), for apps with a PostgreSQL layer.
    pub(crate) fn store(self, pool: &PgPool) -> Option<PostgresStore> {
        match self {
            Self::Lease
            | Self::LeaseWait
            | Self::SlowLease
            | Self::SlowLeaseWait
            | Self::LeaseNoCache
            | Self::KibNoCache
            | Self::KibNoCacheSealed
            | Self::AcquirerLease
            | Self::AcquirerSteps => Some(PostgresStore::new(pool.clone())),
            Self::Transactional => Some(PostgresStore::new(pool.clone()).transactional()),
            Self::LeasePartitioned => Some(partitioned_store(pool)),
            Self::Bare
            | Self::MemoryBare
            | Self::Memory
            | Self::MemoryBareBusy
            | Self::AnyBodyBare
            | Self::AnyBodyMemory
            | Self::MemoryKib
            | Self::MemoryKibSealed => None,
        }
    }
}

/// The store of [`App::LeasePartitioned`]: partitioned mode, [`PARTITION_WIDTH`] wide
/// partitions.
pub(crate) fn partitioned_store(pool: &PgPool) -> PostgresStore {
    PostgresStore::new(pool.clone())
        .partitioned(PARTITION_WIDTH)
        .expect("PARTITION_WIDTH is a valid width")
}

/// Builds `app`. `pool` is `Some` exactly for apps that [use the database](App::uses_database).
pub(crate) fn router(app: App, pool: Option<PgPool>) -> Router {
    let routes = match (app, pool) {
        (App::Bare, Some(pool)) => charges(pool),
        (App::Lease, Some(pool)) => charges(pool.clone()).layer(IdempotencyLayer::postgres(pool)),
        (App::LeaseWait, Some(pool)) => charges(pool.clone()).layer(
            IdempotencyLayer::postgres(pool)
                .with_in_flight_wait(InFlightWait::up_to(IN_FLIGHT_WAIT))
                .expect("a wait"),
        ),
        (App::SlowLease, Some(pool)) => {
            slow_charges(pool.clone()).layer(IdempotencyLayer::postgres(pool))
        }
        (App::SlowLeaseWait, Some(pool)) => slow_charges(pool.clone()).layer(
            IdempotencyLayer::postgres(pool)
                .with_in_flight_wait(InFlightWait::up_to(IN_FLIGHT_WAIT))
                .expect("a wait"),
        ),
        (App::LeaseNoCache, Some(pool)) => {
            charges(pool.clone()).layer(IdempotencyLayer::new(PostgresStore::new(pool)))
        }
        (App::LeasePartitioned, Some(pool)) => {
            let store = partitioned_store(&pool);
            charges(pool).layer(IdempotencyLayer::new(store))
        }
        (App::Transactional, Some(pool)) => Router::new()
            .route(CHARGES_PATH, post(create_charge_in_transaction))
            .layer(IdempotencyLayer::new(
                PostgresStore::new(pool).transactional(),
            )),
        (App::AcquirerLease, Some(pool)) => two_step::router(pool, false),
        (App::AcquirerSteps, Some(pool)) => two_step::router(pool, true),
        (App::MemoryBare, _) => no_io(),
        (App::Memory, _) => no_io().layer(IdempotencyLayer::memory()),
        (App::MemoryBareBusy, _) => no_io().layer(middleware::from_fn(busy)),
        (App::AnyBodyBare, _) => any_body(),
        (App::AnyBodyMemory, _) => any_body().layer(IdempotencyLayer::memory()),
        (App::MemoryKib, _) => kib().layer(IdempotencyLayer::memory()),
        (App::MemoryKibSealed, _) => {
            let keys = SealingKeys::new(1, SEAL_KEY);
            kib().layer(IdempotencyLayer::new(SealingStore::new(
                MemoryStore::new(),
                keys,
            )))
        }
        (App::KibNoCache, Some(pool)) => {
            kib().layer(IdempotencyLayer::new(PostgresStore::new(pool)))
        }
        (App::KibNoCacheSealed, Some(pool)) => {
            let keys = SealingKeys::new(1, SEAL_KEY);
            kib().layer(IdempotencyLayer::new(SealingStore::new(
                PostgresStore::new(pool),
                keys,
            )))
        }
        (
            App::Bare
            | App::Lease
            | App::LeaseWait
            | App::SlowLease
            | App::SlowLeaseWait
            | App::LeaseNoCache
            | App::LeasePartitioned
            | App::Transactional
            | App::KibNoCache
            | App::KibNoCacheSealed
            | App::AcquirerLease
            | App::AcquirerSteps,
            None,
        ) => {
            unreachable!("the caller connects a pool for every app that uses the database")
        }
    };
    // Outermost, so the principal is in place when the idempotency layer looks for it.
    routes.layer(middleware::from_fn(authenticate))
}

fn charges(pool: PgPool) -> Router {
    Router::new()
        .route(CHARGES_PATH, post(create_charge))
        .with_state(pool)
}

/// The charge handler, after [`SLOW_HANDLER`] of waiting (inside the idempotency layer, so the
/// key stays in flight meanwhile).
fn slow_charges(pool: PgPool) -> Router {
    charges(pool).layer(middleware::from_fn(slowly))
}

/// Sleeps [`SLOW_HANDLER`], then hands the request on: a handler that takes its time, as one
/// calling a payment network does.
async fn slowly(request: Request, next: Next) -> Response {
    tokio::time::sleep(SLOW_HANDLER).await;
    next.run(request).await
}

fn no_io() -> Router {
    Router::new()
        .route(CHARGES_PATH, post(create_charge_in_memory))
        .with_state(Arc::new(AtomicU64::new(0)))
}

fn kib() -> Router {
    Router::new()
        .route(CHARGES_PATH, post(create_kib_charge_in_memory))
        .with_state(Arc::new(AtomicU64::new(0)))
}

fn any_body() -> Router {
    Router::new()
        .route(CHARGES_PATH, post(create_charge_from_any_body))
        .with_state(Arc::new(AtomicU64::new(0)))
}

/// What a client asks for. A large request carries other fields (`metadata`), read and ignored.
#[derive(Debug, Deserialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

/// What the API answers.
#[derive(Debug, Serialize)]
struct Charge {
    id: String,
    object: &'static str,
    account: String,
    amount: i64,
    currency: String,
}

/// Stands in for real authentication: the bearer token is the account.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .and_then(|account| Principal::new(account).ok());
    match account {
        Some(principal) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        None => (StatusCode::UNAUTHORIZED, "missing bearer token").into_response(),
    }
}

/// One `INSERT` through the pool, then `201 Created` with the charge.
async fn create_charge(
    State(pool): State<PgPool>,
    Extension(principal): Extension<Principal>,
    Json(new): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), HandlerError> {
    let id = insert_charge(&pool, &principal, &new).await?;
    Ok(created(id, &principal, new))
}

/// The same `INSERT`, in the transaction the layer opened for the key; the layer commits it
/// with the record.
async fn create_charge_in_transaction(
    mut tx: IdempotentTx,
    Extension(principal): Extension<Principal>,
    Json(new): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), HandlerError> {
    let id = insert_charge(&mut *tx, &principal, &new).await?;
    Ok(created(id, &principal, new))
}

/// The charge's one `INSERT`, through the pool or the request's transaction; its id.
async fn insert_charge<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    principal: &Principal,
    new: &NewCharge,
) -> Result<i64, HandlerError> {
    sqlx::query_scalar(INSERT_CHARGE)
        .bind(principal.as_str())
        .bind(new.amount)
        .bind(&new.currency)
        .fetch_one(executor)
        .await
        .map_err(HandlerError)
}

/// The same answer without any I/O: the id comes from a counter.
async fn create_charge_in_memory(
    State(ids): State<Arc<AtomicU64>>,
    Extension(principal): Extension<Principal>,
    Json(new): Json<NewCharge>,
) -> (StatusCode, Json<Charge>) {
    let id = ids.fetch_add(1, Ordering::Relaxed) + 1;
    created(i64::try_from(id).unwrap_or(i64::MAX), &principal, new)
}

/// The charge of [`create_charge_in_memory`] with a `description` that pads it to [`KIB`].
async fn create_kib_charge_in_memory(
    State(ids): State<Arc<AtomicU64>>,
    Extension(principal): Extension<Principal>,
    Json(new): Json<NewCharge>,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], String) {
    let id = ids.fetch_add(1, Ordering::Relaxed) + 1;
    let mut json = format!(
        r#"{{"id":"ch_{id}","object":"charge","account":"{}","amount":{},"currency":"{}","description":""#,
        principal.as_str(),
        new.amount,
        new.currency
    );
    let pad = KIB.saturating_sub(json.len() + 2);
    json.extend(std::iter::repeat_n('x', pad));
    json.push_str(r#""}"#);
    let content_type = [(header::CONTENT_TYPE, "application/json")];
    (StatusCode::CREATED, content_type, json)
}

/// Reads the whole body, whatever its type, and answers with a charge of fixed amount, parsing
/// nothing: the body's cost is left to the layer in front.
async fn create_charge_from_any_body(
    State(ids): State<Arc<AtomicU64>>,
    Extension(principal): Extension<Principal>,
    _body: Bytes,
) -> (StatusCode, Json<Charge>) {
    let id = ids.fetch_add(1, Ordering::Relaxed) + 1;
    let new = NewCharge {
        amount: 1000,
        currency: "usd".to_owned(),
    };
    created(i64::try_from(id).unwrap_or(i64::MAX), &principal, new)
}

fn created(id: i64, principal: &Principal, new: NewCharge) -> (StatusCode, Json<Charge>) {
    (
        StatusCode::CREATED,
        Json(Charge {
            id: format!("ch_{id}"),
            object: "charge",
            account: principal.as_str().to_owned(),
            amount: new.amount,
            currency: new.currency,
        }),
    )
}

/// The size of [`App::MemoryKib`]'s answers.
const KIB: usize = 1024;

/// The key of [`App::MemoryKibSealed`]: a benchmark's, not a secret.
const SEAL_KEY: [u8; 32] = [0x5e; 32];

/// How long [`App::MemoryBareBusy`] keeps the CPU busy per request.
const BUSY: Duration = Duration::from_micros(1);

/// Spins for [`BUSY`], then hands the request on: CPU time and nothing else, no allocation, no
/// I/O, no sleep.
async fn busy(request: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    while started.elapsed() < BUSY {
        std::hint::spin_loop();
    }
    next.run(request).await
}

/// A database error in the handler: `500`. The first one is logged; the load generator counts
/// them all.
struct HandlerError(sqlx::Error);

impl IntoResponse for HandlerError {
    fn into_response(self) -> Response {
        static LOGGED: AtomicBool = AtomicBool::new(false);
        if !LOGGED.swap(true, Ordering::Relaxed) {
            tracing::error!(error = %self.0, "charge handler failed (further failures are not logged)");
        }
        (StatusCode::INTERNAL_SERVER_ERROR, "charge failed").into_response()
    }
}
