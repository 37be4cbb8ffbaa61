//! Entries that fail every time never stop the consumer (issue 44.3): bad data the database
//! refuses (an account with a NUL byte, an amount that overflows the balance) is dead-lettered
//! at once with its reason; an entry failing for a reason the consumer cannot classify is
//! dead-lettered after `--max-deliveries`, counted by the stream, and so is one the consumer dies
//! on each time; failing pending entries never starve new ones; and a transient failure is
//! retried until it succeeds, without counting.

use std::time::Duration;

use common::{
    BOUND, applied, kill_after, pending, redis, spawn, spawn_with, started, unique_stream,
};
use idempotency_tests::db::TestDb;
use redis::{
    AsyncCommands,
    aio::MultiplexedConnection,
    streams::{StreamId, StreamInfoGroupsReply, StreamRangeReply},
};
use sqlx::{AssertSqlSafe, Executor, PgPool};

mod common;

/// Distinct events applied, entries dead-lettered, entries pending.
type State = (i64, u64, u64);

async fn state(redis: &mut MultiplexedConnection, stream: &str, pool: &PgPool) -> State {
    let dead: u64 = redis.xlen(format!("{stream}:dead")).await.unwrap();
    (applied(pool).await.1, dead, pending(redis, stream).await)
}

/// Polls until `done` holds, within [`BOUND`].
async fn wait_until(
    redis: &mut MultiplexedConnection,
    stream: &str,
    pool: &PgPool,
    done: impl Fn(State) -> bool,
) -> State {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let now = state(redis, stream, pool).await;
        if done(now) {
            return now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "(applied, dead, pending) = {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the group has been handed every entry up to `last` (so each was tried).
async fn delivered_up_to(redis: &mut MultiplexedConnection, stream: &str, last: &str) {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let groups: StreamInfoGroupsReply = redis.xinfo_groups(stream).await.unwrap();
        if groups.groups.iter().any(|g| g.last_delivered_id == last) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{last} never read");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn add(redis: &mut MultiplexedConnection, stream: &str, fields: &[(&str, &[u8])]) -> String {
    redis.xadd(stream, "*", fields).await.unwrap()
}

fn credit<'a>(event: &'a str, account: &'a str, amount: &'a str) -> [(&'a str, &'a [u8]); 3] {
    [
        ("event_id", event.as_bytes()),
        ("account", account.as_bytes()),
        ("amount", amount.as_bytes()),
    ]
}

async fn dead_letters(redis: &mut MultiplexedConnection, stream: &str) -> Vec<StreamId> {
    let dead: StreamRangeReply = redis.xrange_all(format!("{stream}:dead")).await.unwrap();
    dead.ids
}

fn field(entry: &StreamId, name: &str) -> String {
    entry
        .get(name)
        .unwrap_or_else(|| panic!("no {name}: {entry:?}"))
}

async fn balance(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT balance FROM stream_consumer.accounts WHERE id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A group made before the consumer starts, so the test can read its pending entries.
async fn group(redis: &mut MultiplexedConnection, stream: &str) {
    let _: () = redis
        .xgroup_create_mkstream(stream, "ledger", "0")
        .await
        .unwrap();
}

async fn cleanup(redis: &mut MultiplexedConnection, stream: &str) {
    let _: () = redis
        .del(&[stream, &format!("{stream}:dead")])
        .await
        .unwrap();
}

/// Poison entries the database refuses, then good ones sent after the consumer tried them:
/// the good ones apply, the poison ones are dead-lettered at once with the reason, their id,
/// their delivery count and every original field, bytes that are not UTF-8 included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_entries_are_dead_lettered_and_later_entries_apply() {
    let Some(mut redis) = redis().await else {
        return;
    };
    let db = TestDb::new().await;
    let stream = unique_stream();
    group(&mut redis, &stream).await;
    let mut child = spawn(&db, &stream, "c0");
    let log = started(&mut child).await;

    add(&mut redis, &stream, &credit("evt_1", "acct_1", "100")).await;
    let nul = add(&mut redis, &stream, &credit("evt_nul", "acct\0nul", "5")).await;
    let big = i64::MAX.to_string();
    let overflow = add(&mut redis, &stream, &credit("evt_big", "acct_1", &big)).await;
    let binary: [(&str, &[u8]); 3] = [
        ("event_id", b"evt_bin"),
        ("account", b"acct_1"),
        ("note", b"\xff\xfe not text"),
    ];
    let binary = add(&mut redis, &stream, &binary).await;
    delivered_up_to(&mut redis, &stream, &binary).await;
    for i in 2..5 {
        let event = format!("evt_{i}");
        add(&mut redis, &stream, &credit(&event, "acct_2", "10")).await;
    }
    let done = wait_until(
        &mut redis,
        &stream,
        db.pool(),
        |(applied, dead, pending)| applied == 4 && dead == 3 && pending == 0,
    );
    assert_eq!(done.await, (4, 3, 0));
    child.kill().await.unwrap();
    log.await.unwrap();

    let dead = dead_letters(&mut redis, &stream).await;
    let by_id = |id: &str| {
        let found = dead.iter().find(|e| field(e, "dead_stream_id") == id);
        found.unwrap_or_else(|| panic!("{id} not dead-lettered: {dead:?}"))
    };
    let (nul, overflow, binary) = (by_id(&nul), by_id(&overflow), by_id(&binary));
    assert!(
        field(nul, "dead_reason").contains("SQLSTATE 22021"),
        "{nul:?}"
    );
    assert_eq!(nul.get::<Vec<u8>>("account").unwrap(), b"acct\0nul");
    assert!(field(overflow, "dead_reason").contains("SQLSTATE 22003"));
    assert_eq!(field(overflow, "amount"), big);
    assert_eq!(
        field(binary, "dead_reason"),
        "missing event_id, account or amount"
    );
    assert_eq!(binary.get::<Vec<u8>>("note").unwrap(), b"\xff\xfe not text");
    for entry in [nul, overflow, binary] {
        assert_eq!(field(entry, "dead_deliveries"), "1", "{entry:?}");
    }
    assert_eq!(balance(db.pool(), "acct_1").await, 100);
    assert_eq!(balance(db.pool(), "acct_2").await, 30);
    cleanup(&mut redis, &stream).await;
}

/// A trigger that fails credits to `account` with SQLSTATE `code`: for the first `times`
/// attempts (a sequence counts them, outside the rolled-back transactions), or always.
async fn failing_credits(pool: &PgPool, account: &str, code: &str, times: Option<u32>) {
    let when = match times {
        Some(times) => format!("nextval('stream_consumer.failures') <= {times}"),
        None => "nextval('stream_consumer.failures') > 0".to_owned(),
    };
    let sql = format!(
        "CREATE SEQUENCE stream_consumer.failures;
         CREATE FUNCTION stream_consumer.fail() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = '{account}' AND {when} THEN
                 RAISE EXCEPTION 'credits to {account} fail' USING ERRCODE = '{code}';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER fail BEFORE INSERT ON stream_consumer.accounts
             FOR EACH ROW EXECUTE FUNCTION stream_consumer.fail();"
    );
    pool.execute(AssertSqlSafe(sql)).await.unwrap();
}

/// Attempts the trigger saw: the failures' sequence.
async fn attempts(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT last_value FROM stream_consumer.failures")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// An error the consumer cannot classify is retried once idle, each time a new delivery, and
/// dead-lettered at the `--max-deliveries`th with the error; the good entry beside it applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_failure_is_dead_lettered_after_max_deliveries() {
    let Some(mut redis) = redis().await else {
        return;
    };
    let db = TestDb::new().await;
    let stream = unique_stream();
    group(&mut redis, &stream).await;
    let mut child = spawn_with(&db, &stream, "c0", &["--max-deliveries", "3"]);
    let log = started(&mut child).await;
    failing_credits(db.pool(), "acct_cursed", "P0001", None).await;

    let cursed = add(&mut redis, &stream, &credit("evt_c", "acct_cursed", "1")).await;
    add(&mut redis, &stream, &credit("evt_ok", "acct_ok", "1")).await;
    let done = wait_until(
        &mut redis,
        &stream,
        db.pool(),
        |(applied, dead, pending)| applied == 1 && dead == 1 && pending == 0,
    );
    assert_eq!(done.await, (1, 1, 0));
    child.kill().await.unwrap();
    log.await.unwrap();

    let dead = dead_letters(&mut redis, &stream).await;
    assert_eq!(field(&dead[0], "dead_stream_id"), cursed);
    assert_eq!(field(&dead[0], "dead_deliveries"), "3");
    let reason = field(&dead[0], "dead_reason");
    assert!(reason.contains("credits to acct_cursed fail"), "{reason}");
    assert_eq!(attempts(db.pool()).await, 3, "one attempt per delivery");
    cleanup(&mut redis, &stream).await;
}

/// More failing entries than one round re-reads stay pending (a high bound), and entries sent
/// after them still apply: pending entries never starve new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_pending_entries_never_starve_new_ones() {
    let Some(mut redis) = redis().await else {
        return;
    };
    let db = TestDb::new().await;
    let stream = unique_stream();
    group(&mut redis, &stream).await;
    let mut child = spawn_with(&db, &stream, "c0", &["--max-deliveries", "1000"]);
    let log = started(&mut child).await;
    failing_credits(db.pool(), "acct_cursed", "P0001", None).await;

    let mut last = String::new();
    for i in 0..40 {
        let event = format!("evt_c{i}");
        last = add(&mut redis, &stream, &credit(&event, "acct_cursed", "1")).await;
    }
    delivered_up_to(&mut redis, &stream, &last).await;
    for i in 0..3 {
        let event = format!("evt_ok{i}");
        add(&mut redis, &stream, &credit(&event, "acct_ok", "1")).await;
    }
    let done = wait_until(&mut redis, &stream, db.pool(), |(applied, _, _)| {
        applied == 3
    });
    assert_eq!(done.await, (3, 0, 40));
    child.kill().await.unwrap();
    log.await.unwrap();
    cleanup(&mut redis, &stream).await;
}

/// A transient failure (a serialization failure, three times) is retried until it succeeds and
/// is not dead-lettered, even with a bound of two deliveries: retries in place do not count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_is_retried_until_it_succeeds() {
    let Some(mut redis) = redis().await else {
        return;
    };
    let db = TestDb::new().await;
    let stream = unique_stream();
    group(&mut redis, &stream).await;
    let mut child = spawn_with(&db, &stream, "c0", &["--max-deliveries", "2"]);
    let log = started(&mut child).await;
    failing_credits(db.pool(), "acct_flaky", "40001", Some(3)).await;

    add(&mut redis, &stream, &credit("evt_f", "acct_flaky", "7")).await;
    let done = wait_until(&mut redis, &stream, db.pool(), |(applied, _, pending)| {
        applied == 1 && pending == 0
    });
    assert_eq!(done.await, (1, 0, 0), "applied, and nothing dead-lettered");
    child.kill().await.unwrap();
    log.await.unwrap();
    assert_eq!(
        attempts(db.pool()).await,
        4,
        "three failures, then the credit"
    );
    assert_eq!(balance(db.pool(), "acct_flaky").await, 7);
    cleanup(&mut redis, &stream).await;
}

/// An entry the consumer dies on each time (here: killed mid-effect, twice) is dead-lettered on
/// the next delivery past `--max-deliveries`, before it is tried again; nothing was applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_the_consumer_dies_on_is_dead_lettered_before_another_try() {
    let Some(mut redis) = redis().await else {
        return;
    };
    let db = TestDb::new().await;
    let stream = unique_stream();
    group(&mut redis, &stream).await;
    let deadly = add(&mut redis, &stream, &credit("evt_k", "acct_1", "1")).await;
    let flags = ["--max-deliveries", "2"];
    for name in ["c0", "c1"] {
        let child = spawn_with(&db, &stream, name, &flags);
        assert!(
            kill_after(child, "applying event", 1).await,
            "{name} never applied"
        );
    }
    let mut child = spawn_with(&db, &stream, "c2", &flags);
    let log = started(&mut child).await;
    let done = wait_until(&mut redis, &stream, db.pool(), |(_, dead, pending)| {
        dead == 1 && pending == 0
    });
    assert_eq!(done.await, (0, 1, 0), "dead-lettered, never applied");
    child.kill().await.unwrap();
    log.await.unwrap();

    let dead = dead_letters(&mut redis, &stream).await;
    assert_eq!(field(&dead[0], "dead_stream_id"), deadly);
    assert_eq!(field(&dead[0], "dead_deliveries"), "3");
    let reason = field(&dead[0], "dead_reason");
    assert_eq!(reason, "delivered 3 times without an outcome");
    cleanup(&mut redis, &stream).await;
}
