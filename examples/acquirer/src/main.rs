//! The acquirer: a small card network that authorizes once per `Idempotency-Key`.
//!
//! Run with `cargo run -p acquirer -- --listen 127.0.0.1:4000`; `--help` lists the options.
//! With `--webhook-url http://127.0.0.1:3000/v1/webhooks/acquirer` it reports each approved
//! charge's settlement to the charges demo (`--settle-after-ms`, `--duplicate-rate`).
//! When it is ready it prints one line to standard output, `listening on ADDR`.

use std::{
    io::{self, IsTerminal, Write},
    net::SocketAddr,
    process::ExitCode,
    time::Duration,
};

use acquirer::{Acquirer, DEV_WEBHOOK_SECRET, Settings, WebhookSender, WebhookSettings, app};
use clap::Parser;
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

/// A card network that authorizes Stripe test tokens once per `Idempotency-Key`.
#[derive(Debug, Parser)]
struct Args {
    /// The address to listen on (port 0: any free port, printed at start-up).
    #[arg(long, env = "ACQUIRER_LISTEN_ADDR", default_value = "127.0.0.1:4000")]
    listen: SocketAddr,
    /// How long each authorization takes, in milliseconds.
    #[arg(long, env = "ACQUIRER_DELAY_MS", default_value_t = 0)]
    delay_ms: u64,
    /// The share of calls answered 503 (half before authorizing, half after), from 0 to 1.
    #[arg(long, env = "ACQUIRER_FAIL_RATE", default_value_t = 0.0, value_parser = rate)]
    fail_rate: f64,
    /// The seed of the failures' random choices.
    #[arg(long, env = "ACQUIRER_SEED")]
    seed: Option<u64>,
    /// Where to send `charge.settled` webhooks (the charges demo's
    /// `http://HOST:PORT/v1/webhooks/acquirer`); without it, none are sent.
    #[arg(long, env = "ACQUIRER_WEBHOOK_URL")]
    webhook_url: Option<String>,
    /// The `whsec_...` secret the webhooks are signed with; without it, the development secret
    /// the charges demo also uses by default.
    #[arg(long, env = "ACQUIRER_WEBHOOK_SECRET", hide_env_values = true)]
    webhook_secret: Option<String>,
    /// How long after its authorization a charge settles, in milliseconds.
    #[arg(long, env = "ACQUIRER_SETTLE_AFTER_MS", default_value_t = 1000)]
    settle_after_ms: u64,
    /// The share of webhook events sent twice on purpose, from 0 to 1.
    #[arg(long, env = "ACQUIRER_DUPLICATE_RATE", default_value_t = 0.0, value_parser = rate)]
    duplicate_rate: f64,
}

fn rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if (0.0..=1.0).contains(&rate) => Ok(rate),
        _ => Err(format!("{text:?} is not a number from 0 to 1")),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(io::stderr)
        .with_ansi(io::stderr().is_terminal())
        .init();
    match serve(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(%error, "the acquirer stopped");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args) -> io::Result<()> {
    let webhooks = args.webhook_url.clone().map(|url| WebhookSettings {
        url,
        secret: (args.webhook_secret.clone()).unwrap_or_else(|| DEV_WEBHOOK_SECRET.to_owned()),
        settle_after: Duration::from_millis(args.settle_after_ms),
        duplicate_rate: args.duplicate_rate,
    });
    let sender = webhooks
        .map(WebhookSender::new)
        .transpose()
        .map_err(|error| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("--webhook-secret: {error}"),
            )
        })?;
    let listener = TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, delay_ms = args.delay_ms, fail_rate = args.fail_rate, "ready");
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "listening on {addr}")?;
    stdout.flush()?;
    drop(stdout);
    let mut acquirer = Acquirer::new(Settings {
        delay: Duration::from_millis(args.delay_ms),
        fail_rate: args.fail_rate,
        seed: args.seed,
    });
    if let Some(sender) = sender {
        tracing::info!(?sender, "charge.settled webhooks on");
        acquirer = acquirer.with_webhooks(sender);
    }
    axum::serve(listener, app(acquirer))
        .with_graceful_shutdown(async {
            // Without a handler the default action (exit) applies, which is as good.
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        })
        .await
}
