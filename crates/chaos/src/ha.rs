//! The database of a `--failover` run: two Patroni-managed PostgreSQL nodes behind HAProxy,
//! made, killed, rejoined and removed by `scripts/ha-cluster.sh`, so that the run, the test of
//! the script and a person at a shell share one definition of the cluster.
//!
//! The cluster lives in `ha/` of the run's directory, on a free block of loopback ports the
//! script chooses; the instances and the run reach it through HAProxy's endpoint only. What the
//! script says goes to `ha-cluster.log` beside it. A watchdog shell tears it down (by PID, as
//! the script does) if this program is killed with `SIGKILL`.

use std::{
    fs::{File, OpenOptions},
    io::Write,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    str::FromStr,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use clap::ValueEnum;
use sqlx::{Connection, PgConnection, postgres::PgConnectOptions};

use crate::{BoxError, watchdog::Watchdog};

/// The script, from this crate's directory (the run is a development tool built in its tree).
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/ha-cluster.sh");
/// The bound the script puts on each of its waits (a rejoin with `pg_rewind` included).
const SCRIPT_TIMEOUT_SECS: &str = "120";
/// How often, and how long at most, the endpoint is probed for a write after a kill.
const PROBE_EVERY: Duration = Duration::from_millis(100);
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// `--replication`: how the primary's commits reach the standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Replication {
    /// Patroni's `synchronous_mode` with `synchronous_commit = on`: a commit is acknowledged
    /// once the standby has it.
    Sync,
    /// Asynchronous: a commit is acknowledged once the primary has it; a failover may lose it.
    Async,
}

impl Replication {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::Async => "async",
        }
    }
}

/// How a primary is killed (`kill-primary --postmaster|--node`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kill {
    /// `SIGKILL` of the postmaster only: Patroni stays, sees it gone, and hands over at once.
    Postmaster,
    /// `SIGKILL` of Patroni, the postmaster and its backends: the leader key lapses (its TTL).
    Node,
}

impl Kill {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Postmaster => "postmaster",
            Self::Node => "node",
        }
    }

    pub(crate) fn other(self) -> Self {
        match self {
            Self::Postmaster => Self::Node,
            Self::Node => Self::Postmaster,
        }
    }
}

/// A running cluster; see the [module documentation](self).
#[derive(Debug)]
pub(crate) struct HaCluster {
    dir: PathBuf,
    url: String,
    replication: Replication,
    watchdog: Option<Watchdog>,
    removed: bool,
}

impl HaCluster {
    /// Starts a cluster in `dir` (which must not exist) and waits until it is writable and
    /// replicating. Blocking. `outer` is removed with it by the watchdog.
    pub(crate) fn up(
        dir: PathBuf,
        outer: &Path,
        replication: Replication,
    ) -> Result<Self, BoxError> {
        if !Path::new(SCRIPT).is_file() {
            return Err(format!("{SCRIPT} is missing: the run needs its source tree").into());
        }
        let mut cluster = Self {
            dir,
            url: String::new(),
            replication,
            watchdog: None,
            removed: false,
        };
        cluster.watchdog = Some(cluster.spawn_watchdog(outer)?);
        let printed = cluster.script(&["up", "--replication", replication.name()])?;
        cluster.url = printed
            .lines()
            .rev()
            .find(|line| line.starts_with("postgres://"))
            .ok_or_else(|| format!("ha-cluster.sh up printed no endpoint: {printed:?}"))?
            .to_owned();
        Ok(cluster)
    }

    /// The endpoint (HAProxy's read-write port), as a URL with a query string.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    pub(crate) fn replication(&self) -> Replication {
        self.replication
    }

    /// Where to connect, for this process.
    pub(crate) fn connect_options(&self) -> Result<PgConnectOptions, sqlx::Error> {
        PgConnectOptions::from_str(&self.url)
    }

    /// The server's major version, from the first node's data directory.
    pub(crate) fn version(&self) -> String {
        std::fs::read_to_string(self.dir.join("node1/data/PG_VERSION"))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|_| "?".to_owned())
    }

    /// Kills the primary (after stopping its walsenders for `lag`, if not zero); the name of
    /// the node killed, and when its processes were sent `SIGKILL`.
    pub(crate) async fn kill_primary(
        &self,
        kill: Kill,
        lag: Duration,
    ) -> Result<(String, SystemTime), BoxError> {
        let what = format!("--{}", kill.name());
        let lag = lag.as_millis().to_string();
        let printed = self
            .script_async(&["kill-primary", &what, "--lag-ms", &lag])
            .await?;
        let (node, at) = printed
            .trim()
            .split_once(' ')
            .ok_or_else(|| format!("kill-primary printed {printed:?}, not a node and a time"))?;
        let at: f64 = at
            .parse()
            .map_err(|e| format!("kill-primary's time {at:?}: {e}"))?;
        Ok((node.to_owned(), UNIX_EPOCH + Duration::from_secs_f64(at)))
    }

    /// Polls the endpoint until a write goes through (on a connection of its own each time), at
    /// most `limit` from `since`; the time from `since` to that write.
    pub(crate) async fn first_write(
        &self,
        since: SystemTime,
        limit: Duration,
    ) -> Result<Duration, BoxError> {
        let options = self.connect_options()?;
        let started = Instant::now();
        let taken = || SystemTime::now().duration_since(since).unwrap_or_default();
        loop {
            let probe = async {
                let mut connection = PgConnection::connect_with(&options).await?;
                // A transaction id is given only by a primary that accepts writes.
                sqlx::query("SELECT txid_current()")
                    .execute(&mut connection)
                    .await?;
                connection.close().await
            };
            if let Ok(Ok(())) = tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                return Ok(taken());
            }
            if started.elapsed().max(taken()) >= limit {
                return Err(format!("no write went through the endpoint within {limit:?}").into());
            }
            tokio::time::sleep(PROBE_EVERY).await;
        }
    }

    /// The node Patroni holds as the primary now.
    pub(crate) async fn primary(&self) -> Result<String, BoxError> {
        Ok(self.script_async(&["primary"]).await?.trim().to_owned())
    }

    /// Starts the killed node again and waits until it streams from the primary (and, with
    /// synchronous replication, is Patroni's `sync_standby`: before that a two-node cluster has
    /// no node it would promote).
    pub(crate) async fn rejoin(&self) -> Result<(), BoxError> {
        self.script_async(&["rejoin"]).await.map(drop)
    }

    /// Tears the cluster down; with `keep_logs` its logs stay (the data goes). Blocking.
    pub(crate) fn remove(mut self, keep_logs: bool) -> Result<(), BoxError> {
        self.removed = true;
        self.stop_watchdog();
        let args: &[&str] = if keep_logs {
            &["down", "--keep"]
        } else {
            &["down"]
        };
        self.script(args).map(drop)
    }

    fn command(&self, args: &[&str]) -> Result<Command, BoxError> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())?;
        let mut command = Command::new("bash");
        command
            .arg(SCRIPT)
            .args(args)
            .arg("--dir")
            .arg(&self.dir)
            .args(["--timeout", SCRIPT_TIMEOUT_SECS])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            // A Ctrl-C in the terminal reaches this program only, which then tears down.
            .process_group(0);
        Ok(command)
    }

    fn log(&self) -> PathBuf {
        self.dir.with_file_name("ha-cluster.log")
    }

    /// Runs the script; what it printed on standard output. Blocking.
    fn script(&self, args: &[&str]) -> Result<String, BoxError> {
        let output = self.command(args)?.output()?;
        self.checked(args, output)
    }

    async fn script_async(&self, args: &[&str]) -> Result<String, BoxError> {
        // Tokio's `output` pipes standard error whatever the command says: the log gets it here.
        let output = tokio::process::Command::from(self.command(args)?)
            .kill_on_drop(true)
            .output()
            .await?;
        OpenOptions::new()
            .append(true)
            .open(self.log())?
            .write_all(&output.stderr)?;
        self.checked(args, output)
    }

    fn checked(&self, args: &[&str], output: std::process::Output) -> Result<String, BoxError> {
        if output.status.success() {
            return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
        }
        let said = std::fs::read_to_string(self.log()).unwrap_or_default();
        let last: Vec<&str> = said.lines().rev().take(5).collect();
        Err(format!(
            "ha-cluster.sh {} failed ({}): {}",
            args.join(" "),
            output.status,
            last.into_iter().rev().collect::<Vec<_>>().join(" / ")
        )
        .into())
    }

    /// A watchdog that tears the cluster down and removes `outer` once this process is gone.
    fn spawn_watchdog(&self, outer: &Path) -> Result<Watchdog, BoxError> {
        Watchdog::spawn(&format!(
            "bash '{SCRIPT}' down --dir '{dir}' >/dev/null 2>&1; rm -rf '{outer}'",
            dir = self.dir.display(),
            outer = outer.display(),
        ))
    }

    fn stop_watchdog(&mut self) {
        if let Some(watchdog) = self.watchdog.take() {
            watchdog.stop();
        }
    }
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        self.stop_watchdog();
        if let Ok(mut down) = self.command(&["down"]) {
            let _ = down.stdout(Stdio::null()).status();
        }
    }
}

/// Creates the run's directory for a cluster, its log file beside it.
pub(crate) fn prepare(outer: &Path) -> Result<PathBuf, BoxError> {
    std::fs::create_dir(outer).map_err(|e| format!("cannot create {}: {e}", outer.display()))?;
    File::create(outer.join("ha-cluster.log"))?;
    Ok(outer.join("ha"))
}
