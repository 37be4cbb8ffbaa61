//! How the binary stops: SIGTERM lets the charge in flight finish; a crash mid-charge leaves
//! nothing behind.

use std::time::Instant;

use idempotency_tests::db::TestDb;

use crate::{Server, client, count, wait_for_open_transactions};

#[tokio::test]
async fn sigterm_lets_the_in_flight_charge_finish() {
    let db = TestDb::new().await;
    let url = db.url();
    let server = Server::on_postgres(&url, 3000).await;

    let request = client()
        .post(server.url("/v1/charges"))
        .bearer_auth("sk_test_shutdown")
        .header("Idempotency-Key", "shutdown-1")
        .form(&[("amount", "2000"), ("currency", "usd")])
        .send();
    let in_flight = tokio::spawn(async move {
        let response = request.await;
        (response, Instant::now())
    });

    // The charge is in flight once its transaction is open.
    wait_for_open_transactions(&db, 1).await;
    let signalled = Instant::now();
    server.sigterm();

    let (response, answered) = in_flight.await.expect("request task");
    let response = response.expect("the in-flight request got its response");
    assert!(
        answered > signalled,
        "the response came after SIGTERM, so the request was in flight when it arrived"
    );
    assert_eq!(response.status(), 200);
    let charge: serde_json::Value = response.json().await.expect("a charge");
    assert_eq!(charge["status"], "succeeded");

    let (code, logs) = server.exit().await;
    assert_eq!(code, Some(0), "a clean exit");
    assert!(
        logs.iter().any(|l| l.contains("SIGTERM")),
        "the shutdown is logged: {logs:#?}"
    );
    // Committed before the exit: the charge and its stored response.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM idempotency.records WHERE status = 200"
        )
        .await,
        1,
        "the response was stored for replay"
    );
    let charged: i64 = sqlx::query_scalar("SELECT count(*) FROM charges WHERE id = $1")
        .bind(charge["id"].as_str().expect("id"))
        .fetch_one(db.pool())
        .await
        .expect("count charges");
    assert_eq!(charged, 1);
}

/// Transactional mode: a server killed mid-charge leaves neither a charge nor a held key, so the
/// client's retry (to a restarted server) runs at once and charges once.
#[tokio::test]
async fn a_crash_mid_charge_leaves_nothing_and_the_retry_charges_once() {
    let db = TestDb::new().await;
    let url = db.url();
    let charge = |server: &Server| {
        client()
            .post(server.url("/v1/charges"))
            .bearer_auth("sk_test_crash")
            .header("Idempotency-Key", "crash-1")
            .form(&[("amount", "2000"), ("currency", "usd")])
            .send()
    };
    // A processing delay far longer than the test: the first charge never finishes.
    let server = Server::on_postgres(&url, 600_000).await;
    let lost = tokio::spawn(charge(&server));
    wait_for_open_transactions(&db, 1).await;
    server.crash().await;
    assert!(
        lost.await.expect("task").is_err(),
        "the connection died with the server"
    );

    // PostgreSQL aborts the dead server's transaction: nothing of the charge remains.
    wait_for_open_transactions(&db, 0).await;
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 0);
    assert_eq!(
        count(&db, "SELECT count(*) FROM idempotency.records").await,
        0
    );

    // The retry, to the restarted server, runs at once: no 409, no waiting for a 30 s lease.
    let server = Server::start(&["--listen", "127.0.0.1:0", "--database-url", &url]).await;
    let retry = charge(&server).await.expect("retry");
    assert_eq!(retry.status(), 200);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    let again = charge(&server).await.expect("second retry");
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 1);

    server.sigterm();
    assert_eq!(server.exit_code().await, Some(0));
}
