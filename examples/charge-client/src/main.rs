//! `charge-client`: creates one charge on the [charges demo](../charges-demo) through
//! [`tower_idempotency_client`], and prints one JSON line:
//! `{"status", "key", "attempts", "replayed", "body"}`.
//!
//! Run with `cargo run -p charge-client -- --url http://127.0.0.1:3000 --account sk_test_123
//! --amount 2000 --operation-id order-6735`.
//!
//! Every attempt carries the same key; with `--operation-id`, so does every run: a client killed
//! mid-retry and started again gets the first charge back, never a second one. Exit status: `0`
//! for a `2xx` or a `402` (a declined card is a final answer), `2` for a `422` (the key was used
//! with another payload), `1` otherwise.

mod report;

use std::{process::ExitCode, time::Duration};

use clap::Parser;
use reqwest_middleware::ClientBuilder;
use tower_idempotency_client::{IdempotentMiddleware, OperationId, Policy};

use crate::report::Report;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Creates one charge on charges-demo, safe to retry and to restart"
)]
struct Args {
    /// The demo's base URL (`http://127.0.0.1:3000`).
    #[arg(long)]
    url: String,
    /// The API key (`sk_test_...`), sent as a bearer token: the account charged.
    #[arg(long)]
    account: String,
    /// The amount, in the currency's smallest unit.
    #[arg(long)]
    amount: u64,
    /// The three-letter currency code.
    #[arg(long, default_value = "usd")]
    currency: String,
    /// The card token (`tok_chargeDeclined` for a decline); the demo's default without it.
    #[arg(long)]
    source: Option<String>,
    /// The `Idempotency-Key` to send, as given.
    #[arg(long, conflicts_with = "operation_id")]
    key: Option<String>,
    /// The operation's own id (an order's): the key is derived from it, the same on every run.
    #[arg(long)]
    operation_id: Option<String>,
    /// How long the charge may take, every attempt and wait included.
    #[arg(long, default_value_t = 30)]
    deadline_secs: u64,
    /// How long one attempt may take before it is abandoned and retried.
    #[arg(long, default_value_t = 10)]
    attempt_timeout_secs: u64,
    /// The most attempts, the first included.
    #[arg(long, default_value_t = 10)]
    max_attempts: u32,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    let report = match charge(&args).await {
        Ok(report) => report,
        Err(setup) => Report::unsent(&setup),
    };
    println!("{}", report.line());
    ExitCode::from(report.exit_code())
}

/// Sends the charge: its report, or why the client could not be set up.
async fn charge(args: &Args) -> Result<Report, String> {
    let policy = Policy::new()
        .with_deadline(Duration::from_secs(args.deadline_secs))
        .and_then(|policy| policy.with_max_attempts(args.max_attempts))
        .map_err(|error| error.to_string())?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.attempt_timeout_secs))
        .build()
        .map_err(|error| format!("cannot build the HTTP client: {error}"))?;
    let client = ClientBuilder::new(http)
        .with(IdempotentMiddleware::new(policy))
        .build();
    let mut form = vec![
        ("amount", args.amount.to_string()),
        ("currency", args.currency.clone()),
    ];
    if let Some(source) = &args.source {
        form.push(("source", source.clone()));
    }
    let url = format!("{}/v1/charges", args.url.trim_end_matches('/'));
    let mut request = client.post(url).bearer_auth(&args.account);
    if let Some(key) = &args.key {
        request = request.header("idempotency-key", key);
    }
    if let Some(id) = &args.operation_id {
        form.push(("metadata[operation_id]", id.clone()));
        request = request.with_extension(OperationId::new(id.clone()));
    }
    Ok(Report::of(request.form(&form).send().await).await)
}
