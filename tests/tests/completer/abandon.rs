//! Keys given up part-way ([`Retention::Abandon`](tower_idempotency::Retention::Abandon)) and
//! requests that cannot be kept: the retry takes the first over at once, the completer finishes
//! it when none comes; the second never reaches its handler.

use std::sync::{Arc, atomic::Ordering};

use axum::http::StatusCode;
use idempotency_tests::{bounded, postgres::migrated};

use super::app::{Seen, app, completer, layer, pending_rows, rounds_until, send};

/// A request that cannot be kept is refused before its handler runs, and its key is free:
/// a handler that ran without its request kept could be left half done by a crash with no
/// completer able to finish it.
#[tokio::test]
async fn a_request_that_cannot_be_kept_is_refused_before_its_handler_runs() {
    bounded(async {
        let (db, store) = migrated().await;
        sqlx::raw_sql(
            "CREATE FUNCTION refuse_keeping() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN RAISE EXCEPTION 'keeping refused by the test'; END $$;
             CREATE TRIGGER refuse_keeping BEFORE INSERT OR UPDATE
                 ON idempotency.pending_requests
                 FOR EACH ROW EXECUTE FUNCTION refuse_keeping();",
        )
        .execute(db.pool())
        .await
        .unwrap();
        let seen = Arc::new(Seen {
            hang_always: false,
            ..Seen::default()
        });
        let app = app(layer(store.clone()), &seen);
        let (status, replay, body) = send(&app, "/v1/charges", "k1").await;
        assert_eq!((status, replay), (StatusCode::SERVICE_UNAVAILABLE, false));
        assert!(body.contains("StoreUnavailable"), "{body}");
        assert_eq!(Seen::count(&seen.started, "k1"), 0, "the handler never ran");

        sqlx::raw_sql("DROP TRIGGER refuse_keeping ON idempotency.pending_requests")
            .execute(db.pool())
            .await
            .unwrap();
        // The key is free: the retry runs (its first run hangs, as every test's crash does).
        let (status, _, _) = send(&app, "/v1/charges", "k1").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            Seen::count(&seen.started, "k1"),
            1,
            "the retry ran the handler"
        );
        assert_eq!(pending_rows(&db).await, 1, "and its request is kept");
    })
    .await;
}

/// A claim taken over before its request was kept (a takeover between the two statements,
/// made here by a trigger that moves the claim's token on): the request runs nothing, since
/// another request holds its key. The old code ran the handler all the same.
#[tokio::test]
async fn a_claim_lost_before_its_request_was_kept_runs_nothing() {
    bounded(async {
        let (db, store) = migrated().await;
        sqlx::raw_sql(
            "CREATE FUNCTION take_over() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN
                     UPDATE idempotency.records SET token = token + 1000000
                     WHERE scope_key = NEW.scope_key;
                     RETURN NULL;
                 END $$;
             CREATE TRIGGER take_over AFTER INSERT ON idempotency.records
                 FOR EACH ROW EXECUTE FUNCTION take_over();",
        )
        .execute(db.pool())
        .await
        .unwrap();
        let seen = Arc::new(Seen {
            hang_always: false,
            ..Seen::default()
        });
        let app = app(layer(store), &seen);
        let (status, replay, _) = send(&app, "/v1/charges", "k1").await;
        assert_eq!((status, replay), (StatusCode::CONFLICT, false));
        assert_eq!(Seen::count(&seen.started, "k1"), 0, "the handler never ran");
        assert_eq!(pending_rows(&db).await, 0);
    })
    .await;
}

/// A handler that lost a downstream answer gives its key up part-way: the client's retry takes
/// it over at once (no `409` while a lease runs) and sends the same downstream key again.
#[tokio::test]
async fn an_abandoned_key_is_taken_over_at_once_by_its_retry() {
    bounded(async {
        let (_db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let app = app(layer(store), &seen);
        let (status, replay, _) = send(&app, "/v1/lost", "k1").await;
        assert_eq!((status, replay), (StatusCode::SERVICE_UNAVAILABLE, false));
        let (status, replay, body) = send(&app, "/v1/lost", "k1").await;
        assert_eq!((status, replay), (StatusCode::CREATED, false), "{body}");
        assert_eq!(body, "auth_1 takeover=true");
        let downstream = seen.downstream.lock().unwrap().clone();
        assert_eq!(downstream.len(), 2);
        assert_eq!(
            downstream[0], downstream[1],
            "the same downstream key, resent"
        );
        let (status, replay, body) = send(&app, "/v1/lost", "k1").await;
        assert_eq!(
            (status, replay, body.as_str()),
            (StatusCode::CREATED, true, "auth_1 takeover=true")
        );
    })
    .await;
}

/// With no retry, the completer finishes an abandoned key after the grace; the client's late
/// retry replays it.
#[tokio::test]
async fn the_completer_finishes_a_key_its_handler_abandoned() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let app = app(layer(store.clone()), &seen);
        let (status, _, _) = send(&app, "/v1/lost", "k1").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            pending_rows(&db).await,
            1,
            "the abandoned key's request is kept"
        );
        let completer = completer(&store, &app);
        let round = rounds_until(&completer, |r| r.completed == 1).await;
        assert_eq!(round.failed, 0);
        let (status, replay, body) = send(&app, "/v1/lost", "k1").await;
        assert_eq!((status, replay), (StatusCode::CREATED, true));
        assert_eq!(body, "auth_1 takeover=true");
        assert_eq!(seen.authorize_calls.load(Ordering::SeqCst), 1);
    })
    .await;
}
