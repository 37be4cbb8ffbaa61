//! The child side: `chaos serve [charges-demo options]`, one demo instance.
//!
//! The chaos run re-executes its own binary with this hidden subcommand for each instance, so
//! there is no second binary to build or find. The instance serves the demo's router
//! ([`charges_demo::app`]) on the state [`AppState::postgres`] makes (the layer in
//! transactional mode) and on a pool sized as [`charges_demo::server::run`] sizes it, which
//! sets the layer's limit of detached handlers; plus, for the charges marked so, the handler of
//! [`catch`] under the same layer. Each end of a duplicate's wait for its key is logged
//! ([`waits`](crate::waits)). It prints `listening on ADDR` on standard
//! output and logs to standard error, as the demo does.
//!
//! It exits as soon as its standard input closes: the parent keeps the write end open, so an
//! instance never outlives the run, however the run ends (even killed with `SIGKILL`, when the
//! kernel closes the pipe).
//!
//! `--inject-bug` (hidden, for the run's self-check only) builds the demo from the same library
//! parts but wired wrongly, to show that the run catches a real exactly-once bug; see [`Bug`].

use std::{
    io::{self, Write},
    process::ExitCode,
    str::FromStr,
    time::Duration,
};

use charges_demo::{
    AppState, app,
    auth::Account,
    completer, idempotency_layer,
    ledger::{
        Balance, Charge, ChargePage, Ledger, Page, PostgresLedger, PostgresLedgerError, Refund,
        RefundRefusal, Settlement,
    },
    params::RefundParams,
    processor::CardProcessor,
    server::{self, ErrorChain},
    webhooks::Inbox,
};
use clap::{Parser, ValueEnum};
use sqlx::{
    PgConnection,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tokio::{io::AsyncReadExt, net::TcpListener};
use tower_idempotency::store::{PostgresStore, continuously_delete_expired};
use tracing_subscriber::EnvFilter;

use crate::{BoxError, Mode, catch};

/// The demo's pool (`server::run`): its size bounds the layer's detached handlers (half of it).
const POOL_SIZE: u32 = 20;
/// How long a request waits for a pooled connection (`server::run`).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// The demo's expiry loop (`server::run`).
const EXPIRY_PERIOD: Duration = Duration::from_secs(60);
const EXPIRY_BATCH: u32 = 1_000;

/// `chaos serve`: the demo's own options, plus the self-check's bug.
#[derive(Debug, Parser)]
#[command(
    name = "chaos serve",
    about = "One charges-demo instance of a chaos run (internal)"
)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    demo: server::Args,

    /// How the instance makes a charge exactly once.
    #[arg(long, value_enum, default_value_t = Mode::Transactional)]
    mode: Mode,

    /// Run the demo with a deliberate exactly-once bug (the chaos run's self-check).
    #[arg(long, value_enum)]
    inject_bug: Option<Bug>,
}

/// A deliberate bug for the self-check (`chaos --inject-bug ...`). Each is a real integration
/// mistake, built from the demo's public parts, that loses exactly-once under crashes.
///
/// In both, the handler records the charge *first* and then takes its processing time (as a
/// handler does that writes a pending charge and then calls the card network); the latency is
/// the same as the demo's. This only widens the window between the charge's write and the
/// stored response, so that the run's kills land in it often: with the demo's order (write
/// last) the window is about a millisecond and catching the bug takes many more kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Bug {
    /// Transactional claims, but the handler writes its charge on the pool, outside the
    /// request's `IdempotentTx`: a kill after that autocommit and before the claim commits
    /// leaves a charge whose key is free again, and the retry charges a second time.
    WritesOutsideTx,
    /// Lease mode (a 2 s lease) over the same handler: the charge commits on its own, the
    /// response is stored afterwards; a kill between the two, and the takeover after the lease
    /// lapses charges again.
    LeaseMode,
    /// Steps mode without the completer: a charge whose instance was killed mid-way and whose
    /// client went away leaves its authorization at the network without a charge.
    NoCompleter,
}

impl Bug {
    /// The mode whose wiring this bug breaks.
    pub(crate) fn mode(self) -> Mode {
        match self {
            Self::WritesOutsideTx | Self::LeaseMode => Mode::Transactional,
            Self::NoCompleter => Mode::Steps,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::WritesOutsideTx => "writes-outside-tx",
            Self::LeaseMode => "lease-mode",
            Self::NoCompleter => "no-completer",
        }
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::WritesOutsideTx => {
                "transactional claims, but charges written outside the request's transaction"
            }
            Self::LeaseMode => "lease mode (2 s lease): charges and stored responses commit apart",
            Self::NoCompleter => "steps mode without the completer: abandoned charges left mid-way",
        }
    }
}

pub(crate) fn main(args: ServeArgs) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn")),
        )
        .with_writer(io::stderr)
        .with_ansi(false)
        .init();
    crate::waits::install();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    let served = runtime.block_on(async {
        tokio::spawn(exit_when_stdin_closes());
        if let Some(bug) = args.inject_bug {
            tracing::warn!(bug = bug.name(), "SELF-CHECK: {}", bug.describe());
        }
        let served = match args.mode {
            Mode::Steps => serve_steps(args.demo, args.inject_bug).await,
            Mode::Transactional => serve(args.demo, args.inject_bug).await,
        };
        served.map_err(|error| ErrorChain(&*error).to_string())
    });
    // Exit at once: dropping the runtime would wait for the blocking read of standard input.
    match served {
        Ok(()) => std::process::exit(0),
        Err(error) => {
            tracing::error!("{error}");
            std::process::exit(1)
        }
    }
}

/// Exits the process once its standard input closes (see the module documentation).
pub(crate) async fn exit_when_stdin_closes() {
    let mut stdin = tokio::io::stdin();
    let mut buffer = [0_u8; 64];
    loop {
        match stdin.read(&mut buffer).await {
            Ok(0) | Err(_) => std::process::exit(0),
            Ok(_) => {}
        }
    }
}

/// The demo on PostgreSQL, with the catching handler; with `bug`, wired wrongly on purpose. As
/// [`server::run`] otherwise, without its graceful shutdown (the run closes standard input) or
/// metrics.
async fn serve(args: server::Args, bug: Option<Bug>) -> Result<(), BoxError> {
    let settings = args.settings();
    // With writes outside the transaction each charge needs two connections at once, and a pool
    // the size of the concurrency would deadlock until its acquire timeout, hiding the bug
    // behind timeouts.
    let pool_size = if bug.is_some() { 64 } else { POOL_SIZE };
    let pool = connect(&args, pool_size).await?;
    let store = match bug {
        Some(Bug::LeaseMode) => PostgresStore::new(pool.clone()),
        _ => PostgresStore::new(pool.clone()).transactional(),
    };
    // What `AppState::postgres` builds, keeping the layer for the catching handler.
    let layer = idempotency_layer(store.clone(), &settings)?;
    // The webhooks' inbox as `AppState::postgres` keeps it: settlements commit with their record.
    let inbox = Inbox::postgres(pool.clone(), &settings.webhook_secret);
    let demo = match bug {
        None => app(AppState::new(
            PostgresLedger::new(pool.clone()),
            layer.clone(),
            CardProcessor::new(settings.processing_delay),
        )
        .with_inbox(inbox)),
        Some(_) => app(AppState::new(
            WriteFirst {
                ledger: PostgresLedger::new(pool.clone()),
                then: settings.processing_delay,
            },
            layer.clone(),
            CardProcessor::new(Duration::ZERO),
        )
        .with_inbox(inbox)),
    };
    let router = catch::route(demo, layer);
    tokio::spawn(continuously_delete_expired(
        store,
        EXPIRY_PERIOD,
        EXPIRY_BATCH,
    ));
    listen_and_serve(args.listen, router).await
}

/// The demo as [`server::run`] serves it on PostgreSQL: lease mode with steps, the acquirer at
/// `--acquirer-url`, and the completer on (off with [`Bug::NoCompleter`]).
async fn serve_steps(args: server::Args, bug: Option<Bug>) -> Result<(), BoxError> {
    let mut settings = args.settings();
    if bug == Some(Bug::NoCompleter) {
        settings.completer_grace = None;
    }
    let pool = connect(&args, POOL_SIZE).await?;
    let state = AppState::postgres(pool.clone(), &settings)?;
    let store = state.idempotency_store().clone();
    let (demo, completing) = completer::app_and_completer(state, &settings)?;
    if let Some(completing) = completing {
        tokio::spawn(completing);
    }
    tokio::spawn(continuously_delete_expired(
        store,
        EXPIRY_PERIOD,
        EXPIRY_BATCH,
    ));
    listen_and_serve(args.listen, demo).await
}

/// The instance's pool of `size` connections (`server::run`'s is [`POOL_SIZE`]), the
/// migrations applied.
async fn connect(args: &server::Args, size: u32) -> Result<sqlx::PgPool, BoxError> {
    let url = args
        .database_url
        .as_deref()
        .ok_or("chaos serve needs --database-url")?;
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(PgConnectOptions::from_str(url)?)
        .await?;
    charges_demo::migrate(&pool).await?;
    Ok(pool)
}

/// Binds, prints `listening on ADDR` and serves.
pub(crate) async fn listen_and_serve(
    listen: std::net::SocketAddr,
    router: axum::Router,
) -> Result<(), BoxError> {
    let listener = TcpListener::bind(listen).await?;
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "listening on {}", listener.local_addr()?)?;
    stdout.flush()?;
    drop(stdout);
    axum::serve(listener, router).await?;
    Ok(())
}

/// A ledger that writes on the pool, ignoring the request's transaction, and then takes the
/// processing time: the [`Bug`]s' handler. Refunds are written as the demo writes them.
#[derive(Debug, Clone)]
struct WriteFirst {
    ledger: PostgresLedger,
    then: Duration,
}

impl Ledger for WriteFirst {
    type Error = PostgresLedgerError;

    async fn insert(
        &self,
        charge: &Charge,
        _transaction: Option<&mut PgConnection>,
    ) -> Result<(), PostgresLedgerError> {
        self.ledger.insert(charge, None).await?;
        tokio::time::sleep(self.then).await;
        Ok(())
    }

    async fn retrieve(
        &self,
        account: &Account,
        id: &str,
    ) -> Result<Option<Charge>, PostgresLedgerError> {
        self.ledger.retrieve(account, id).await
    }

    async fn list(
        &self,
        account: &Account,
        limit: usize,
        starting_after: Option<&str>,
    ) -> Result<ChargePage, PostgresLedgerError> {
        self.ledger.list(account, limit, starting_after).await
    }

    async fn refund(
        &self,
        account: &Account,
        params: &RefundParams,
        transaction: Option<&mut PgConnection>,
    ) -> Result<Result<Refund, RefundRefusal>, PostgresLedgerError> {
        self.ledger.refund(account, params, transaction).await
    }

    async fn retrieve_refund(
        &self,
        account: &Account,
        id: &str,
    ) -> Result<Option<Refund>, PostgresLedgerError> {
        self.ledger.retrieve_refund(account, id).await
    }

    async fn settle(
        &self,
        id: &str,
        transaction: Option<&mut PgConnection>,
    ) -> Result<Settlement, PostgresLedgerError> {
        self.ledger.settle(id, transaction).await
    }

    async fn balance(&self, account: &Account) -> Result<Balance, PostgresLedgerError> {
        self.ledger.balance(account).await
    }

    async fn list_refunds(
        &self,
        account: &Account,
        limit: usize,
        starting_after: Option<&str>,
    ) -> Result<Page<Refund>, PostgresLedgerError> {
        self.ledger
            .list_refunds(account, limit, starting_after)
            .await
    }
}
