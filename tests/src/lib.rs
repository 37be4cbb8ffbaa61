//! Shared support for tower-idempotency's integration tests: isolated PostgreSQL databases, a
//! real HTTP server, the application under test, an observable store wrapper, and the protocol
//! suite every store runs ([`store_suite!`]).

pub mod app;
pub mod db;
pub mod faults;
pub mod ha;
pub mod hostile;
pub mod pgbouncer;
pub mod postgres;
pub mod requests;
pub mod server;
pub mod store;
pub mod suite;
pub mod tx;

/// No test may take longer than this, whatever the server does.
pub const TEST_BOUND: std::time::Duration = std::time::Duration::from_secs(60);

/// Bounds a test by [`TEST_BOUND`]: it fails instead of hanging.
pub async fn bounded<F: std::future::Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_BOUND, test)
        .await
        .expect("the test did not finish within its bound")
}

/// Logs to the test's captured output at `RUST_LOG` (default `warn`); safe to call repeatedly.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}
