//! The `metrics` feature: every outcome, rejection and store operation is counted.
//!
//! One test per binary: the recorder is process-global.

use http::StatusCode;
use idempotency_tests::{
    app::{Probe, app},
    init_tracing,
    server::TestServer,
    suite::Reply,
};
use metrics::{SharedString, Unit};
use metrics_util::{
    CompositeKey, MetricKind,
    debugging::{DebugValue, DebuggingRecorder},
};
use tower_idempotency::{IdempotencyLayer, Scope, metrics as names};

type Metrics = Vec<(CompositeKey, Option<Unit>, Option<SharedString>, DebugValue)>;

fn counter(metrics: &Metrics, name: &str, label: (&str, &str)) -> u64 {
    metrics
        .iter()
        .filter(|(key, _, _, _)| {
            key.kind() == MetricKind::Counter
                && key.key().name() == name
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == label.0 && l.value() == label.1)
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
    // A begin for each of the four keyed requests (a memory store has no replay cache in front
    // of it), one complete, one release.
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
}
