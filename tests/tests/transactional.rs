//! Transactional mode: the claim, the handler's writes and the stored response commit together or
//! not at all. Each test has its own database; "rows" are the handler's `charges` inserts.

use std::{process::Stdio, time::Duration};

use http::StatusCode;
use idempotency_tests::{
    app::{CHARGES_TABLE, Probe, tx_app},
    db::TestDb,
    init_tracing,
    server::TestServer,
    store::ObservedStore,
    suite::Reply,
};
use sqlx::{Executor, PgPool, postgres::PgPoolOptions};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
    process::Command,
    task::JoinSet,
};
use tower_idempotency::{IdempotencyLayer, store::PostgresStore};

const BODY: &str = r#"{"amount":100}"#;

struct Tx {
    db: TestDb,
    store: ObservedStore<PostgresStore>,
    probe: Probe,
    server: TestServer,
    client: reqwest::Client,
}

impl Tx {
    async fn start() -> Self {
        Self::with_pool(|db| db.pool().clone(), |store| store).await
    }

    async fn with_pool(
        pool: impl FnOnce(&TestDb) -> PgPool,
        configure: impl FnOnce(PostgresStore) -> PostgresStore,
    ) -> Self {
        init_tracing();
        let db = TestDb::new().await;
        db.pool()
            .execute(CHARGES_TABLE)
            .await
            .expect("charges table");
        let pool = pool(&db);
        let store = configure(PostgresStore::new(pool.clone()).transactional());
        store.migrate().await.expect("migrate");
        let store = ObservedStore::new(store);
        let probe = Probe::default();
        let layer = IdempotencyLayer::new(store.clone()).required();
        let server = TestServer::start(tx_app(layer, probe.clone(), pool)).await;
        Self {
            db,
            store,
            probe,
            server,
            client: reqwest::Client::new(),
        }
    }

    fn post(&self, key: &str) -> reqwest::RequestBuilder {
        post(&self.client, &self.server, "/tx/charges", key)
    }

    async fn rows(&self) -> i64 {
        rows(self.db.pool()).await
    }

    async fn records(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
            .fetch_one(self.db.pool())
            .await
            .expect("count records")
    }
}

fn post(
    client: &reqwest::Client,
    server: &TestServer,
    path: &str,
    key: &str,
) -> reqwest::RequestBuilder {
    client
        .post(server.url(path))
        .bearer_auth("acct_a")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(BODY)
}

async fn rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await
        .expect("count charges")
}

#[tokio::test]
async fn the_writes_and_the_record_commit_together() {
    let t = Tx::start().await;
    let first = Reply::of(t.post("k1")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(t.rows().await, 1);
    assert_eq!(t.records().await, 1);
    let retry = Reply::of(t.post("k1")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(t.rows().await, 1);
    assert_eq!(t.probe.executions(), 1);
}

#[tokio::test]
async fn a_panic_rolls_back_the_writes_and_frees_the_key() {
    let t = Tx::start().await;
    Reply::of(t.post("k-panic").header("x-test-panic", "1"))
        .await
        .assert_problem(500, "HandlerPanicked");
    assert_eq!(
        t.rows().await,
        0,
        "the insert before the panic was rolled back"
    );
    assert_eq!(t.records().await, 0);
    let retry = Reply::of(t.post("k-panic")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(t.rows().await, 1);
}

#[tokio::test]
async fn server_errors_and_released_answers_roll_back() {
    let t = Tx::start().await;
    for status in ["500", "503", "400", "422"] {
        let reply = Reply::of(t.post("k-status").header("x-test-status", status)).await;
        assert_eq!(
            reply.status.as_str(),
            status,
            "the handler's answer is delivered"
        );
        assert_eq!(t.rows().await, 0, "{status}: its writes were rolled back");
        assert_eq!(t.records().await, 0, "{status}: the key is free");
    }
    let kept = Reply::of(t.post("k-status").header("x-test-status", "402")).await;
    assert_eq!(kept.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(t.rows().await, 1, "a final 4xx commits");
    assert!(Reply::of(t.post("k-status")).await.replayed());
}

/// Issue 28.2: a handler that catches a failed statement and answers success anyway leaves an
/// aborted transaction: nothing can commit, so the client gets a `500` saying so, not the
/// success nothing backs, and the key is free for the retry.
#[tokio::test]
async fn a_success_over_an_aborted_transaction_is_a_500_and_nothing_happened() {
    let t = Tx::start().await;
    let reply = Reply::of(t.post("k-abort").header("x-test-abort", "1")).await;
    reply.assert_problem(500, "TransactionAborted");
    assert_eq!(t.rows().await, 0);
    assert_eq!(t.records().await, 0);
    let retry = Reply::of(t.post("k-abort")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(t.rows().await, 1);
}

/// Issue 28.2: a handler that catches a database error (a unique violation) and answers with a
/// status the layer keeps (`409`) gets its answer delivered, unstored: its transaction did
/// nothing, the key is released, and a retry runs again (and gets its `409` again), never a
/// `503` from a commit that cannot happen.
#[tokio::test]
async fn a_handler_that_catches_a_database_error_is_answered_and_releases_the_key() {
    let t = Tx::start().await;
    t.db.pool()
        .execute("CREATE UNIQUE INDEX charges_one_per_body ON charges (body)")
        .await
        .expect("unique index");
    sqlx::query("INSERT INTO charges (idempotency_key, body) VALUES ('earlier', $1)")
        .bind(BODY)
        .execute(t.db.pool())
        .await
        .expect("earlier charge");
    for attempt in 1..=2 {
        let reply = Reply::of(t.post("k-dup-body").header("x-test-catch", "1")).await;
        assert_eq!(
            reply.status,
            StatusCode::CONFLICT,
            "attempt {attempt}: {reply:?}"
        );
        assert_eq!(reply.json()["error"], "duplicate charge");
        assert!(!reply.replayed());
        assert_eq!(t.records().await, 0, "attempt {attempt}: nothing stored");
    }
    assert_eq!(t.rows().await, 1, "only the earlier charge");
    assert_eq!(t.probe.executions(), 2, "the released key ran again");
}

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

/// Issue 28.0 under load: 64 concurrent retries of each of 20 completed keys, on a layer with
/// no replay cache (every retry reads the store): every one is a replay, never a 409.
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
    let layer = IdempotencyLayer::new(store).required().with_replay_cache(0);
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
    let other_layer = IdempotencyLayer::postgres(other_pool.clone())
        .transactional()
        .required();
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

/// The server process is SIGKILLed with the handler's insert uncommitted: PostgreSQL aborts the
/// transaction, so the retry runs at once (no lease to wait out) and exactly one row exists.
#[tokio::test]
async fn a_killed_process_leaves_nothing_and_frees_the_key_at_once() {
    let t = Tx::start().await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tx-server"))
        .arg(t.db.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start tx-server");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = lines.next_line().await.expect("read").expect("a line");
    let addr = line
        .strip_prefix("listening on ")
        .expect("listening line")
        .to_owned();

    let mut stream = TcpStream::connect(&addr).await.expect("connect");
    let request = format!(
        "POST /tx/charges HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer acct_a\r\n\
         Idempotency-Key: k-kill\r\nX-Test-Hang: 1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let started = lines.next_line().await.expect("read").expect("a line");
    assert_eq!(started, "handler started");
    child.start_kill().expect("SIGKILL");
    child.wait().await.expect("reaped");
    drop(stream);

    // PostgreSQL ends the dead connection's transaction as soon as it reads the EOF; allow it
    // a moment (far below the 30 s a lease would take), answering 409 meanwhile.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let retry = loop {
        let reply = Reply::of(t.post("k-kill")).await;
        if reply.status != StatusCode::CONFLICT || tokio::time::Instant::now() > deadline {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(!retry.replayed());
    assert_eq!(t.rows().await, 1, "the killed attempt left no row");
    assert!(Reply::of(t.post("k-kill")).await.replayed());
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
/// holding its transaction) does not leave requests hanging for a connection: a new key gets a
/// prompt `503` with `Retry-After`, a replay this instance holds is answered, and once the
/// handlers finish, new keys run again.
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
    assert!(
        Reply::of(t.post("k-done")).await.replayed(),
        "replayed once: now cached"
    );
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
    assert!(Reply::of(t.post("k-done")).await.replayed());
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
    assert_eq!(t.rows().await, 1 + i64::from(POOL) + 1);
}

/// Issue 28.2: a handler that never took its transaction, whose commit then fails (its
/// connection lost): its response stands, as in lease mode, so the key is claimed again to
/// store it, and the retry gets the replay instead of running the handler a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unused_transaction_that_fails_to_commit_still_keeps_its_key() {
    let t = Tx::start().await;
    let request = tokio::spawn(Reply::of(
        post(&t.client, &t.server, "/tx/untransacted", "k-unused").header("x-test-gate", "1"),
    ));
    t.probe.started(1).await;
    let terminated: Vec<bool> = sqlx::query_scalar(
        // With a timeout it returns once the backend has exited, so its locks are gone too.
        "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_all(t.db.pool())
    .await
    .expect("terminate");
    assert_eq!(terminated, [true], "the request's transaction, and only it");
    t.probe.open_gate(1);
    let first = request.await.expect("task");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let retry = Reply::of(post(&t.client, &t.server, "/tx/untransacted", "k-unused")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(t.probe.executions(), 1);
    assert_eq!(t.rows().await, 1);
}

#[tokio::test]
async fn a_handler_without_the_transaction_still_works() {
    let t = Tx::start().await;
    let first = Reply::of(post(&t.client, &t.server, "/tx/untransacted", "k-plain")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = Reply::of(post(&t.client, &t.server, "/tx/untransacted", "k-plain")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(t.rows().await, 1);
}

#[tokio::test]
async fn a_disconnected_client_still_commits() {
    let t = Tx::start().await;
    let mut stream = TcpStream::connect(t.server.addr()).await.expect("connect");
    let request = format!(
        "POST /tx/charges HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer acct_a\r\n\
         Idempotency-Key: k-gone\r\nX-Test-Gate: 1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    t.probe.started(1).await;
    drop(stream);
    t.probe.open_gate(1);
    t.store.settled(1).await;
    assert_eq!(t.store.completed(), 1);
    assert_eq!(t.rows().await, 1);
    let retry = Reply::of(t.post("k-gone")).await;
    assert!(retry.replayed());
}

/// A handler that answers while a task of its own still holds the transaction: the layer
/// cannot commit it, so the client gets a `503` rather than a success that may not be durable,
/// and once the task lets go the transaction is rolled back: no row, no record, the key free.
#[tokio::test]
async fn a_handler_keeping_the_transaction_is_a_503_and_nothing_commits() {
    let t = Tx::start().await;
    Reply::of(t.post("k-keep").header("x-test-keep-tx", "1"))
        .await
        .assert_problem(503, "StoreUnavailable");
    t.probe.open_gate(1);
    t.probe.finished(1).await;
    let retry = Reply::of(t.post("k-keep")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "the key is free");
    assert!(!retry.replayed());
    assert_eq!(t.rows().await, 1, "only the retry's insert committed");
    assert_eq!(t.records().await, 1);
    assert_eq!(t.probe.executions(), 2);
}

/// The `IdempotentTx` extractor outside transactional mode, and taken twice: a `500` that says
/// what is wrong (a misconfigured server, not the client's fault), with nothing written; the
/// optional form runs the handler without a transaction.
#[tokio::test]
async fn the_extractor_refuses_clearly_outside_transactional_mode() {
    use axum::{Router, routing::post as route_post};
    use tower_idempotency::IdempotentTx;

    async fn needs_tx(_tx: IdempotentTx) -> StatusCode {
        StatusCode::CREATED
    }
    async fn takes_it_twice(_first: IdempotentTx, _second: IdempotentTx) -> StatusCode {
        StatusCode::CREATED
    }
    async fn optional_tx(tx: Option<IdempotentTx>) -> String {
        format!("transaction: {}", tx.is_some())
    }

    init_tracing();
    let db = TestDb::new().await;
    let lease = PostgresStore::new(db.pool().clone());
    lease.migrate().await.expect("migrate");
    let transactional = PostgresStore::new(db.pool().clone()).transactional();
    let app = Router::new()
        .route("/lease/needs-tx", route_post(needs_tx))
        .route("/lease/optional", route_post(optional_tx))
        .layer(IdempotencyLayer::new(lease).required())
        .merge(
            Router::new()
                .route("/tx/twice", route_post(takes_it_twice))
                .route("/tx/optional", route_post(optional_tx))
                .layer(IdempotencyLayer::new(transactional).required()),
        )
        .layer(axum::middleware::from_fn(
            |mut request: axum::extract::Request, next: axum::middleware::Next| async move {
                request
                    .extensions_mut()
                    .insert(tower_idempotency::Principal::new("acct_a").expect("principal"));
                next.run(request).await
            },
        ));
    let server = TestServer::start(app).await;
    let client = reqwest::Client::new();
    let send = |path: &'static str, key: &'static str| Reply::of(post(&client, &server, path, key));

    let refused = send("/lease/needs-tx", "k-1").await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    let body = String::from_utf8_lossy(&refused.body);
    assert!(
        body.contains("IdempotencyLayer::postgres(pool).transactional()"),
        "says how to fix it: {body}"
    );

    let twice = send("/tx/twice", "k-2").await;
    assert_eq!(twice.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        String::from_utf8_lossy(&twice.body).contains("already taken"),
        "{:?}",
        twice.body
    );

    assert_eq!(
        send("/lease/optional", "k-3").await.body,
        "transaction: false"
    );
    assert_eq!(send("/tx/optional", "k-4").await.body, "transaction: true");

    // The refusals were 500s: released, nothing kept. The optional handlers' answers were kept.
    let records: Vec<i16> =
        sqlx::query_scalar("SELECT status FROM idempotency.records ORDER BY status")
            .fetch_all(db.pool())
            .await
            .expect("records");
    assert_eq!(records, [200, 200]);
}

/// The database connection is lost while the handler runs (its backend terminated, as a
/// failover or a network cut would): the commit cannot happen, so the client gets a `503`
/// rather than a success, nothing was written, and the retry runs from scratch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_mid_request_is_a_503_and_nothing_happened() {
    let t = Tx::start().await;
    let request = tokio::spawn(Reply::of(t.post("k-lost").header("x-test-gate", "1")));
    t.probe.started(1).await;
    let terminated: Vec<bool> = sqlx::query_scalar(
        // With a timeout it returns once the backend has exited, so its locks are gone too.
        "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .fetch_all(t.db.pool())
    .await
    .expect("terminate");
    assert_eq!(terminated, [true], "the request's transaction, and only it");
    t.probe.open_gate(1);
    request
        .await
        .expect("task")
        .assert_problem(503, "StoreUnavailable");
    assert_eq!(t.rows().await, 0);
    assert_eq!(t.records().await, 0);

    let retry = Reply::of(t.post("k-lost")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(t.rows().await, 1);
    assert_eq!(t.probe.executions(), 2);
}
