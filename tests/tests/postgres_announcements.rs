//! With waiting on, a settled key is announced (`NOTIFY`) only when a waiter's read marked it: every
//! notifying commit is serialised with the others, so keys nobody waits for must send nothing.
//! Transactional mode's claims cannot be marked (invisible until they commit): it announces all.

use std::time::Duration;

use idempotency_tests::{
    app::{Probe, app},
    db::TestDb,
    postgres::{claim_request, migrated, post, wait_until},
    server::TestServer,
    store::ObservedStore,
    suite::Reply,
};
use sqlx::postgres::PgListener;
use tower_idempotency::{
    IdempotencyLayer, InFlightWait, Record,
    store::{ClaimRequest, ClaimStatus, KeyState, PgClaim, PostgresStore, Store},
};

const SENTINEL: &str = "sentinel";

/// Listens on the store's channel before anything settles.
async fn listener(db: &TestDb) -> PgListener {
    let mut listener = PgListener::connect_with(db.pool()).await.expect("listener");
    listener
        .listen("idempotency_settled")
        .await
        .expect("listen");
    listener
}

/// What the channel carries next: a settled key (its first 16 bytes, as PostgreSQL's uuid
/// text) or the sentinel.
async fn next(listener: &mut PgListener) -> String {
    let received = tokio::time::timeout(Duration::from_secs(10), listener.recv()).await;
    received
        .expect("a notification within 10 s")
        .expect("the listener's connection")
        .payload()
        .to_owned()
}

/// Announcements are delivered in commit order: one sent after a settlement arrives after
/// anything that settlement announced.
async fn sentinel(db: &TestDb) {
    sqlx::query("SELECT pg_notify('idempotency_settled', $1)")
        .bind(SENTINEL)
        .execute(db.pool())
        .await
        .expect("sentinel");
}

fn payload(key: u8) -> String {
    let bytes = [key; 16];
    uuid::Uuid::from_bytes(bytes).to_string()
}

async fn claim(store: &PostgresStore, key: u8) -> PgClaim {
    match store.claim(&claim_request(key, 1)).await.expect("claim") {
        KeyState::Acquired { claim, .. } => claim,
        other => panic!("key {key}: {other:?}"),
    }
}

fn record() -> Record {
    Record::from_parts(http::StatusCode::CREATED, Default::default(), None)
}

async fn only_marked_keys_are_announced(store: PostgresStore, db: &TestDb) {
    // A layer that waits has the store announce settled keys.
    let _layer = tower_idempotency::IdempotencyLayer::new(store.clone())
        .with_in_flight_wait(InFlightWait::up_to(std::time::Duration::from_secs(1)))
        .expect("a wait");
    let mut listener = listener(db).await;

    let unmarked = claim(&store, 1).await;
    assert_eq!(
        store
            .complete(&unmarked, &record())
            .await
            .expect("complete"),
        ClaimStatus::Held
    );
    let unmarked = claim(&store, 2).await;
    assert_eq!(
        store.release(&unmarked).await.expect("release"),
        ClaimStatus::Held
    );
    sentinel(db).await;
    assert_eq!(
        next(&mut listener).await,
        SENTINEL,
        "no waiter, no announcement"
    );

    let marked = claim(&store, 3).await;
    assert!(
        matches!(wait_read(&store, 3).await, KeyState::InFlight { .. }),
        "a waiter's read finds the key in flight and marks it"
    );
    assert_eq!(
        store.complete(&marked, &record()).await.expect("complete"),
        ClaimStatus::Held
    );
    assert_eq!(next(&mut listener).await, payload(3));
    assert!(
        matches!(wait_read(&store, 3).await, KeyState::Completed { .. }),
        "a settled key is not in flight: the waiter has its replay"
    );
    let marked = claim(&store, 4).await;
    assert!(matches!(
        wait_read(&store, 4).await,
        KeyState::InFlight { .. }
    ));
    assert_eq!(
        store.release(&marked).await.expect("release"),
        ClaimStatus::Held
    );
    assert_eq!(next(&mut listener).await, payload(4));
}

/// A waiting duplicate's read of `key` (it marks a claim it finds in flight).
async fn wait_read(store: &PostgresStore, key: u8) -> KeyState<PgClaim> {
    let request = ClaimRequest {
        waiting: true,
        keeps_request: false,
        ..claim_request(key, 1)
    };
    store.claim(&request).await.expect("claim")
}

#[tokio::test]
async fn in_lease_mode_with_group_commit() {
    let (db, store) = migrated().await;
    only_marked_keys_are_announced(store, &db).await;
}

#[tokio::test]
async fn in_lease_mode_statement_by_statement() {
    let (db, store) = migrated().await;
    only_marked_keys_are_announced(store.without_prepared_statements(), &db).await;
}

#[tokio::test]
async fn in_partitioned_mode() {
    let (db, _) = migrated().await;
    let store = PostgresStore::new(db.pool().clone())
        .partitioned(Duration::from_secs(3600))
        .expect("a valid width");
    store.migrate().await.expect("partitions");
    only_marked_keys_are_announced(store, &db).await;
}

/// The listener, started by the first request that waits, holds a connection of its own: a pool
/// of one is still free for requests.
#[tokio::test]
async fn the_listener_takes_no_connection_from_the_pool() {
    let (db, _) = migrated().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(db.options().clone())
        .await
        .expect("pool");
    let store = ObservedStore::new(PostgresStore::new(pool.clone()));
    let probe = Probe::default();
    let layer = IdempotencyLayer::new(store.clone())
        .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(20)))
        .expect("a wait");
    let server = TestServer::start(app(layer, probe.clone())).await;
    let client = reqwest::Client::new();
    let first = tokio::spawn(Reply::of(
        post(&client, &server, "k-listen").header("x-test-gate", "1"),
    ));
    probe.started(1).await;
    let duplicate = tokio::spawn(Reply::of(post(&client, &server, "k-listen")));
    store.begun(2).await;
    wait_until(
        &db,
        "SELECT count(*) = 1 FROM pg_stat_activity
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .await;
    let connection = pool.acquire().await;
    assert!(connection.is_ok(), "{:?}", connection.err());
    drop(connection);
    probe.open_gate(1);
    let first = first.await.expect("task");
    let duplicate = duplicate.await.expect("task");
    assert!(duplicate.replayed(), "{duplicate:?}");
    assert_eq!(duplicate.body, first.body);
}

#[tokio::test]
async fn in_transactional_mode_every_key_is_announced() {
    let (db, store) = migrated().await;
    let store = store.transactional();
    // A layer that waits has the store announce settled keys.
    let _layer = tower_idempotency::IdempotencyLayer::new(store.clone())
        .with_in_flight_wait(InFlightWait::up_to(std::time::Duration::from_secs(1)))
        .expect("a wait");
    let mut listener = listener(&db).await;
    let claimed = claim(&store, 5).await;
    assert_eq!(
        store.complete(&claimed, &record()).await.expect("complete"),
        ClaimStatus::Held
    );
    assert_eq!(next(&mut listener).await, payload(5));
    let claimed = claim(&store, 6).await;
    assert_eq!(
        store.release(&claimed).await.expect("release"),
        ClaimStatus::Held
    );
    assert_eq!(next(&mut listener).await, payload(6));
}
