//! Entries that can never apply are moved to `<stream>:dead` with the reason and acknowledged,
//! never lost and never retried forever: a missing field, an amount that is not an integer, an
//! event id that is not a valid key, and an event id reused with another payload (whose first
//! payload stays applied, once).

use std::{collections::BTreeMap, time::Duration};

use common::{BOUND, applied, redis, spawn, unique_stream};
use idempotency_tests::db::TestDb;
use redis::{AsyncCommands, streams::StreamRangeReply};

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_entries_are_dead_lettered_with_their_reason() {
    let Some(mut redis) = redis().await else {
        return;
    };
    let db = TestDb::new().await;
    let stream = unique_stream();
    let entries: [&[(&str, &str)]; 5] = [
        &[
            ("event_id", "evt_1"),
            ("account", "acct_1"),
            ("amount", "100"),
        ],
        &[("event_id", "evt_2"), ("account", "acct_1")],
        &[
            ("event_id", "evt_3"),
            ("account", "acct_1"),
            ("amount", "ten"),
        ],
        &[
            ("event_id", "evt\t4"),
            ("account", "acct_1"),
            ("amount", "5"),
        ],
        &[
            ("event_id", "evt_1"),
            ("account", "acct_1"),
            ("amount", "999"),
        ],
    ];
    // The group exists before the consumer starts, so the test can read its pending entries.
    let _: () = redis
        .xgroup_create_mkstream(&stream, "ledger", "0")
        .await
        .unwrap();
    for fields in entries {
        let _: String = redis.xadd(&stream, "*", fields).await.unwrap();
    }
    let dead_stream = format!("{stream}:dead");
    let mut child = spawn(&db, &stream, "c0");
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let dead: u64 = redis.xlen(&dead_stream).await.unwrap();
        let pending: (u64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("ledger")
            .query_async(&mut redis)
            .await
            .unwrap();
        if dead == 4 && pending.0 == 0 && applied(db.pool()).await.0 == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "dead {dead}, pending {}",
            pending.0
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child.kill().await.unwrap();

    let dead: StreamRangeReply = redis.xrange_all(&dead_stream).await.unwrap();
    let reasons: BTreeMap<String, String> = dead
        .ids
        .iter()
        .map(|entry| {
            let event: String = entry.get("event_id").unwrap();
            (event, entry.get("dead_reason").unwrap())
        })
        .collect();
    assert_eq!(
        reasons,
        BTreeMap::from([
            (
                "evt_1".into(),
                "event id reused with another payload".into()
            ),
            ("evt_2".into(), "missing event_id, account or amount".into()),
            ("evt_3".into(), "amount is not an integer".into()),
            ("evt\t4".into(), "invalid event id".into()),
        ])
    );
    // The reused id's copy kept its own fields, for whoever repairs it.
    let copy = dead
        .ids
        .iter()
        .find(|entry| entry.get::<String>("event_id").as_deref() == Some("evt_1"));
    assert_eq!(
        copy.unwrap().get::<String>("amount").as_deref(),
        Some("999")
    );
    let balance: i64 =
        sqlx::query_scalar("SELECT balance FROM stream_consumer.accounts WHERE id = 'acct_1'")
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert_eq!((applied(db.pool()).await, balance), ((1, 1), 100));
    let _: () = redis.del(&[&stream, &dead_stream]).await.unwrap();
}
