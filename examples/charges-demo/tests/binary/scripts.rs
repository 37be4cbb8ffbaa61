//! The scripts a person runs against the binary: the curl scenarios, and Stripe's Python and
//! Node.js libraries, each with the demo answering duplicates `409` and with it waiting.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use idempotency_tests::db::TestDb;
use tokio::process::Command;

use crate::{Server, count};

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
/// amount, a declined card, a refund, a webhook redelivered.
const CURL_SCENARIOS: usize = 6;

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
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 6);
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

/// `examples/curl/crash-during-processing.sh`: it kills the binary while a charge sleeps
/// between its authorization and its ledger write, restarts it and retries; the acquirer (this
/// test's, outliving the kill) made one authorization, and the database holds one charge.
#[tokio::test]
async fn the_crash_script_leaves_one_authorization_and_one_charge() {
    if !succeeds("curl", &["--version"]) {
        return skip_without("curl is not installed, so the crash script cannot run");
    }
    let db = TestDb::new().await;
    let (acquirer, acquirer_url) = crate::acquirer().await;
    let script: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "..",
        "curl",
        "crash-during-processing.sh",
    ]
    .iter()
    .collect();
    let run = Command::new("bash")
        .arg(&script)
        .env("CHARGES_DEMO_BIN", crate::BINARY)
        .env("ACQUIRER_URL", &acquirer_url)
        .env("DATABASE_URL", db.url())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the script finished in time")
        .expect("run the script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(output.status.success(), "the script failed");
    assert!(stdout.contains("\nPASS: killed mid-charge"), "{stdout}");
    assert_eq!(acquirer.authorizations().len(), 1);
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 1);
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
    assert_eq!(count(&db, "SELECT count(*) FROM charges").await, 6);
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
