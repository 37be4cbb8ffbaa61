//! PostgreSQL only: each ledger write commits with its step's record, and a refund locks its
//! charge.

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use charges_demo::processor::CardProcessor;
use serde_json::json;

use super::refunds::refunded;
use crate::common::{Backend, Gate, Harness, Reply, bounded, charge, new_api_key, new_key, refund};

/// PostgreSQL only: the charge is locked while a refund reads it. A refund sent while another
/// transaction holds the charge (a refund of it in flight) waits, and then reads what that one
/// committed: here, the charge refunded in full, so `charge_already_refunded`. (Had it read
/// without the lock, it would have seen 0 refunded and asked for all of it; the table's CHECK
/// would then have refused it, as `amount_too_large`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_refund_waits_for_the_charge_and_reads_what_committed() {
    bounded(async {
        let h = Harness::start(Backend::Postgres).await;
        let pool = h.db.as_ref().unwrap().pool().clone();
        let api_key = new_api_key();
        let id = h.charged(&api_key, 1000).await;

        let mut other = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM charges WHERE id = $1 FOR UPDATE")
            .bind(&id)
            .execute(&mut *other)
            .await
            .unwrap();
        let waiting = tokio::spawn({
            let app = h.app.clone();
            let request = refund(&api_key, Some(&new_key()), &format!("charge={id}"));
            async move { tower::ServiceExt::oneshot(app, request).await }
        });
        wait_for_lock_waits(&pool, 1).await;
        sqlx::query("UPDATE charges SET amount_refunded = amount WHERE id = $1")
            .bind(&id)
            .execute(&mut *other)
            .await
            .unwrap();
        other.commit().await.unwrap();

        let response = waiting.await.unwrap().unwrap();
        let (parts, body) = response.into_parts();
        let body = http_body_util::BodyExt::collect(body)
            .await
            .unwrap()
            .to_bytes();
        let reply = Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        };
        let error = reply.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(error["code"], "charge_already_refunded");
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM refunds")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 0);
    })
    .await
}

/// PostgreSQL only: the table's `CHECK (amount_refunded <= amount)` is the last line of
/// defence. A writer that skipped the lock is played by a trigger that adds another 1000 to
/// every refund; the refund then fails the CHECK inside the request's transaction. The handler
/// catches it and answers Stripe's `400 amount_too_large`, which the layer delivers without
/// storing it, rolling the transaction back: no refund row, nothing added, the key free, so the
/// retry (once the trigger is gone) refunds, fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_refund_past_the_check_is_amount_too_large_and_leaves_nothing() {
    bounded(async {
        let h = Harness::start(Backend::Postgres).await;
        let pool = h.db.as_ref().unwrap().pool().clone();
        let api_key = new_api_key();
        let id = h.charged(&api_key, 1000).await;
        sqlx::raw_sql(
            "CREATE FUNCTION unlocked_writer() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN NEW.amount_refunded := NEW.amount_refunded + 1000; RETURN NEW; END $$;
             CREATE TRIGGER unlocked_writer BEFORE UPDATE OF amount_refunded ON charges
             FOR EACH ROW EXECUTE FUNCTION unlocked_writer();",
        )
        .execute(&pool)
        .await
        .unwrap();
        let key = new_key();
        let form = format!("charge={id}&amount=100");
        let refused = h.send(refund(&api_key, Some(&key), &form)).await;
        let error = refused.stripe_error(StatusCode::BAD_REQUEST, "invalid_request_error");
        assert_eq!(
            (&error["code"], &error["param"]),
            (&json!("amount_too_large"), &json!("amount"))
        );
        let state = || async {
            sqlx::query_as::<_, (i64, i64, i64)>(
                "SELECT (SELECT amount_refunded FROM charges WHERE id = $1),
                        (SELECT count(*) FROM refunds),
                        (SELECT count(*) FROM idempotency.records)",
            )
            .bind(&id)
            .fetch_one(&pool)
            .await
            .unwrap()
        };
        // The charge's own record only.
        assert_eq!(
            state().await,
            (0, 0, 1),
            "rolled back, the refusal not stored"
        );

        sqlx::raw_sql("DROP TRIGGER unlocked_writer ON charges")
            .execute(&pool)
            .await
            .unwrap();
        let retry = h.send(refund(&api_key, Some(&key), &form)).await;
        assert!(!retry.replayed());
        assert_eq!(refunded(&retry)["amount"], 100);
        assert_eq!(state().await, (100, 1, 2));
    })
    .await
}

/// Waits until `n` sessions of the test's database wait for a lock (a row another transaction
/// holds).
async fn wait_for_lock_waits(pool: &sqlx::PgPool, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} lock wait(s), found {waiting}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// PostgreSQL only: the rows in `charges` and the idempotency records, as other connections
/// see them.
async fn charges_and_records(pool: &sqlx::PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM charges), (SELECT count(*) FROM idempotency.records)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// PostgreSQL only: a charge in flight holds its claim, committed, and no transaction: none is
/// open across the acquirer call. The charge row appears with its ledger step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_charge_in_flight_holds_its_claim_and_no_transaction() {
    bounded(async {
        let gate = Gate::new();
        let h = Harness::with_processor(Backend::Postgres, gate.processor(Duration::ZERO)).await;
        let pool = h.db.as_ref().unwrap().pool().clone();
        let counts = || charges_and_records(&pool);
        let api_key = new_api_key();
        let key = new_key();
        let first = tokio::spawn({
            let app = h.app.clone();
            let request = charge(&api_key, Some(&key), "amount=2000&currency=usd");
            async move { tower::ServiceExt::oneshot(app, request).await }
        });
        gate.started().await;
        assert_eq!(
            counts().await,
            (0, 1),
            "the claim is committed, the charge not made"
        );
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(open, 0, "no transaction is held across the acquirer call");
        let duplicate = h
            .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
            .await;
        let error = duplicate.problem(StatusCode::CONFLICT, "InFlight");
        assert_eq!(error["code"], "idempotency_key_in_use");

        gate.release(1);
        assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
        assert_eq!(counts().await, (1, 1), "charged and recorded");
    })
    .await
}

/// PostgreSQL only: when the ledger write fails (a trigger makes it fail here), the ledger
/// step rolls back and records nothing, the charge is a `500` and the key released; the
/// authorization step stays recorded, so the retry charges once without authorizing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failed_ledger_write_leaves_no_row_and_the_retry_authorizes_once() {
    bounded(async {
        let acquirer = acquirer::Acquirer::new(acquirer::Settings::default());
        let processor = CardProcessor::in_process(acquirer.clone(), Duration::ZERO);
        let h = Harness::with_processor(Backend::Postgres, processor).await;
        let pool = h.db.as_ref().unwrap().pool().clone();
        sqlx::raw_sql(
            "CREATE FUNCTION fail_charge() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'injected: the charge cannot be written'; END $$;
             CREATE TRIGGER fail_charge BEFORE INSERT ON charges
             FOR EACH ROW EXECUTE FUNCTION fail_charge();",
        )
        .execute(&pool)
        .await
        .unwrap();
        let api_key = new_api_key();
        let key = new_key();
        let failed = h
            .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
            .await;
        failed.stripe_error(StatusCode::INTERNAL_SERVER_ERROR, "api_error");
        assert_eq!(charges_and_records(&pool).await.0, 0, "no charge row");
        assert_eq!(acquirer.authorizations().len(), 1);

        sqlx::raw_sql("DROP TRIGGER fail_charge ON charges")
            .execute(&pool)
            .await
            .unwrap();
        let retry = h
            .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
            .await;
        assert_eq!(retry.status, StatusCode::OK, "{}", retry.text());
        assert!(!retry.replayed());
        assert_eq!(charges_and_records(&pool).await, (1, 1), "charged once");
        assert_eq!(acquirer.authorizations().len(), 1, "authorized once");
    })
    .await
}

/// PostgreSQL only (issue 45.5): a database that goes away mid-charge (a failover: the server
/// shutting down, then read-only) is a `503` with `Retry-After` that Stripe's libraries retry,
/// never a `500`; the key is kept for the retry, which charges once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_gone_mid_charge_is_a_retryable_503() {
    bounded(async {
        let acquirer = acquirer::Acquirer::new(acquirer::Settings::default());
        let processor = CardProcessor::in_process(acquirer.clone(), Duration::ZERO);
        let h = Harness::with_processor(Backend::Postgres, processor).await;
        let pool = h.db.as_ref().unwrap().pool().clone();
        let api_key = new_api_key();
        for sqlstate in ["57P01", "25006"] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "CREATE FUNCTION fail_charge() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN RAISE EXCEPTION 'injected failover' USING ERRCODE = '{sqlstate}'; END $$;
                 CREATE TRIGGER fail_charge BEFORE INSERT ON charges
                 FOR EACH ROW EXECUTE FUNCTION fail_charge();"
            )))
            .execute(&pool)
            .await
            .unwrap();
            let key = new_key();
            let failed = h
                .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
                .await;
            failed.stripe_error(StatusCode::SERVICE_UNAVAILABLE, "api_error");
            assert_eq!(failed.headers["retry-after"], "1", "{sqlstate}");
            assert_eq!(failed.headers["stripe-should-retry"], "true", "{sqlstate}");
            sqlx::raw_sql("DROP TRIGGER fail_charge ON charges; DROP FUNCTION fail_charge();")
                .execute(&pool)
                .await
                .unwrap();
            let retry = h
                .send(charge(&api_key, Some(&key), "amount=2000&currency=usd"))
                .await;
            assert_eq!(retry.status, StatusCode::OK, "{}", retry.text());
        }
        assert_eq!(
            charges_and_records(&pool).await.0,
            2,
            "each key charged once"
        );
        assert_eq!(
            acquirer.authorizations().len(),
            2,
            "each card authorized once"
        );
    })
    .await
}

/// PostgreSQL only: both sets of migrations, each in its own table, re-runnable; and what a
/// charge leaves in the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_migrations_live_apart_and_charges_are_rows() {
    bounded(async {
        let h = Harness::start(Backend::Postgres).await;
        let pool = h.db.as_ref().unwrap().pool();
        // Again: a restart applies nothing and fails on nothing.
        charges_demo::migrate(pool)
            .await
            .expect("migrations are re-runnable");

        let applied = |table: &'static str| async move {
            sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!(
                "SELECT description FROM {table} WHERE success ORDER BY version"
            )))
            .fetch_all(pool)
            .await
            .unwrap_or_else(|e| panic!("{table}: {e}"))
        };
        assert_eq!(
            applied("public._sqlx_migrations").await,
            ["create charges", "create refunds", "create balances"]
        );
        // Every migration the store ships, in order, in the store's own table.
        let shipped: Vec<String> = tower_idempotency::store::PostgresStore::migrator()
            .iter()
            .map(|m| m.description.to_string())
            .collect();
        assert_eq!(shipped.first().map(String::as_str), Some("create records"));
        assert_eq!(applied("idempotency._sqlx_migrations").await, shipped);

        let api_key = new_api_key();
        let reply = h
            .send(charge(
                &api_key,
                Some(&new_key()),
                "amount=4200&currency=gbp&metadata[k]=v",
            ))
            .await;
        assert_eq!(reply.status, StatusCode::OK);
        let id = reply.json()["id"].as_str().unwrap().to_owned();
        let (amount, status, metadata): (i64, String, String) =
            sqlx::query_as("SELECT amount, status, metadata::text FROM charges WHERE id = $1")
                .bind(&id)
                .fetch_one(pool)
                .await
                .unwrap();
        assert_eq!((amount, status.as_str()), (4200, "succeeded"));
        assert_eq!(metadata, r#"{"k": "v"}"#);
        let completed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotency.records WHERE status = 200")
                .fetch_one(pool)
                .await
                .unwrap();
        assert_eq!(completed, 1, "the response is stored for replay");
    })
    .await
}
