//! Issue 34: waiting duplicates on PostgreSQL. A storm of waiters writes the key's row once,
//! not once per read; a layer built outside a runtime still hears other instances'
//! announcements; and transactional mode's fallback completion announces its key.

use std::time::Duration;

use http::StatusCode;
use idempotency_tests::{
    app::{Probe, app},
    db::TestDb,
    postgres::{claim_request, instance_pool, migrated, post},
    server::TestServer,
    store::ObservedStore,
    suite::Reply,
};
use sqlx::postgres::PgListener;
use tower_idempotency::{
    IdempotencyLayer, InFlightWait, Record,
    store::{ClaimStatus, KeyState, PostgresStore, Store},
};

/// Counts the row updates of `idempotency.records` from now on, exactly (the statistics
/// views are flushed late and per backend): a trigger adds a row to `record_updates`.
async fn count_record_updates(db: &TestDb) {
    sqlx::raw_sql(
        "CREATE TABLE public.record_updates (at timestamptz NOT NULL DEFAULT now());
         CREATE FUNCTION public.count_record_update() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN INSERT INTO public.record_updates DEFAULT VALUES; RETURN NULL; END $$;
         CREATE TRIGGER counted AFTER UPDATE ON idempotency.records
             FOR EACH ROW EXECUTE FUNCTION public.count_record_update();",
    )
    .execute(db.pool())
    .await
    .expect("update counter");
}

async fn record_updates(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM public.record_updates")
        .fetch_one(db.pool())
        .await
        .expect("count")
}

/// Issue 35.3: building a layer that waits starts no task and opens no connection (it once
/// started the store's listener on the spot); the first request that waits starts it.
#[tokio::test]
async fn building_a_waiting_layer_starts_no_task() {
    let (db, _) = migrated().await;
    let pool = instance_pool(&db).await;
    let store = PostgresStore::new(pool.clone());
    let metrics = tokio::runtime::Handle::current().metrics();
    let (tasks, connections) = (metrics.num_alive_tasks(), pool.size());
    let layer = IdempotencyLayer::new(store)
        .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(5)))
        .expect("a wait");
    tokio::task::yield_now().await;
    // At most: a pool's own task may end meanwhile (3 -> 2 was seen under load), never start.
    assert!(metrics.num_alive_tasks() <= tasks, "a task was started");
    assert_eq!(pool.size(), connections, "a connection was opened");
    drop(layer);
}

/// Issue 34.3: a hundred duplicates wait for one key in flight, each reading it twice or more;
/// the key's row is updated once for them all (the mark) and once by the completion, not once
/// per waiter's read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_waiters_marks_the_key_once() {
    const WAITERS: u32 = 100;
    let (db, _) = migrated().await;
    count_record_updates(&db).await;
    let store = ObservedStore::new(PostgresStore::new(instance_pool(&db).await));
    let probe = Probe::default();
    let server = TestServer::start(app(
        IdempotencyLayer::new(store.clone())
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(20)))
            .expect("a wait"),
        probe.clone(),
    ))
    .await;
    let client = reqwest::Client::new();
    let first = tokio::spawn(Reply::of(
        post(&client, &server, "k-storm").header("x-test-gate", "1"),
    ));
    probe.started(1).await;
    store.begun(1).await;
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| tokio::spawn(Reply::of(post(&client, &server, "k-storm"))))
        .collect();
    // Each found the key in flight and waits.
    store.found_in_flight(WAITERS).await;
    let marked = record_updates(&db).await;
    probe.open_gate(1);
    assert_eq!(first.await.expect("task").status, StatusCode::CREATED);
    for waiter in waiters {
        assert!(waiter.await.expect("task").replayed());
    }
    assert_eq!(probe.executions(), 1);
    assert!(
        marked <= 1,
        "{WAITERS} waiters updated the row {marked} times before the completion"
    );
    assert!(record_updates(&db).await <= 2);
    // Waiters that come while a read is under way share the next (issue 34.3): without that,
    // each waiter reads the key once after subscribing and once when woken.
    let reads = store.waiting_begins();
    assert!(
        reads <= WAITERS as usize + 5,
        "{WAITERS} waiters read the key {reads} times"
    );
}

/// Issue 34.5: instance B's layer is built in a plain `#[test]`, outside any runtime, where no
/// listener can be spawned; its first waiter starts it, and is woken by instance A's commit
/// rather than by its once-a-second re-read.
#[test]
fn a_layer_built_outside_a_runtime_still_wakes_its_waiters() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (db, a_pool, b_pool) = runtime.block_on(async {
        let (db, _) = migrated().await;
        let (a, b) = (instance_pool(&db).await, instance_pool(&db).await);
        (db, a, b)
    });
    let b_store = ObservedStore::new(PostgresStore::new(b_pool));
    let b_layer = IdempotencyLayer::new(b_store.clone())
        .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(5)))
        .expect("a wait");
    runtime.block_on(async move {
        let probe = Probe::default();
        let a = TestServer::start(app(
            IdempotencyLayer::new(PostgresStore::new(a_pool))
                .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(5)))
                .expect("a wait"),
            probe.clone(),
        ))
        .await;
        let b = TestServer::start(app(b_layer, probe.clone())).await;
        let client = reqwest::Client::new();
        let first = tokio::spawn(Reply::of(
            post(&client, &a, "k-outside").header("x-test-gate", "1"),
        ));
        probe.started(1).await;
        let duplicate = tokio::spawn({
            let request = post(&client, &b, "k-outside");
            async move {
                let reply = Reply::of(request).await;
                (reply, tokio::time::Instant::now())
            }
        });
        // Found in flight, subscribed, found in flight again: it waits (its next re-read is a
        // second away, unless its listener was started).
        b_store.begun(2).await;
        probe.open_gate(1);
        let first = first.await.expect("task");
        let answered = tokio::time::Instant::now();
        let (duplicate, duplicate_answered) = duplicate.await.expect("task");
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(duplicate.replayed(), "{duplicate:?}");
        let behind = duplicate_answered.saturating_duration_since(answered);
        assert!(
            behind < Duration::from_millis(300),
            "the duplicate was answered {behind:?} after the first: woken by a re-read"
        );
        drop(db);
    });
}

/// Issue 34.5: a transactional claim whose commit failed (its connection lost) although the
/// handler never used the transaction is claimed again in lease mode to store the response;
/// that completion announces the key as every transactional one does, since transactional
/// mode's waiters mark nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fallback_completion_of_a_transactional_claim_is_announced() {
    let (db, store) = migrated().await;
    let store = store.transactional();
    // A layer that waits has the store announce settled keys.
    let _layer = tower_idempotency::IdempotencyLayer::new(store.clone())
        .with_in_flight_wait(InFlightWait::up_to(std::time::Duration::from_secs(1)))
        .expect("a wait");
    let mut listener = PgListener::connect_with(db.pool()).await.expect("listener");
    listener
        .listen("idempotency_settled")
        .await
        .expect("listen");
    let KeyState::Acquired { claim, .. } = store.claim(&claim_request(7, 1)).await.expect("claim")
    else {
        panic!("a free key is acquired");
    };
    let terminated: Vec<bool> = sqlx::query_scalar(
        // With a timeout it returns once the backend has exited, so its locks are gone too.
        "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_all(db.pool())
    .await
    .expect("terminate");
    assert_eq!(terminated, [true], "the claim's transaction, and only it");
    let record = Record::from_parts(StatusCode::CREATED, Default::default(), None);
    assert_eq!(
        store.complete(&claim, &record).await.expect("complete"),
        ClaimStatus::Held
    );
    let replay = store.claim(&claim_request(7, 1)).await.expect("claim");
    assert!(matches!(replay, KeyState::Completed { .. }), "{replay:?}");
    // Announcements arrive in commit order: the sentinel comes after the key's, if any.
    sqlx::query("SELECT pg_notify('idempotency_settled', 'sentinel')")
        .execute(db.pool())
        .await
        .expect("sentinel");
    let next = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .expect("a notification within 10 s")
        .expect("the listener's connection");
    assert_eq!(
        next.payload(),
        uuid::Uuid::from_bytes([7; 16]).to_string(),
        "the fallback completion announced nothing"
    );
}

/// A claim that takes a key over starts unmarked: its predecessor's waiters read the key again
/// and mark the new claim themselves, and a mark inherited from it would have a settlement
/// nobody waits for announced, a notifying commit that queues behind every other.
#[tokio::test]
async fn a_claim_taken_over_starts_unmarked() {
    let (db, store) = migrated().await;
    let waited = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT coalesce(bool_or(waited), false) FROM idempotency.records",
        )
        .fetch_one(db.pool())
        .await
        .expect("waited")
    };
    // As a layer that waits has it: its statements announce marked keys.
    // A layer that waits has the store announce settled keys.
    let _layer = tower_idempotency::IdempotencyLayer::new(store.clone())
        .with_in_flight_wait(InFlightWait::up_to(std::time::Duration::from_secs(1)))
        .expect("a wait");
    let request = claim_request(7, 7);
    assert!(matches!(
        store.claim(&request).await,
        Ok(KeyState::Acquired { .. })
    ));
    let waiting = tower_idempotency::store::ClaimRequest {
        waiting: true,
        keeps_request: false,
        ..request.clone()
    };
    assert!(matches!(
        store.claim(&waiting).await,
        Ok(KeyState::InFlight { .. })
    ));
    assert!(waited().await, "a waiter's read marks the claim");
    sqlx::query("UPDATE idempotency.records SET lease_until = now() - interval '1 second'")
        .execute(db.pool())
        .await
        .expect("lapse");
    assert!(matches!(
        store.claim(&request).await,
        Ok(KeyState::Acquired { takeover: true, .. })
    ));
    assert!(
        !waited().await,
        "the claim that took the key over is not marked"
    );
}
