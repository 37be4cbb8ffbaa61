//! The run's own PostgreSQL database: created fresh, dropped at the end.
//!
//! The server is `--database-url` (or `DATABASE_URL`), else a PostgreSQL on `127.0.0.1:5432`
//! that lets `root` or `postgres` in without a password. Beside whatever database that URL
//! names, the run creates `idem_bench_<pid>_<n>`, with the charge table and the store's
//! migrations, and drops it when it ends — normally, on an error, on Ctrl-C or on a panic.
//! Databases left by a run that was killed outright are dropped by the next run on the same
//! machine.

use std::{
    str::FromStr,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use sqlx::{
    AssertSqlSafe, ConnectOptions, Connection, Executor, PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tower_idempotency::store::PostgresStore;

use crate::{BoxError, app::CHARGES_SCHEMA, procfs};

/// Where to look when no URL is given.
const LOCAL_SERVERS: [&str; 2] = [
    "postgres://root@127.0.0.1:5432/postgres",
    "postgres://postgres@127.0.0.1:5432/postgres",
];

const NAME_PREFIX: &str = "idem_bench_";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The run's database. Drop it with [`drop_database`](Self::drop_database); if the value is
/// dropped without that (a panic), `Drop` does it on a thread of its own.
pub(crate) struct BenchDb {
    /// The server's URL as given (or found), naming some other database on it.
    server_url: String,
    admin: PgConnectOptions,
    name: String,
    options: PgConnectOptions,
    /// One connection for the benchmark's own queries (backend pids, settings).
    control: PgPool,
    dropped: bool,
}

impl BenchDb {
    /// Creates the database on the server at `url` (or a local one) and prepares its schema.
    pub(crate) async fn create(url: Option<&str>) -> Result<Self, BoxError> {
        let (server_url, admin) = find_server(url).await?;
        if admin.get_host() == "127.0.0.1" || admin.get_host() == "localhost" {
            sweep_orphans(&admin).await;
        }
        let name = format!(
            "{NAME_PREFIX}{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let mut conn = admin.connect().await?;
        conn.execute(AssertSqlSafe(format!(
            r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
        )))
        .await?;
        conn.execute(AssertSqlSafe(format!(r#"CREATE DATABASE "{name}""#)))
            .await?;
        let _ = conn.close().await;

        let options = admin.clone().database(&name);
        let db = Self {
            server_url,
            admin,
            name,
            options: options.clone(),
            control: PgPoolOptions::new()
                .max_connections(1)
                .connect_lazy_with(options),
            dropped: false,
        };
        // On an error, `db` is dropped here, and with it the new database.
        db.prepare().await?;
        Ok(db)
    }

    async fn prepare(&self) -> Result<(), BoxError> {
        self.control.execute(CHARGES_SCHEMA).await?;
        PostgresStore::new(self.control.clone()).migrate().await?;
        Ok(())
    }

    /// Sets `name` to `value` for every new session on the database (`ALTER DATABASE ...
    /// SET`). `name` must be a setting's name (letters, digits, `_` and `.`).
    pub(crate) async fn set(&self, name: &str, value: &str) -> Result<(), BoxError> {
        let valid = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        if !valid {
            return Err(format!("`{name}` is not a setting's name").into());
        }
        let value = value.replace('\'', "''");
        self.control
            .execute(AssertSqlSafe(format!(
                r#"ALTER DATABASE "{}" SET {name} = '{value}'"#,
                self.name
            )))
            .await?;
        Ok(())
    }

    /// The database's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The server's URL (naming another database), for child processes to connect with
    /// [`name`](Self::name).
    pub(crate) fn server_url(&self) -> &str {
        &self.server_url
    }

    /// The benchmark's own connection to the database (one): for its queries between and
    /// around measurements. Its backend is left out of the CPU accounting.
    pub(crate) fn control(&self) -> &PgPool {
        &self.control
    }

    /// A new pool of `size` connections, all opened before it is handed out.
    pub(crate) async fn pool(&self, size: u32) -> Result<PgPool, sqlx::Error> {
        connect_pool(self.options.clone(), size, true).await
    }

    /// The pids of the backends connected to the database, the benchmark's own excepted.
    pub(crate) async fn backend_pids(&self) -> Result<Vec<u32>, sqlx::Error> {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_all(&self.control)
        .await?;
        Ok(pids
            .into_iter()
            .filter_map(|pid| u32::try_from(pid).ok())
            .collect())
    }

    /// The server's version and the settings that move the numbers most.
    pub(crate) async fn describe_server(&self) -> Result<String, sqlx::Error> {
        let version: String = sqlx::query_scalar("SHOW server_version")
            .fetch_one(&self.control)
            .await?;
        let settings: Vec<(String, String)> = sqlx::query_as(
            // `current_setting` shows a value in the unit it was set in (`128MB`); `setting` is
            // in the setting's base unit (`16384` of `8kB`), which pasted beside it misleads.
            "SELECT name, current_setting(name) FROM pg_settings WHERE name IN \
             ('synchronous_commit', 'fsync', 'shared_buffers', 'max_connections', \
              'autovacuum', 'wal_level', 'wal_compression', 'full_page_writes', \
              'checkpoint_timeout', 'max_wal_size') ORDER BY name",
        )
        .fetch_all(&self.control)
        .await?;
        let settings: Vec<String> = settings
            .into_iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        Ok(format!("PostgreSQL {version} ({})", settings.join(", ")))
    }

    /// Drops the database (closing this run's connections to it).
    pub(crate) async fn drop_database(mut self) -> Result<(), BoxError> {
        self.dropped = true;
        self.control.close().await;
        let mut conn = self.admin.connect().await?;
        conn.execute(AssertSqlSafe(format!(
            r#"DROP DATABASE IF EXISTS "{}" WITH (FORCE)"#,
            self.name
        )))
        .await?;
        let _ = conn.close().await;
        Ok(())
    }

    /// Drops the database from any context, blocking: on a thread with a runtime of its own.
    fn drop_now(&mut self) {
        if std::mem::replace(&mut self.dropped, true) {
            return;
        }
        let admin = self.admin.clone();
        let name = self.name.clone();
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
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

impl Drop for BenchDb {
    fn drop(&mut self) {
        self.drop_now();
    }
}

/// A pool of `size` connections to `options`, all opened before it is returned, so no
/// measurement pays for connecting.
pub(crate) async fn connect_pool(
    options: PgConnectOptions,
    size: u32,
    test_before_acquire: bool,
) -> Result<PgPool, sqlx::Error> {
    let pool = PgPoolOptions::new()
        .test_before_acquire(test_before_acquire)
        .max_connections(size)
        .min_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await?;
    // `min_connections` is reached in the background; open them now by holding them all.
    let mut held = Vec::with_capacity(size as usize);
    for _ in 0..size {
        held.push(pool.acquire().await?);
    }
    drop(held);
    Ok(pool)
}

/// The server to use, with the URL that reaches it. Statements of the benchmark's own
/// connections are not logged (`DROP DATABASE` is slow, and expected to be).
async fn find_server(url: Option<&str>) -> Result<(String, PgConnectOptions), BoxError> {
    let (url, options) = connectable_server(url).await?;
    Ok((url, options.disable_statement_logging()))
}

async fn connectable_server(url: Option<&str>) -> Result<(String, PgConnectOptions), BoxError> {
    if let Some(url) = url {
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| format!("--database-url is not a PostgreSQL URL: {e}"))?;
        options
            .connect()
            .await
            .map_err(|e| format!("cannot connect to --database-url/DATABASE_URL: {e}"))?;
        return Ok((url.to_owned(), options));
    }
    for url in LOCAL_SERVERS {
        let options = PgConnectOptions::from_str(url)?;
        if options.connect().await.is_ok() {
            return Ok((url.to_owned(), options));
        }
    }
    Err(
        "no PostgreSQL found: nothing on 127.0.0.1:5432 lets `root` or `postgres` in without \
         a password. Start one, or pass --database-url (or set DATABASE_URL) to a server where \
         this user may create databases."
            .into(),
    )
}

/// Drops databases of earlier runs whose process is gone.
async fn sweep_orphans(admin: &PgConnectOptions) {
    let Ok(mut conn) = admin.connect().await else {
        return;
    };
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_bench\\_%'")
            .fetch_all(&mut conn)
            .await
            .unwrap_or_default();
    for name in names {
        let pid = name
            .strip_prefix(NAME_PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        if pid.is_some_and(|pid| !procfs::exists(pid)) {
            let _ = conn
                .execute(AssertSqlSafe(format!(
                    r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
                )))
                .await;
        }
    }
    let _ = conn.close().await;
}
