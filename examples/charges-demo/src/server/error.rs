//! Why the server could not start, said with what to do about it.

use std::{fmt, io, net::SocketAddr};

use tower_idempotency::ConfigError;

/// Why the server could not start or keep serving.
#[derive(Debug)]
#[non_exhaustive]
pub enum RunError {
    /// The TTL or lease is invalid.
    Config(ConfigError),
    /// `--seal-key` is not 32 bytes in base64.
    SealKey,
    /// `--completer` without `--database-url`.
    CompleterWithoutDatabase,
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
            Self::CompleterWithoutDatabase => f.write_str(
                "--completer needs --database-url: in memory, a crashed server's charges are \
                 gone with it, and there is nothing left to complete",
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
            Self::SealKey | Self::CompleterWithoutDatabase => None,
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
