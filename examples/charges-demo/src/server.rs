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
//! | `--seal-key BASE64` | `CHARGES_DEMO_SEAL_KEY` | none: stored responses in clear; with 32 bytes in base64, sealed ([`SealingStore`](tower_idempotency::store::SealingStore), key id 1) |
//!
//! Without `--acquirer-url`, the in-process acquirer's own idempotency layer reports to the same
//! `/metrics`, so each charge counts twice there.
//!
//! When it is ready the server prints exactly one line to standard output, `listening on ADDR`
//! with the address it bound (so `--listen 127.0.0.1:0` tells which port it got); logs go to
//! standard error. SIGTERM or Ctrl-C stops accepting connections, lets the requests in flight
//! finish, and exits 0.

use std::{
    fmt,
    io::{self, Write},
    net::SocketAddr,
    str::FromStr,
    time::Duration,
};

use axum::{Router, routing::get};
use base64::{Engine, engine::general_purpose::STANDARD};
use clap::Parser;
use metrics_exporter_prometheus::PrometheusBuilder;
use sqlx::{
    Connection,
    postgres::{PgConnectOptions, PgConnection, PgPoolOptions},
};
use tokio::net::TcpListener;
use tower_idempotency::{
    ConfigError,
    store::{ExpiredDeletion, SealingKeys, Store, continuously_delete_expired},
};

use crate::{AppState, Settings, StepSecret, app, ledger::Ledger, webhooks::WebhookSecret};

/// How often expired idempotency records are deleted, and how many per batch.
const EXPIRY_PERIOD: Duration = Duration::from_secs(60);
const EXPIRY_BATCH: u32 = 1_000;

/// The command line; see the [module documentation](self).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "charges-demo",
    version,
    about = "A Stripe-style payments API whose POST /v1/charges runs once per Idempotency-Key"
)]
pub struct Args {
    /// The address to listen on (port 0: any free port; the bound address is printed).
    #[arg(
        long,
        env = "LISTEN_ADDR",
        default_value = "127.0.0.1:3000",
        value_name = "ADDR"
    )]
    pub listen: SocketAddr,

    /// PostgreSQL for idempotency keys and charges; without it, both live in memory.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: Option<String>,

    /// Simulated card-processor latency of every charge, in milliseconds.
    #[arg(
        long,
        env = "CHARGE_PROCESSING_DELAY_MS",
        default_value_t = 0,
        value_name = "N"
    )]
    pub processing_delay_ms: u64,

    /// How long an idempotency key and its stored response live, in seconds.
    #[arg(
        long,
        env = "IDEMPOTENCY_KEY_TTL_SECS",
        default_value_t = 86_400,
        value_name = "N",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub key_ttl_secs: u64,

    /// How long a key is held without renewal before a retry may take it over, in seconds.
    #[arg(
        long,
        env = "IDEMPOTENCY_LEASE_SECS",
        default_value_t = 30,
        value_name = "N",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub lease_secs: u64,

    /// How long a duplicate of a charge still being processed waits for its answer instead of
    /// getting `409` at once, in milliseconds (0: answer `409`, the IETF draft's behaviour).
    #[arg(
        long,
        env = "IDEMPOTENCY_IN_FLIGHT_WAIT_MS",
        default_value_t = 0,
        value_name = "N"
    )]
    pub in_flight_wait_ms: u64,

    /// Seals stored responses with this AES-256 key (32 bytes, base64); without it, they are
    /// stored in clear.
    #[arg(
        long,
        env = "CHARGES_DEMO_SEAL_KEY",
        hide_env_values = true,
        value_name = "BASE64"
    )]
    pub seal_key: Option<String>,

    /// The card network to authorize charges at (`http://host:port`, an `acquirer`); without
    /// it, an acquirer in this process.
    #[arg(long, env = "CHARGES_DEMO_ACQUIRER_URL", value_name = "URL")]
    pub acquirer_url: Option<String>,

    /// The secret the steps' downstream keys are derived from (at least 32 bytes), the same on
    /// every instance and across restarts; without it, a development secret.
    #[arg(
        long,
        env = "CHARGES_DEMO_STEP_SECRET",
        hide_env_values = true,
        value_name = "SECRET"
    )]
    pub step_secret: Option<String>,

    /// The secret the acquirer signs its webhooks with (`whsec_` and base64, as Standard
    /// Webhooks writes it); without it, a development secret, printed at start-up.
    #[arg(long, env = "CHARGES_DEMO_WEBHOOK_SECRET", hide_env_values = true,
          value_name = "WHSEC", value_parser = WebhookSecret::parse)]
    pub webhook_secret: Option<WebhookSecret>,
    // `--completer` (driving claims abandoned mid-way) is wired here when it lands.
}

/// The key id of `--seal-key`: the demo has one key; an app that rotates numbers its keys.
const SEAL_KEY_ID: u32 = 1;

impl Args {
    /// The sealing keys of `--seal-key`, if given. The key itself is never echoed.
    ///
    /// # Errors
    ///
    /// [`RunError::SealKey`] unless it is 32 bytes in standard base64.
    pub fn seal_keys(&self) -> Result<Option<SealingKeys>, RunError> {
        let Some(encoded) = &self.seal_key else {
            return Ok(None);
        };
        let key = STANDARD
            .decode(encoded.trim())
            .ok()
            .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
            .ok_or(RunError::SealKey)?;
        Ok(Some(SealingKeys::new(SEAL_KEY_ID, key)))
    }

    /// The [`Settings`] these options give.
    pub fn settings(&self) -> Settings {
        Settings {
            key_ttl: Duration::from_secs(self.key_ttl_secs),
            lease: Duration::from_secs(self.lease_secs),
            processing_delay: Duration::from_millis(self.processing_delay_ms),
            // The flag's 0 is "no waiting"; the layer itself takes no zero wait.
            in_flight_wait: (self.in_flight_wait_ms > 0)
                .then(|| Duration::from_millis(self.in_flight_wait_ms)),
            acquirer_url: self.acquirer_url.clone(),
            step_secret: self
                .step_secret
                .as_ref()
                .map_or_else(StepSecret::default, |secret| {
                    StepSecret(secret.as_bytes().to_vec())
                }),
            webhook_secret: self.webhook_secret.clone().unwrap_or_default(),
        }
    }
}

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
                key_id = SEAL_KEY_ID,
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
    St: ExpiredDeletion + Clone,
{
    let expiry = tokio::spawn(continuously_delete_expired(
        state.idempotency_store().clone(),
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
    let served = axum::serve(listener, app(state).merge(metrics))
        .with_graceful_shutdown(shutdown.recv())
        .await
        .map_err(RunError::Serve);
    expiry.abort();
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

/// Why the server could not start or keep serving.
#[derive(Debug)]
#[non_exhaustive]
pub enum RunError {
    /// The TTL or lease is invalid.
    Config(ConfigError),
    /// `--seal-key` is not 32 bytes in base64.
    SealKey,
    /// `DATABASE_URL` is not a PostgreSQL URL.
    DatabaseUrl(sqlx::Error),
    /// PostgreSQL could not be reached.
    Connect(sqlx::Error),
    /// Applying the migrations failed.
    Migrate(Box<dyn std::error::Error + Send + Sync>),
    /// The metrics recorder could not be installed.
    Metrics(Box<dyn std::error::Error + Send + Sync>),
    /// The signal handlers could not be installed.
    Signal(io::Error),
    /// The listen address could not be bound.
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// Serving failed.
    Serve(io::Error),
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(_) => f.write_str("invalid settings"),
            Self::SealKey => f.write_str(
                "--seal-key (CHARGES_DEMO_SEAL_KEY) must be 32 bytes in standard base64, such as \
                 the output of `openssl rand -base64 32`",
            ),
            Self::DatabaseUrl(_) => f.write_str("DATABASE_URL is not a valid PostgreSQL URL"),
            Self::Connect(error) => {
                f.write_str("cannot connect to PostgreSQL")?;
                if let Some(hint) = connect_hint(error) {
                    write!(f, " ({hint})")?;
                }
                // PostgreSQL's own words, without the source line of the server's C code that
                // sqlx appends ("at line 948"), which reads as if it were a line of the user's.
                match error.as_database_error() {
                    Some(refusal) => write!(f, ": {}", refusal.message()),
                    None => Ok(()),
                }
            }
            Self::Migrate(_) => f.write_str("applying the database migrations failed"),
            Self::Metrics(_) => f.write_str("installing the metrics recorder failed"),
            Self::Signal(_) => f.write_str("cannot install the shutdown signal handlers"),
            Self::Bind { addr, .. } => write!(f, "cannot listen on {addr}"),
            Self::Serve(_) => f.write_str("serving failed"),
        }
    }
}

impl std::error::Error for RunError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Config(error) => Some(error),
            Self::SealKey => None,
            // A refusal from PostgreSQL is in this error's own message (see `Display`).
            Self::Connect(error) if error.as_database_error().is_some() => None,
            Self::DatabaseUrl(error) | Self::Connect(error) => Some(error),
            Self::Migrate(error) | Self::Metrics(error) => Some(error.as_ref()),
            Self::Signal(error) | Self::Serve(error) | Self::Bind { source: error, .. } => {
                Some(error)
            }
        }
    }
}

/// What to do about the failures a first run against a fresh PostgreSQL meets.
fn connect_hint(error: &sqlx::Error) -> Option<&'static str> {
    match error {
        sqlx::Error::Io(io)
            if matches!(
                io.kind(),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::TimedOut
            ) =>
        {
            Some("nothing answers at that address: is PostgreSQL running there?")
        }
        sqlx::Error::PoolTimedOut => Some(
            "no connection within the pool's acquire timeout: is PostgreSQL running at that \
             address?",
        ),
        sqlx::Error::Database(refusal) => match refusal.code()?.as_ref() {
            // invalid_catalog_name
            "3D000" => {
                Some("the database does not exist: create it first, e.g. `createdb charges`")
            }
            // invalid_authorization_specification: no role of that name
            "28000" => Some(
                "PostgreSQL has no role of that name (a URL without a user name logs in as \
                 $PGUSER, else as you): put an existing one in the URL \
                 (`postgres://USER@localhost/charges`) or create yours with \
                 `sudo -u postgres createuser --superuser $USER`",
            ),
            _ => None,
        },
        _ => None,
    }
}

/// Displays an error with its sources, `outer: inner: innermost`, each message once (sqlx's
/// errors repeat their source's message in their own).
#[derive(Debug, Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut messages: Vec<String> = std::iter::successors(Some(self.0), |error| error.source())
            .map(ToString::to_string)
            .collect();
        messages.dedup_by(|inner, outer| outer.ends_with(inner.as_str()));
        f.write_str(&messages.join(": "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("charges-demo").chain(args.iter().copied()))
    }

    #[test]
    fn flags_parse_into_settings() {
        let args = parse(&[
            "--listen",
            "127.0.0.1:0",
            "--processing-delay-ms",
            "1500",
            "--key-ttl-secs",
            "600",
            "--lease-secs",
            "10",
            "--in-flight-wait-ms",
            "2500",
        ])
        .unwrap();
        assert_eq!(args.listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(
            args.settings(),
            Settings {
                key_ttl: Duration::from_secs(600),
                lease: Duration::from_secs(10),
                processing_delay: Duration::from_millis(1500),
                in_flight_wait: Some(Duration::from_millis(2500)),
                ..Settings::default()
            }
        );
        assert!(parse(&["--lease-secs", "0"]).is_err());
        assert_eq!(args.seal_keys().unwrap().map(|k| k.sealing_key_id()), None);
        let sealed = parse(&["--seal-key", &"A".repeat(43)]).unwrap();
        assert!(
            sealed.seal_keys().is_err(),
            "43 characters are not 32 bytes"
        );
        let sealed = parse(&["--seal-key", &format!("{}=", "A".repeat(43))]).unwrap();
        assert_eq!(
            sealed.seal_keys().unwrap().map(|k| k.sealing_key_id()),
            Some(1)
        );
        assert!(parse(&["--listen", "not an address"]).is_err());
    }

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
