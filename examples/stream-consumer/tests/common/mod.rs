//! What the consumer's tests share: the test's Redis, the consumer binary, what it applied.
// Each test binary uses a part of it.
#![allow(dead_code)]

use std::{process::Stdio, time::Duration};

use idempotency_tests::db::TestDb;
use redis::aio::MultiplexedConnection;
use sqlx::PgPool;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};

/// No wait for an observed condition may take longer than this.
pub(crate) const BOUND: Duration = Duration::from_secs(60);

/// A stream name no other run uses.
pub(crate) fn unique_stream() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos();
    format!("stream-consumer-test:{}:{nanos}", std::process::id())
}

/// The test's Redis, or `None` (the test then returns) when there is none and `CI` is unset.
pub(crate) async fn redis() -> Option<redis::aio::MultiplexedConnection> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let connected = async {
        let client = redis::Client::open(url.as_str())?;
        let mut connection = client.get_multiplexed_async_connection().await?;
        let _: String = redis::cmd("PING").query_async(&mut connection).await?;
        Ok::<_, redis::RedisError>(connection)
    };
    match tokio::time::timeout(Duration::from_secs(5), connected).await {
        Ok(Ok(connection)) => Some(connection),
        failed => {
            assert!(
                std::env::var_os("CI").is_none(),
                "no Redis at {url} (set REDIS_URL); CI must start one: {failed:?}"
            );
            eprintln!("no Redis at {url} (set REDIS_URL): skipping this test");
            None
        }
    }
}

/// The consumer binary, logging to a pipe the test reads.
pub(crate) fn spawn(db: &TestDb, stream: &str, consumer: &str) -> Child {
    spawn_with(db, stream, consumer, &[])
}

/// [`spawn`], with more flags.
pub(crate) fn spawn_with(db: &TestDb, stream: &str, consumer: &str, flags: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_stream-consumer"))
        .args([
            "--database-url",
            &db.url(),
            "--stream",
            stream,
            "--group",
            "ledger",
        ])
        .args([
            "--consumer",
            consumer,
            "--claim-idle-ms",
            "300",
            "--effect-delay-ms",
            "40",
        ])
        .args(flags)
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the consumer binary starts")
}

/// Rows in `applied_events`, and distinct events among them.
pub(crate) async fn applied(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM stream_consumer.applied_events")
        .fetch_one(pool)
        .await
        .unwrap_or((0, 0))
}

/// Entries of `stream` delivered to the group and not acknowledged.
pub(crate) async fn pending(redis: &mut MultiplexedConnection, stream: &str) -> u64 {
    let summary: (u64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg(stream)
        .arg("ledger")
        .query_async(redis)
        .await
        .expect("XPENDING");
    summary.0
}

/// Waits until the consumer logged that it is consuming (its tables exist), then drains the
/// rest of its log so that it never blocks on a full pipe.
pub(crate) async fn started(child: &mut Child) -> tokio::task::JoinHandle<()> {
    let mut lines = BufReader::new(child.stderr.take().expect("piped")).lines();
    let consuming = tokio::time::timeout(BOUND, async {
        while let Some(line) = lines.next_line().await.expect("the log") {
            if line.contains("consuming") {
                return true;
            }
        }
        false
    });
    assert!(
        consuming.await.unwrap_or(false),
        "the consumer did not start"
    );
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} })
}

/// Waits until the consumer has logged `count` lines containing `marker`, then `SIGKILL`s it.
/// `false` when it logged no such line (it had nothing left to do) within a bounded wait.
pub(crate) async fn kill_after(mut child: Child, marker: &str, count: u64) -> bool {
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = 0;
    let observed = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains(marker) {
                seen += 1;
                if seen == count {
                    return true;
                }
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    child.kill().await.expect("SIGKILL the consumer");
    observed
}
