//! Test support: the demo's `app()` on either backend, requests as Stripe's clients send them,
//! and a gate that holds charges inside the card processor.
#![allow(dead_code, unreachable_pub)]

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::{Body, Bytes},
    http::{HeaderMap, Request, StatusCode},
};
use charges_demo::{AppState, Settings, app, processor::CardProcessor};
use http_body_util::BodyExt;
pub use idempotency_tests::bounded;
use idempotency_tests::db::TestDb;
use serde_json::Value;
use tokio::sync::Semaphore;
use tower::ServiceExt;

/// Where keys and charges are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Postgres,
}

/// The app under test, with the database it runs on (dropped with it).
pub struct Harness {
    pub app: Router,
    pub db: Option<TestDb>,
}

impl Harness {
    pub async fn start(backend: Backend) -> Self {
        Self::with_processor(backend, CardProcessor::default()).await
    }

    pub async fn with_processor(backend: Backend, processor: CardProcessor) -> Self {
        let settings = Settings::default();
        match backend {
            Backend::Memory => Self {
                app: app(AppState::memory(&settings)
                    .expect("settings")
                    .with_processor(processor)),
                db: None,
            },
            Backend::Postgres => {
                let db = TestDb::new().await;
                charges_demo::migrate(db.pool()).await.expect("migrate");
                let state = AppState::postgres(db.pool().clone(), &settings)
                    .expect("settings")
                    .with_processor(processor);
                Self {
                    app: app(state),
                    db: Some(db),
                }
            }
        }
    }

    pub async fn send(&self, request: Request<Body>) -> Reply {
        let response = self.app.clone().oneshot(request).await.expect("infallible");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// The account's charges, newest first (up to 100).
    pub async fn charges_of(&self, api_key: &str) -> Vec<Value> {
        self.list_of(api_key, "/v1/charges?limit=100").await
    }

    /// The account's refunds, newest first (up to 100).
    pub async fn refunds_of(&self, api_key: &str) -> Vec<Value> {
        self.list_of(api_key, "/v1/refunds?limit=100").await
    }

    async fn list_of(&self, api_key: &str, path: &str) -> Vec<Value> {
        let reply = self.send(get(api_key, path)).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.json()["data"].as_array().expect("data").clone()
    }

    /// A new charge of `amount` that succeeded: its id.
    pub async fn charged(&self, api_key: &str, amount: i64) -> String {
        let form = format!("amount={amount}&currency=usd");
        let reply = self.send(charge(api_key, Some(&new_key()), &form)).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.json()["id"].as_str().expect("an id").to_owned()
    }

    /// The charge `id` as the API shows it.
    pub async fn charge_of(&self, api_key: &str, id: &str) -> Value {
        let reply = self.send(get(api_key, &format!("/v1/charges/{id}"))).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.json()
    }
}

/// A response, its body collected.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn replayed(&self) -> bool {
        idempotency_tests::requests::replayed(&self.headers)
    }

    pub fn content_type(&self) -> &str {
        self.headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// Asserts a Stripe-style error of `status` and `type`, and returns its `error` object.
    pub fn stripe_error(&self, status: StatusCode, kind: &str) -> Value {
        assert_eq!(self.status, status, "{}", self.text());
        assert_eq!(self.content_type(), "application/json");
        let error = self.json()["error"].clone();
        assert_eq!(error["type"], kind, "{}", self.text());
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}",
            self.text()
        );
        error
    }

    /// A response header, if present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// `Stripe-Should-Retry`, as Stripe's libraries read it.
    pub fn should_retry(&self) -> Option<bool> {
        match self.header("stripe-should-retry") {
            Some("true") => Some(true),
            Some("false") => Some(false),
            Some(other) => panic!("Stripe-Should-Retry is true or false, not {other:?}"),
            None => None,
        }
    }

    /// Asserts a refusal of the idempotency layer, of `status` and kind `kind`: an RFC 9457
    /// problem document (its members, of the types the RFC gives them) whose extension member
    /// `error` is a Stripe error object, with `Stripe-Should-Retry`. Returns `error`.
    pub fn problem(&self, status: StatusCode, kind: &str) -> Value {
        assert_eq!(self.status, status, "{}", self.text());
        assert_eq!(self.content_type(), "application/problem+json");
        assert_eq!(self.header("cache-control"), Some("no-store"));
        let problem = self.json();
        let members = problem.as_object().expect("a JSON object");
        let problem_type = members["type"].as_str().expect("`type` is a string");
        assert!(
            problem_type.starts_with("https://")
                && problem_type.ends_with(&format!("#variant.{kind}")),
            "`type` is an absolute URI naming {kind}: {problem_type}"
        );
        assert!(
            members["title"].as_str().is_some_and(|t| !t.is_empty()),
            "`title` is a string: {problem}"
        );
        assert_eq!(
            members["status"].as_u64(),
            Some(u64::from(status.as_u16())),
            "`status` is the response's status, as a number: {problem}"
        );
        assert!(
            members["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "`detail` is a string: {problem}"
        );
        let error = members["error"].clone();
        assert!(
            error["type"].as_str().is_some_and(|t| !t.is_empty()),
            "`error` is a Stripe error object: {problem}"
        );
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{problem}"
        );
        assert!(self.should_retry().is_some(), "Stripe-Should-Retry is set");
        error
    }
}

/// A Stripe request id: `req_` and letters and digits.
pub fn is_request_id(id: &str) -> bool {
    id.strip_prefix("req_")
        .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric()))
}

pub fn new_key() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A fresh API key: an account of its own.
pub fn new_api_key() -> String {
    format!("sk_test_{}", uuid::Uuid::new_v4().simple())
}

/// `POST /v1/charges` with a form body, as Stripe's libraries send it.
pub fn charge(api_key: &str, idempotency_key: Option<&str>, form: &str) -> Request<Body> {
    let mut request = Request::post("/v1/charges")
        .header("authorization", format!("Bearer {api_key}"))
        .header("content-type", "application/x-www-form-urlencoded");
    if let Some(key) = idempotency_key {
        request = request.header("idempotency-key", key);
    }
    request.body(Body::from(form.to_owned())).expect("request")
}

/// `POST /v1/charges` with a JSON body.
pub fn charge_json(api_key: &str, idempotency_key: &str, json: &Value) -> Request<Body> {
    Request::post("/v1/charges")
        .header("authorization", format!("Bearer {api_key}"))
        .header("idempotency-key", idempotency_key)
        .header("content-type", "application/json")
        .body(Body::from(json.to_string()))
        .expect("request")
}

/// `POST /v1/refunds` with a form body, as Stripe's libraries send it.
pub fn refund(api_key: &str, idempotency_key: Option<&str>, form: &str) -> Request<Body> {
    let mut request = Request::post("/v1/refunds")
        .header("authorization", format!("Bearer {api_key}"))
        .header("content-type", "application/x-www-form-urlencoded");
    if let Some(key) = idempotency_key {
        request = request.header("idempotency-key", key);
    }
    request.body(Body::from(form.to_owned())).expect("request")
}

pub fn get(api_key: &str, path: &str) -> Request<Body> {
    Request::get(path)
        .header("authorization", format!("Bearer {api_key}"))
        .body(Body::empty())
        .expect("request")
}

/// Holds every charge and refund at the start of the card processor until released, and counts
/// them.
#[derive(Clone)]
pub struct Gate {
    started: Arc<Semaphore>,
    release: Arc<Semaphore>,
    entered: Arc<AtomicUsize>,
}

impl Gate {
    pub fn new() -> Self {
        Self {
            started: Arc::new(Semaphore::new(0)),
            release: Arc::new(Semaphore::new(0)),
            entered: Arc::default(),
        }
    }

    /// A processor with `delay` whose every charge and refund waits at this gate first.
    pub fn processor(&self, delay: Duration) -> CardProcessor {
        let gate = self.clone();
        CardProcessor::new(delay).with_hook(move || {
            let gate = gate.clone();
            async move {
                gate.entered.fetch_add(1, Ordering::SeqCst);
                gate.started.add_permits(1);
                gate.release.acquire().await.expect("open").forget();
            }
        })
    }

    /// Waits until one more charge or refund reached the processor.
    pub async fn started(&self) {
        self.started.acquire().await.expect("open").forget();
    }

    /// Lets `n` waiting charges or refunds go on.
    pub fn release(&self, n: usize) {
        self.release.add_permits(n);
    }

    /// How many charges and refunds reached the processor.
    pub fn entered(&self) -> usize {
        self.entered.load(Ordering::SeqCst)
    }
}
