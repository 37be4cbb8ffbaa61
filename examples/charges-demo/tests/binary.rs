//! The built binary, as a person runs it: options, the `listening on` line, the curl scenarios
//! and Stripe's Python and Node.js libraries over real HTTP against PostgreSQL, and graceful
//! shutdown on SIGTERM.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use idempotency_tests::db::TestDb;
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, BufReader},
    process::{Child, ChildStdout, Command},
};

const BINARY: &str = env!("CARGO_BIN_EXE_charges-demo");
const STARTUP: Duration = Duration::from_secs(60);
const EXIT: Duration = Duration::from_secs(30);

/// The running binary; killed if the test ends without stopping it.
struct Server {
    child: Child,
    addr: SocketAddr,
    stdout: BufReader<ChildStdout>,
    stderr: Arc<Mutex<Vec<String>>>,
    /// The task reading `stderr`: it ends when the process has closed it.
    stderr_reader: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Starts the binary with `args` and a clean environment, and waits for `listening on`.
    async fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[]).await
    }

    /// [`Server::start`], with these variables in the otherwise clean environment.
    async fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(BINARY)
            .args(args)
            .env_clear()
            .env("RUST_LOG", "info,sqlx=warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the binary");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let log = Arc::clone(&stderr);
        let stderr_reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("[charges-demo] {line}");
                log.lock().expect("log").push(line);
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        tokio::time::timeout(STARTUP, stdout.read_line(&mut line))
            .await
            .expect("the server announced itself in time")
            .expect("read stdout");
        let addr = line
            .strip_prefix("listening on ")
            .and_then(|rest| rest.strip_suffix('\n'))
            .unwrap_or_else(|| panic!("expected `listening on ADDR`, got {line:?}"))
            .parse()
            .expect("a socket address");
        Self {
            child,
            addr,
            stdout,
            stderr,
            stderr_reader,
        }
    }

    /// Starts the binary on PostgreSQL at `url`, each charge taking `delay_ms` in the handler
    /// (so that duplicates overlap it, or a signal finds it in flight).
    async fn on_postgres(url: &str, delay_ms: u64) -> Self {
        let delay = delay_ms.to_string();
        Self::start(&[
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            url,
            "--processing-delay-ms",
            &delay,
        ])
        .await
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn sigterm(&self) {
        self.signal("TERM");
    }

    /// Sends the signal `name` (`TERM`, `INT`...) to the process.
    fn signal(&self, name: &str) {
        let pid = self.child.id().expect("running");
        let status = std::process::Command::new("kill")
            .args([&format!("-{name}"), &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {pid}");
    }

    /// Kills the process with SIGKILL, as a crash would, and waits for it.
    async fn crash(mut self) {
        self.child.start_kill().expect("SIGKILL");
        let status = tokio::time::timeout(EXIT, self.child.wait())
            .await
            .expect("the server died in time")
            .expect("wait");
        assert_eq!(status.code(), None, "killed by a signal");
    }

    /// Stops the process with SIGTERM: its exit code and everything it logged.
    async fn stop(self) -> (Option<i32>, Vec<String>) {
        self.sigterm();
        self.exit().await
    }

    /// Waits for the process to exit: its exit code and everything it logged.
    async fn exit(self) -> (Option<i32>, Vec<String>) {
        let stderr = Arc::clone(&self.stderr);
        let code = self.exit_code().await;
        let logs = stderr.lock().expect("log").clone();
        (code, logs)
    }

    /// Waits for the process to exit, and checks it printed nothing more on stdout.
    async fn exit_code(mut self) -> Option<i32> {
        let status = tokio::time::timeout(EXIT, self.child.wait())
            .await
            .expect("the server exited in time")
            .expect("wait");
        let mut rest = String::new();
        self.stdout
            .read_to_string(&mut rest)
            .await
            .expect("read stdout");
        assert_eq!(rest, "", "stdout holds the `listening on` line only");
        // Every line it logged has been read once its stderr is closed.
        tokio::time::timeout(EXIT, self.stderr_reader)
            .await
            .expect("stderr closed in time")
            .expect("stderr reader");
        status.code()
    }
}

/// Waits until the database has `n` open transactions: in transactional mode, the charges in
/// flight (their claims are not visible to other connections until they commit).
async fn wait_for_open_transactions(db: &TestDb, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
        )
        .fetch_one(db.pool())
        .await
        .expect("pg_stat_activity");
        if open == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} open transaction(s), found {open}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn count(db: &TestDb, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(db.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// Runs a scenario script, echoes what it printed, and checks that it passed all `scenarios`
/// (a `PASS:` line each and the closing `all N scenarios passed`); returns its standard output.
async fn run_scenarios(mut script: Command, scenarios: usize) -> String {
    let run = script.stdin(Stdio::null()).kill_on_drop(true).output();
    let output = tokio::time::timeout(Duration::from_secs(180), run)
        .await
        .expect("the scenarios finished in time")
        .expect("run the script");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        output.status.success(),
        "the script failed:\n{stdout}\n{stderr}"
    );
    assert_eq!(stdout.matches("\nPASS: ").count(), scenarios, "{stdout}");
    assert!(
        stdout.contains(&format!("all {scenarios} scenarios passed")),
        "{stdout}"
    );
    stdout
}

/// Whether `program` runs with `args` and succeeds (silenced): a probe for a tool a test needs.
fn succeeds(program: &str, args: &[&str]) -> bool {
    std::process::Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The scenarios of `examples/curl/run-all.sh`: a lost response, a double click, a changed
/// amount, a declined card, a refund.
const CURL_SCENARIOS: usize = 5;

#[tokio::test]
async fn curl_scenarios_pass_against_the_binary_on_postgres() {
    if !succeeds("curl", &["--version"]) {
        return skip_without(
            "curl is not installed, so examples/curl/run-all.sh cannot run; install curl to run \
             this test",
        );
    }
    let db = TestDb::new().await;
    let url = db.url();
    // The double click needs the first request to be in flight while the duplicates arrive.
    let server = Server::on_postgres(&url, 1500).await;

    let script: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "curl", "run-all.sh"]
        .iter()
        .collect();
    let mut bash = Command::new("bash");
    bash.arg(&script).env("BASE_URL", server.url(""));
    run_scenarios(bash, CURL_SCENARIOS).await;

    // The scenarios left their charges in PostgreSQL: one each (the declined one too), and the
    // refund scenario its one refund, of 500.
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 5);
    assert_eq!(
        count(&db, "SELECT count(*) FROM refunds WHERE amount = 500").await,
        1
    );
    assert_eq!(
        count(&db, "SELECT sum(amount_refunded)::bigint FROM charges").await,
        500
    );

    server.sigterm();
    assert_eq!(server.exit_code().await, Some(0));
}

/// The same scenarios against the binary waiting for charges in flight: the double click's
/// duplicates get the first charge, never `409`.
#[tokio::test]
async fn curl_scenarios_pass_against_the_binary_that_waits() {
    if !succeeds("curl", &["--version"]) {
        return skip_without("curl is not installed, so examples/curl/run-all.sh cannot run");
    }
    let db = TestDb::new().await;
    let url = db.url();
    let server = Server::start(&[
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        &url,
        "--processing-delay-ms",
        "1500",
        "--in-flight-wait-ms",
        "5000",
    ])
    .await;
    let script: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "curl", "run-all.sh"]
        .iter()
        .collect();
    let mut bash = Command::new("bash");
    bash.arg(&script)
        .env("BASE_URL", server.url(""))
        .env("DEMO_WAITS", "1");
    run_scenarios(bash, CURL_SCENARIOS).await;
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 5);
    assert_eq!(count(&db, "SELECT count(*) FROM refunds").await, 1);
    server.sigterm();
    assert_eq!(server.exit_code().await, Some(0));
}

/// What an SDK script requires of a key's second request while its first still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InFlight {
    /// The same charge, or the library's typed `idempotency_key_in_use` error (the demo answers
    /// `409` at once).
    SameChargeOrKeyInUse,
    /// Always the same charge (`--expect-wait`): for a demo that waits for the first request.
    SameCharge,
}

/// Runs a Stripe SDK's scenario script (`program` with `script` and its arguments) against the
/// binary on PostgreSQL, with a 1 s processing delay and `server_args`, and checks what the
/// scripts' payments left in the database. A run against a demo that waits for a key's first
/// request is this with its flag in `server_args` and [`InFlight::SameCharge`].
async fn sdk_scenarios_pass(
    mut program: Command,
    script: &Path,
    server_args: &[&str],
    in_flight: InFlight,
) {
    let db = TestDb::new().await;
    let url = db.url();
    // Longer than the scripts' 0.5 s client timeout: the first response is really lost, and
    // the double click's requests overlap.
    let mut args = vec![
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        url.as_str(),
        "--processing-delay-ms",
        "1000",
    ];
    args.extend_from_slice(server_args);
    let server = Server::start(&args).await;

    program.arg(script).arg(server.url(""));
    if in_flight == InFlight::SameCharge {
        program.arg("--expect-wait");
    }
    let stdout = run_scenarios(program, 9).await;
    assert!(
        stdout.contains("the first response was lost"),
        "the first response was lost, and its retry got the charge: {stdout}"
    );

    // What the library saw is what happened: one charge per payment (the lost response, the
    // double click, the changed amount, the declined card, the corrected request, the one
    // refunded), and three under keys the library chose. The changed amount, the malformed
    // idempotency key and the bad API key charged nothing; the retried refund refunded once,
    // and the one of more than was left nothing.
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 9);
    assert_eq!(count(&db, "SELECT count(*) FROM refunds").await, 1);
    assert_eq!(
        count(&db, "SELECT sum(amount_refunded)::bigint FROM charges").await,
        500
    );

    server.sigterm();
    assert_eq!(server.exit_code().await, Some(0));
}

/// Skips a test for want of `what`, saying so; under CI, fails it instead.
fn skip_without(what: &str) {
    assert!(std::env::var_os("CI").is_none(), "under CI: {what}");
    eprintln!("SKIPPED: {what}");
}

/// The Python that runs `examples/stripe-python`: `$STRIPE_PYTHON` if set (`.ci/run` makes one
/// with the pinned `stripe`), else `python3`; `None` if it cannot import `stripe`.
fn stripe_python() -> Option<String> {
    let python = std::env::var("STRIPE_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    succeeds(&python, &["-c", "import stripe"]).then_some(python)
}

/// Stripe's own Python library, at its defaults, against the binary on PostgreSQL:
/// `examples/stripe-python/charges.py`, whose scenarios check what the library saw.
#[tokio::test]
async fn stripe_python_scenarios_pass_against_the_binary_on_postgres() {
    stripe_python_scenarios(&[], InFlight::SameChargeOrKeyInUse).await;
}

/// The same with the demo waiting for a charge in flight: a double click always gets the same
/// charge.
#[tokio::test]
async fn stripe_python_gets_the_same_charge_when_the_demo_waits() {
    stripe_python_scenarios(&["--in-flight-wait-ms", "5000"], InFlight::SameCharge).await;
}

async fn stripe_python_scenarios(server_args: &[&str], in_flight: InFlight) {
    let Some(python) = stripe_python() else {
        return skip_without(
            "Python with Stripe's library is not available (set STRIPE_PYTHON, or \
             `pip install -r examples/stripe-python/requirements.txt`)",
        );
    };
    let script: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "..",
        "stripe-python",
        "charges.py",
    ]
    .iter()
    .collect();
    let mut program = Command::new(python);
    program.env("PYTHONUNBUFFERED", "1");
    sdk_scenarios_pass(program, &script, server_args, in_flight).await;
}

/// `examples/stripe-node` with its modules installed: `$STRIPE_NODE_DIR` if set (`.ci/run`
/// exports it after `npm ci`), else the example itself; `None` without `node` or without
/// `node_modules/stripe` there.
fn stripe_node() -> Option<PathBuf> {
    let dir = std::env::var_os("STRIPE_NODE_DIR").map_or_else(
        || {
            [env!("CARGO_MANIFEST_DIR"), "..", "stripe-node"]
                .iter()
                .collect()
        },
        PathBuf::from,
    );
    let installed = dir.join("node_modules/stripe/package.json").is_file();
    (installed && succeeds("node", &["--version"])).then_some(dir)
}

/// Stripe's own Node.js library, at its defaults, against the binary on PostgreSQL:
/// `examples/stripe-node/charges.mjs`, whose scenarios check what the library saw.
#[tokio::test]
async fn stripe_node_scenarios_pass_against_the_binary_on_postgres() {
    stripe_node_scenarios(&[], InFlight::SameChargeOrKeyInUse).await;
}

/// The same with the demo waiting for a charge in flight: a double click always gets the same
/// charge, with no `409` on the way.
#[tokio::test]
async fn stripe_node_gets_the_same_charge_when_the_demo_waits() {
    stripe_node_scenarios(&["--in-flight-wait-ms", "5000"], InFlight::SameCharge).await;
}

async fn stripe_node_scenarios(server_args: &[&str], in_flight: InFlight) {
    let Some(dir) = stripe_node() else {
        return skip_without(
            "Node.js with Stripe's library is not available (set STRIPE_NODE_DIR, or run \
             `npm ci` in examples/stripe-node)",
        );
    };
    sdk_scenarios_pass(
        Command::new("node"),
        &dir.join("charges.mjs"),
        server_args,
        in_flight,
    )
    .await;
}

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
    assert!(
        metrics.contains(r#"idempotency_requests_total{outcome="acquired"} 1"#),
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
    let mut child = Command::new(BINARY)
        .args(["--listen", "127.0.0.1:0", "--database-url", database_url])
        .env_clear()
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
