//! The three servers: the same charge handler bare, behind tower-idempotency's memory store,
//! and behind axum-idempotent with ruts' in-memory (moka) session store, each on a loopback
//! port of its own.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Json, Router,
    extract::{Request, State},
    http::{HeaderMap, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::{CookieOptions, Session, SessionLayer, store::moka::MokaStore};
use serde::Deserialize;
use serde_json::json;
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};
use tower_cookies::CookieManagerLayer;
use tower_idempotency::{IdempotencyLayer, Principal};

/// The path of the charge endpoint on every server.
pub(crate) const CHARGES: &str = "/v1/charges";
/// The path a client posts to once to open a session (the peer caches responses only for
/// requests that carry one); a no-op on the other servers.
pub(crate) const LOGIN: &str = "/login";
/// The name of the peer's session cookie.
pub(crate) const SESSION_COOKIE: &str = "session";

/// The `name=value` of the peer's session cookie that `response` sets, if it sets one.
pub(crate) fn session_cookie(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .filter_map(|value| value.split(';').next())
        .find(|pair| pair.starts_with(&format!("{SESSION_COOKIE}=")))
        .map(str::to_owned)
}

/// Which server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The handler with no idempotency layer.
    Bare,
    /// `IdempotencyLayer::memory()`.
    Ours,
    /// `axum_idempotent::IdempotentLayer` in direct-key mode on ruts' `MokaStore`.
    Peer,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare handler",
            Self::Ours => "tower-idempotency (memory store)",
            Self::Peer => "axum-idempotent 0.6 (ruts moka store)",
        }
    }
}

/// What the handler did: how many times it started, per key, and how many runs finished.
#[derive(Debug)]
pub(crate) struct Ledger {
    delay: Duration,
    started: AtomicU64,
    per_key: Mutex<HashMap<String, u32>>,
    finished: watch::Sender<u64>,
}

impl Ledger {
    /// Times the handler started for `key`.
    pub(crate) fn executions(&self, key: &str) -> u32 {
        let per_key = self.per_key.lock().unwrap_or_else(PoisonError::into_inner);
        per_key.get(key).copied().unwrap_or(0)
    }

    /// Waits until `n` runs of the handler have finished, at most `limit`; whether they did.
    pub(crate) async fn finished(&self, n: u64, limit: Duration) -> bool {
        let mut finished = self.finished.subscribe();
        tokio::time::timeout(limit, finished.wait_for(|done| *done >= n))
            .await
            .is_ok_and(|done| done.is_ok())
    }

    pub(crate) fn finished_runs(&self) -> u64 {
        *self.finished.borrow()
    }
}

/// A running server.
pub(crate) struct Server {
    pub(crate) kind: Kind,
    pub(crate) addr: SocketAddr,
    pub(crate) ledger: Arc<Ledger>,
    task: JoinHandle<()>,
}

impl Server {
    /// Starts `kind` on `127.0.0.1:0`; its handler takes `delay` (a card network's latency).
    pub(crate) async fn start(kind: Kind, delay: Duration) -> std::io::Result<Self> {
        let ledger = Arc::new(Ledger {
            delay,
            started: AtomicU64::new(0),
            per_key: Mutex::default(),
            finished: watch::Sender::new(0),
        });
        let charges = Router::new()
            .route(CHARGES, post(charge))
            .with_state(ledger.clone());
        let app = match kind {
            Kind::Bare => charges.route(LOGIN, post(|| async { StatusCode::NO_CONTENT })),
            Kind::Ours => charges
                .layer(IdempotencyLayer::memory())
                .route(LOGIN, post(|| async { StatusCode::NO_CONTENT })),
            Kind::Peer => {
                let options = IdempotentOptions::default()
                    .use_idempotency_key_header(Some("Idempotency-Key"), true)
                    .replay_header_name("Idempotent-Replayed")
                    .expire_after(24 * 60 * 60);
                let store = Arc::new(MokaStore::builder().build());
                charges
                    .layer(IdempotentLayer::<MokaStore>::new(options))
                    .route(LOGIN, post(login))
                    .layer(
                        SessionLayer::new(store)
                            .with_cookie_options(CookieOptions::build().name(SESSION_COOKIE)),
                    )
                    .layer(CookieManagerLayer::new())
            }
        };
        // Every server authenticates alike (outermost): the bearer token is the account.
        let app = app.layer(middleware::from_fn(authenticate));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            kind,
            addr,
            ledger,
            task,
        })
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Debug, Deserialize)]
struct NewCharge {
    amount: i64,
    currency: String,
}

/// The charge: counted when it starts (that is when a card would be charged), then `delay`.
async fn charge(
    State(ledger): State<Arc<Ledger>>,
    headers: HeaderMap,
    Json(new): Json<NewCharge>,
) -> (StatusCode, Json<serde_json::Value>) {
    let n = ledger.started.fetch_add(1, Ordering::Relaxed) + 1;
    if let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) {
        let mut per_key = ledger
            .per_key
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *per_key.entry(key.to_owned()).or_default() += 1;
    }
    if !ledger.delay.is_zero() {
        tokio::time::sleep(ledger.delay).await;
    }
    ledger.finished.send_modify(|done| *done += 1);
    (
        StatusCode::CREATED,
        Json(json!({
            "id": format!("ch_{n}"),
            "object": "charge",
            "amount": new.amount,
            "currency": new.currency,
        })),
    )
}

/// Opens a session for the peer: it stores responses only in an existing session.
async fn login(session: Session<MokaStore>) -> StatusCode {
    let ttl = ruts::store::Ttl::new(24 * 60 * 60).expect("a valid TTL");
    match session.set("account", &"signed-in", ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

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
