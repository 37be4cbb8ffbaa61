//! The application under test: handlers that count their executions, can be held at a gate, and
//! answer with whatever status, headers and bytes a scenario needs.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{
    Extension, Router,
    body::Bytes,
    extract::{Path, Query, Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use tokio::sync::Semaphore;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, Principal, Retention, store::Store};

/// Shared with the handlers: what ran, and the gate they may wait at.
#[derive(Clone)]
pub struct Probe {
    executions: Arc<AtomicUsize>,
    started: Arc<Semaphore>,
    gate: Arc<Semaphore>,
    finished: Arc<Semaphore>,
    abandoned: Arc<Semaphore>,
}

impl Default for Probe {
    fn default() -> Self {
        let closed = || Arc::new(Semaphore::new(0));
        Self {
            executions: Arc::default(),
            started: closed(),
            gate: closed(),
            finished: closed(),
            abandoned: closed(),
        }
    }
}

impl Probe {
    /// How many times any handler body ran.
    pub fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }

    /// Waits until `n` more handlers have started (failing the test after 30 s).
    pub async fn started(&self, n: u32) {
        within(self.started.acquire_many(n), "handlers to start").await;
    }

    /// Waits until `n` more gated handlers have finished (failing the test after 30 s).
    pub async fn finished(&self, n: u32) {
        within(self.finished.acquire_many(n), "gated handlers to finish").await;
    }

    /// Lets `n` handlers waiting at the gate go on.
    pub fn open_gate(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// Waits until the server has dropped `n` more requests unanswered (their clients hung
    /// up), failing the test after 30 s. Only [`app`]'s routes report it.
    pub async fn abandoned(&self, n: u32) {
        within(self.abandoned.acquire_many(n), "requests to be abandoned").await;
    }

    /// Waits at the gate, then counts as finished once `then` ran: what a gated handler does.
    async fn at_gate<T>(&self, then: impl FnOnce() -> T) -> T {
        self.gate.acquire().await.expect("open").forget();
        let out = then();
        self.finished.add_permits(1);
        out
    }

    async fn enter(&self, headers: &HeaderMap) -> usize {
        let n = self.executions.fetch_add(1, Ordering::SeqCst) + 1;
        self.started.add_permits(1);
        if headers.contains_key("x-test-gate") {
            self.at_gate(|| ()).await;
        }
        n
    }
}

async fn within(
    permits: impl std::future::Future<
        Output = Result<tokio::sync::SemaphorePermit<'_>, tokio::sync::AcquireError>,
    >,
    what: &str,
) {
    tokio::time::timeout(std::time::Duration::from_secs(30), permits)
        .await
        .unwrap_or_else(|_| panic!("waited 30 s for {what}"))
        .expect("open")
        .forget();
}

/// Reads `Authorization: Bearer <account>` into a [`Principal`]; no header, no principal.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    if let Some(principal) = account.and_then(|account| Principal::new(account).ok()) {
        request.extensions_mut().insert(principal);
    }
    next.run(request).await
}

/// The test routes behind `layer`, with authentication outside it.
pub fn app<St: Store>(layer: IdempotencyLayer<St>, probe: Probe) -> Router {
    Router::new()
        .route("/charges", post(charge).get(list))
        .route("/binary", post(binary))
        .route("/status/{code}", post(status))
        .route("/keep/{code}", post(keep))
        .route("/release/{code}", post(release))
        .route("/panic", post(panic))
        .route("/large", post(large))
        .route("/broken", post(broken))
        .with_state(probe.clone())
        .layer(layer)
        .layer(middleware::from_fn(authenticate))
        .layer(middleware::from_fn(move |request: Request, next: Next| {
            report_abandoned(probe.clone(), request, next)
        }))
}

/// Outermost: counts a request whose response future the server dropped before it was ready
/// (hyper does so when the client hangs up), so that a test knows the layer below has seen
/// the disconnection.
async fn report_abandoned(probe: Probe, request: Request, next: Next) -> Response {
    struct Abandoned(Option<Probe>);
    impl Drop for Abandoned {
        fn drop(&mut self) {
            if let Some(probe) = self.0.take() {
                probe.abandoned.add_permits(1);
            }
        }
    }
    let mut abandoned = Abandoned(Some(probe));
    let response = next.run(request).await;
    abandoned.0 = None;
    response
}

/// Creates a "charge": its number, the request body echoed, and whether it took a key over.
async fn charge(
    State(probe): State<Probe>,
    context: Option<IdempotencyContext>,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    let n = probe.enter(&headers).await;
    let body = serde_json::json!({
        "id": format!("ch_{n}"),
        "object": "charge",
        "request": String::from_utf8_lossy(&body),
        "takeover": context.as_ref().map(IdempotencyContext::takeover),
    });
    (
        StatusCode::CREATED,
        [
            (header::LOCATION, format!("/charges/ch_{n}")),
            (header::SET_COOKIE, "session=secret".to_owned()),
        ],
        axum::Json(body),
    )
}

async fn list(State(probe): State<Probe>, headers: HeaderMap) -> String {
    format!("list {}", probe.enter(&headers).await)
}

/// A response with repeated headers and a body that is not UTF-8.
async fn binary(State(probe): State<Probe>, headers: HeaderMap) -> Response {
    let n = probe.enter(&headers).await;
    let mut response = Response::new(axum::body::Body::from(vec![
        0u8, 159, 146, 150, 255, n as u8,
    ]));
    *response.status_mut() = StatusCode::ACCEPTED;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::ETAG, HeaderValue::from_static("\"v1\""));
    h.append("x-trace", HeaderValue::from_static("a"));
    h.append("x-trace", HeaderValue::from_static("b"));
    h.insert(
        header::DATE,
        HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"),
    );
    response
}

async fn status(State(probe): State<Probe>, headers: HeaderMap, Path(code): Path<u16>) -> Response {
    let n = probe.enter(&headers).await;
    (
        StatusCode::from_u16(code).expect("status"),
        format!("status {code} #{n}"),
    )
        .into_response()
}

async fn keep(State(probe): State<Probe>, headers: HeaderMap, Path(code): Path<u16>) -> Response {
    let n = probe.enter(&headers).await;
    let status = StatusCode::from_u16(code).expect("status");
    (
        status,
        Extension(Retention::Keep),
        format!("kept {code} #{n}"),
    )
        .into_response()
}

async fn release(
    State(probe): State<Probe>,
    headers: HeaderMap,
    Path(code): Path<u16>,
) -> Response {
    let n = probe.enter(&headers).await;
    let status = StatusCode::from_u16(code).expect("status");
    (
        status,
        Extension(Retention::Release),
        format!("released {code} #{n}"),
    )
        .into_response()
}

async fn panic(State(probe): State<Probe>, headers: HeaderMap) -> String {
    let n = probe.enter(&headers).await;
    if n == 1 {
        panic!("handler panicked on purpose");
    }
    format!("survived #{n}")
}

#[derive(serde::Deserialize)]
struct Size {
    bytes: usize,
}

async fn large(
    State(probe): State<Probe>,
    headers: HeaderMap,
    Query(size): Query<Size>,
) -> Response {
    probe.enter(&headers).await;
    let mut response = Response::new(axum::body::Body::from(vec![b'x'; size.bytes]));
    response
        .headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static("/exports/1"));
    response
}

/// A `201` whose body fails after its first bytes, as a handler streaming from a source that
/// breaks does.
async fn broken(State(probe): State<Probe>, headers: HeaderMap) -> Response {
    let n = probe.enter(&headers).await;
    let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
        Ok(Bytes::from(format!("partial #{n}"))),
        Err(std::io::Error::other("the source broke")),
    ];
    (
        StatusCode::CREATED,
        axum::body::Body::from_stream(futures_util::stream::iter(chunks)),
    )
        .into_response()
}

/// The table the transactional routes write to, in the test's own database.
pub const CHARGES_TABLE: &str = "CREATE TABLE IF NOT EXISTS charges (
    id bigserial PRIMARY KEY,
    idempotency_key text NOT NULL,
    body text NOT NULL
)";

#[derive(Clone)]
struct TxState {
    probe: Probe,
    pool: sqlx::PgPool,
}

/// Routes whose handlers write charges to PostgreSQL: `/tx/charges` through the request's
/// [`IdempotentTx`](tower_idempotency::IdempotentTx), `/tx/untransacted` straight to the pool.
/// Headers steer them: `x-test-gate` (wait at the probe's gate after the insert),
/// `x-test-status: N` (answer N after the insert), `x-test-panic`, `x-test-abort` (make the
/// transaction fail, then answer 201), `x-test-catch` (insert, and answer `409` if the insert
/// fails, as a handler catching a unique violation does), `x-test-keep-tx` (answer 201 while a task keeps the
/// transaction until the probe's gate opens), `x-test-hang` (print `handler started` on stdout
/// after the insert, then never return: for a child process about to be killed).
pub fn tx_app<St: Store>(layer: IdempotencyLayer<St>, probe: Probe, pool: sqlx::PgPool) -> Router {
    Router::new()
        .route("/tx/charges", post(tx_charge))
        .route("/tx/untransacted", post(untransacted_charge))
        .with_state(TxState {
            probe: probe.clone(),
            pool,
        })
        .layer(layer)
        .layer(middleware::from_fn(authenticate))
        .layer(middleware::from_fn(move |request: Request, next: Next| {
            report_abandoned(probe.clone(), request, next)
        }))
}

async fn tx_charge(
    State(state): State<TxState>,
    context: IdempotencyContext,
    mut tx: tower_idempotency::IdempotentTx,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if headers.contains_key("x-test-catch") {
        state.probe.enter(&headers).await;
        let inserted = sqlx::query("INSERT INTO charges (idempotency_key, body) VALUES ($1, $2)")
            .bind(context.key().as_str())
            .bind(String::from_utf8_lossy(&body).into_owned())
            .execute(&mut *tx)
            .await;
        return match inserted {
            Ok(_) => StatusCode::CREATED.into_response(),
            Err(_) => (
                StatusCode::CONFLICT,
                axum::Json(serde_json::json!({ "error": "duplicate charge" })),
            )
                .into_response(),
        };
    }
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO charges (idempotency_key, body) VALUES ($1, $2) RETURNING id",
    )
    .bind(context.key().as_str())
    .bind(String::from_utf8_lossy(&body).into_owned())
    .fetch_one(&mut *tx)
    .await
    .expect("insert charge");
    if headers.contains_key("x-test-hang") {
        use std::io::Write;
        let mut stdout = std::io::stdout();
        let _ = writeln!(stdout, "handler started");
        let _ = stdout.flush();
        std::future::pending::<()>().await;
    }
    let n = state.probe.enter(&headers).await;
    if headers.contains_key("x-test-panic") {
        panic!("handler panicked after its insert");
    }
    if headers.contains_key("x-test-keep-tx") {
        // Answers while a task still holds the transaction, until the probe's gate opens.
        let probe = state.probe.clone();
        tokio::spawn(async move { probe.at_gate(move || drop(tx)).await });
        let body = serde_json::json!({ "id": id, "execution": n });
        return (StatusCode::CREATED, axum::Json(body)).into_response();
    }
    if headers.contains_key("x-test-abort") {
        let failed = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
        assert!(failed.is_err(), "division by zero fails");
    }
    let status = headers
        .get("x-test-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .and_then(|code| StatusCode::from_u16(code).ok())
        .unwrap_or(StatusCode::CREATED);
    let body = serde_json::json!({ "id": id, "execution": n });
    (status, axum::Json(body)).into_response()
}

async fn untransacted_charge(
    State(state): State<TxState>,
    context: IdempotencyContext,
    headers: HeaderMap,
) -> Response {
    let n = state.probe.enter(&headers).await;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO charges (idempotency_key, body) VALUES ($1, '') RETURNING id",
    )
    .bind(context.key().as_str())
    .fetch_one(&state.pool)
    .await
    .expect("insert charge");
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({ "id": id, "execution": n })),
    )
        .into_response()
}
