//! `Once::run_in_transaction` on real PostgreSQL (issue 37.1): the closure's writes and the
//! record commit together, once under concurrency; a failure, a failed transaction or a panic
//! rolls both back and frees the key; a store in lease mode is refused.

use std::{sync::Arc, time::Duration};

use futures_util::future::BoxFuture;
use idempotency_tests::{bounded, db::TestDb, init_tracing};
use sqlx::{Executor, PgConnection, PgPool};
use tokio::sync::Semaphore;
use tower_idempotency::{InFlightWait, Once, OnceError, store::PostgresStore};

const SCOPE: &str = "ledger-consumer";

/// A database with a `ledger` table (no unique constraint: a second run would show as a second
/// row) and a transactional `Once` on it.
async fn setup() -> (TestDb, Once<PostgresStore>) {
    init_tracing();
    let db = TestDb::new().await;
    db.pool()
        .execute("CREATE TABLE ledger (event text NOT NULL, amount bigint NOT NULL)")
        .await
        .unwrap();
    let store = PostgresStore::new(db.pool().clone());
    store.migrate().await.unwrap();
    (db, Once::new(store.transactional()))
}

async fn ledger_rows(pool: &PgPool, event: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger WHERE event = $1")
        .bind(event)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Credits `amount` for `event` and answers the ledger's row count as seen in the transaction.
fn credit(
    event: &'static str,
    amount: i64,
) -> impl for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<i64, sqlx::Error>> {
    move |tx| {
        Box::pin(async move {
            sqlx::query("INSERT INTO ledger (event, amount) VALUES ($1, $2)")
                .bind(event)
                .bind(amount)
                .execute(&mut *tx)
                .await?;
            sqlx::query_scalar("SELECT count(*) FROM ledger")
                .fetch_one(&mut *tx)
                .await
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_write_once() {
    bounded(async {
        let (db, once) = setup().await;
        let once = once
            .with_in_flight_wait(InFlightWait::up_to(Duration::from_secs(30)))
            .unwrap();
        let payload = serde_json::json!({ "amount": 100 });
        let mut callers = Vec::new();
        for _ in 0..20 {
            let (once, payload) = (once.clone(), payload.clone());
            callers.push(tokio::spawn(async move {
                once.run_in_transaction(SCOPE, "evt_1", &payload, credit("evt_1", 100))
                    .await
            }));
        }
        for caller in callers {
            assert_eq!(caller.await.unwrap().unwrap(), 1);
        }
        assert_eq!(ledger_rows(db.pool(), "evt_1").await, 1);
    })
    .await;
}

#[tokio::test]
async fn a_failure_rolls_the_writes_back_and_frees_the_key() {
    bounded(async {
        let (db, once) = setup().await;
        let payload = serde_json::json!({ "amount": 5 });
        let failed = once
            .run_in_transaction(SCOPE, "evt_2", &payload, |tx: &mut PgConnection| {
                Box::pin(async move {
                    credit("evt_2", 5)(tx).await?;
                    Err::<i64, _>(sqlx::Error::Protocol("declined after writing".into()))
                })
            })
            .await;
        assert!(matches!(failed, Err(OnceError::Failed(_))), "{failed:?}");
        assert_eq!(ledger_rows(db.pool(), "evt_2").await, 0);
        let ran = once
            .run_in_transaction(SCOPE, "evt_2", &payload, credit("evt_2", 5))
            .await
            .unwrap();
        assert_eq!((ran, ledger_rows(db.pool(), "evt_2").await), (1, 1));
        let replayed = once
            .run_in_transaction(SCOPE, "evt_2", &payload, credit("evt_2", 5))
            .await
            .unwrap();
        assert_eq!((replayed, ledger_rows(db.pool(), "evt_2").await), (1, 1));
    })
    .await;
}

/// A closure that catches a database error and answers `Ok` anyway: nothing it wrote commits,
/// and no result is stored for it.
#[tokio::test]
async fn ok_over_a_failed_transaction_is_rolled_back() {
    bounded(async {
        let (db, once) = setup().await;
        let payload = serde_json::json!({ "amount": 7 });
        let answered = once
            .run_in_transaction(SCOPE, "evt_3", &payload, |tx: &mut PgConnection| {
                Box::pin(async move {
                    credit("evt_3", 7)(&mut *tx).await?;
                    let missing = sqlx::query("INSERT INTO no_such_table VALUES (1)");
                    assert!(missing.execute(&mut *tx).await.is_err());
                    Ok::<i64, sqlx::Error>(1)
                })
            })
            .await;
        assert!(
            matches!(answered, Err(OnceError::RolledBack)),
            "{answered:?}"
        );
        assert_eq!(ledger_rows(db.pool(), "evt_3").await, 0);
        let ran = once
            .run_in_transaction(SCOPE, "evt_3", &payload, credit("evt_3", 7))
            .await
            .unwrap();
        assert_eq!(ran, 1);
    })
    .await;
}

#[tokio::test]
async fn a_panic_rolls_the_writes_back_and_frees_the_key() {
    bounded(async {
        let (db, once) = setup().await;
        let panicked = tokio::spawn({
            let once = once.clone();
            async move {
                let payload = serde_json::json!({ "amount": 9 });
                once.run_in_transaction(SCOPE, "evt_4", &payload, |tx: &mut PgConnection| {
                    Box::pin(async move {
                        credit("evt_4", 9)(tx).await?;
                        if true {
                            panic!("the closure panicked after writing");
                        }
                        Ok::<i64, sqlx::Error>(0)
                    })
                })
                .await
                .map(|_: i64| ())
            }
        })
        .await;
        assert!(panicked.unwrap_err().is_panic());
        assert_eq!(ledger_rows(db.pool(), "evt_4").await, 0);
        let payload = serde_json::json!({ "amount": 9 });
        let ran = once
            .run_in_transaction(SCOPE, "evt_4", &payload, credit("evt_4", 9))
            .await
            .unwrap();
        assert_eq!((ran, ledger_rows(db.pool(), "evt_4").await), (1, 1));
    })
    .await;
}

/// A cancelled call (its future dropped mid-closure) rolls back and frees the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_rolls_back() {
    bounded(async {
        let (db, once) = setup().await;
        let entered = Arc::new(Semaphore::new(0));
        let call = tokio::spawn({
            let (once, entered) = (once.clone(), Arc::clone(&entered));
            async move {
                let payload = serde_json::json!({ "amount": 3 });
                once.run_in_transaction(SCOPE, "evt_5", &payload, |tx: &mut PgConnection| {
                    Box::pin(async move {
                        credit("evt_5", 3)(tx).await?;
                        entered.add_permits(1);
                        std::future::pending::<Result<i64, sqlx::Error>>().await
                    })
                })
                .await
            }
        });
        let _ = entered.acquire().await.unwrap();
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
        // The release runs on a task of its own: poll, bounded, until the key is free again.
        let payload = serde_json::json!({ "amount": 3 });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let ran = loop {
            match once
                .run_in_transaction(SCOPE, "evt_5", &payload, credit("evt_5", 3))
                .await
            {
                Err(OnceError::InFlight) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => break other.unwrap(),
            }
        };
        assert_eq!((ran, ledger_rows(db.pool(), "evt_5").await), (1, 1));
    })
    .await;
}

#[tokio::test]
async fn a_store_in_lease_mode_is_refused() {
    bounded(async {
        let (db, _) = setup().await;
        let once = Once::new(PostgresStore::new(db.pool().clone()));
        let refused = once
            .run_in_transaction(SCOPE, "evt_6", &1, credit("evt_6", 1))
            .await;
        assert!(
            matches!(refused, Err(OnceError::NotTransactional)),
            "{refused:?}"
        );
        let records: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency.records")
            .fetch_one(db.pool())
            .await
            .unwrap();
        assert_eq!((records, ledger_rows(db.pool(), "evt_6").await), (0, 0));
    })
    .await;
}
