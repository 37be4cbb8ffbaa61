//! How the binary starts: without a database, with one it cannot use, and its options.

use std::process::Stdio;

use idempotency_tests::db::TestDb;
use tokio::{io::AsyncReadExt, process::Command};

use crate::{BINARY, EXIT, Server, client};

#[tokio::test]
async fn without_a_database_it_says_so_first_and_serves_from_memory() {
    let server = Server::start(&["--listen", "127.0.0.1:0"]).await;
    let response = client()
        .post(server.url("/v1/charges"))
        .basic_auth("sk_test_memory", Some(""))
        .header("Idempotency-Key", "memory-1")
        .form(&[("amount", "100"), ("currency", "usd")])
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);

    // The layer's metrics, in Prometheus text format, without authentication.
    let metrics = client()
        .get(server.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    // Two keys claimed: the charge's, and its authorization's at the in-process acquirer,
    // whose layer reports to the same recorder.
    assert!(
        metrics.contains(r#"idempotency_requests_total{outcome="acquired"} 2"#),
        "{metrics}"
    );

    let (code, logs) = server.stop().await;
    assert_eq!(code, Some(0));
    let first = logs.first().expect("a log line");
    assert!(
        first.contains("no DATABASE_URL") && first.contains("in-memory"),
        "the first log line names the mode: {first}"
    );
}

/// Runs the binary against `database_url`, expecting it to give up: its exit code, standard
/// output and standard error.
async fn failed_start(database_url: &str) -> (Option<i32>, String, String) {
    failed_start_with(&["--database-url", database_url], &[]).await
}

/// Runs the binary with `args` (and `env`), expecting it to give up, as [`failed_start`].
async fn failed_start_with(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut child = Command::new(BINARY)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the binary");
    let status = tokio::time::timeout(EXIT, child.wait())
        .await
        .expect("it gave up in time")
        .expect("wait");
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut stdout)
        .await
        .expect("read");
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .await
        .expect("read");
    (status.code(), stdout, stderr)
}

#[tokio::test]
async fn an_unreachable_database_fails_start_up() {
    // Port 1 on loopback: nothing listens there, so the connection is refused at once.
    let (code, stdout, stderr) = failed_start("postgres://nobody:secret@127.0.0.1:1/charges").await;
    assert_eq!(code, Some(1));
    assert_eq!(stdout, "", "it never announced itself");
    assert!(stderr.contains("cannot connect to PostgreSQL"), "{stderr}");
    // At once, from the refused connection, not after the pool's acquire timeout.
    assert!(stderr.contains("Connection refused"), "{stderr}");
    assert!(stderr.contains("is PostgreSQL running"), "{stderr}");
    assert!(
        !stderr.contains("secret"),
        "no credentials in the logs: {stderr}"
    );
}

/// A server that accepts the connection and then says nothing (a wrong port, a stuck server):
/// start-up gives up after its connect timeout instead of waiting for ever.
#[tokio::test]
async fn a_database_that_never_answers_fails_start_up() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            connections.push(connection);
        }
    });
    let (code, stdout, stderr) = failed_start(&format!("postgres://demo@{addr}/charges")).await;
    held.abort();
    assert_eq!(code, Some(1));
    assert_eq!(stdout, "", "it never announced itself");
    assert!(stderr.contains("cannot connect to PostgreSQL"), "{stderr}");
    assert!(stderr.contains("no answer within"), "{stderr}");
    assert!(stderr.contains("is PostgreSQL running"), "{stderr}");
}

/// A first run against a server without the demo's database says how to make one, and says
/// PostgreSQL's message once (sqlx repeats it in its own).
#[tokio::test]
async fn a_missing_database_fails_start_up_saying_how_to_create_it() {
    let db = TestDb::new().await;
    // The test database's URL with another database name (before any `?host=` of a socket).
    let url = db.url();
    let (path, query) = url.split_once('?').unwrap_or((&url, ""));
    let url = format!("{path}_missing?{query}");
    let (code, stdout, stderr) = failed_start(&url).await;
    assert_eq!(code, Some(1));
    assert_eq!(stdout, "", "it never announced itself");
    assert!(stderr.contains("createdb"), "{stderr}");
    assert_eq!(
        stderr.matches("does not exist").count(),
        2,
        "the hint's and PostgreSQL's, once: {stderr}"
    );
    assert!(
        !stderr.contains(" at line "),
        "no source line of PostgreSQL's C code: {stderr}"
    );
}

/// Every option has an environment variable, and a flag wins over it: the `ready` line shows
/// what the server took. Ctrl-C (`SIGINT`) stops it cleanly, as `SIGTERM` does.
#[tokio::test]
async fn options_come_from_the_environment_and_a_flag_wins() {
    let server = Server::start_with_env(
        &["--lease-secs", "11"],
        &[
            ("LISTEN_ADDR", "127.0.0.1:0"),
            ("CHARGE_PROCESSING_DELAY_MS", "7"),
            ("IDEMPOTENCY_KEY_TTL_SECS", "600"),
            ("IDEMPOTENCY_LEASE_SECS", "9"),
            ("IDEMPOTENCY_IN_FLIGHT_WAIT_MS", "1200"),
        ],
    )
    .await;
    server.signal("INT");
    let (code, logs) = server.exit().await;
    assert_eq!(code, Some(0), "a clean exit on Ctrl-C");
    assert!(
        logs.iter().any(|line| line.contains("SIGINT")),
        "the shutdown is logged: {logs:#?}"
    );
    let ready = logs
        .iter()
        .find(|line| line.contains(" ready "))
        .unwrap_or_else(|| panic!("a `ready` line in {logs:?}"));
    for setting in [
        "addr=127.0.0.1:",
        "processing_delay_ms=7",
        "key_ttl_secs=600",
        "lease_secs=11",
        "in_flight_wait_ms=1200",
    ] {
        assert!(ready.contains(setting), "{setting} in {ready}");
    }
}

/// Issue 37.4: a seal key that is not 32 bytes of base64 stops start-up, naming the flag and
/// never echoing the key; a valid one seals, and replays are unchanged.
#[tokio::test]
async fn an_invalid_seal_key_fails_start_up_and_a_valid_one_seals() {
    for (args, env) in [
        (vec!["--seal-key", "c2hvcnQtc2VjcmV0"], vec![]),
        (
            vec![],
            vec![("CHARGES_DEMO_SEAL_KEY", "not base64 secret!")],
        ),
    ] {
        let (code, stdout, stderr) = failed_start_with(&args, &env).await;
        assert_eq!(code, Some(1), "{stderr}");
        assert_eq!(stdout, "", "it never announced itself");
        assert!(stderr.contains("--seal-key"), "{stderr}");
        assert!(
            !stderr.contains("c2hvcnQtc2VjcmV0") && !stderr.contains("secret!"),
            "{stderr}"
        );
    }

    let key = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    let server = Server::start_with_env(
        &["--listen", "127.0.0.1:0"],
        &[("CHARGES_DEMO_SEAL_KEY", key)],
    )
    .await;
    let charge = || {
        client()
            .post(server.url("/v1/charges"))
            .basic_auth("sk_test_sealed", Some(""))
            .header("Idempotency-Key", "sealed-1")
            .form(&[("amount", "100"), ("currency", "usd")])
            .send()
    };
    let first = charge().await.expect("charge");
    assert_eq!(first.status(), 200);
    let first = first.text().await.expect("body");
    let replay = charge().await.expect("replay");
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.expect("body"), first);
    let (code, logs) = server.stop().await;
    assert_eq!(code, Some(0));
    assert!(logs.iter().any(|line| line.contains("sealed")), "{logs:#?}");
}

#[tokio::test]
async fn the_completer_without_a_database_fails_start_up_saying_why() {
    let (code, stdout, stderr) = failed_start_with(&["--completer"], &[]).await;
    assert_eq!(code, Some(1));
    assert!(stdout.is_empty(), "never announced: {stdout}");
    assert!(
        stderr.contains("--completer needs --database-url"),
        "{stderr}"
    );
}
