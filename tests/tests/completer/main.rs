//! The completer on real PostgreSQL (issue 36.3): it finishes a key whose client never came back
//! and the client's retry replays it; it leaves alone a key its client came back for; two
//! instances' completers never run one key twice; attempts are bounded; the extensions hook
//! restores what authentication put in; only named headers are kept, sealed behind
//! `SealingStore`; and a finished step is not run again. Keys given up part-way, and requests
//! that cannot be kept, are in [`abandon`]; claims whose request was never kept, in [`unkept`].

mod abandon;
mod app;
mod unkept;
mod unprotected;

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use axum::{Router, http::StatusCode};
use idempotency_tests::{bounded, postgres::migrated, requests::replayed};
use tower::ServiceExt;
use tower_idempotency::{
    Completer, Completion, ConfigError, Fingerprinting, IdempotencyLayer, Principal, Scope,
    store::{MemoryStore, PostgresStore, SealingKeys, SealingStore},
};

use self::app::{
    MERCHANT, Seen, app, completer, key_of, layer, pending_rows, request, rounds_until,
    rounds_until_finished, send,
};

#[tokio::test]
async fn the_completer_finishes_an_abandoned_key_and_the_retry_replays_it() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let app = app(layer(store.clone()), &seen);
        let (status, _, _) = send(&app, "/v1/charges", "k1").await;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "the crash stands in"
        );
        let completer = completer(&store, &app);
        // Within the grace the key is its client's.
        assert_eq!(completer.complete_abandoned().await.unwrap().picked, 0);
        let round = rounds_until(&completer, |r| r.completed == 1).await;
        assert_eq!((round.picked, round.failed), (1, 0));
        let (status, replay, body) = send(&app, "/v1/charges", "k1").await;
        assert_eq!((status, replay), (StatusCode::CREATED, true));
        assert_eq!(body, "charged k1 1");
        assert_eq!(Seen::count(&seen.started, "k1"), 2);
        assert_eq!(Seen::count(&seen.finished, "k1"), 1);
        let completions = seen.completions.lock().unwrap().clone();
        assert_eq!(completions.len(), 1);
        let (attempt, headers) = &completions[0];
        assert_eq!(*attempt, 1);
        // The key's header and the named one are kept; the credential is not.
        assert_eq!(headers["idempotency-key"], "k1");
        assert_eq!(headers[&MERCHANT], "m_1");
        assert!(headers.get("authorization").is_none());
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(
            pending_rows(&db).await,
            0,
            "a completed key keeps no request"
        );
    })
    .await;
}

#[tokio::test]
async fn a_key_its_client_came_back_for_is_not_touched() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let app = app(layer(store.clone()), &seen);
        send(&app, "/v1/charges", "k1").await;
        let completer = Completer::new(&store, app.clone())
            .unwrap()
            .with_grace(Duration::from_secs(3600))
            .unwrap();
        assert_eq!(completer.complete_abandoned().await.unwrap().picked, 0);
        let (status, replay, _) = send(&app, "/v1/charges", "k1").await;
        assert_eq!((status, replay), (StatusCode::CREATED, false));
        let round = completer.complete_abandoned().await.unwrap();
        assert_eq!(round.picked, 0);
        assert!(seen.completions.lock().unwrap().is_empty());
        assert_eq!(
            pending_rows(&db).await,
            0,
            "purged once the client completed it"
        );
    })
    .await;
}

#[tokio::test]
async fn two_instances_completers_never_run_one_key_twice() {
    bounded(async {
        let (db, store_a) = migrated().await;
        let store_b = PostgresStore::new(
            sqlx::PgPool::connect_with(db.options().clone())
                .await
                .unwrap(),
        );
        let seen = Arc::new(Seen::default());
        let app_a = app(layer(store_a.clone()), &seen);
        let app_b = app(layer(store_b.clone()), &seen);
        let keys: Vec<String> = (0..24).map(|i| format!("k{i}")).collect();
        let crashes = keys.iter().enumerate().map(|(i, key)| {
            let app = if i % 2 == 0 { &app_a } else { &app_b };
            send(app, "/v1/charges", key)
        });
        futures_util::future::join_all(crashes).await;
        let a = completer(&store_a, &app_a).with_concurrency(3).unwrap();
        let b = completer(&store_b, &app_b).with_concurrency(3).unwrap();
        let (a, b) = tokio::join!(
            rounds_until_finished(&a, &seen, 24),
            rounds_until_finished(&b, &seen, 24),
        );
        // Each key was picked by one completer once and completed by it.
        assert_eq!(a.picked + b.picked, 24, "{a:?} {b:?}");
        assert_eq!(a.completed + b.completed, 24, "{a:?} {b:?}");
        assert!(
            a.completed > 0 && b.completed > 0,
            "both took part: {a:?} {b:?}"
        );
        for key in &keys {
            assert_eq!(Seen::count(&seen.finished, key), 1, "{key}");
            assert_eq!(Seen::count(&seen.started, key), 2, "{key}");
        }
    })
    .await;
}

#[tokio::test]
async fn a_key_is_tried_at_most_max_attempts_times() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen {
            hang_always: true,
            ..Seen::default()
        });
        let app = app(layer(store.clone()), &seen);
        send(&app, "/v1/charges", "k1").await;
        let completer = completer(&store, &app).with_max_attempts(3).unwrap();
        let round = rounds_until(&completer, |r| r.gave_up == 1).await;
        assert_eq!((round.picked, round.failed, round.completed), (3, 2, 0));
        // Due again, and still left alone.
        loop {
            let (attempts, due): (i32, bool) = sqlx::query_as(
                "SELECT attempts, next_attempt_at <= now() FROM idempotency.pending_requests",
            )
            .fetch_one(db.pool())
            .await
            .unwrap();
            assert_eq!(attempts, 3);
            if due {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(completer.complete_abandoned().await.unwrap().picked, 0);
        assert_eq!(Seen::count(&seen.started, "k1"), 4);
        let attempts: Vec<u32> = seen
            .completions
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(attempts, [1, 2, 3]);
    })
    .await;
}

/// What an app's JWT middleware leaves in the extensions, and the scope reads.
#[derive(Clone)]
struct Claims {
    sub: String,
}

#[tokio::test]
async fn the_extensions_hook_restores_what_authentication_put_in() {
    bounded(async {
        let (_db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let scope = Scope::from_fn(|parts| {
            Principal::new(parts.extensions.get::<Claims>()?.sub.as_str()).ok()
        });
        let app = app(layer(store.clone()).with_scope(scope), &seen);
        let mut client = request("/v1/charges", "k1");
        client.extensions_mut().insert(Claims {
            sub: "acct_a".into(),
        });
        app.clone().oneshot(client).await.unwrap();
        // Without the hook, the rebuilt request has no claims: refused, not completed.
        let bare = completer(&store, &app).with_max_attempts(1).unwrap();
        assert_eq!(rounds_until(&bare, |r| r.gave_up == 1).await.completed, 0);
        let hooked = completer(&store, &app)
            .with_max_attempts(2)
            .unwrap()
            .with_extensions(|principal, extensions| {
                extensions.insert(Claims {
                    sub: principal.as_str().to_owned(),
                });
            });
        rounds_until(&hooked, |r| r.completed == 1).await;
        let mut retry = request("/v1/charges", "k1");
        retry.extensions_mut().insert(Claims {
            sub: "acct_a".into(),
        });
        let response = app.oneshot(retry).await.unwrap();
        assert!(replayed(response.headers()));
    })
    .await;
}

#[tokio::test]
async fn a_finished_step_is_not_run_again_by_the_completer() {
    bounded(async {
        let (_db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let app = app(layer(store.clone()), &seen);
        send(&app, "/v1/steps", "k1").await;
        assert_eq!(seen.authorize_calls.load(Ordering::SeqCst), 1);
        rounds_until(&completer(&store, &app), |r| r.completed == 1).await;
        let (status, replay, body) = send(&app, "/v1/steps", "k1").await;
        assert_eq!((status, replay), (StatusCode::CREATED, true));
        assert_eq!(body, "auth_1");
        assert_eq!(seen.authorize_calls.load(Ordering::SeqCst), 1);
    })
    .await;
}

#[tokio::test]
async fn only_named_headers_are_kept_and_sealed_behind_a_sealing_store() {
    bounded(async {
        let (db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        // In clear: the named header and the body are there, the credential is not.
        let app_clear = app(layer(store.clone()), &seen);
        send(&app_clear, "/v1/charges", "clear").await;
        let sealed = SealingStore::new(store.clone(), SealingKeys::new(1, [7; 32]));
        let app_sealed = app(layer(sealed.clone()), &seen);
        send(&app_sealed, "/v1/charges", "sealed").await;
        let rows: Vec<Vec<u8>> =
            sqlx::query_scalar("SELECT request FROM idempotency.pending_requests ORDER BY kept_at")
                .fetch_all(db.pool())
                .await
                .unwrap();
        let has = |row: &[u8], what: &str| row.windows(what.len()).any(|w| w == what.as_bytes());
        assert_eq!(rows.len(), 2);
        assert!(has(&rows[0], "x-merchant") && has(&rows[0], "4242424242424242"));
        assert!(!has(&rows[0], "authorization") && !has(&rows[0], "sk_secret_token"));
        for what in ["x-merchant", "4242424242424242", "acct_a", "/v1/charges"] {
            assert!(!has(&rows[1], what), "{what} in clear behind SealingStore");
        }
        // The sealed request opens for the completer and completes.
        let completer = completer(&sealed, &app_sealed);
        rounds_until(&completer, |r| r.completed == 1).await;
        let (status, replay, _) = send(&app_sealed, "/v1/charges", "sealed").await;
        assert_eq!((status, replay), (StatusCode::CREATED, true));
        // The request kept in clear does not open behind sealing: it is never sent.
        let completions = seen.completions.lock().unwrap().clone();
        let keys: Vec<_> = completions.iter().map(|(_, h)| key_of(h)).collect();
        assert_eq!(keys, ["sealed"]);
    })
    .await;
}

/// The headers the fingerprint covers are kept without being named (issue 44.1): the old code
/// kept only named ones, so the completer's request fingerprinted otherwise and never ran.
#[tokio::test]
async fn the_headers_the_fingerprint_covers_are_kept() {
    bounded(async {
        let (_db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let layer = layer(store.clone())
            .with_completion(Completion::new())
            .unwrap()
            .with_fingerprint(Fingerprinting::semantic().with_headers([MERCHANT]))
            .unwrap();
        let app = app(layer, &seen);
        send(&app, "/v1/charges", "k1").await;
        let completer = completer(&store, &app).with_max_attempts(2).unwrap();
        let round = rounds_until(&completer, |r| r.completed + r.gave_up == 1).await;
        assert_eq!(round.completed, 1, "{round:?}");
        let completions = seen.completions.lock().unwrap().clone();
        assert_eq!(completions[0].1[&MERCHANT], "m_1");
    })
    .await;
}

#[tokio::test]
async fn the_loop_completes_abandoned_keys_in_the_background() {
    bounded(async {
        let (_db, store) = migrated().await;
        let seen = Arc::new(Seen::default());
        let app = app(layer(store.clone()), &seen);
        send(&app, "/v1/charges", "k1").await;
        let task = tokio::spawn(completer(&store, &app).run(Duration::from_millis(50)));
        while Seen::count(&seen.finished, "k1") == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The handler has answered; its record may still be on its way (a 409 meanwhile).
        let (status, replay, body) = loop {
            let answer = send(&app, "/v1/charges", "k1").await;
            if answer.0 != StatusCode::CONFLICT {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(
            (status, replay, body.as_str()),
            (StatusCode::CREATED, true, "charged k1 1")
        );
        task.abort();
    })
    .await;
}

#[tokio::test]
async fn a_store_that_keeps_no_requests_and_zero_settings_are_refused() {
    let memory = MemoryStore::new();
    let refused = IdempotencyLayer::new(memory.clone()).with_completion(Completion::new());
    assert_eq!(refused.err(), Some(ConfigError::CompletionUnsupported));
    let refused = Completer::new(&memory, Router::<()>::new());
    assert_eq!(refused.err(), Some(ConfigError::CompletionUnsupported));
    let pool = sqlx::PgPool::connect_lazy("postgres://127.0.0.1/unused").unwrap();
    let transactional = PostgresStore::new(pool.clone()).transactional();
    assert!(Completer::new(&transactional, Router::<()>::new()).is_err());
    let completer = Completer::new(&PostgresStore::new(pool), Router::<()>::new()).unwrap();
    assert!(matches!(
        completer.with_grace(Duration::ZERO),
        Err(ConfigError::Zero(_))
    ));
}
