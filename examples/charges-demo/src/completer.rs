//! `--completer`: a charge whose server crashed between the authorization and the ledger write,
//! and whose client never retried, is finished by the servers themselves, as the client's retry
//! would finish it: the recorded authorization is taken back, the ledger written once.
//!
//! ```no_run
//! use std::time::Duration;
//! use charges_demo::{AppState, Settings, completer};
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let settings = Settings {
//!     completer_grace: Some(Duration::from_secs(60)),
//!     ..Settings::default()
//! };
//! let state = AppState::postgres(pool, &settings)?;
//! let (app, completing) = completer::app_and_completer(state, &settings)?;
//! if let Some(completing) = completing {
//!     tokio::spawn(completing);
//! }
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```
//!
//! The layer keeps each charge's request with its claim; the request the completer sends
//! carries the kept principal, and [`restore_account`] puts back the [`Account`] that the
//! authentication would have. Only on PostgreSQL: the memory store keeps no requests.

use std::time::Duration;

use axum::Router;
use http::Extensions;
use tower_idempotency::{Completer, ConfigError, Principal, store::Store};

use crate::{AppState, Routers, Settings, auth::Account, ledger::Ledger};

/// How many abandoned charges one server drives at a time.
const CONCURRENCY: u32 = 8;

/// How many times a charge is tried before it is left to its client.
const MAX_ATTEMPTS: u32 = 5;

/// The app, and with [`Settings::completer_grace`] the loop of the completer of its abandoned
/// charges (spawn it), which looks every [`period`] of the grace.
///
/// # Errors
///
/// [`ConfigError::CompletionUnsupported`] when the completer is on and the store keeps no
/// requests (the memory store).
pub fn app_and_completer<L, St>(
    state: AppState<L, St>,
    settings: &Settings,
) -> Result<(Router, Option<impl Future<Output = ()> + Send + 'static>), ConfigError>
where
    L: Ledger,
    St: Store + Clone,
{
    let store = state.idempotency_store().clone();
    let Routers { app, completing } = Routers::new(state);
    let Some(grace) = settings.completer_grace else {
        return Ok((app, None));
    };
    let completer = Completer::new(&store, completing)?
        .with_grace(grace)?
        .with_concurrency(CONCURRENCY)?
        .with_max_attempts(MAX_ATTEMPTS)?
        .with_extensions(restore_account);
    tracing::info!(grace_secs = grace.as_secs(), "completing abandoned charges");
    Ok((app, Some(completer.run(period(grace)))))
}

/// How often the completer looks for abandoned charges: four times per grace, at least every
/// second and at most every 30 seconds.
pub fn period(grace: Duration) -> Duration {
    (grace / 4).clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// Puts back what [`authenticate`](crate::auth::authenticate) puts in a request besides the
/// principal: the [`Account`] the handlers read (the principal is its id).
pub fn restore_account(principal: &Principal, extensions: &mut Extensions) {
    extensions.insert(Account::from_id(principal.as_str()));
}
