//! A PostgreSQL database of its own for every test.
//!
//! The server is found once per test binary, in this order:
//! 1. `DATABASE_URL`, if set (any database on the server; tests create their own beside it);
//! 2. a PostgreSQL on `127.0.0.1:5432` accepting the current user, `postgres` or `root`;
//! 3. a throwaway cluster made with the installed server binaries (`initdb`, `pg_ctl`, found on
//!    `PATH` or under `/usr/lib/postgresql/*/bin`) in a temporary directory, listening on a Unix
//!    socket only and removed when the test binary exits.
//!
//! If none works, the first test fails with a message saying what to install.
//!
//! Each [`TestDb`] is a fresh database named `idem_test_<pid>_<n>`, dropped when the value is
//! dropped. Databases left behind by a test binary that was killed are swept by the next one.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    str::FromStr,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use sqlx::{
    AssertSqlSafe, ConnectOptions, Connection, Executor, PgConnection, PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tokio::sync::OnceCell;

static SERVER: OnceCell<PgConnectOptions> = OnceCell::const_new();
static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A pool of a database nobody serves: nothing listens on port 1, so each connection attempt
/// fails at once, and `acquire_timeout` bounds anything slower. For store outages.
pub fn unreachable_pool(acquire_timeout: Duration) -> PgPool {
    PgPoolOptions::new()
        .acquire_timeout(acquire_timeout)
        .connect_lazy("postgres://postgres@127.0.0.1:1/none")
        .expect("lazy pool")
}

/// Connection options for the test server's `postgres` database (found on first use).
pub async fn server() -> PgConnectOptions {
    SERVER.get_or_init(find_server).await.clone()
}

/// A database of its own, dropped with this value.
pub struct TestDb {
    pool: PgPool,
    options: PgConnectOptions,
    admin: PgConnectOptions,
    name: String,
}

impl TestDb {
    /// Creates a fresh, empty database.
    pub async fn new() -> Self {
        let admin = server().await;
        let name = format!(
            "idem_test_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let mut conn = admin.connect().await.expect("connect to the test server");
        conn.execute(AssertSqlSafe(format!(
            r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
        )))
        .await
        .expect("drop stale test database");
        conn.execute(AssertSqlSafe(format!(r#"CREATE DATABASE "{name}""#)))
            .await
            .expect("create test database");
        let _ = conn.close().await;
        let options = admin.clone().database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.clone())
            .await
            .expect("connect to the test database");
        Self {
            pool,
            options,
            admin,
            name,
        }
    }

    /// A pool on the database.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Connection options for the database (for a second pool, or a child process).
    pub fn options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// A `postgres://` URL for the database, for child processes.
    pub fn url(&self) -> String {
        let o = &self.options;
        let mut url = format!(
            "postgres://{}@{}/{}",
            o.get_username(),
            if o.get_socket().is_some() {
                String::new()
            } else {
                format!("{}:{}", o.get_host(), o.get_port())
            },
            self.name
        );
        if let Some(socket) = o.get_socket() {
            url.push_str(&format!("?host={}&port={}", socket.display(), o.get_port()));
        }
        url
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        let name = std::mem::take(&mut self.name);
        // Drop runs inside the test's runtime; the clean-up gets a runtime of its own. The pool
        // is not closed first: closing waits for connections that tasks of the (now blocked)
        // test runtime may hold. `WITH (FORCE)` ends them instead.
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                if let Ok(mut conn) = admin.connect().await {
                    let _ = conn
                        .execute(AssertSqlSafe(format!(
                            r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
                        )))
                        .await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

async fn find_server() -> PgConnectOptions {
    let options = match std::env::var("DATABASE_URL") {
        Ok(url) => {
            let options = PgConnectOptions::from_str(&url)
                .unwrap_or_else(|e| panic!("DATABASE_URL is not a PostgreSQL URL: {e}"));
            if let Err(e) = options.connect().await {
                panic!("DATABASE_URL is set but its server cannot be reached: {e}");
            }
            options
        }
        Err(_) => match local_server().await {
            Some(options) => options,
            None => throwaway_cluster(),
        },
    };
    sweep_orphans(&options).await;
    options
}

async fn local_server() -> Option<PgConnectOptions> {
    let mut users = vec!["postgres".to_owned(), "root".to_owned()];
    if let Ok(user) = std::env::var("USER") {
        users.insert(0, user);
    }
    for user in users {
        let options = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(5432)
            .username(&user)
            .database("postgres");
        if options.connect().await.is_ok() {
            return Some(options);
        }
    }
    None
}

/// Drops test databases whose creating process is gone.
async fn sweep_orphans(options: &PgConnectOptions) {
    let Ok(mut conn) = options.connect().await else {
        return;
    };
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_test\\_%'")
            .fetch_all(&mut conn)
            .await
            .unwrap_or_default();
    for name in names {
        let pid = name.split('_').nth(2).and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = conn
                .execute(AssertSqlSafe(format!(
                    r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
                )))
                .await;
        }
    }
}

fn throwaway_cluster() -> PgConnectOptions {
    let bin = server_binaries().unwrap_or_else(|| {
        panic!(
            "no PostgreSQL for the tests: DATABASE_URL is unset, nothing accepts connections on \
             127.0.0.1:5432, and no server binaries (initdb, pg_ctl) were found on PATH or under \
             /usr/lib/postgresql/*/bin. Install PostgreSQL (Debian/Ubuntu: `apt install postgresql`, \
             macOS: `brew install postgresql`), or set DATABASE_URL to a server you can create \
             databases on."
        )
    });
    let dir = std::env::temp_dir().join(format!("tower-idempotency-pg-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create cluster directory");
    let data = dir.join("data");
    // initdb refuses to run as root; run the cluster as `postgres` then.
    let run_as = if running_as_root() {
        let status = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(&dir)
            .status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "running as root, the throwaway cluster needs a `postgres` user to own it"
        );
        Some("postgres")
    } else {
        None
    };
    let command = |program: &str| {
        let mut command = match run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(bin.join(program));
                c
            }
            None => Command::new(bin.join(program)),
        };
        command.stdout(Stdio::null());
        command
    };
    let initdb = command("initdb")
        .args([
            "--auth=trust",
            "--username=postgres",
            "--encoding=UTF8",
            "-D",
        ])
        .arg(&data)
        .status()
        .expect("run initdb");
    assert!(initdb.success(), "initdb failed");
    let start = command("pg_ctl")
        .arg("-D")
        .arg(&data)
        .arg("-l")
        .arg(dir.join("log"))
        .arg("-o")
        .arg(format!(
            "-c listen_addresses='' -k {} -c max_connections=300 -c fsync=off",
            dir.display()
        ))
        .args(["-w", "start"])
        .status()
        .expect("run pg_ctl");
    assert!(
        start.success(),
        "pg_ctl start failed; see {}",
        dir.join("log").display()
    );
    stop_at_exit(&bin, &data, &dir, run_as);
    PgConnectOptions::new()
        .socket(&dir)
        .port(5432)
        .username("postgres")
        .database("postgres")
}

/// The cluster outlives no test binary: a watchdog stops and removes it once this process exits.
fn stop_at_exit(bin: &Path, data: &Path, dir: &Path, run_as: Option<&str>) {
    let pg_ctl = bin.join("pg_ctl");
    let stop = match run_as {
        Some(user) => format!(
            "runuser -u {user} -- {} -D {} stop -m immediate",
            pg_ctl.display(),
            data.display()
        ),
        None => format!(
            "{} -D {} stop -m immediate",
            pg_ctl.display(),
            data.display()
        ),
    };
    run_after_exit(&format!("{stop} >/dev/null 2>&1; rm -rf {}", dir.display()));
}

/// Runs a shell command once this (test) process has exited: the clean-up of helper processes
/// that live in statics, which are never dropped.
pub(crate) fn run_after_exit(command: &str) {
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {command}",
        pid = std::process::id(),
    );
    let _ = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}

/// Whether this process runs as root (server processes then run as `postgres`).
pub(crate) fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn server_binaries() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("initdb").is_file() && dir.join("pg_ctl").is_file() {
                return Some(dir);
            }
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| entry.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("initdb").is_file())
        .collect();
    versions.sort_by_key(|bin| {
        bin.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    versions.pop()
}

/// Connects once to `options`, for tests that need a raw connection.
pub async fn connect(options: &PgConnectOptions) -> PgConnection {
    options.connect().await.expect("connect")
}
