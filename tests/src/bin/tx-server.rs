//! A transactional-mode test server in a process of its own, for tests that kill it.
//!
//! `tx-server <database-url>` migrates, serves `idempotency_tests::app::tx_app` on
//! `127.0.0.1:0` and prints `listening on <addr>`.

use std::io::Write;

use idempotency_tests::app::{CHARGES_TABLE, Probe, tx_app};
use sqlx::Executor;
use tower_idempotency::{IdempotencyLayer, KeySource, store::PostgresStore};

#[tokio::main]
async fn main() {
    let url = std::env::args()
        .nth(1)
        .expect("usage: tx-server <database-url>");
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    pool.execute(CHARGES_TABLE).await.expect("charges table");
    let layer = IdempotencyLayer::new(PostgresStore::new(pool.clone()).transactional());
    layer.store().migrate().await.expect("migrate");
    let app = tx_app(
        layer.with_key(KeySource::default().required()),
        Probe::default(),
        pool,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let mut stdout = std::io::stdout();
    writeln!(
        stdout,
        "listening on {}",
        listener.local_addr().expect("addr")
    )
    .expect("stdout");
    stdout.flush().expect("stdout");
    axum::serve(listener, app).await.expect("serve");
}
