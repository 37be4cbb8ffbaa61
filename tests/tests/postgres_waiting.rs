//! Issue 34: waiting duplicates on PostgreSQL. A storm of waiters writes the key's row once,
//! not once per read.

use std::time::Duration;

use http::StatusCode;
use idempotency_tests::{
    app::{Probe, app},
    db::TestDb,
    postgres::{instance_pool, migrated, post},
    server::TestServer,
    store::ObservedStore,
    suite::Reply,
};
use tower_idempotency::{IdempotencyLayer, store::PostgresStore};

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
        IdempotencyLayer::new(store.clone()).with_in_flight_wait(Duration::from_secs(20)),
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
    // Each found the key in flight, subscribed, and read it again as a waiter.
    store.begun(2 * WAITERS).await;
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
}
