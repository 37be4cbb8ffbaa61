//! A consumer with nothing to read keeps waiting: its blocking read outlasts the Redis
//! client's default response timeout (500 ms), which once ended the process after half a
//! second without entries.

use std::time::Duration;

use common::{BOUND, applied, redis, spawn, started, unique_stream};
use idempotency_tests::db::TestDb;
use redis::AsyncCommands;

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_consumer_keeps_consuming() {
    let Some(mut redis) = redis().await else {
        return;
    };
    let db = TestDb::new().await;
    let stream = unique_stream();
    let mut child = spawn(&db, &stream, "c0");
    let log = started(&mut child).await;
    // Idle for longer than a blocking read and the client's response timeout: the behaviour
    // under test is the wait itself.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(child.try_wait().unwrap().is_none(), "the consumer exited");

    let fields = [
        ("event_id", "evt_1"),
        ("account", "acct_1"),
        ("amount", "5"),
    ];
    let _: String = redis.xadd(&stream, "*", &fields).await.unwrap();
    let deadline = tokio::time::Instant::now() + BOUND;
    while applied(db.pool()).await != (1, 1) {
        assert!(tokio::time::Instant::now() < deadline, "never applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child.kill().await.unwrap();
    log.await.unwrap();
    let _: () = redis.del(&stream).await.unwrap();
}
