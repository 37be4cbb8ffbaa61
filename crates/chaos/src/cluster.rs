//! The run's own PostgreSQL: a throwaway cluster in a temporary directory, so the run can stop
//! and restart it without disturbing any other database on the machine.
//!
//! It is made with the installed server binaries (`initdb`, `pg_ctl`, found on `PATH` or under
//! `/usr/lib/postgresql/*/bin`), listens on a Unix socket in its directory only (no TCP port at
//! all), and runs as the `postgres` user when this program runs as root (`initdb` refuses root).
//! The directory holds the data, the socket, the server log and the demo instances' log.
//!
//! It is removed however the run ends: [`Cluster::remove`] at the end, `Drop` on an error or a
//! panic, and a watchdog shell started with it, which stops and removes the cluster once this
//! process has gone even if it was killed with `SIGKILL`.

use std::{
    os::unix::{fs::MetadataExt, process::CommandExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use sqlx::postgres::PgConnectOptions;

use crate::{BoxError, watchdog::Watchdog};

/// The database the demo instances share (the one `initdb` creates).
const DATABASE: &str = "postgres";
/// The socket's port number (only its file name: `.s.PGSQL.5432` in the cluster directory).
const PORT: u16 = 5432;

/// How the server is stopped for its mid-run restart (`pg_ctl stop -m ...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopMode {
    /// Sessions are terminated, transactions rolled back, a checkpoint written.
    Fast,
    /// The server is killed and recovers from its WAL when it starts: a crash.
    Immediate,
}

impl StopMode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Fast => "fast",
            Self::Immediate => "immediate",
        }
    }
}

/// A running throwaway cluster; see the [module documentation](self).
#[derive(Debug)]
pub(crate) struct Cluster {
    bin: PathBuf,
    dir: PathBuf,
    run_as: Option<&'static str>,
    watchdog: Option<Watchdog>,
    removed: bool,
}

impl Cluster {
    /// Creates and starts a cluster in `dir` (which must not exist). Blocking.
    pub(crate) fn create(dir: PathBuf) -> Result<Self, BoxError> {
        let bin = server_binaries().ok_or(
            "no PostgreSQL server binaries (initdb, pg_ctl) on PATH or under \
             /usr/lib/postgresql/*/bin; install PostgreSQL (Debian/Ubuntu: `apt install \
             postgresql`)",
        )?;
        std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let run_as = running_as_root().then_some("postgres");
        let mut cluster = Self {
            bin,
            dir,
            run_as,
            watchdog: None,
            removed: false,
        };
        // From here on, `Drop` removes the directory, and the watchdog does if we are killed.
        cluster.watchdog = Some(cluster.spawn_watchdog()?);
        if let Some(user) = run_as {
            run(Command::new("chown").args(["-R", user]).arg(&cluster.dir))
                .map_err(|e| format!("running as root, the cluster needs a `{user}` user: {e}"))?;
        }
        let mut initdb = cluster.command("initdb");
        initdb
            .args(["--auth=trust", "--username=postgres", "--encoding=UTF8"])
            .args(["--no-sync", "-D"])
            .arg(cluster.data());
        run(&mut initdb)?;
        run(&mut cluster.start_command())?;
        Ok(cluster)
    }

    /// The directory: data, socket and logs.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The server's log file.
    pub(crate) fn server_log(&self) -> PathBuf {
        self.dir.join("postgresql.log")
    }

    /// The server's major version, from the data directory.
    pub(crate) fn version(&self) -> String {
        std::fs::read_to_string(self.data().join("PG_VERSION"))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|_| "?".to_owned())
    }

    /// Where to connect, for this process.
    pub(crate) fn connect_options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .socket(&self.dir)
            .port(PORT)
            .username("postgres")
            .database(DATABASE)
    }

    /// Where to connect, for the demo instances (`--database-url`).
    pub(crate) fn url(&self) -> String {
        format!(
            "postgres://postgres@localhost:{PORT}/{DATABASE}?host={}",
            self.dir.display()
        )
    }

    /// Stops the server (`mode`), leaves it down for `down_for`, and starts it again.
    pub(crate) async fn restart(&self, mode: StopMode, down_for: Duration) -> Result<(), BoxError> {
        run_async(self.stop_command(mode)).await?;
        tokio::time::sleep(down_for).await;
        run_async(self.start_command()).await
    }

    /// Stops the server and removes the directory, or only its data when `keep_logs` (the
    /// directory is then returned, holding the logs). Blocking.
    pub(crate) fn remove(mut self, keep_logs: bool) -> Result<Option<PathBuf>, BoxError> {
        self.removed = true;
        let stopped = run(&mut self.stop_command(StopMode::Fast));
        self.stop_watchdog();
        let removed = if keep_logs {
            std::fs::remove_dir_all(self.data())
        } else {
            std::fs::remove_dir_all(&self.dir)
        };
        stopped?;
        removed.map_err(|e| format!("cannot remove {}: {e}", self.dir.display()))?;
        Ok(keep_logs.then(|| self.dir.clone()))
    }

    /// A command running `program` from the server binaries, as the cluster's owner.
    fn command(&self, program: &str) -> Command {
        let mut command = match self.run_as {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--"]).arg(self.bin.join(program));
                command
            }
            None => Command::new(self.bin.join(program)),
        };
        // Its own process group: a Ctrl-C in the terminal reaches this program only, which then
        // stops everything in order.
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0);
        command
    }

    fn start_command(&self) -> Command {
        let mut command = self.command("pg_ctl");
        command
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.server_log())
            .arg("-o")
            .arg(format!(
                "-c listen_addresses='' -k {} -c max_connections=200 -c fsync=off \
                 -c full_page_writes=off",
                self.dir.display()
            ))
            .args(["-w", "-t", "60", "start"]);
        command
    }

    fn stop_command(&self, mode: StopMode) -> Command {
        let mut command = self.command("pg_ctl");
        command
            .arg("-D")
            .arg(self.data())
            .args(["-m", mode.as_str(), "-w", "-t", "60", "stop"]);
        command
    }

    /// A watchdog that stops the server and removes the directory once this process is gone.
    fn spawn_watchdog(&self) -> Result<Watchdog, BoxError> {
        let stop = self.stop_command(StopMode::Immediate);
        let stop = std::iter::once(stop.get_program())
            .chain(stop.get_args())
            .map(|arg| format!("'{}'", arg.to_string_lossy()))
            .collect::<Vec<_>>()
            .join(" ");
        Watchdog::spawn(&format!(
            "{stop} >/dev/null 2>&1; rm -rf '{dir}'",
            dir = self.dir.display()
        ))
    }

    fn stop_watchdog(&mut self) {
        if let Some(watchdog) = self.watchdog.take() {
            watchdog.stop();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        if self.data().join("postmaster.pid").exists() {
            let _ = self
                .stop_command(StopMode::Immediate)
                .stderr(Stdio::null())
                .status();
        }
        self.stop_watchdog();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run(command: &mut Command) -> Result<(), BoxError> {
    let described = describe(command);
    let output = command
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run {described}: {e}"))?;
    check(&described, &output)
}

async fn run_async(mut command: Command) -> Result<(), BoxError> {
    command.stderr(Stdio::piped());
    let described = describe(&command);
    let output = tokio::process::Command::from(command)
        .output()
        .await
        .map_err(|e| format!("cannot run {described}: {e}"))?;
    check(&described, &output)
}

fn describe(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|arg| arg.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

fn check(described: &str, output: &std::process::Output) -> Result<(), BoxError> {
    if output.status.success() {
        return Ok(());
    }
    Err(format!(
        "{described} failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    )
    .into())
}

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `initdb` and `pg_ctl`: on `PATH`, else the newest `/usr/lib/postgresql/<version>/bin`.
fn server_binaries() -> Option<PathBuf> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    if let Some(dir) = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .find(|dir| has_both(dir))
    {
        return Some(dir);
    }
    std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            has_both(&bin).then_some((version, bin))
        })
        .max_by_key(|(version, _)| *version)
        .map(|(_, bin)| bin)
}
