//! Transactional mode under concurrency: retries and duplicates of one key at once, instances
//! racing, and every pooled connection taken. Each test has its own database; "rows" are the
//! handler's `charges` inserts.

use std::time::Duration;

use http::StatusCode;
use idempotency_tests::{
    app::{CHARGES_TABLE, Probe, tx_app},
    db::TestDb,
    init_tracing,
    requests::{BODY, post},
    server::TestServer,
    suite::Reply,
    tx::Tx,
};
use sqlx::{Executor, postgres::PgPoolOptions};
use tokio::{io::AsyncWriteExt, net::TcpStream, task::JoinSet};
use tower_idempotency::{IdempotencyLayer, KeySource, store::PostgresStore};

/// Issue 28.0: a retry of a completed key gets its replay even while another request holds
/// the key's advisory lock (a concurrent lookup of the same key, here held by hand): only a
/// claim in flight is a 409.
#[tokio::test]
async fn a_completed_key_is_replayed_while_another_lookup_holds_its_lock() {
    use tower_idempotency::{IdempotencyKey, Principal, ScopeKey};

    let t = Tx::start().await;
    let first = Reply::of(t.post("k-locked")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let scope = ScopeKey::new(
        &Principal::new("acct_a").expect("principal"),
        &http::Method::POST,
        "/tx/charges",
        &IdempotencyKey::new("k-locked").expect("key"),
    );
    let lock = i64::from_be_bytes(scope.as_bytes()[..8].try_into().expect("8 bytes"));
    let mut other = t.db.pool().begin().await.expect("begin");
    let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(lock)
        .fetch_one(&mut *other)
        .await
        .expect("lock");
    assert!(held);
    let retry = Reply::of(t.post("k-locked")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    // Another payload under the completed key is still a 422, not a 409.
    Reply::of(t.post("k-locked").body(r#"{"amount":200}"#))
        .await
        .assert_problem(422, "Mismatch");
    other.rollback().await.expect("rollback");
    assert_eq!(t.probe.executions(), 1);
}

/// Issue 28.0 under load: 64 concurrent retries of each of 20 completed keys, on a store with
/// no `CachingStore` in front (every retry reads it): every one is a replay, never a 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_replays_of_completed_keys_are_never_409() {
    const KEYS: usize = 20;
    const RETRIES: usize = 64;
    init_tracing();
    let db = TestDb::new().await;
    db.pool()
        .execute(CHARGES_TABLE)
        .await
        .expect("charges table");
    let store = PostgresStore::new(db.pool().clone()).transactional();
    store.migrate().await.expect("migrate");
    let probe = Probe::default();
    let layer = IdempotencyLayer::new(store).with_key(KeySource::default().required());
    let server = TestServer::start(tx_app(layer, probe.clone(), db.pool().clone())).await;
    let client = reqwest::Client::new();
    for k in 0..KEYS {
        let first = Reply::of(post(&client, &server, "/tx/charges", &format!("k-{k}"))).await;
        assert_eq!(first.status, StatusCode::CREATED);
    }
    let mut retries = JoinSet::new();
    for _ in 0..RETRIES {
        for k in 0..KEYS {
            let request = post(&client, &server, "/tx/charges", &format!("k-{k}"));
            retries.spawn(Reply::of(request));
        }
    }
    let mut statuses = std::collections::BTreeMap::new();
    while let Some(reply) = retries.join_next().await {
        let reply = reply.expect("task");
        *statuses
            .entry((reply.status.as_u16(), reply.replayed()))
            .or_insert(0) += 1;
    }
    assert_eq!(
        statuses,
        [((201, true), KEYS * RETRIES)].into_iter().collect(),
        "every retry is a replay"
    );
    assert_eq!(probe.executions(), KEYS);
}

/// 50 duplicates while the first holds its transaction open: every one is a 409 at once
/// (nobody waits on the uncommitted row), then one row, replayed to everyone after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_get_409_at_once_and_write_one_row() {
    const N: usize = 50;
    let t = Tx::start().await;
    let holder = tokio::spawn(Reply::of(t.post("k-dup").header("x-test-gate", "1")));
    t.probe.started(1).await;
    let mut duplicates = JoinSet::new();
    for _ in 0..N - 1 {
        duplicates.spawn(Reply::of(t.post("k-dup")));
    }
    let answered = tokio::time::timeout(Duration::from_secs(20), async {
        let mut conflicts = 0;
        while let Some(reply) = duplicates.join_next().await {
            let reply = reply.expect("task");
            reply.assert_problem(409, "InFlight");
            conflicts += 1;
        }
        conflicts
    })
    .await
    .expect("duplicates are answered while the holder's transaction is still open");
    assert_eq!(answered, N - 1);
    t.probe.open_gate(1);
    let first = holder.await.expect("task");
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = Reply::of(t.post("k-dup")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(t.rows().await, 1);
}

/// Two app instances (two pools) racing 50 duplicates without any gate: one row, one body.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_instances_write_one_row() {
    let t = Tx::start().await;
    let other_pool = PgPoolOptions::new()
        .max_connections(20)
        .connect_with(t.db.options().clone())
        .await
        .expect("second pool");
    let other_layer = IdempotencyLayer::new(PostgresStore::new(other_pool.clone()).transactional())
        .with_key(KeySource::default().required());
    let other = TestServer::start(tx_app(other_layer, Probe::default(), other_pool)).await;
    let mut requests = JoinSet::new();
    for i in 0..50 {
        let server = if i % 2 == 0 { &t.server } else { &other };
        requests.spawn(Reply::of(post(&t.client, server, "/tx/charges", "k-race")));
    }
    let mut bodies = Vec::new();
    while let Some(reply) = requests.join_next().await {
        let reply = reply.expect("task");
        match reply.status {
            StatusCode::CREATED => bodies.push(reply.body),
            StatusCode::CONFLICT => reply.assert_problem(409, "InFlight"),
            other => panic!("unexpected {other}: {:?}", reply.body),
        }
    }
    assert!(!bodies.is_empty());
    assert!(
        bodies.iter().all(|b| *b == bodies[0]),
        "every 201 is the same charge"
    );
    assert_eq!(t.rows().await, 1);
}

/// With every pooled connection held by a transaction in flight, another request gets a 503
/// problem after the store's timeout instead of hanging; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_is_a_prompt_503() {
    let t = Tx::with_pool(
        |db| {
            PgPoolOptions::new()
                .max_connections(2)
                .connect_lazy_with(db.options().clone())
        },
        |store| store.with_timeout(Duration::from_millis(300)),
    )
    .await;
    let holders: Vec<_> = ["k-hold-1", "k-hold-2"]
        .into_iter()
        .map(|key| tokio::spawn(Reply::of(t.post(key).header("x-test-gate", "1"))))
        .collect();
    t.probe.started(2).await;
    let started = tokio::time::Instant::now();
    let refused = Reply::of(t.post("k-third")).await;
    refused.assert_problem(503, "StoreUnavailable");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered promptly"
    );
    t.probe.open_gate(2);
    for holder in holders {
        assert_eq!(holder.await.expect("task").status, StatusCode::CREATED);
    }
    assert_eq!(
        Reply::of(t.post("k-third")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(t.rows().await, 3);
}

/// Issue 28.7: every pooled connection pinned by handlers whose clients hung up (each runs on,
/// holding its transaction) does not leave requests hanging for a connection: a new key, and a
/// retry of a completed one alike, gets a prompt `503` with `Retry-After` (the overload check
/// comes before the store's claim, and so before any `CachingStore`), and once the handlers
/// finish, both are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_ups_that_pin_the_pool_leave_every_request_answered_promptly() {
    const POOL: u32 = 4;
    let t = Tx::with_pool(
        |db| {
            PgPoolOptions::new()
                .max_connections(POOL)
                .connect_lazy_with(db.options().clone())
        },
        |store| store,
    )
    .await;
    assert_eq!(
        Reply::of(t.post("k-done")).await.status,
        StatusCode::CREATED
    );
    t.store.settled(1).await;
    assert!(Reply::of(t.post("k-done")).await.replayed());
    // Four handlers run (one per connection), then all their clients hang up.
    let mut streams = Vec::new();
    for i in 0..POOL {
        let mut stream = TcpStream::connect(t.server.addr()).await.expect("connect");
        let request = format!(
            "POST /tx/charges HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer acct_a\r\n\
             Idempotency-Key: k-hung-{i}\r\nX-Test-Gate: 1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{BODY}",
            BODY.len()
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        streams.push(stream);
    }
    t.probe.started(POOL).await;
    drop(streams);
    t.probe.abandoned(POOL).await;

    let started = tokio::time::Instant::now();
    let refused = Reply::of(t.post("k-new")).await;
    refused.assert_problem(503, "Overloaded");
    assert_eq!(refused.headers["retry-after"], "1");
    Reply::of(t.post("k-done"))
        .await
        .assert_problem(503, "Overloaded");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered promptly, not after a wait for a connection"
    );

    t.probe.open_gate(POOL as usize);
    t.store.settled(POOL).await;
    assert_eq!(
        (t.store.completed(), t.store.released(), t.store.lost()),
        (POOL as usize + 1, 0, 0),
        "every hung handler's record committed"
    );
    // Their tasks end just after their records commit; until then a retry is still refused,
    // as a client honouring Retry-After would find.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let later = loop {
        let reply = Reply::of(t.post("k-new")).await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE || tokio::time::Instant::now() > deadline
        {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(later.status, StatusCode::CREATED);
    assert!(Reply::of(t.post("k-done")).await.replayed());
    assert_eq!(t.rows().await, 1 + i64::from(POOL) + 1);
}
