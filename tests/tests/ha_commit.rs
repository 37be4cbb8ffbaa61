//! Issue 45.2 and 45.3 on a real Patroni cluster in synchronous mode: the store's promise is
//! read as kept, and no commit is abandoned mid-flight. With the standby stalled (its walsender
//! stopped by `SIGSTOP`), a completion's commit waits for it; the store's timeout answers the
//! caller, but the commit is neither cancelled nor cut off: it still waits, invisible to every
//! other session, and lands once the standby has it. A retry of the completion then succeeds.

use std::{process::Command, time::Duration};

use idempotency_tests::{bounded, ha::Cluster, init_tracing, postgres::claim_request};
use sqlx::{Connection, PgConnection, postgres::PgPoolOptions};
use tower_idempotency::{
    Record,
    store::{ClaimStatus, Durability, KeyState, PostgresStore, PostgresStoreError, Store},
};

async fn scalar(url: &str, sql: &'static str) -> i64 {
    let mut connection = PgConnection::connect(url).await.expect("connect");
    let value = sqlx::query_scalar(sql)
        .fetch_one(&mut connection)
        .await
        .expect(sql);
    connection.close().await.ok();
    value
}

/// Sends `signal` to the primary's walsenders: the standby's acknowledgements stop or resume.
async fn walsenders(url: &str, signal: &str) {
    let mut connection = PgConnection::connect(url).await.expect("connect");
    let pids: Vec<i32> = sqlx::query_scalar("SELECT pid FROM pg_stat_replication")
        .fetch_all(&mut connection)
        .await
        .expect("walsenders");
    assert!(!pids.is_empty(), "a standby streams");
    for pid in pids {
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status();
        assert!(status.expect("kill").success(), "kill {signal} {pid}");
    }
}

/// Polls `sql` until it answers `want`, within the test's bound.
async fn until(url: &str, sql: &'static str, want: i64) {
    while scalar(url, sql).await != want {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const WAITING: &str = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'";
const COMPLETED: &str = "SELECT count(*) FROM idempotency.records WHERE status IS NOT NULL";

#[tokio::test]
async fn a_commit_waiting_for_a_stalled_standby_is_never_abandoned() {
    init_tracing();
    let Some(cluster) = Cluster::up("sync", "commit") else {
        return;
    };
    bounded(async {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&cluster.url)
            .await
            .expect("pool");
        let store = PostgresStore::new(pool)
            .with_timeout(Duration::from_millis(500))
            .with_durability(Durability::SynchronousStandby);
        store
            .migrate()
            .await
            .expect("a synchronous standby: the promise holds");
        assert!(store.durability().await.unwrap().survives_failover());
        let KeyState::Acquired { claim, .. } = store.claim(&claim_request(1, 1)).await.unwrap()
        else {
            panic!("a new key is acquired");
        };

        walsenders(&cluster.url, "-STOP").await;
        let (parts, ()) = http::Response::new(()).into_parts();
        let record = Record::capture(&parts, Some(bytes::Bytes::from("charged")));
        let timed_out = store.complete(&claim, &record).await.unwrap_err();
        assert!(
            matches!(timed_out, PostgresStoreError::Timeout { .. }),
            "{timed_out}"
        );
        // The commit still waits for the standby, and nobody sees it meanwhile.
        until(&cluster.url, WAITING, 1).await;
        assert_eq!(scalar(&cluster.url, COMPLETED).await, 0);

        walsenders(&cluster.url, "-CONT").await;
        until(&cluster.url, COMPLETED, 1).await;
        assert_eq!(scalar(&cluster.url, WAITING).await, 0);
        assert_eq!(
            store.complete(&claim, &record).await.unwrap(),
            ClaimStatus::Held,
            "the retry finds its own completion"
        );
    })
    .await;
    drop(cluster);
}
