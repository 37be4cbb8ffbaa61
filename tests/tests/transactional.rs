//! Transactional mode: the claim, the handler's writes and the stored response commit together or
//! not at all, whatever the handler answers or does with its transaction, and whatever happens to
//! its client, its process or its connection. Each test has its own database; "rows" are the
//! handler's `charges` inserts. Under concurrency: `transactional_concurrency`.

use std::{process::Stdio, time::Duration};

use http::StatusCode;
use idempotency_tests::{
    db::TestDb,
    init_tracing,
    requests::{BODY, post},
    server::TestServer,
    suite::Reply,
    tx::Tx,
};
use sqlx::Executor;
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
    process::Command,
};
use tower_idempotency::{IdempotencyLayer, KeySource, store::PostgresStore};

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
        .layer(IdempotencyLayer::new(lease).with_key(KeySource::default().required()))
        .merge(
            Router::new()
                .route("/tx/twice", route_post(takes_it_twice))
                .route("/tx/optional", route_post(optional_tx))
                .layer(
                    IdempotencyLayer::new(transactional).with_key(KeySource::default().required()),
                ),
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
        body.contains("PostgresStore::new(pool).transactional()"),
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
