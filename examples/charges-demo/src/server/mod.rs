//! The server process: options, start-up, serving, graceful shutdown.
//!
//! Every option is a flag, else an environment variable, else a default:
//!
//! | flag | environment | default |
//! |---|---|---|
//! | `--listen ADDR` | `LISTEN_ADDR` | `127.0.0.1:3000` |
//! | `--database-url URL` | `DATABASE_URL` | none: the embedded in-memory store and ledger |
//! | `--processing-delay-ms N` | `CHARGE_PROCESSING_DELAY_MS` | `0` |
//! | `--key-ttl-secs N` | `IDEMPOTENCY_KEY_TTL_SECS` | `86400` |
//! | `--lease-secs N` | `IDEMPOTENCY_LEASE_SECS` | `30` |
//! | `--in-flight-wait-ms N` | `IDEMPOTENCY_IN_FLIGHT_WAIT_MS` | `0`: a duplicate of a charge in flight gets `409` at once |
//! | `--acquirer-url URL` | `CHARGES_DEMO_ACQUIRER_URL` | none: an [`acquirer`] in this process |
//! | `--step-secret SECRET` | `CHARGES_DEMO_STEP_SECRET` | a development secret (≥ 32 bytes; said at start-up) |
//! | `--completer` | `CHARGES_DEMO_COMPLETER` | off; on, charges abandoned mid-way are finished ([`completer`](crate::completer)) |
//! | `--completer-grace-secs N` | `CHARGES_DEMO_COMPLETER_GRACE_SECS` | `60`: how long a client has to retry after its lease lapsed |
//! | `--seal-key BASE64` | `CHARGES_DEMO_SEAL_KEY` | none: stored responses in clear; with 32 bytes in base64, sealed ([`SealingStore`](tower_idempotency::store::SealingStore), key id 1) |
//!
//! Without `--acquirer-url`, the in-process acquirer's own idempotency layer reports to the same
//! `/metrics`, so each charge counts twice there.
//!
//! When it is ready the server prints exactly one line to standard output, `listening on ADDR`
//! with the address it bound (so `--listen 127.0.0.1:0` tells which port it got); logs go to
//! standard error. SIGTERM or Ctrl-C stops accepting connections, lets the requests in flight
//! finish, and exits 0.

mod args;
mod error;

use std::{
    io::{self, Write},
    net::SocketAddr,
    str::FromStr,
    time::Duration,
};

use axum::{Router, routing::get};
use metrics_exporter_prometheus::PrometheusBuilder;
use sqlx::{
    Connection,
    postgres::{PgConnectOptions, PgConnection, PgPoolOptions},
};
use tokio::net::TcpListener;
use tower_idempotency::store::{ExpiredDeletion, SealingKeys, Store, continuously_delete_expired};

pub use self::{
    args::Args,
    error::{ErrorChain, RunError},
};
use crate::{AppState, Settings, StepSecret, completer::app_and_completer, ledger::Ledger};

/// How often expired idempotency records are deleted, and how many per batch.
const EXPIRY_PERIOD: Duration = Duration::from_secs(60);
const EXPIRY_BATCH: u32 = 1_000;

/// Runs the server until SIGTERM or Ctrl-C, then returns once the requests in flight finished.
///
/// # Errors
///
/// A [`RunError`] when start-up fails: invalid settings, an unreachable database, a failed
/// migration, an address that cannot be bound.
pub async fn run(args: Args) -> Result<(), RunError> {
    let settings = args.settings();
    let seal = args.seal_keys()?;
    let Some(url) = &args.database_url else {
        if args.completer {
            return Err(RunError::CompleterWithoutDatabase);
        }
        // This must stay the first log line of the embedded mode.
        tracing::info!(
            "no DATABASE_URL: using the embedded in-memory idempotency store and ledger \
             (everything is lost on exit, and keys are not shared between instances)"
        );
        let state = AppState::memory(&settings).map_err(RunError::Config)?;
        return serve_sealed(args.listen, state, &settings, seal).await;
    };

    let options = PgConnectOptions::from_str(url).map_err(RunError::DatabaseUrl)?;
    tracing::info!(
        database = %describe(&options),
        "using PostgreSQL for idempotency keys and the charges ledger"
    );
    // One connection first, on its own: the pool retries a failed connection until its acquire
    // timeout and then reports only that it timed out, where this reports why (refused, no such
    // database or role) at once.
    match tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options)).await {
        // Closing a connection that worked cannot be a reason not to start.
        Ok(connected) => drop(connected.map_err(RunError::Connect)?.close().await),
        Err(_) => {
            return Err(RunError::Connect(sqlx::Error::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {CONNECT_TIMEOUT:?}"),
            ))));
        }
    }
    let pool = PgPoolOptions::new()
        .max_connections(20)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(RunError::Connect)?;
    crate::migrate(&pool).await.map_err(RunError::Migrate)?;
    tracing::info!("migrations applied: idempotency._sqlx_migrations and _sqlx_migrations");
    let state = AppState::postgres(pool.clone(), &settings).map_err(RunError::Config)?;
    let served = serve_sealed(args.listen, state, &settings, seal).await;
    pool.close().await;
    served
}

/// [`serve`], the store wrapped in a [`SealingStore`](tower_idempotency::store::SealingStore)
/// when `seal` has keys.
async fn serve_sealed<L, St>(
    listen: SocketAddr,
    state: AppState<L, St>,
    settings: &Settings,
    seal: Option<SealingKeys>,
) -> Result<(), RunError>
where
    L: Ledger,
    St: Store + ExpiredDeletion + Clone,
{
    match seal {
        Some(keys) => {
            tracing::info!(
                key_id = args::SEAL_KEY_ID,
                "stored responses are sealed (AES-256-GCM)"
            );
            let state = state.sealed(keys, settings).map_err(RunError::Config)?;
            serve(listen, state, settings).await
        }
        None => serve(listen, state, settings).await,
    }
}

async fn serve<L, St>(
    listen: SocketAddr,
    state: AppState<L, St>,
    settings: &Settings,
) -> Result<(), RunError>
where
    L: Ledger,
    St: Store + ExpiredDeletion + Clone,
{
    let store = state.idempotency_store().clone();
    let (app, completing) = app_and_completer(state, settings).map_err(RunError::Config)?;
    let expiry = tokio::spawn(continuously_delete_expired(
        store,
        EXPIRY_PERIOD,
        EXPIRY_BATCH,
    ));
    // Signals are caught from here on, before anyone is told the server is up.
    let shutdown = ShutdownSignal::install().map_err(RunError::Signal)?;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| RunError::Bind {
            addr: listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(RunError::Serve)?;
    tracing::info!(
        %addr,
        processing_delay_ms = settings.processing_delay.as_millis(),
        key_ttl_secs = settings.key_ttl.as_secs(),
        lease_secs = settings.lease.as_secs(),
        in_flight_wait_ms = settings.in_flight_wait.map_or(0, |wait| wait.as_millis()),
        acquirer = settings.acquirer_url.as_deref().unwrap_or("in process"),
        "ready"
    );
    if settings.step_secret == StepSecret::default() {
        tracing::warn!(
            "no CHARGES_DEMO_STEP_SECRET: the steps' downstream keys use the development \
             secret; give every instance the same one of your own"
        );
    }
    if settings.webhook_secret.is_development() {
        // Printed on purpose: it is public, and the acquirer needs it to sign.
        tracing::warn!(
            secret = crate::webhooks::DEV_WEBHOOK_SECRET,
            "no CHARGES_DEMO_WEBHOOK_SECRET: webhooks are checked with the development secret"
        );
    }
    announce(addr).map_err(RunError::Serve)?;

    let metrics = install_metrics()?;
    let completing = completing.map(tokio::spawn);
    let served = axum::serve(listener, app.merge(metrics))
        .with_graceful_shutdown(shutdown.recv())
        .await
        .map_err(RunError::Serve);
    expiry.abort();
    if let Some(completing) = completing {
        completing.abort();
    }
    tracing::info!("stopped");
    served
}

/// Installs the process's metrics recorder and returns `GET /metrics`, the layer's counters and
/// histograms in Prometheus text format (outside authentication, as scrapers expect).
fn install_metrics() -> Result<Router, RunError> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|error| RunError::Metrics(Box::new(error)))?;
    // Histograms are drained by upkeep; the exporter's own listener would do this, ours must.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(Router::new().route("/metrics", get(move || std::future::ready(handle.render()))))
}

/// The one line on standard output.
fn announce(addr: SocketAddr) -> io::Result<()> {
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "listening on {addr}")?;
    stdout.flush()
}

/// SIGTERM or SIGINT (Ctrl-C), registered when installed.
struct ShutdownSignal {
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    #[cfg(unix)]
    fn install() -> io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    #[cfg(not(unix))]
    fn install() -> io::Result<Self> {
        Ok(Self {})
    }

    async fn recv(mut self) {
        #[cfg(unix)]
        let name = tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        };
        #[cfg(not(unix))]
        let name = match tokio::signal::ctrl_c().await {
            Ok(()) => "Ctrl-C",
            Err(_) => std::future::pending().await,
        };
        tracing::info!(
            signal = name,
            "shutting down: no new connections; waiting for requests in flight"
        );
    }
}

/// How long start-up waits for PostgreSQL to answer, and a request for a pooled connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Who connects to which database where, without the password.
fn describe(options: &PgConnectOptions) -> String {
    let user = options.get_username();
    let database = options.get_database().unwrap_or("(default database)");
    match options.get_socket() {
        Some(socket) => format!("{user}@{}/{database}", socket.display()),
        None => format!(
            "{user}@{}:{}/{database}",
            options.get_host(),
            options.get_port()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_description_has_no_password() {
        let options =
            PgConnectOptions::from_str("postgres://demo:s3cret@db.example:5433/charges").unwrap();
        let text = describe(&options);
        assert_eq!(text, "demo@db.example:5433/charges");
        assert!(!text.contains("s3cret"));
    }

    /// As with libpq: `$PGUSER`, else the user running the process (not whoami's stub name,
    /// "anonymous", which sqlx gets unless whoami's `std` feature is on).
    #[test]
    fn a_url_without_a_user_name_logs_in_as_the_operating_system_user() {
        let expected = std::env::var("PGUSER").unwrap_or_else(|_| {
            let id = std::process::Command::new("id")
                .arg("-un")
                .output()
                .expect("run `id -un`");
            String::from_utf8(id.stdout).unwrap().trim().to_owned()
        });
        let options = PgConnectOptions::from_str("postgres://localhost/charges").unwrap();
        assert_eq!(options.get_username(), expected);
    }
}
