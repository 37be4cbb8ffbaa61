//! Keys claimed to keep their request that never kept it (issue 44, defect 6): the process died
//! between the claim and the keeping, so the key is in flight with nothing to finish it. The
//! claim says in its own statement that its request will be kept, and the completer's round
//! releases such a claim once its lease lapsed more than the grace ago.

use std::sync::{Arc, atomic::Ordering};

use axum::http::StatusCode;
use idempotency_tests::{bounded, db::TestDb, postgres::migrated};
use sqlx::AssertSqlSafe;
use tower_idempotency::StoreFailure;

use super::app::{Seen, app, completer, layer, pending_rows, send};

/// Makes `event` on `table` fail, as a process that died would never have done it (the names
/// are the test's own).
async fn refuse(db: &TestDb, name: &str, event: &str, table: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN RAISE EXCEPTION '{name} by the test'; END $$;
         CREATE TRIGGER {name} BEFORE {event} ON idempotency.{table}
             FOR EACH ROW EXECUTE FUNCTION {name}();"
    )))
    .execute(db.pool())
    .await
    .unwrap();
}

async fn allow(db: &TestDb, name: &str, table: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TRIGGER {name} ON idempotency.{table}"
    )))
    .execute(db.pool())
    .await
    .unwrap();
}

/// Moves every claim's lease (and claim time) a minute into the past: lease and grace passed.
async fn lapse(db: &TestDb) {
    sqlx::raw_sql(
        "UPDATE idempotency.records SET created_at = created_at - interval '1 minute',
             lease_until = lease_until - interval '1 minute' WHERE status IS NULL",
    )
    .execute(db.pool())
    .await
    .unwrap();
}

async fn records(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
        .fetch_one(db.pool())
        .await
        .unwrap()
}

/// The keeping failed and so did the release of the key (what a crash between the two leaves):
/// one completer round releases it and counts it; a key whose request was kept is left to the
/// pick, which finishes it. The old code left the first in flight until its TTL.
#[tokio::test]
async fn a_key_whose_request_was_never_kept_is_released_by_the_completer() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let app = app(layer(store.clone()), &seen);
        // Its first run hangs and is given up: its request is kept.
        let (status, _, _) = send(&app, "/v1/charges", "k-kept").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        refuse(
            &db,
            "refuse_keeping",
            "INSERT OR UPDATE",
            "pending_requests",
        )
        .await;
        refuse(&db, "refuse_release", "DELETE", "records").await;
        let (status, _, _) = send(&app, "/v1/charges", "k-unkept").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(Seen::count(&seen.started, "k-unkept"), 0, "it never ran");
        allow(&db, "refuse_keeping", "pending_requests").await;
        allow(&db, "refuse_release", "records").await;
        assert_eq!((records(&db).await, pending_rows(&db).await), (2, 1));

        lapse(&db).await;
        let round = completer(&store, &app).complete_abandoned().await.unwrap();
        assert_eq!(round.released_unkept, 1, "{round:?}");
        assert_eq!((round.picked, round.completed), (1, 1), "{round:?}");
        // Only the kept key's record is left: the other's next claim is new, not a takeover.
        assert_eq!(records(&db).await, 1);
        let (status, _, _) = send(&app, "/v1/charges", "k-unkept").await;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "its first run hangs"
        );
        assert_eq!(Seen::count(&seen.started, "k-unkept"), 1, "and it ran");
    })
    .await;
}

/// Failing open, a request whose keeping failed runs anyway: its claim does not say it keeps
/// its request, so the completer never releases it from under its handler.
#[tokio::test]
async fn failing_open_a_claim_is_not_marked_as_keeping_its_request() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let marked = |db: &TestDb| {
            let pool = db.pool().clone();
            async move {
                sqlx::query_scalar::<_, bool>(
                    "SELECT coalesce(bool_and(keeps_request), false) FROM idempotency.records",
                )
                .fetch_one(&pool)
                .await
                .unwrap()
            }
        };
        send(&app(layer(store.clone()), &seen), "/v1/charges", "k1").await;
        assert!(marked(&db).await, "failing closed, the claim is marked");
        sqlx::raw_sql("DELETE FROM idempotency.records")
            .execute(db.pool())
            .await
            .unwrap();
        let open = layer(store.clone()).with_store_failure(StoreFailure::FailOpen);
        send(&app(open, &seen), "/v1/charges", "k2").await;
        assert!(!marked(&db).await, "failing open, it is not");
        assert_eq!(records(&db).await, 1);
    })
    .await;
}

/// A retry that takes over a key whose first run recorded a step, and whose keeping fails (the
/// database went away between its claim and its keeping): its key is given back in flight, not
/// released, so the completer still finishes the first run's work with its recorded steps. A
/// release deleted the key, the purge then deleted its kept request, and the authorization was
/// left with no charge (stop 50's failover chaos run).
#[tokio::test]
async fn a_takeover_that_fails_to_keep_its_request_leaves_the_key_to_the_completer() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let app = app(layer(store.clone()), &seen);
        // Its first run authorizes, hangs and is given up part-way: its request is kept.
        let (status, _, _) = send(&app, "/v1/steps", "k-steps").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        refuse(
            &db,
            "refuse_keeping",
            "INSERT OR UPDATE",
            "pending_requests",
        )
        .await;
        let (status, _, _) = send(&app, "/v1/steps", "k-steps").await;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "its keeping failed"
        );
        allow(&db, "refuse_keeping", "pending_requests").await;
        assert_eq!(records(&db).await, 1, "the key is still in flight");

        lapse(&db).await;
        let round = completer(&store, &app).complete_abandoned().await.unwrap();
        assert_eq!((round.picked, round.completed), (1, 1), "{round:?}");
        assert_eq!(seen.authorize_calls.load(Ordering::SeqCst), 1);
        let (status, replayed, body) = send(&app, "/v1/steps", "k-steps").await;
        assert_eq!((status, replayed), (StatusCode::CREATED, true));
        assert_eq!(body, "auth_1");
    })
    .await;
}

/// A retry that took a key over, found its first run's step recorded and answered a server
/// error gives the key back in flight rather than releasing it: the step's downstream key went
/// out before, so the key's work must stay where the completer finds it.
#[tokio::test]
async fn a_server_error_after_a_recorded_step_gives_the_key_back() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let app = app(layer(store.clone()), &seen);
        let (status, _, _) = send(&app, "/v1/failing", "k-failing").await;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "its first run hangs"
        );
        let (status, _, _) = send(&app, "/v1/failing", "k-failing").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(records(&db).await, 1, "the key is still in flight");
        assert_eq!(pending_rows(&db).await, 1, "with its kept request");
        assert_eq!(seen.authorize_calls.load(Ordering::SeqCst), 1);
    })
    .await;
}
