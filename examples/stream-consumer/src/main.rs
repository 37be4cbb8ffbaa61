//! A Redis Streams consumer that applies each message's effect exactly once, however often it
//! is killed: each entry is applied with `Once::run_in_transaction` (the credit and the event's
//! record commit together) and acknowledged after.
//!
//! Run with `cargo run -p stream-consumer -- --redis-url redis://127.0.0.1:6379 --database-url
//! postgres://localhost/app --stream credits --group ledger --consumer c1`.

use std::time::Duration;

use clap::Parser;
use redis::AsyncConnectionConfig;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;
use tower_idempotency::{Once, store::PostgresStore};

mod consumer;
mod effect;
mod failure;
mod round;

use consumer::Consumer;
use round::RESPONSE_TIMEOUT;

/// Applies credits from a Redis stream to PostgreSQL, each event once.
#[derive(Debug, Parser)]
struct Args {
    /// The Redis server.
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// The PostgreSQL database holding the accounts and the idempotency records.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// The stream to consume; also the scope of its event ids.
    #[arg(long, env = "STREAM", default_value = "credits")]
    stream: String,
    /// The consumer group.
    #[arg(long, env = "GROUP", default_value = "ledger")]
    group: String,
    /// This consumer's name in the group.
    #[arg(long, env = "CONSUMER", default_value = "consumer-1")]
    consumer: String,
    /// How long a pending entry stays untouched (with any consumer, this one included) before
    /// it is claimed and tried again.
    #[arg(long, env = "CLAIM_IDLE_MS", default_value_t = 30_000)]
    claim_idle_ms: u64,
    /// The deliveries an entry gets before it is moved to `<stream>:dead`: an entry failing
    /// for a reason that is neither its data nor a transient outage, or that kills the consumer.
    #[arg(long, env = "MAX_DELIVERIES", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..))]
    max_deliveries: u64,
    /// A pause inside each effect, with its row locked: widens the crash window in tests.
    #[arg(long, env = "EFFECT_DELAY_MS", default_value_t = 0)]
    effect_delay_ms: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&args.database_url)
        .await?;
    let store = PostgresStore::new(pool.clone());
    effect::migrate(&pool, &store).await?;
    let config = AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
    let redis = redis::Client::open(args.redis_url.as_str())?
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    let consumer = Consumer {
        redis,
        once: Once::new(store.transactional()),
        stream: args.stream,
        group: args.group,
        name: args.consumer,
        claim_idle: Duration::from_millis(args.claim_idle_ms),
        max_deliveries: args.max_deliveries,
        effect_delay: Duration::from_millis(args.effect_delay_ms),
        retry_after: None,
    };
    let (stop, shutdown) = watch::channel(false);
    tokio::spawn(async move {
        if let Err(error) = terminated().await {
            tracing::error!(%error, "listening for SIGTERM failed; stopping");
        }
        let _ = stop.send(true);
    });
    tracing::info!(consumer = %consumer.name, stream = %consumer.stream, "consuming");
    consumer.run(shutdown).await?;
    Ok(())
}

/// SIGTERM or Ctrl-C.
async fn terminated() -> std::io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => Ok(()),
        result = tokio::signal::ctrl_c() => result,
    }
}
