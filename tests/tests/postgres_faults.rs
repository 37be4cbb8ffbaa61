//! `PostgresStore` when things fail: a database out of reach, connections cut or terminated
//! under a batch, claims whose callers went away (cancelled, timed out) before they committed,
//! completions the database refuses. None leaves a key held for nobody or runs a handler twice.
//! Each test in its own database.

use std::time::Duration;

use http::StatusCode;
use idempotency_tests::{
    app::{Probe, app},
    init_tracing,
    postgres::{
        claim_released_after, claim_request, held_uncommitted, migrated, post,
        statement_waits_on_a_lock, wait_until,
    },
    server::TestServer,
    suite::Reply,
};
use sqlx::{Executor, postgres::PgPoolOptions};
use tower_idempotency::{
    IdempotencyLayer,
    store::{ClaimStatus, PostgresStore},
};

#[tokio::test]
async fn an_unreachable_database_is_a_prompt_503() {
    init_tracing();
    let pool = idempotency_tests::db::unreachable_pool(Duration::from_secs(1));
    let store = PostgresStore::new(pool).with_timeout(Duration::from_secs(2));
    let probe = Probe::default();
    let server = TestServer::start(app(IdempotencyLayer::new(store), probe.clone())).await;
    let started = tokio::time::Instant::now();
    let reply = Reply::of(post(&reqwest::Client::new(), &server, "k-down")).await;
    reply.assert_problem(503, "StoreUnavailable");
    assert_eq!(reply.headers["retry-after"], "1");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(probe.executions(), 0);
}

/// A claim written in a batch for a request that has gone meanwhile (cancelled while it
/// waited) is released at once, not left in flight until its lease lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_batched_for_a_request_that_is_gone_is_released() {
    use tower_idempotency::store::Store;

    let (db, store) = migrated().await;
    let request = claim_request(9, 1);
    // Another transaction inserts the same key and stays open: the batch waits on it.
    let blocker = held_uncommitted(&db, &request).await;
    let claiming = tokio::spawn({
        let (store, request) = (store.clone(), request.clone());
        async move { store.claim(&request).await }
    });
    statement_waits_on_a_lock(&db, "%unnest%").await;
    // The request goes away; then the batch gets through and claims the key for no one.
    claiming.abort();
    assert!(claiming.await.expect_err("aborted").is_cancelled());
    blocker.rollback().await.expect("rollback");
    claim_released_after(&db, &store, "%unnest%", &request).await;
}

/// The connection a batch writer keeps between batches can die under it (a server restart,
/// a terminated backend): that batch's claims go alone, the connection is not reused, and
/// the batches queued behind it go out on a fresh one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_connection_dies_is_claimed_alone_and_batching_goes_on() {
    use tower_idempotency::store::{KeyState, Store};

    let (db, store) = migrated().await;
    let request = |i: u8| claim_request(i, i);
    let claim = |i: u8| {
        let store = store.clone();
        tokio::spawn(async move { (i, store.claim(&request(i)).await) })
    };
    // Another transaction holds key 0's row uncommitted: the first batch waits on it.
    let blocker = held_uncommitted(&db, &request(0)).await;
    let mut claims = vec![claim(0)];
    statement_waits_on_a_lock(&db, "%unnest%").await;
    // Eight more queue behind that batch.
    claims.extend((1..=8).map(claim));
    // The batch writer's connection dies mid-batch.
    let terminated: bool = sqlx::query_scalar(
        "SELECT bool_and(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND query LIKE '%unnest%' AND pid <> pg_backend_pid()",
    )
    .fetch_one(db.pool())
    .await
    .expect("terminate");
    assert!(terminated);
    // The blocker gives key 0 up; its claim, sent alone after the failed batch, gets it.
    blocker.rollback().await.expect("rollback");
    for claimed in claims {
        let (i, begin) = claimed.await.expect("task");
        assert!(
            matches!(
                begin,
                Ok(KeyState::Acquired {
                    takeover: false,
                    ..
                })
            ),
            "key {i}: {begin:?}"
        );
    }
    // Batching goes on.
    for claimed in (9..=16).map(claim) {
        let (i, begin) = claimed.await.expect("task");
        assert!(
            matches!(begin, Ok(KeyState::Acquired { .. })),
            "key {i}: {begin:?}"
        );
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
        .fetch_one(db.pool())
        .await
        .expect("count");
    assert_eq!(rows, 17);
}

/// Issue 28.4, claims orphaned by errors: a batch of claims that committed but whose answer
/// was lost (the connection cut right after the server confirmed the `INSERT`) is not left
/// in flight for nobody: the request's own claim, retried alone, finds its row and holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_claim_that_committed_then_failed_is_held_by_its_request() {
    use idempotency_tests::faults::CuttingProxy;
    use tower_idempotency::store::{KeyState, Store};

    let (db, _) = migrated().await;
    let proxy = CuttingProxy::start(&db).await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(proxy.options(&db))
        .await
        .expect("pool through the proxy");
    let store = PostgresStore::new(pool);
    let request = claim_request(11, 1);
    proxy.cut_after("INSERT");
    let begin = store.claim(&request).await.expect("claim");
    assert!(proxy.has_cut(), "the batch's answer was cut");
    assert!(
        matches!(
            begin,
            KeyState::Acquired {
                takeover: false,
                ..
            }
        ),
        "{begin:?}"
    );
    let KeyState::Acquired { claim, .. } = begin else {
        unreachable!()
    };
    // The claim is really held: it completes, and the key replays.
    let record = tower_idempotency::Record::from_parts(StatusCode::OK, Default::default(), None);
    assert_eq!(
        store.complete(&claim, &record).await.expect("complete"),
        tower_idempotency::store::ClaimStatus::Held
    );
    assert!(matches!(
        store.claim(&request).await.expect("claim"),
        KeyState::Completed { .. }
    ));
}

/// Issue 28.4: a batched claim whose caller stopped waiting (the store's timeout) and that
/// commits afterwards is released once it does, not left to block its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_claim_that_timed_out_is_released_when_it_commits() {
    use tower_idempotency::store::Store;

    let (db, store) = migrated().await;
    let store = store.with_timeout(Duration::from_millis(300));
    let request = claim_request(12, 1);
    let blocker = held_uncommitted(&db, &request).await;
    let claiming = tokio::spawn({
        let (store, request) = (store.clone(), request.clone());
        async move { store.claim(&request).await }
    });
    statement_waits_on_a_lock(&db, "%unnest%").await;
    assert!(
        matches!(
            claiming.await.expect("task"),
            Err(tower_idempotency::store::PostgresStoreError::Timeout { .. })
        ),
        "the caller stopped waiting"
    );
    // The blocker gives the key up: the batch claims it, for nobody.
    blocker.rollback().await.expect("rollback");
    // Another payload under the key is a new request, not a 422.
    claim_released_after(&db, &store, "%unnest%", &claim_request(12, 2)).await;
}

/// Issue 28.4: a single-key claim (a key with a row: here a lapsed lease, taken over)
/// cancelled while its statement waits (what `Disconnect::Cancel` does when the client
/// hangs up) leaves no claim behind once the statement commits. The key is given back as the
/// claim found it (stop 50's failover chaos run): in flight under a lapsed lease, since its
/// first holder may have run in part, so the same payload takes it over and another is a `422`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_takeover_gives_the_key_back_as_it_found_it() {
    use tower_idempotency::store::{KeyState, Store};

    let (db, store) = migrated().await;
    let request = claim_request(13, 1);
    assert!(matches!(
        store.claim(&request).await.expect("claim"),
        KeyState::Acquired { .. }
    ));
    lapse_and_cancel_a_takeover(&db, &store, &request).await;
    let mismatch = store.claim(&claim_request(13, 2)).await.expect("claim");
    assert!(matches!(mismatch, KeyState::Mismatch), "{mismatch:?}");
    let again = store.claim(&request).await.expect("claim");
    assert!(
        matches!(again, KeyState::Acquired { takeover: true, .. }),
        "{again:?}"
    );
}

/// A takeover whose answer was lost (a failover cut its connection after the commit) must not
/// hide the key from the completer: the first holder's steps and kept request stay pending, and
/// the completer picks the key (stop 50's CI: an authorization orphaned by such a takeover).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_takeover_leaves_its_key_to_the_completer() {
    use tower_idempotency::store::{KeyState, PendingPick, StepRecord, Store};

    let (db, store) = migrated().await;
    let request = tower_idempotency::store::ClaimRequest {
        keeps_request: true,
        ..claim_request(14, 1)
    };
    let KeyState::Acquired { claim, .. } = store.claim(&request).await.expect("claim") else {
        panic!("a new key is acquired");
    };
    let fence = *claim.fence();
    let capabilities = store.capabilities();
    let log = capabilities.pending_log().expect("a pending log");
    let kept = log.keep(&fence, &request.fingerprint, "kept".into());
    assert_eq!(kept.await.expect("keep"), ClaimStatus::Held);
    let steps = capabilities.step_log().expect("a step log");
    let step = StepRecord {
        name: "authorize".into(),
        output: "{}".into(),
    };
    let recorded = steps.record(&fence, &request.fingerprint, &step);
    assert_eq!(recorded.await.expect("record"), ClaimStatus::Held);
    lapse_and_cancel_a_takeover(&db, &store, &request).await;
    db.pool()
        .execute("UPDATE idempotency.records SET lease_until = now() - interval '1 hour'")
        .await
        .expect("past the grace");
    log.purge(100).await.expect("purge");
    let pick = PendingPick {
        limit: 10,
        grace: Duration::from_secs(1),
        max_attempts: 5,
    };
    let picked = log.pick(pick).await.expect("pick");
    assert_eq!(picked.len(), 1, "the completer still finds the key");
    assert_eq!(picked[0].request, "kept");
}

/// Lapses `request`'s claim, then takes it over with a claim cancelled while its statement
/// waits on the row, and waits until that statement has ended and its attempt was undone.
async fn lapse_and_cancel_a_takeover(
    db: &idempotency_tests::db::TestDb,
    store: &PostgresStore,
    request: &tower_idempotency::store::ClaimRequest,
) {
    use tower_idempotency::store::Store;

    db.pool()
        .execute("UPDATE idempotency.records SET lease_until = now() - interval '1 second'")
        .await
        .expect("lapse");
    // Another transaction locks the row: the takeover's statement waits on it.
    let mut blocker = db.pool().begin().await.expect("begin");
    blocker
        .execute("SELECT * FROM idempotency.records FOR UPDATE")
        .await
        .expect("lock the row");
    let claiming = tokio::spawn({
        let (store, request) = (store.clone(), request.clone());
        async move { store.claim(&request).await }
    });
    statement_waits_on_a_lock(db, "%taken AS%").await;
    claiming.abort();
    assert!(claiming.await.expect_err("aborted").is_cancelled());
    blocker.rollback().await.expect("rollback");
    // The takeover committed for nobody; its attempt gives the key back with its lease ended.
    wait_until(
        db,
        "SELECT count(*) = 1 FROM idempotency.records
         WHERE takeover AND status IS NULL AND lease_until <= now()",
    )
    .await;
}

/// Issue 28.1: the database refuses to store a delivered response for longer than the lease
/// (a trigger rejects every completion). The layer keeps the claim alive while it retries,
/// so a retry sent after the lease gets `409`, never a second execution; once the database
/// takes the record again, the retry gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_the_database_refuses_keeps_its_key_past_the_lease() {
    let (db, store) = migrated().await;
    db.pool()
        .execute(
            "CREATE FUNCTION idempotency.refuse_completion() RETURNS trigger
             LANGUAGE plpgsql AS $$ BEGIN
                 IF NEW.status IS NOT NULL AND OLD.status IS NULL THEN
                     RAISE EXCEPTION 'completions refused for the test';
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_completion BEFORE UPDATE ON idempotency.records
                 FOR EACH ROW EXECUTE FUNCTION idempotency.refuse_completion();",
        )
        .await
        .expect("trigger");
    let lease = Duration::from_millis(600);
    let probe = Probe::default();
    let layer = IdempotencyLayer::new(store)
        .with_lease(lease)
        .expect("lease");
    let server = TestServer::start(app(layer, probe.clone())).await;
    let client = reqwest::Client::new();
    let first = Reply::of(post(&client, &server, "k-refused")).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "delivered though not stored"
    );
    // The scenario is time passing: the refusal outlasts the lease three times over.
    tokio::time::sleep(lease * 3).await;
    Reply::of(post(&client, &server, "k-refused"))
        .await
        .assert_problem(409, "InFlight");
    db.pool()
        .execute("DROP TRIGGER refuse_completion ON idempotency.records")
        .await
        .expect("drop trigger");
    wait_until(
        &db,
        "SELECT count(*) = 1 FROM idempotency.records WHERE status IS NOT NULL",
    )
    .await;
    let retry = Reply::of(post(&client, &server, "k-refused")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(probe.executions(), 1);
}
