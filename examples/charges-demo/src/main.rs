//! The charges demo server: a Stripe-style payments API whose `POST /v1/charges` runs once per
//! `Idempotency-Key`.
//!
//! Run with `cargo run -p charges-demo` (in memory), or with PostgreSQL:
//! `DATABASE_URL=postgres://localhost/charges cargo run -p charges-demo`. `--help` lists the
//! options; the library's `server` module documents them.

use std::{io::IsTerminal, process::ExitCode};

use charges_demo::server::{self, Args, ErrorChain};
use clap::Parser;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    // Logs go to standard error; standard output carries only the `listening on` line.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match server::run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{}", ErrorChain(&error));
            ExitCode::FAILURE
        }
    }
}
