//! The `metrics` feature: every outcome, rejection and store operation is counted.
//!
//! One test per binary: the recorder is process-global.

use std::time::Duration;

use http::StatusCode;
use idempotency_tests::{
    app::{Probe, app},
    init_tracing,
    server::TestServer,
    suite::{CHARGE, Reply, claim_request},
};
use metrics::{SharedString, Unit};
use metrics_util::{
    CompositeKey, MetricKind,
    debugging::{DebugValue, DebuggingRecorder, Snapshotter},
};
use sqlx::Executor;
use tower_idempotency::{
    IdempotencyLayer, Scope, metrics as names,
    store::{KeyState, PostgresStore, Store, continuously_delete_expired},
};

type Metrics = Vec<(CompositeKey, Option<Unit>, Option<SharedString>, DebugValue)>;

fn counter(metrics: &Metrics, name: &str, label: (&str, &str)) -> u64 {
    counter_where(metrics, name, Some(label))
}

/// The sum of the counter `name`'s values, those with `label` if given.
fn counter_where(metrics: &Metrics, name: &str, label: Option<(&str, &str)>) -> u64 {
    metrics
        .iter()
        .filter(|(key, _, _, _)| {
            key.kind() == MetricKind::Counter
                && key.key().name() == name
                && label.is_none_or(|label| {
                    key.key()
                        .labels()
                        .any(|l| l.key() == label.0 && l.value() == label.1)
                })
        })
        .map(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

/// The sum of a histogram's samples with `label`.
fn histogram_sum(metrics: &Metrics, name: &str, label: (&str, &str)) -> f64 {
    metrics
        .iter()
        .filter(|(key, _, _, _)| {
            key.key().name() == name
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == label.0 && l.value() == label.1)
        })
        .map(|(_, _, _, value)| match value {
            DebugValue::Histogram(samples) => samples.iter().map(|s| s.into_inner()).sum(),
            _ => 0.0,
        })
        .sum()
}

/// Takes snapshots until the counter `name` (with `label`, if given) has counted `at_least`
/// over them, for what happens on a timer of its own (lease renewals, the expiry loop);
/// fails after 10 s. Snapshots drain the recorder: whatever else they held is dropped.
async fn counted(
    snapshotter: &Snapshotter,
    name: &str,
    label: Option<(&str, &str)>,
    at_least: u64,
) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut total = 0;
    loop {
        total += counter_where(&snapshotter.snapshot().into_vec(), name, label);
        if total >= at_least {
            return total;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} {label:?} counted {total}, expected at least {at_least}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn histogram_samples(metrics: &Metrics, name: &str) -> usize {
    metrics
        .iter()
        .filter(|(key, _, _, _)| key.key().name() == name)
        .map(|(_, _, _, value)| match value {
            DebugValue::Histogram(samples) => samples.len(),
            _ => 0,
        })
        .sum()
}

#[tokio::test]
async fn outcomes_rejections_and_store_latency_are_recorded() {
    init_tracing();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder in this binary");

    let probe = Probe::default();
    let layer = IdempotencyLayer::memory().with_scope(Scope::single_tenant());
    let server = TestServer::start(app(layer, probe)).await;
    let client = reqwest::Client::new();
    let post = |key: &str, body: &'static str| {
        client
            .post(server.url("/charges"))
            .header("idempotency-key", key)
            .body(body)
    };

    assert_eq!(Reply::of(post("m1", "a")).await.status, StatusCode::CREATED);
    assert!(Reply::of(post("m1", "a")).await.replayed());
    Reply::of(post("m1", "b"))
        .await
        .assert_problem(422, "Mismatch");
    Reply::of(post("", "a"))
        .await
        .assert_problem(400, "KeyInvalid");
    let released = client
        .post(server.url("/status/500"))
        .header("idempotency-key", "m2")
        .body("x");
    assert_eq!(
        Reply::of(released).await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );

    // A snapshot drains the recorder: take one.
    let m = snapshotter.snapshot().into_vec();
    assert_eq!(counter(&m, names::REQUESTS, ("outcome", "acquired")), 1);
    assert_eq!(counter(&m, names::REQUESTS, ("outcome", "replayed")), 1);
    assert_eq!(counter(&m, names::REQUESTS, ("outcome", "mismatch")), 1);
    assert_eq!(counter(&m, names::REQUESTS, ("outcome", "released")), 1);
    assert_eq!(counter(&m, names::REJECTIONS, ("kind", "mismatch")), 1);
    assert_eq!(counter(&m, names::REJECTIONS, ("kind", "key_invalid")), 1);
    // A claim for each of the four keyed requests (no CachingStore in front of the memory
    // store), one complete, one release.
    assert_eq!(histogram_samples(&m, names::STORE_SECONDS), 4 + 1 + 1);
    assert_eq!(histogram_samples(&m, names::STORED_BODY_BYTES), 1);

    // PostgreSQL in lease mode: every new key's claim and completion goes through exactly one
    // batch, however the 40 concurrent requests were grouped.
    let db = idempotency_tests::db::TestDb::new().await;
    let store = tower_idempotency::store::PostgresStore::new(db.pool().clone());
    store.migrate().await.expect("migrate");
    let layer = IdempotencyLayer::new(store).with_scope(Scope::single_tenant());
    let server = TestServer::start(app(layer, Probe::default())).await;
    let replies = futures_util::future::join_all((0..40).map(|i| {
        Reply::of(
            client
                .post(server.url("/charges"))
                .header("idempotency-key", format!("pg-{i}"))
                .body("a"),
        )
    }))
    .await;
    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    let m = snapshotter.snapshot().into_vec();
    let batched = |operation| histogram_sum(&m, names::STORE_BATCH_SIZE, ("operation", operation));
    assert_eq!(batched("claim"), 40.0);
    assert_eq!(batched("complete"), 40.0);

    // The outcomes an operator alerts on, on the same database: a takeover, a conflict, lease
    // renewals, a store error, and the expiry loop's deletions and errors.
    let store = PostgresStore::new(db.pool().clone());
    let probe = Probe::default();
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(60))
        .expect("lease");
    let server = TestServer::start(app(layer, probe.clone())).await;
    let charge = |key: &str| {
        client
            .post(server.url("/charges"))
            .bearer_auth("acct_a")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(CHARGE)
    };

    // A holder that stopped (claimed directly, its lease then lapsed): the retry takes over.
    let Ok(KeyState::Acquired { .. }) = store.claim(&claim_request("t1", CHARGE)).await else {
        panic!("the stopped holder claims first");
    };
    db.pool()
        .execute(
            "UPDATE idempotency.records SET lease_until = now() - interval '1 second' \
             WHERE status IS NULL",
        )
        .await
        .expect("lapse the lease");
    assert_eq!(Reply::of(charge("t1")).await.status, StatusCode::CREATED);
    probe.started(1).await; // the takeover's handler, counted: the next wait is for another
    let m = snapshotter.snapshot().into_vec();
    assert_eq!(counter(&m, names::REQUESTS, ("outcome", "takeover")), 1);

    // A duplicate while the first is in its handler: a conflict. The first's lease (60 ms) is
    // renewed every 20 ms meanwhile.
    let first = tokio::spawn(Reply::of(charge("c1").header("x-test-gate", "1")));
    probe.started(1).await;
    Reply::of(charge("c1"))
        .await
        .assert_problem(409, "InFlight");
    let m = snapshotter.snapshot().into_vec();
    assert_eq!(counter(&m, names::REQUESTS, ("outcome", "conflict")), 1);
    assert_eq!(counter(&m, names::REJECTIONS, ("kind", "in_flight")), 1);
    counted(
        &snapshotter,
        names::LEASE_RENEWALS,
        Some(("result", "held")),
        1,
    )
    .await;
    probe.open_gate(1);
    assert_eq!(first.await.expect("task").status, StatusCode::CREATED);

    // A database that refuses connections: a store error, answered 503.
    let broken = PostgresStore::new(idempotency_tests::db::unreachable_pool(
        Duration::from_millis(300),
    ));
    let server =
        TestServer::start(app(IdempotencyLayer::new(broken.clone()), Probe::default())).await;
    let reply = Reply::of(
        client
            .post(server.url("/charges"))
            .bearer_auth("acct_a")
            .header("idempotency-key", "s1")
            .body("a"),
    )
    .await;
    reply.assert_problem(503, "StoreUnavailable");
    let m = snapshotter.snapshot().into_vec();
    assert_eq!(counter(&m, names::REQUESTS, ("outcome", "store_error")), 1);
    assert_eq!(
        counter(&m, names::REJECTIONS, ("kind", "store_unavailable")),
        1
    );

    // The expiry loop: every record expired is counted once deleted; a failing store is counted
    // as an error.
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
        .fetch_one(db.pool())
        .await
        .expect("count");
    assert!(
        records >= 42,
        "40 batched, a takeover and a conflict's: {records}"
    );
    db.pool()
        .execute("UPDATE idempotency.records SET expires_at = now() - interval '1 second'")
        .await
        .expect("expire");
    let reaping = tokio::spawn(continuously_delete_expired(
        store,
        Duration::from_secs(3600),
        1_000,
    ));
    let deleted = counted(&snapshotter, names::EXPIRED_DELETED, None, 1).await;
    reaping.abort();
    assert_eq!(deleted, u64::try_from(records).expect("count"));
    let failing = tokio::spawn(continuously_delete_expired(
        broken,
        Duration::from_secs(3600),
        1_000,
    ));
    counted(&snapshotter, names::EXPIRY_ERRORS, None, 1).await;
    failing.abort();
}
