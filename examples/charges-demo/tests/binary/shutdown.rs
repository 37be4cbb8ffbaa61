//! How the binary stops: SIGTERM lets the charge in flight finish; a crash between the
//! authorization and the ledger write is finished by the retry, authorizing once.

use std::time::{Duration, Instant};

use idempotency_tests::db::TestDb;

use crate::{Server, acquirer, client, count, wait_for_authorizations};

#[tokio::test]
async fn sigterm_lets_the_in_flight_charge_finish() {
    let db = TestDb::new().await;
    let url = db.url();
    let (acquirer, acquirer_url) = acquirer().await;
    let server = Server::on_postgres_with(&url, 3000, &acquirer_url, "30").await;

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

    // The charge is in its processing delay once the acquirer authorized it.
    wait_for_authorizations(&acquirer, 1).await;
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

/// A server killed between the authorization and the ledger write leaves the authorization
/// recorded as the charge's first step and its key held; once the lease lapses, the client's
/// retry to a restarted server takes the key over, gets the recorded authorization back
/// (the acquirer is not asked again) and charges once.
#[tokio::test]
async fn a_crash_after_the_authorization_is_finished_by_the_retry_authorizing_once() {
    let db = TestDb::new().await;
    let url = db.url();
    let (acquirer, acquirer_url) = acquirer().await;
    let charge = |server: &Server| {
        client()
            .post(server.url("/v1/charges"))
            .bearer_auth("sk_test_crash")
            .header("Idempotency-Key", "crash-1")
            .form(&[("amount", "2000"), ("currency", "usd")])
            .send()
    };
    // A processing delay far longer than the test: the first charge never finishes.
    let server = Server::on_postgres_with(&url, 600_000, &acquirer_url, "1").await;
    let lost = tokio::spawn(charge(&server));
    wait_for_authorizations(&acquirer, 1).await;
    server.crash().await;
    assert!(
        lost.await.expect("task").is_err(),
        "the connection died with the server"
    );
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 0);

    let server = Server::on_postgres_with(&url, 0, &acquirer_url, "1").await;
    // `409` while the dead server's lease runs, then the takeover.
    let deadline = Instant::now() + Duration::from_secs(20);
    let retry = loop {
        let retry = charge(&server).await.expect("retry");
        if retry.status() != 409 {
            break retry;
        }
        assert!(Instant::now() < deadline, "the lease never lapsed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(retry.status(), 200);
    let again = charge(&server).await.expect("second retry");
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 1);
    assert_eq!(acquirer.authorizations().len(), 1, "authorized once");

    server.sigterm();
    assert_eq!(server.exit_code().await, Some(0));
}

/// A server killed between the authorization and the ledger write, whose client never comes
/// back: a restarted server with `--completer` finishes the charge once its lease lapsed and
/// the grace passed, without asking the acquirer again; the client's late retry is its replay.
#[tokio::test]
async fn a_charge_left_mid_way_is_finished_by_the_completer_and_replayed_to_its_client() {
    let db = TestDb::new().await;
    let url = db.url();
    let (acquirer, acquirer_url) = acquirer().await;
    let charge = |server: &Server| {
        client()
            .post(server.url("/v1/charges"))
            .bearer_auth("sk_test_abandoned")
            .header("Idempotency-Key", "abandoned-1")
            .form(&[("amount", "1500"), ("currency", "eur")])
            .send()
    };
    // Every server keeps its charges' requests, so that any of them can finish them.
    let completing = |delay_ms: &'static str| {
        Server::start_owned(vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--database-url".into(),
            url.clone(),
            "--processing-delay-ms".into(),
            delay_ms.into(),
            "--acquirer-url".into(),
            acquirer_url.clone(),
            "--lease-secs".into(),
            "1".into(),
            "--completer".into(),
            "--completer-grace-secs".into(),
            "1".into(),
        ])
    };
    let server = completing("600000").await;
    let lost = tokio::spawn(charge(&server));
    wait_for_authorizations(&acquirer, 1).await;
    server.crash().await;
    assert!(lost.await.expect("task").is_err());

    let server = completing("0").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(&db, "SELECT count(*) FROM charges").await == 0 {
        assert!(Instant::now() < deadline, "the completer never finished it");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let retry = charge(&server).await.expect("the client's late retry");
    assert_eq!(retry.status(), 200);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let body: serde_json::Value = retry.json().await.expect("a charge");
    assert_eq!(
        (body["amount"].as_i64(), body["currency"].as_str()),
        (Some(1500), Some("eur"))
    );
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 1);
    assert_eq!(acquirer.authorizations().len(), 1, "authorized once");

    server.sigterm();
    let (code, log) = server.exit().await;
    assert_eq!(code, Some(0));
    assert!(
        log.iter()
            .any(|line| line.contains("completing a charge its client left mid-way")),
        "the charge was the completer's: {log:#?}"
    );
}
