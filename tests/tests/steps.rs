//! `Steps` over real HTTP on both stores (issue 36): a takeover after a finished step does not
//! run it again, a step interrupted mid-call is sent again with the same downstream key, a stale
//! holder records nothing, and downstream keys depend on exactly what they should.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::{Request, State},
    http::{HeaderMap, StatusCode, header},
    middleware::{self, Next},
    response::Response,
    routing,
};
use http_body_util::BodyExt;
use idempotency_tests::{
    bounded,
    requests::{post, replayed},
    server::TestServer,
    store::ObservedStore,
};
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyLayer, KeySource, Principal, StepError, Steps,
    store::{MemoryStore, Store},
};

/// The layers' step secret: the same on every instance.
const SECRET: &[u8; 32] = b"steps test secret, 32 bytes long";

/// What the handlers' steps sent downstream, and where the tests hold them.
struct Downstream {
    /// Each call a step's closure made: the step and the downstream key it was given.
    calls: Mutex<Vec<(&'static str, String)>>,
    fail_next_authorize: AtomicBool,
    /// A handler reached its hold point (after `authorize`).
    reached: Semaphore,
    go_a: Semaphore,
    go_b: Semaphore,
    /// What `run("ledger")` answered each handler: `recorded`, `lost` or `error`.
    ledger_outcomes: Mutex<Vec<&'static str>>,
}

impl Default for Downstream {
    fn default() -> Self {
        Self {
            calls: Mutex::default(),
            fail_next_authorize: AtomicBool::default(),
            reached: Semaphore::new(0),
            go_a: Semaphore::new(0),
            go_b: Semaphore::new(0),
            ledger_outcomes: Mutex::default(),
        }
    }
}

impl Downstream {
    /// Records a call of `step` with `key`; how many calls of `step` there have been.
    fn call(&self, step: &'static str, key: String) -> usize {
        let mut calls = self.calls.lock().unwrap();
        calls.push((step, key));
        calls.iter().filter(|(name, _)| *name == step).count()
    }

    fn keys_of(&self, step: &str) -> Vec<String> {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .filter(|(name, _)| *name == step)
            .map(|(_, key)| key.clone())
            .collect()
    }

    async fn reached(&self) {
        let permit = tokio::time::timeout(Duration::from_secs(30), self.reached.acquire());
        permit
            .await
            .expect("a handler reached its hold point")
            .unwrap()
            .forget();
    }
}

/// `authorize`, then (held where `x-hold` says) `ledger`.
async fn charge(
    State(downstream): State<Arc<Downstream>>,
    headers: HeaderMap,
    steps: Steps,
) -> Result<(StatusCode, String), StepError<StatusCode>> {
    let d = Arc::clone(&downstream);
    let authorization: String = steps
        .run("authorize", move |key| async move {
            let n = d.call("authorize", key.to_string());
            // "Sent", then the connection broke: the processor may have seen it.
            if d.fail_next_authorize.swap(false, Ordering::SeqCst) {
                return Err(StatusCode::BAD_GATEWAY);
            }
            Ok(format!("auth_{n}"))
        })
        .await?;
    hold(&downstream, &headers).await;
    let d = Arc::clone(&downstream);
    let ledger = steps
        .run("ledger", move |key| async move {
            Ok::<_, StatusCode>(d.call("ledger", key.to_string()))
        })
        .await;
    downstream
        .ledger_outcomes
        .lock()
        .unwrap()
        .push(match &ledger {
            Ok(_) => "recorded",
            Err(StepError::Lost) => "lost",
            Err(_) => "error",
        });
    Ok((
        StatusCode::CREATED,
        format!("{authorization} ledger_{}", ledger?),
    ))
}

/// `x-hold: crash` never goes on (the process died); `a` and `b` wait for their gate.
async fn hold(downstream: &Downstream, headers: &HeaderMap) {
    let gate = match headers.get("x-hold").map(|v| v.as_bytes()) {
        Some(b"crash") => None,
        Some(b"a") => Some(&downstream.go_a),
        Some(b"b") => Some(&downstream.go_b),
        _ => return,
    };
    downstream.reached.add_permits(1);
    match gate {
        Some(gate) => gate.acquire().await.unwrap().forget(),
        None => std::future::pending().await,
    }
}

/// `authorize`, then (held where `x-hold` says) `ledger` as a row of `test_ledger` written in
/// the step's own transaction.
async fn charge_in_transaction(
    State(downstream): State<Arc<Downstream>>,
    headers: HeaderMap,
    steps: Steps,
) -> Result<(StatusCode, String), StepError<StatusCode>> {
    let d = Arc::clone(&downstream);
    let authorization: String = steps
        .run("authorize", move |key| async move {
            Ok(format!("auth_{}", d.call("authorize", key.to_string())))
        })
        .await?;
    hold(&downstream, &headers).await;
    let entry: i64 = steps
        .run_in_transaction("ledger", |tx: &mut sqlx::PgConnection, key| {
            Box::pin(async move {
                sqlx::query_scalar(
                    "INSERT INTO test_ledger (downstream_key) VALUES ($1) RETURNING id",
                )
                .bind(key.to_string())
                .fetch_one(tx)
                .await
                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)
            })
        })
        .await?;
    Ok((
        StatusCode::CREATED,
        format!("{authorization} entry_{entry}"),
    ))
}

/// The downstream keys of `authorize` and `ledger`, without running either.
async fn keys(steps: Steps) -> String {
    format!(
        "{} {}",
        steps.downstream_key("authorize"),
        steps.downstream_key("ledger")
    )
}

async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|account| Principal::new(account.to_owned()).ok());
    if let Some(principal) = account {
        request.extensions_mut().insert(principal);
    }
    next.run(request).await
}

/// One instance of the app on `store`, with `secret`.
fn instance<St: Store>(store: St, secret: &[u8], downstream: Arc<Downstream>) -> Router {
    let layer = IdempotencyLayer::new(store)
        .with_key(KeySource::default().required())
        .with_step_secret(secret)
        .expect("a long enough secret");
    Router::new()
        .route("/charges", routing::post(charge))
        .route("/keys", routing::post(keys))
        .route("/charges-in-tx", routing::post(charge_in_transaction))
        .with_state(downstream)
        .layer(layer)
        .layer(middleware::from_fn(authenticate))
}

/// A store shared by two app instances, and the means to lapse its leases.
trait Backend: Sized {
    type Store: Store + Clone;
    async fn start() -> Self;
    fn store(&self) -> Self::Store;
    /// Makes every lease in flight lapse now.
    async fn lapse_leases(&self);
}

/// Two instances of the app on one store: `a` (whose store can be cut off, as a crashed
/// process's) and `b`.
struct Pair<B: Backend> {
    backend: B,
    a_store: ObservedStore<B::Store>,
    a: TestServer,
    b: TestServer,
    downstream: Arc<Downstream>,
    client: reqwest::Client,
}

impl<B: Backend> Pair<B> {
    async fn start() -> Self {
        let backend = B::start().await;
        let downstream = Arc::new(Downstream::default());
        let a_store = ObservedStore::new(backend.store());
        let a = instance(a_store.clone(), SECRET, Arc::clone(&downstream));
        let b = instance(backend.store(), SECRET, Arc::clone(&downstream));
        Self {
            a: TestServer::start(a).await,
            b: TestServer::start(b).await,
            backend,
            a_store,
            downstream,
            client: reqwest::Client::new(),
        }
    }

    /// Instance `a`'s process stops reaching the store (its heartbeat fails), and its lease
    /// lapses.
    async fn crash_a(&self) {
        self.a_store.set_down(true);
        self.backend.lapse_leases().await;
    }
}

/// A handler that finished `authorize` and died: the request that takes the key over gets
/// the recorded authorization without calling the processor again, and runs `ledger` once.
async fn a_takeover_does_not_run_a_finished_step_again<B: Backend>() {
    let p = Pair::<B>::start().await;
    let crashed = post(&p.client, &p.a, "/charges", "k-crash")
        .header("x-hold", "crash")
        .send();
    let crashed = tokio::spawn(crashed);
    p.downstream.reached().await;
    p.crash_a().await;

    let retry = post(&p.client, &p.b, "/charges", "k-crash")
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.text().await.unwrap(), "auth_1 ledger_1");
    assert_eq!(
        p.downstream.keys_of("authorize").len(),
        1,
        "authorized twice"
    );
    assert_eq!(p.downstream.keys_of("ledger").len(), 1);

    let replay = post(&p.client, &p.b, "/charges", "k-crash")
        .send()
        .await
        .unwrap();
    assert!(replayed(replay.headers()));
    assert_eq!(replay.text().await.unwrap(), "auth_1 ledger_1");
    assert_eq!(p.downstream.keys_of("authorize").len(), 1);
    crashed.abort();
}

/// A step whose call failed after it may have reached the processor records nothing; the
/// retry, on another instance, calls it again with the same downstream key.
async fn an_interrupted_step_is_sent_again_with_the_same_key<B: Backend>() {
    let p = Pair::<B>::start().await;
    p.downstream
        .fail_next_authorize
        .store(true, Ordering::SeqCst);
    let failed = post(&p.client, &p.a, "/charges", "k-fail")
        .send()
        .await
        .unwrap();
    assert_eq!(failed.status(), StatusCode::BAD_GATEWAY);
    let retry = post(&p.client, &p.b, "/charges", "k-fail")
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    let keys = p.downstream.keys_of("authorize");
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(
        keys[0], keys[1],
        "the retry must carry the same downstream key"
    );
}

/// Holder `a` finished `authorize` and stalled; `b` took the key over. When `a` goes on, its
/// `ledger` is refused (`Lost`) and not recorded: `b` runs it itself, with the same downstream
/// key (so the processor deduplicates `a`'s late call).
async fn a_stale_holder_cannot_record_a_step<B: Backend>() {
    let p = Pair::<B>::start().await;
    let stale = post(&p.client, &p.a, "/charges", "k-stale")
        .header("x-hold", "a")
        .send();
    let stale = tokio::spawn(stale);
    p.downstream.reached().await;
    p.crash_a().await;
    let fresh = post(&p.client, &p.b, "/charges", "k-stale")
        .header("x-hold", "b")
        .send();
    let fresh = tokio::spawn(fresh);
    p.downstream.reached().await;
    assert_eq!(
        p.downstream.keys_of("authorize").len(),
        1,
        "authorized twice"
    );

    p.downstream.go_a.add_permits(1);
    let stale = stale.await.unwrap().unwrap();
    assert_eq!(stale.status(), StatusCode::CONFLICT);
    assert_eq!(*p.downstream.ledger_outcomes.lock().unwrap(), ["lost"]);

    p.downstream.go_b.add_permits(1);
    let fresh = fresh.await.unwrap().unwrap();
    assert_eq!(fresh.status(), StatusCode::CREATED);
    // `a`'s ledger was not recorded: `b` ran it.
    assert_eq!(fresh.text().await.unwrap(), "auth_1 ledger_2");
    let ledger = p.downstream.keys_of("ledger");
    assert_eq!(ledger.len(), 2);
    assert_eq!(ledger[0], ledger[1], "one downstream key for both calls");
}

mod memory {
    use super::*;

    struct Memory(MemoryStore);

    impl Backend for Memory {
        type Store = MemoryStore;

        async fn start() -> Self {
            Self(MemoryStore::new())
        }

        fn store(&self) -> MemoryStore {
            self.0.clone()
        }

        /// Past the default 30 s lease, on the tokio clock the memory store reads.
        async fn lapse_leases(&self) {
            tokio::time::pause();
            tokio::time::advance(Duration::from_secs(31)).await;
            tokio::time::resume();
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_takeover_does_not_run_a_finished_step_again() {
        bounded(super::a_takeover_does_not_run_a_finished_step_again::<Memory>()).await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_interrupted_step_is_sent_again_with_the_same_key() {
        bounded(super::an_interrupted_step_is_sent_again_with_the_same_key::<Memory>()).await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_stale_holder_cannot_record_a_step() {
        bounded(super::a_stale_holder_cannot_record_a_step::<Memory>()).await;
    }
}

mod postgres {
    use idempotency_tests::{db::TestDb, postgres::migrated};
    use sqlx::Executor;
    use tower_idempotency::store::PostgresStore;

    use super::*;

    struct Postgres(TestDb, PostgresStore);

    impl Backend for Postgres {
        type Store = PostgresStore;

        async fn start() -> Self {
            let (db, store) = migrated().await;
            Self(db, store)
        }

        fn store(&self) -> PostgresStore {
            self.1.clone()
        }

        async fn lapse_leases(&self) {
            self.0
                .pool()
                .execute(
                    "UPDATE idempotency.records SET lease_until = now() - interval '1 second' \
                     WHERE status IS NULL",
                )
                .await
                .expect("lapse leases");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_takeover_does_not_run_a_finished_step_again() {
        bounded(super::a_takeover_does_not_run_a_finished_step_again::<
            Postgres,
        >())
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_interrupted_step_is_sent_again_with_the_same_key() {
        bounded(super::an_interrupted_step_is_sent_again_with_the_same_key::<Postgres>()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_holder_cannot_record_a_step() {
        bounded(super::a_stale_holder_cannot_record_a_step::<Postgres>()).await;
    }

    /// A step run in its own transaction: the stale holder's row is rolled back with its
    /// refused record; the holder's row commits with its record, once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_holders_transaction_is_rolled_back() {
        bounded(async {
            let p = Pair::<Postgres>::start().await;
            let pool = p.backend.0.pool();
            pool.execute("CREATE TABLE test_ledger (id bigserial, downstream_key text)")
                .await
                .unwrap();
            let rows = || async {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM test_ledger")
                    .fetch_one(pool)
                    .await
                    .unwrap()
            };
            let send = |server: &TestServer, hold: &'static str| {
                let request = post(&p.client, server, "/charges-in-tx", "k-tx");
                tokio::spawn(request.header("x-hold", hold).send())
            };
            let stale = send(&p.a, "a");
            p.downstream.reached().await;
            p.crash_a().await;
            let fresh = send(&p.b, "b");
            p.downstream.reached().await;

            p.downstream.go_a.add_permits(1);
            let stale = stale.await.unwrap().unwrap();
            assert_eq!(stale.status(), StatusCode::CONFLICT);
            assert_eq!(rows().await, 0, "the stale holder's write was rolled back");

            p.downstream.go_b.add_permits(1);
            let fresh = fresh.await.unwrap().unwrap();
            assert_eq!(fresh.status(), StatusCode::CREATED);
            assert_eq!(rows().await, 1);
            let body = fresh.text().await.unwrap();
            let replay = post(&p.client, &p.b, "/charges-in-tx", "k-tx")
                .send()
                .await
                .unwrap();
            assert_eq!(replay.text().await.unwrap(), body);
            assert_eq!(rows().await, 1);
        })
        .await;
    }

    /// Transactional mode commits the handler's writes with its response and has no steps: a
    /// handler that asks for them gets `500` saying to use lease mode, and nothing is kept.
    #[tokio::test]
    async fn transactional_mode_says_to_use_lease_mode_for_steps() {
        let (db, store) = migrated().await;
        let app = instance(store.transactional(), SECRET, Arc::default());
        let request = axum::http::Request::post("/keys")
            .header("authorization", "Bearer acct_a")
            .header("idempotency-key", "k1")
            .body(Body::empty())
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert!(body.contains("use lease mode for Steps"), "{body}");
        let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
            .fetch_one(db.pool())
            .await
            .unwrap();
        assert_eq!(kept, 0, "a 500 releases the key");
    }
}

/// The downstream keys a fresh instance with `secret` hands `account`'s request with `key`
/// and `body`.
async fn downstream_keys(secret: &[u8], account: &str, key: &str, body: &str) -> Vec<String> {
    let app = instance(MemoryStore::new(), secret, Arc::default());
    let request = axum::http::Request::post("/keys")
        .header("authorization", format!("Bearer {account}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let keys = String::from_utf8(body.to_vec()).unwrap();
    keys.split(' ').map(str::to_owned).collect()
}

/// Keys differ by step, scope and payload, and are the same on every instance that shares the
/// secret (each request here goes to a fresh instance with a store of its own).
#[tokio::test]
async fn downstream_keys_depend_on_step_scope_and_payload_only() {
    let body = r#"{"amount":100}"#;
    let base = downstream_keys(SECRET, "acct_a", "k1", body).await;
    assert_ne!(base[0], base[1], "one key per step");
    for key in &base {
        assert_eq!(key.len(), 36, "{key}");
        assert_eq!(&key[14..15], "8", "a UUIDv8: {key}");
        assert!(!key.contains("k1"), "never the client's key: {key}");
    }
    assert_eq!(downstream_keys(SECRET, "acct_a", "k1", body).await, base);
    let other_secret = [9; 32];
    for (what, other) in [
        (
            "principal",
            downstream_keys(SECRET, "acct_b", "k1", body).await,
        ),
        ("key", downstream_keys(SECRET, "acct_a", "k2", body).await),
        (
            "payload",
            downstream_keys(SECRET, "acct_a", "k1", r#"{"amount":200}"#).await,
        ),
        (
            "secret",
            downstream_keys(&other_secret, "acct_a", "k1", body).await,
        ),
    ] {
        assert_ne!(other[0], base[0], "another {what}, another key");
        assert_ne!(other[1], base[1], "another {what}, another key");
    }
}

/// Without a step secret a handler that asks for `Steps` gets `500` saying what to set.
#[tokio::test]
async fn steps_without_a_secret_say_what_to_set() {
    let app = Router::new()
        .route("/keys", routing::post(keys))
        .layer(IdempotencyLayer::memory().with_key(KeySource::default().required()))
        .layer(middleware::from_fn(authenticate));
    let request = axum::http::Request::post("/keys")
        .header("authorization", "Bearer acct_a")
        .header("idempotency-key", "k1")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(body.contains("with_step_secret"), "{body}");
}
