//! What a claim tells `Steps` about the key's recorded steps (issue 36.5): a claim of a key
//! that has none says so, and its handler's first step reads nothing; a key with steps, even
//! one claimed as new after a release, or after a racing claim released it during the
//! claim's own statement, hands them back and they are not run again.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{
    Router,
    extract::{Request, State},
    http::{StatusCode, header},
    middleware::{self, Next},
    response::Response,
    routing,
};
use bytes::Bytes;
use idempotency_tests::{
    bounded,
    db::TestDb,
    postgres::{claim_request, held_uncommitted, migrated, statement_waits_on_a_lock},
    requests::post,
    server::TestServer,
};
use tower_idempotency::{
    IdempotencyLayer, KeySource, Principal, StepError, Steps,
    store::{
        ClaimHandle, ClaimRequest, ClaimStatus, KeyState, MemoryStore, PgClaim, PostgresStore,
        StepLog, StepRecord, Store,
    },
};

/// The layers' step secret.
const SECRET: &[u8; 32] = b"steps test secret, 32 bytes long";

/// How many times each step's closure ran.
#[derive(Default)]
struct Calls {
    authorize: AtomicUsize,
    ledger: AtomicUsize,
}

/// `authorize`, then `ledger`, which fails on its first call: the layer releases the key after
/// the `502`, keeping `authorize`'s record.
async fn charge(
    State(calls): State<Arc<Calls>>,
    steps: Steps,
) -> Result<(StatusCode, String), StepError<StatusCode>> {
    let authorization: String = steps
        .run("authorize", |_key| async {
            let n = calls.authorize.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(format!("auth_{n}"))
        })
        .await?;
    let entry: usize = steps
        .run("ledger", |_key| async {
            match calls.ledger.fetch_add(1, Ordering::SeqCst) {
                0 => Err(StatusCode::BAD_GATEWAY),
                n => Ok(n),
            }
        })
        .await?;
    Ok((
        StatusCode::CREATED,
        format!("{authorization} ledger_{entry}"),
    ))
}

async fn authenticate(mut request: Request, next: Next) -> Response {
    let principal = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|account| Principal::new(account.to_owned()).ok());
    if let Some(principal) = principal {
        request.extensions_mut().insert(principal);
    }
    next.run(request).await
}

fn app<St: Store>(store: St, calls: Arc<Calls>) -> Router {
    let layer = IdempotencyLayer::new(store)
        .with_key(KeySource::default().required())
        .with_step_secret(SECRET)
        .expect("a long enough secret");
    Router::new()
        .route("/charges", routing::post(charge))
        .with_state(calls)
        .layer(layer)
        .layer(middleware::from_fn(authenticate))
}

/// A request whose `ledger` failed released its key; the retry claims the key as new, yet gets
/// `authorize`'s recorded result instead of running it again.
async fn a_step_recorded_before_a_release_is_not_run_again<St: Store>(store: St) {
    let calls = Arc::new(Calls::default());
    let server = TestServer::start(app(store, Arc::clone(&calls))).await;
    let client = reqwest::Client::new();
    let failed = post(&client, &server, "/charges", "k-release")
        .send()
        .await
        .unwrap();
    assert_eq!(failed.status(), StatusCode::BAD_GATEWAY);
    let retry = post(&client, &server, "/charges", "k-release")
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.text().await.unwrap(), "auth_1 ledger_1");
    assert_eq!(
        calls.authorize.load(Ordering::SeqCst),
        1,
        "authorized twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_step_recorded_before_a_release_is_not_run_again() {
    bounded(a_step_recorded_before_a_release_is_not_run_again(
        MemoryStore::new(),
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_step_recorded_before_a_release_is_not_run_again() {
    bounded(async {
        let (_db, store) = migrated().await;
        a_step_recorded_before_a_release_is_not_run_again(store).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_unbatched_a_step_recorded_before_a_release_is_not_run_again() {
    bounded(async {
        let (_db, store) = migrated().await;
        let store = store.without_prepared_statements();
        a_step_recorded_before_a_release_is_not_run_again(store).await;
    })
    .await;
}

/// The store's step log.
fn log(store: &PostgresStore) -> Arc<dyn StepLog> {
    let capabilities = store.capabilities();
    Arc::clone(capabilities.step_log().expect("lease mode keeps steps"))
}

async fn acquire(store: &PostgresStore, request: &ClaimRequest) -> PgClaim {
    match store.claim(request).await.expect("claim") {
        KeyState::Acquired { claim, .. } => claim,
        other => panic!("expected the key acquired, got {other:?}"),
    }
}

fn authorized() -> StepRecord {
    StepRecord {
        name: "authorize".to_owned(),
        output: Bytes::from_static(b"\"auth_1\""),
    }
}

/// Records a step under a new claim of `request`'s key; the claim.
async fn record_a_step(store: &PostgresStore, request: &ClaimRequest) -> PgClaim {
    let claim = acquire(store, request).await;
    let recorded = log(store)
        .record(claim.fence(), &request.fingerprint, &authorized())
        .await;
    assert_eq!(recorded.unwrap(), ClaimStatus::Held);
    claim
}

/// Once steps are in use, claims of new keys say they have none (the round trip `Steps`
/// saves); a key whose steps outlived a release says it may, for their payload only. Before,
/// no claim says so: apps without steps do not pay for the check.
async fn new_keys_claim_stepless(store: PostgresStore) {
    let request = claim_request(1, 1);
    let claim = record_a_step(&store, &request).await;
    assert!(claim.may_have_steps(), "steps were not in use yet");
    assert_eq!(store.release(&claim).await.unwrap(), ClaimStatus::Held);

    let again = acquire(&store, &request).await;
    assert!(again.may_have_steps(), "steps outlived the release");
    let found = log(&store)
        .recorded(again.fence(), &request.fingerprint)
        .await;
    assert_eq!(found.unwrap(), [authorized()]);
    let new = acquire(&store, &claim_request(2, 1)).await;
    assert!(!new.may_have_steps(), "a new key has no steps");
    assert_eq!(store.release(&again).await.unwrap(), ClaimStatus::Held);
    let other = acquire(&store, &claim_request(1, 2)).await;
    assert!(!other.may_have_steps(), "another payload has none");
}

#[tokio::test]
async fn new_keys_claim_stepless_batched() {
    let (_db, store) = migrated().await;
    bounded(new_keys_claim_stepless(store)).await;
}

#[tokio::test]
async fn new_keys_claim_stepless_alone() {
    let (_db, store) = migrated().await;
    bounded(new_keys_claim_stepless(store.without_prepared_statements())).await;
}

/// A racing claim inserts the key, records a step and releases the key while this claim's
/// statement waits on its row: the statement inserts the key as new after that commit, which its
/// own snapshot predates. It must still see the step, or `Steps` would run it again.
async fn a_step_committed_during_the_claim_is_seen(db: &TestDb, store: PostgresStore) {
    record_a_step(&store, &claim_request(9, 9)).await;
    let request = claim_request(7, 7);
    let mut racer = held_uncommitted(db, &request).await;
    sqlx::query(
        "INSERT INTO idempotency.steps (scope_key, fingerprint, name, output, expires_at)
         VALUES (encode(substring($1::bytea FROM 1 FOR 16), 'hex')::uuid, $2, 'authorize',
                 '\"auth_1\"', now() + interval '1 hour')",
    )
    .bind(&request.key.as_bytes()[..])
    .bind(&request.fingerprint.as_bytes()[..])
    .execute(&mut *racer)
    .await
    .expect("the racer's step");
    sqlx::query("DELETE FROM idempotency.records")
        .execute(&mut *racer)
        .await
        .expect("the racer's release");
    let claiming = tokio::spawn({
        let (store, request) = (store.clone(), request.clone());
        async move { acquire(&store, &request).await }
    });
    statement_waits_on_a_lock(db, "%INSERT INTO idempotency.records%").await;
    racer.commit().await.expect("commit");
    let claim = claiming.await.expect("the claim");
    assert!(claim.may_have_steps(), "the racer's step was missed");
    let found = log(&store)
        .recorded(claim.fence(), &request.fingerprint)
        .await;
    assert_eq!(found.unwrap(), [authorized()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_committed_during_a_batched_claim_is_seen() {
    let (db, store) = migrated().await;
    bounded(a_step_committed_during_the_claim_is_seen(&db, store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_committed_during_a_claim_alone_is_seen() {
    let (db, store) = migrated().await;
    let store = store.without_prepared_statements();
    bounded(a_step_committed_during_the_claim_is_seen(&db, store)).await;
}
