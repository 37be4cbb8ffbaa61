//! `scripts/ha-cluster.sh` (issue 45.1): a two-node Patroni cluster comes up from an empty
//! directory, takes a write through its endpoint, loses its primary, takes a write again on the
//! other node with the first write still there, and is torn down by PID. Skipped, saying so,
//! when Patroni, etcd or HAProxy is not installed; under CI (`CI` set) it fails instead.

use std::time::{Duration, Instant};

use idempotency_tests::ha::Cluster;
use sqlx::{Connection, PgConnection};

/// How long the endpoint may take to reach the new primary (the script's own waits are bounded
/// by `--timeout` as well).
const FAILOVER_LIMIT: Duration = Duration::from_secs(60);

/// Inserts `value` through the endpoint in a connection of its own; the server port that took it.
async fn write(url: &str, value: i32) -> Result<i32, sqlx::Error> {
    let mut connection = PgConnection::connect(url).await?;
    sqlx::query("INSERT INTO ha_test VALUES ($1)")
        .bind(value)
        .execute(&mut connection)
        .await?;
    let port = sqlx::query_scalar("SELECT inet_server_port()")
        .fetch_one(&mut connection)
        .await?;
    connection.close().await?;
    Ok(port)
}

#[tokio::test]
async fn a_write_goes_through_the_endpoint_again_after_the_primary_is_killed() {
    let Some(cluster) = Cluster::up("sync", "cluster") else {
        return;
    };
    let url = cluster.url.clone();
    let mut connection = PgConnection::connect(&url).await.expect("connect");
    sqlx::query("CREATE TABLE ha_test (value int)")
        .execute(&mut connection)
        .await
        .expect("create the table");
    drop(connection);
    let first = write(&url, 1).await.expect("the first write");

    let killed = cluster.run(&["kill-primary", "--postmaster"]);
    let killed = String::from_utf8_lossy(&killed.stdout).trim().to_owned();
    assert!(
        killed.starts_with("node"),
        "kill-primary printed {killed:?}"
    );
    let killed_at = Instant::now();
    // Polled: the endpoint follows the new primary only once Patroni has promoted it.
    let second = loop {
        match write(&url, 2).await {
            Ok(port) => break port,
            Err(error) => {
                assert!(
                    killed_at.elapsed() < FAILOVER_LIMIT,
                    "no write within {FAILOVER_LIMIT:?} of the kill: {error}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    eprintln!(
        "{killed} killed; a write went through {:.1} s later",
        killed_at.elapsed().as_secs_f64()
    );
    assert_ne!(first, second, "the second write reached another node");
    let mut connection = PgConnection::connect(&url).await.expect("connect");
    let values: Vec<i32> = sqlx::query_scalar("SELECT value FROM ha_test ORDER BY value")
        .fetch_all(&mut connection)
        .await
        .expect("read back");
    assert_eq!(
        values,
        [1, 2],
        "synchronous replication kept the acknowledged write"
    );
    drop(connection);
    drop(cluster);
}
