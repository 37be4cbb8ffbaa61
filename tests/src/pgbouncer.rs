//! PgBouncer in transaction pooling mode in front of the test server, started once per test
//! binary from the installed `pgbouncer` (Debian: `apt install pgbouncer`) and stopped when the
//! binary exits.
//!
//! It listens on a Unix socket in a temporary directory (no port to collide on) and multiplexes
//! every client onto [`SERVER_POOL_SIZE`] server connections per database, so a test with more
//! client connections than that really hands transactions from one server connection to another.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use sqlx::{ConnectOptions, postgres::PgConnectOptions};
use tokio::sync::OnceCell;

use crate::db::{self, TestDb};

/// Server connections per database behind PgBouncer.
pub const SERVER_POOL_SIZE: u32 = 3;

/// A running PgBouncer.
#[derive(Debug)]
pub struct PgBouncer {
    dir: PathBuf,
    user: String,
}

const PORT: u16 = 6432;

static BOUNCER: OnceCell<Option<PgBouncer>> = OnceCell::const_new();

/// The binary's PgBouncer, started on first use; `None` when PgBouncer is not installed, which
/// fails the calling test instead when `CI` is set.
pub async fn pgbouncer() -> Option<&'static PgBouncer> {
    BOUNCER.get_or_init(start).await.as_ref()
}

impl PgBouncer {
    /// Options that reach `db` through PgBouncer.
    pub fn options(&self, db: &TestDb) -> PgConnectOptions {
        let name = db
            .options()
            .get_database()
            .expect("test databases are named")
            .to_owned();
        PgConnectOptions::new()
            .socket(&self.dir)
            .port(PORT)
            .username(&self.user)
            .database(&name)
    }
}

fn binary() -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("pgbouncer"))
        .find(|candidate| candidate.is_file())
}

async fn start() -> Option<PgBouncer> {
    let Some(binary) = binary() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "PgBouncer is not installed; CI must install it (apt install pgbouncer)"
        );
        eprintln!("PgBouncer is not installed (apt install pgbouncer): skipping its tests");
        return None;
    };
    let server = db::server().await;
    let user = server.get_username().to_owned();
    let host = match server.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => server.get_host().to_owned(),
    };
    let dir = std::env::temp_dir().join(format!(
        "tower-idempotency-pgbouncer-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("pgbouncer directory");
    let ini = dir.join("pgbouncer.ini");
    std::fs::write(
        &ini,
        format!(
            "[databases]\n\
             * = host={host} port={port} user={user}\n\
             [pgbouncer]\n\
             listen_addr =\n\
             unix_socket_dir = {dir}\n\
             listen_port = {PORT}\n\
             auth_type = any\n\
             pool_mode = transaction\n\
             default_pool_size = {SERVER_POOL_SIZE}\n\
             max_client_conn = 1000\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n",
            port = server.get_port(),
            dir = dir.display(),
        ),
    )
    .expect("pgbouncer.ini");
    // PgBouncer refuses to run as root.
    let mut command = if db::running_as_root() {
        let owned = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(&dir)
            .status();
        assert!(
            owned.is_ok_and(|s| s.success()),
            "chown the pgbouncer directory"
        );
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(&binary);
        command
    } else {
        Command::new(&binary)
    };
    command
        .args(["-d"])
        .arg(&ini)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let started = command.status().expect("run pgbouncer");
    assert!(
        started.success(),
        "pgbouncer failed to start; see {}",
        dir.join("pgbouncer.log").display()
    );
    db::run_after_exit(&format!(
        "kill $(cat {pid}) 2>/dev/null; sleep 1; rm -rf {dir}",
        pid = dir.join("pgbouncer.pid").display(),
        dir = dir.display()
    ));
    wait_until_accepting(&dir, &user).await;
    Some(PgBouncer { dir, user })
}

/// Waits (bounded) for the daemon's socket to accept a connection: it has no readiness signal.
async fn wait_until_accepting(dir: &Path, user: &str) {
    let options = PgConnectOptions::new()
        .socket(dir)
        .port(PORT)
        .username(user)
        .database("postgres");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match options.connect().await {
            Ok(_) => return,
            Err(error) if tokio::time::Instant::now() > deadline => {
                panic!("pgbouncer did not accept connections: {error}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}
