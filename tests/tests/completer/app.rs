//! The completer tests' app: handlers that crash on each key's first run, the layer that keeps
//! their requests, and the client's side.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use axum::{
    Extension, Router,
    body::Body,
    extract::State,
    http::{HeaderMap, HeaderName, Request, StatusCode},
    response::{IntoResponse, Response},
    routing,
};
use http_body_util::BodyExt;
use idempotency_tests::{db::TestDb, requests::replayed};
use tower::ServiceExt;
use tower_idempotency::{
    Completer, Completing, Completion, IdempotencyContext, IdempotencyLayer, Limits, Principal,
    Retention, Round, StepError, Steps, store::Store,
};

/// How long a hung handler runs before the layer stops it and gives its key up.
const MAX_HANDLER_TIME: Duration = Duration::from_millis(200);
/// The grace of the tests' completers.
const GRACE: Duration = Duration::from_millis(300);
pub(crate) const MERCHANT: HeaderName = HeaderName::from_static("x-merchant");

/// What the handlers saw, shared by every instance of the app.
#[derive(Default)]
pub(crate) struct Seen {
    /// Runs started, per key.
    pub(crate) started: Mutex<HashMap<String, u32>>,
    /// Runs that answered, per key.
    pub(crate) finished: Mutex<HashMap<String, u32>>,
    /// Every run hangs (the layer stops it) instead of only each key's first.
    pub(crate) hang_always: bool,
    /// The completer's attempt, when a run came from it, and the headers it carried.
    pub(crate) completions: Mutex<Vec<(u32, HeaderMap)>>,
    pub(crate) authorize_calls: AtomicU32,
    /// The downstream keys the steps were handed, in order.
    pub(crate) downstream: Mutex<Vec<String>>,
}

impl Seen {
    /// Counts a run of `key` starting; whether it hangs (each key's first run, the client's,
    /// stands for a crash mid-way).
    fn start(&self, key: &str) -> bool {
        let mut started = self.started.lock().unwrap();
        let n = started.entry(key.to_owned()).or_default();
        *n += 1;
        self.hang_always || *n == 1
    }

    fn finish(&self, key: &str) -> u32 {
        let mut finished = self.finished.lock().unwrap();
        let n = finished.entry(key.to_owned()).or_default();
        *n += 1;
        *n
    }

    pub(crate) fn count(map: &Mutex<HashMap<String, u32>>, key: &str) -> u32 {
        map.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

pub(crate) fn key_of(headers: &HeaderMap) -> String {
    headers["idempotency-key"].to_str().unwrap().to_owned()
}

fn note_completion(seen: &Seen, completing: Option<Extension<Completing>>, headers: &HeaderMap) {
    if let Some(Extension(completing)) = completing {
        let entry = (completing.attempt(), headers.clone());
        seen.completions.lock().unwrap().push(entry);
    }
}

async fn charge(
    State(seen): State<Arc<Seen>>,
    completing: Option<Extension<Completing>>,
    headers: HeaderMap,
) -> (StatusCode, String) {
    note_completion(&seen, completing, &headers);
    let key = key_of(&headers);
    if seen.start(&key) {
        std::future::pending::<()>().await;
    }
    let n = seen.finish(&key);
    (StatusCode::CREATED, format!("charged {key} {n}"))
}

/// `authorize` as a step, then each key's first run crashes.
async fn charge_in_steps(
    State(seen): State<Arc<Seen>>,
    headers: HeaderMap,
    steps: Steps,
) -> Result<(StatusCode, String), StepError<StatusCode>> {
    let key = key_of(&headers);
    let s = Arc::clone(&seen);
    let auth: u32 = steps
        .run("authorize", move |_| async move {
            Ok::<_, StatusCode>(s.authorize_calls.fetch_add(1, Ordering::SeqCst) + 1)
        })
        .await?;
    if seen.start(&key) {
        std::future::pending::<()>().await;
    }
    seen.finish(&key);
    Ok((StatusCode::CREATED, format!("auth_{auth}")))
}

/// `authorize` as a step; each key's first run crashes, and every later run answers `500`
/// after the recorded step.
async fn charge_in_steps_failing_after(
    State(seen): State<Arc<Seen>>,
    headers: HeaderMap,
    steps: Steps,
) -> Result<StatusCode, StepError<StatusCode>> {
    let key = key_of(&headers);
    let s = Arc::clone(&seen);
    steps
        .run("authorize", move |_| async move {
            Ok::<_, StatusCode>(s.authorize_calls.fetch_add(1, Ordering::SeqCst) + 1)
        })
        .await?;
    if seen.start(&key) {
        std::future::pending::<()>().await;
    }
    Ok(StatusCode::INTERNAL_SERVER_ERROR)
}

/// A call downstream whose answer each key's first run loses: that run answers `503` and gives
/// its key up part-way ([`Retention::Abandon`]), not knowing whether the call went through.
async fn charge_losing_an_answer(
    State(seen): State<Arc<Seen>>,
    headers: HeaderMap,
    idempotency: IdempotencyContext,
    steps: Steps,
) -> Result<Response, StepError<StatusCode>> {
    let key = key_of(&headers);
    let lost = seen.start(&key);
    let s = Arc::clone(&seen);
    let sent = steps
        .run("authorize", move |downstream| async move {
            s.downstream.lock().unwrap().push(downstream.to_string());
            if lost {
                return Err(StatusCode::BAD_GATEWAY);
            }
            Ok(s.authorize_calls.fetch_add(1, Ordering::SeqCst) + 1)
        })
        .await;
    let auth: u32 = match sent {
        Err(StepError::Failed(_)) => {
            let abandon = Extension(Retention::Abandon);
            return Ok((StatusCode::SERVICE_UNAVAILABLE, abandon, "answer lost").into_response());
        }
        other => other?,
    };
    seen.finish(&key);
    let took_over = idempotency.takeover();
    Ok((
        StatusCode::CREATED,
        format!("auth_{auth} takeover={took_over}"),
    )
        .into_response())
}

/// The app with `layer` (its authentication stands outside: requests carry their principal).
pub(crate) fn app<St: Store>(layer: IdempotencyLayer<St>, seen: &Arc<Seen>) -> Router {
    Router::new()
        .route("/v1/charges", routing::post(charge))
        .route("/v1/steps", routing::post(charge_in_steps))
        .route("/v1/lost", routing::post(charge_losing_an_answer))
        .route("/v1/failing", routing::post(charge_in_steps_failing_after))
        .layer(layer)
        .with_state(Arc::clone(seen))
}

pub(crate) fn layer<St: Store>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store)
        .with_limits(Limits::default().with_max_handler_time(MAX_HANDLER_TIME))
        .unwrap()
        .with_step_secret(*b"completer test secret, 32 bytes!")
        .unwrap()
        .with_completion(Completion::storing_headers([MERCHANT]))
        .unwrap()
}

pub(crate) fn completer(store: &impl Store, app: &Router) -> Completer<Router> {
    Completer::new(store, app.clone())
        .unwrap()
        .with_grace(GRACE)
        .unwrap()
}

/// The client's request for `key`, as `acct_a`, with a header named for keeping and one not.
pub(crate) fn request(path: &str, key: &str) -> Request<Body> {
    let mut request = Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .header(MERCHANT, "m_1")
        .header("authorization", "Bearer sk_secret_token")
        .body(Body::from(r#"{"card":"4242424242424242"}"#))
        .unwrap();
    request
        .extensions_mut()
        .insert(Principal::new("acct_a").unwrap());
    request
}

/// Sends the client's request; its status, whether it replayed, and its body.
pub(crate) async fn send(app: &Router, path: &str, key: &str) -> (StatusCode, bool, String) {
    let response = app.clone().oneshot(request(path, key)).await.unwrap();
    let (status, replay) = (response.status(), replayed(response.headers()));
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replay, String::from_utf8(body.to_vec()).unwrap())
}

/// Rounds of `completer` until `done` says the rounds so far are enough, within the test's bound.
pub(crate) async fn rounds_until(
    completer: &Completer<Router>,
    done: impl Fn(&Round) -> bool,
) -> Round {
    let mut total = Round::default();
    loop {
        let round = completer.complete_abandoned().await.expect("a round");
        total.picked += round.picked;
        total.completed += round.completed;
        total.failed += round.failed;
        total.gave_up += round.gave_up;
        if done(&total) {
            return total;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Rounds of `completer` until the handlers have finished `n` runs in all.
pub(crate) async fn rounds_until_finished(
    completer: &Completer<Router>,
    seen: &Seen,
    n: u32,
) -> Round {
    let finished = || seen.finished.lock().unwrap().values().sum::<u32>();
    rounds_until(completer, |_| finished() >= n).await
}

pub(crate) async fn pending_rows(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency.pending_requests")
        .fetch_one(db.pool())
        .await
        .unwrap()
}
