//! Benchmark servers as child processes: the benchmark re-executes its own binary as
//! `idempotency-bench serve --app <app>`, so every server has a process — and a peak RSS — of
//! its own.
//!
//! The protocol between the two sides is small:
//! * the child binds `127.0.0.1:0`, connects its pool, and prints `listening <addr>` on stdout;
//! * the parent keeps the child's stdin open; the child exits as soon as it reads end-of-file
//!   there. So a child never outlives the benchmark, however the benchmark ends (even killed
//!   with `SIGKILL`, when its end of the pipe is closed by the kernel);
//! * a child started with `--reaper-batch` starts its expiry loop when it reads a `reap` line,
//!   and reports on stdout (`drained <json>`, and `reaper <json>` as it exits; see
//!   [`reaper`]);
//! * besides, [`ServerProcess`] kills the child when dropped (an error, a panic, Ctrl-C).

use std::{
    net::{Ipv4Addr, SocketAddr},
    process::Stdio,
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use axum::serve::ListenerExt;
use sqlx::postgres::PgConnectOptions;
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::TcpListener,
    process::{Child, ChildStdin, Command},
    sync::{Notify, mpsc},
};
use tower_idempotency::store::continuously_delete_expired;

use crate::{
    BoxError,
    app::{self, App},
    cli::ServeArgs,
    db::{self, BenchDb},
    procfs,
    reaper::{self, ReaperStats, TimedReaper},
};

const READY: &str = "listening";

/// How long a server may take to start (connecting its pool included).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a server may take to exit once told to.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The command that starts a child's expiry loop.
pub(crate) const REAP: &str = "reap";

/// The child side: `idempotency-bench serve`.
pub(crate) async fn serve(args: ServeArgs) -> Result<(), BoxError> {
    let reap = Arc::new(Notify::new());
    let stats = args.reaper_batch.map(ReaperStats::new);
    // Exit when the parent closes our stdin, or dies; start the expiry loop when told to.
    tokio::spawn({
        let reap = Arc::clone(&reap);
        let stats = stats.clone();
        async move {
            let mut lines = BufReader::new(tokio::io::stdin()).lines();
            loop {
                match lines.next_line().await {
                    Ok(Some(line)) if line.trim() == REAP => reap.notify_one(),
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => {
                        if let Some(stats) = &stats {
                            ReaperStats::print(reaper::FINAL, &stats.report());
                        }
                        std::process::exit(0)
                    }
                }
            }
        }
    });

    let pool = if args.app.uses_database() {
        let url = std::env::var("DATABASE_URL")
            .map_err(|_| "serve: DATABASE_URL is not set (the benchmark sets it)")?;
        let database = args
            .database
            .as_deref()
            .ok_or("serve: --database is required for this app")?;
        let options = PgConnectOptions::from_str(&url)?.database(database);
        let size = u32::try_from(args.pool_size.get()).unwrap_or(u32::MAX);
        Some(db::connect_pool(options, size, !args.no_pool_checks).await?)
    } else {
        None
    };
    if let (Some(stats), Some(store)) = (stats, pool.as_ref().and_then(|pool| args.app.store(pool)))
    {
        let period = Duration::from_millis(args.reaper_period_ms.max(1));
        tokio::spawn(async move {
            reap.notified().await;
            stats.start();
            let batch = args.reaper_batch.unwrap_or(1_000);
            let store = TimedReaper {
                inner: store,
                stats,
            };
            continuously_delete_expired(store, period, batch).await;
        });
    }
    let router = app::router(args.app, pool);

    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    let mut stdout = tokio::io::stdout();
    stdout
        .write_all(format!("{READY} {addr}\n").as_bytes())
        .await?;
    stdout.flush().await?;

    let listener = listener.tap_io(|tcp| {
        // Small responses on keep-alive connections: never wait for Nagle.
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router).await?;
    Ok(())
}

/// The parent side: a running server process.
#[derive(Debug)]
pub(crate) struct ServerProcess {
    child: Child,
    pid: u32,
    addr: SocketAddr,
    /// Held open for the child's lifetime: closing it tells the child to exit.
    stdin: Option<ChildStdin>,
    /// What the child prints after `listening`, line by line, until it exits. The task
    /// reading it keeps the pipe open, so the child never writes into a closed pipe.
    lines: mpsc::UnboundedReceiver<String>,
}

/// Options of a server process beyond its app.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ServeOptions {
    /// Arms the expiry loop with this batch size (started by [`ServerProcess::command`]
    /// with [`REAP`]).
    pub(crate) reaper_batch: Option<u32>,
    /// The server's pool skips sqlx's check before each checkout.
    pub(crate) no_pool_checks: bool,
}

impl ServerProcess {
    /// Starts `app` (on `db` if it uses the database) and waits until it listens.
    pub(crate) async fn start(
        app: App,
        db: &BenchDb,
        pool_size: usize,
        options: ServeOptions,
    ) -> Result<Self, BoxError> {
        let mut command = Command::new(std::env::current_exe()?);
        command
            .args(["serve", "--app", app.as_arg(), "--pool-size"])
            .arg(pool_size.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        if options.no_pool_checks {
            command.arg("--no-pool-checks");
        }
        if let Some(batch) = options.reaper_batch {
            command.arg("--reaper-batch").arg(batch.to_string());
        }
        if app.uses_database() {
            command
                .args(["--database", db.name()])
                .env("DATABASE_URL", db.server_url());
        }
        let mut child = command.spawn()?;
        let pid = child.id().ok_or("server exited at once")?;
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().ok_or("no stdout pipe")?);

        let mut line = String::new();
        let read = tokio::time::timeout(START_TIMEOUT, stdout.read_line(&mut line)).await;
        let addr = match read {
            Ok(Ok(n)) if n > 0 => line
                .trim()
                .strip_prefix(READY)
                .and_then(|addr| addr.trim().parse::<SocketAddr>().ok())
                .ok_or_else(|| format!("server {} said {line:?}", app.as_arg()))?,
            Ok(Ok(_)) => {
                let status = child.wait().await?;
                return Err(
                    format!("server {} exited before listening: {status}", app.as_arg()).into(),
                );
            }
            Ok(Err(error)) => return Err(error.into()),
            Err(_) => {
                return Err(format!(
                    "server {} did not listen within {START_TIMEOUT:?}",
                    app.as_arg()
                )
                .into());
            }
        };
        let (sender, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut stdout = stdout.lines();
            while let Ok(Some(line)) = stdout.next_line().await {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            pid,
            addr,
            stdin,
            lines,
        })
    }

    /// Writes `line` on the child's stdin.
    pub(crate) async fn command(&mut self, line: &str) -> Result<(), BoxError> {
        let stdin = self.stdin.as_mut().ok_or("the server is stopping")?;
        stdin.write_all(format!("{line}\n").as_bytes()).await?;
        stdin.flush().await?;
        Ok(())
    }

    /// The next line the child prints that starts with `prefix` (the rest of it), waiting
    /// until `deadline`; `None` at the deadline or if the child is gone.
    pub(crate) async fn line_starting(
        &mut self,
        prefix: &str,
        deadline: tokio::time::Instant,
    ) -> Option<String> {
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.recv())
                .await
                .ok()??;
            if let Some(rest) = line.strip_prefix(prefix) {
                return Some(rest.trim().to_owned());
            }
        }
    }

    /// The address it listens on.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its process id.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Its peak resident set size so far, in bytes.
    pub(crate) fn peak_rss(&self) -> std::io::Result<u64> {
        procfs::peak_rss(self.pid)
    }

    /// Tells it to exit, and kills it if it has not within a few seconds; returns what it
    /// printed since the last line read.
    pub(crate) async fn stop(mut self) -> Result<Vec<String>, BoxError> {
        drop(self.stdin.take());
        match tokio::time::timeout(STOP_TIMEOUT, self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => {
                self.child.kill().await?;
            }
        }
        let mut printed = Vec::new();
        let deadline = tokio::time::Instant::now() + STOP_TIMEOUT;
        while let Ok(Some(line)) = tokio::time::timeout_at(deadline, self.lines.recv()).await {
            printed.push(line);
        }
        Ok(printed)
    }
}
