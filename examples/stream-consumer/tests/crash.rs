//! The consumer survives its own crash (issue 37.3): it is `SIGKILL`ed mid-message again and
//! again (while an effect holds its row lock, or right after an effect committed and before
//! its `XACK`), restarted under rotating consumer names so that entries left pending are
//! claimed once idle (`XCLAIM`), and finally drained; every event's effect applied exactly once.

use std::{collections::BTreeMap, time::Duration};

use common::{BOUND, applied, kill_after, redis, spawn_with, unique_stream};
use idempotency_tests::db::TestDb;
use redis::AsyncCommands;
use tokio::io::{AsyncBufReadExt, BufReader};

mod common;

const EVENTS: u64 = 40;
const DUPLICATES: u64 = 12;
const KILLS: u64 = 24;
/// The kills here are the test's, not the entries': an entry killed on again and again must not
/// be taken for one that kills the consumer (`--max-deliveries`, which `poison.rs` tests).
const UNBOUNDED: &[&str] = &["--max-deliveries", "1000"];

/// A pseudo-random sequence, the same on every run (xorshift).
struct Dice(u64);

impl Dice {
    fn roll(&mut self, sides: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % sides
    }
}

/// Every event, and the copies a producer sends again under new stream ids.
async fn produce(
    redis: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    dice: &mut Dice,
) -> BTreeMap<String, i64> {
    let mut balances = BTreeMap::new();
    let credit = |i: u64| {
        (
            format!("evt_{i}"),
            format!("acct_{}", i % 5),
            (i + 1) as i64,
        )
    };
    let mut sends: Vec<u64> = (0..EVENTS).collect();
    for _ in 0..DUPLICATES {
        let copy = dice.roll(EVENTS);
        let at = dice.roll(sends.len() as u64 + 1) as usize;
        sends.insert(at.max(copy as usize + 1).min(sends.len()), copy);
    }
    for i in sends {
        let (event, account, amount) = credit(i);
        let fields = [
            ("event_id", event),
            ("account", account),
            ("amount", amount.to_string()),
        ];
        let _: String = redis.xadd(stream, "*", &fields).await.unwrap();
    }
    for i in 0..EVENTS {
        let (_, account, amount) = credit(i);
        *balances.entry(account).or_default() += amount;
    }
    balances
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_applies_once_across_sigkills() {
    let Some(mut redis) = redis().await else {
        return;
    };
    let db = TestDb::new().await;
    let stream = unique_stream();
    let mut dice = Dice(0x9e37_79b9_7f4a_7c15);
    let expected = produce(&mut redis, &stream, &mut dice).await;

    let mut kills = 0;
    for run in 0..KILLS * 2 {
        // Mid-effect (its row locked), or between its commit and its XACK.
        let marker = if dice.roll(3) == 0 {
            "committed event"
        } else {
            "applying event"
        };
        let child = spawn_with(&db, &stream, &format!("c{}", run % 3), UNBOUNDED);
        if kill_after(child, marker, 1 + dice.roll(3)).await {
            kills += 1;
        }
        if kills == KILLS {
            break;
        }
    }
    assert_eq!(
        kills, KILLS,
        "the consumer ran out of work before it was killed {KILLS} times"
    );

    // Drain: one consumer until every event applied and nothing is pending, then SIGTERM.
    let mut child = spawn_with(&db, &stream, "c0", UNBOUNDED);
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let drain_log =
        tokio::spawn(async move { while let Ok(Some(_)) = stderr.next_line().await {} });
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let pending: (u64, Option<String>, Option<String>, redis::Value) = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("ledger")
            .query_async(&mut redis)
            .await
            .unwrap();
        if applied(db.pool()).await.1 == EVENTS as i64 && pending.0 == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not drained: {:?}, {pending:?}",
            applied(db.pool()).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = child.id().unwrap().to_string();
    let term = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(term.success());
    let exited = tokio::time::timeout(BOUND, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exited.success(), "graceful shutdown: {exited:?}");
    drain_log.await.unwrap();

    let (rows, distinct) = applied(db.pool()).await;
    assert_eq!(
        (rows, distinct),
        (EVENTS as i64, EVENTS as i64),
        "an event applied twice"
    );
    let balances: BTreeMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT id, balance FROM stream_consumer.accounts")
            .fetch_all(db.pool())
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(balances, expected);
    let dead: u64 = redis.xlen(format!("{stream}:dead")).await.unwrap();
    assert_eq!(dead, 0, "no entry was dead-lettered");
    let _: () = redis
        .del(&[&stream, &format!("{stream}:dead")])
        .await
        .unwrap();
}
