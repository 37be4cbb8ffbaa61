//! The built `charge-client` against the charges demo, as a person runs it: its JSON line and
//! exit status; and a client killed mid-retry and started again with the same
//! `--operation-id`, which gets the first charge back and never makes a second one.

use std::{
    io,
    process::Stdio,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, body::Body};
use charges_demo::{AppState, Settings, app};
use http_body_util::BodyExt;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use idempotency_tests::db::TestDb;
use serde_json::Value;
use tokio::{net::TcpListener, process::Command, sync::mpsc};
use tower::ServiceExt;

const BINARY: &str = env!("CARGO_BIN_EXE_charge-client");
/// The longest a run of the client or a step of a test may take.
const LIMIT: Duration = Duration::from_secs(60);

/// One run of the client: its exit code and its JSON line.
struct Run {
    code: Option<i32>,
    line: Value,
}

fn client(args: &[&str]) -> Command {
    let mut command = Command::new(BINARY);
    command
        .args(args)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    command
}

async fn run(args: &[&str]) -> Run {
    let output = tokio::time::timeout(LIMIT, client(args).output())
        .await
        .expect("the client finished in time")
        .expect("run the client");
    let stdout = String::from_utf8(output.stdout).expect("UTF-8");
    assert_eq!(stdout.lines().count(), 1, "one line: {stdout:?}");
    Run {
        code: output.status.code(),
        line: serde_json::from_str(&stdout).expect("a JSON line"),
    }
}

/// The demo in memory, on a port of its own: its URL.
async fn demo_in_memory() -> String {
    let app = app(AppState::memory(&Settings::default()).expect("settings"));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::test]
async fn a_charge_prints_its_line_and_its_retry_is_the_replay() {
    let url = demo_in_memory().await;
    let args = [
        "--url",
        &url,
        "--account",
        "sk_test_cli",
        "--amount",
        "2000",
        "--key",
        "cli-order-1",
    ];
    let first = run(&args).await;
    assert_eq!(first.code, Some(0), "{}", first.line);
    let line = &first.line;
    assert_eq!(
        (&line["status"], &line["key"]),
        (&200.into(), &"cli-order-1".into())
    );
    assert_eq!(
        (&line["attempts"], &line["replayed"]),
        (&1.into(), &false.into())
    );
    assert_eq!(line["body"]["object"], "charge");
    assert!(line.get("error").is_none());
    let again = run(&args).await;
    assert_eq!(again.code, Some(0));
    assert_eq!(again.line["replayed"], true);
    assert_eq!(again.line["body"], first.line["body"], "the same charge");
}

#[tokio::test]
async fn a_declined_card_is_a_final_answer_and_exits_0() {
    let url = demo_in_memory().await;
    let declined = run(&[
        "--url",
        &url,
        "--account",
        "sk_test_cli",
        "--amount",
        "2000",
        "--source",
        "tok_chargeDeclined",
    ])
    .await;
    assert_eq!(declined.code, Some(0));
    assert_eq!(declined.line["status"], 402);
    assert_eq!(declined.line["body"]["error"]["code"], "card_declined");
}

#[tokio::test]
async fn a_key_reused_with_another_amount_exits_2() {
    let url = demo_in_memory().await;
    let charge = |amount: &'static str| {
        let url = url.clone();
        async move {
            let args = [
                "--url",
                &url,
                "--account",
                "sk_test_cli",
                "--amount",
                amount,
            ];
            run(&[&args[..], &["--key", "cli-order-2"]].concat()).await
        }
    };
    assert_eq!(charge("2000").await.code, Some(0));
    let reused = charge("5000").await;
    assert_eq!(reused.code, Some(2), "{}", reused.line);
    assert_eq!(reused.line["status"], 422);
    assert_eq!(reused.line["attempts"], 1, "never retried");
    assert_eq!(reused.line["body"]["error"]["type"], "idempotency_error");
    let error = reused.line["error"].as_str().expect("the error");
    assert!(
        error.contains("already used with another request payload"),
        "{error}"
    );
}

#[tokio::test]
async fn no_server_exits_1_with_the_key_to_send_again() {
    // Port 1 on loopback: nothing listens there, so every attempt is refused at once.
    let refused = run(&[
        "--url",
        "http://127.0.0.1:1",
        "--account",
        "sk_test_cli",
        "--amount",
        "2000",
        "--deadline-secs",
        "1",
    ])
    .await;
    assert_eq!(refused.code, Some(1));
    assert_eq!(refused.line["status"], Value::Null);
    assert!(refused.line["key"].is_string(), "{}", refused.line);
    assert!(refused.line["attempts"].as_u64() >= Some(1));
    assert!(refused.line["error"].is_string());
}

/// In front of the demo: the first request is handled and its connection dropped before the
/// answer; the second (the retry) is held, and announced; the rest pass through.
struct Front {
    url: String,
    keys: Arc<Mutex<Vec<String>>>,
    retried: mpsc::UnboundedReceiver<()>,
}

impl Front {
    async fn start(app: Router) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let keys = Arc::new(Mutex::new(Vec::new()));
        let (announce, retried) = mpsc::unbounded_channel();
        let seen = Arc::new(AtomicUsize::new(0));
        let noted = Arc::clone(&keys);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (app, seen, keys, announce) = (
                    app.clone(),
                    Arc::clone(&seen),
                    Arc::clone(&noted),
                    announce.clone(),
                );
                let service = service_fn(move |request: hyper::Request<Incoming>| {
                    let n = seen.fetch_add(1, Ordering::SeqCst);
                    let key = request.headers().get("idempotency-key");
                    let key = key.and_then(|k| k.to_str().ok()).unwrap_or_default();
                    keys.lock().expect("keys").push(key.to_owned());
                    let (app, announce) = (app.clone(), announce.clone());
                    async move {
                        let answer = app.oneshot(request.map(Body::new)).await;
                        let answer = answer.map_err(io::Error::other)?;
                        match n {
                            0 => {
                                // The handler ran to its end; the answer is lost.
                                let _ = answer.into_body().collect().await;
                                Err(io::Error::other("dropped before the answer"))
                            }
                            1 => {
                                let _ = announce.send(());
                                std::future::pending().await
                            }
                            _ => Ok(answer),
                        }
                    }
                });
                tokio::spawn(async move {
                    let io = TokioIo::new(stream);
                    let _ = http1::Builder::new().serve_connection(io, service).await;
                });
            }
        });
        Self { url, keys, retried }
    }
}

async fn charges(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar("SELECT id FROM charges ORDER BY seq")
        .fetch_all(db.pool())
        .await
        .expect("the charges")
}

#[tokio::test]
async fn a_client_killed_mid_retry_and_started_again_gets_the_first_charge() {
    let db = TestDb::new().await;
    charges_demo::migrate(db.pool()).await.expect("migrate");
    let state = AppState::postgres(db.pool().clone(), &Settings::default()).expect("settings");
    let mut front = Front::start(app(state)).await;
    let args = [
        "--url",
        &front.url,
        "--account",
        "sk_test_restart",
        "--amount",
        "2500",
        "--operation-id",
        "order-8812/charge",
    ];

    let mut first = client(&args).spawn().expect("start the client");
    // Its first attempt charged and lost its answer; its retry is held: it is mid-retry.
    tokio::time::timeout(LIMIT, front.retried.recv())
        .await
        .expect("the retry came in time")
        .expect("the front is up");
    assert_eq!(charges(&db).await.len(), 1, "the first attempt charged");
    first.start_kill().expect("SIGKILL");
    let killed = first.wait_with_output().await.expect("wait");
    assert_eq!(killed.status.code(), None, "killed by a signal");
    assert!(killed.stdout.is_empty(), "it died before printing");

    let again = run(&args).await;
    assert_eq!(again.code, Some(0), "{}", again.line);
    assert_eq!(
        (&again.line["status"], &again.line["replayed"]),
        (&200.into(), &true.into())
    );
    let made = charges(&db).await;
    assert_eq!(made.len(), 1, "never a second charge");
    assert_eq!(
        again.line["body"]["id"],
        made[0].as_str(),
        "the first charge"
    );
    let keys = front.keys.lock().expect("keys").clone();
    let key = again.line["key"].as_str().expect("a key");
    assert!(keys.len() >= 3, "{keys:?}");
    assert!(
        keys.iter().all(|sent| *sent == format!("\"{key}\"")),
        "{keys:?}"
    );
}
