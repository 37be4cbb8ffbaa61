//! The run's database: its own throwaway PostgreSQL ([`cluster`](crate::cluster)), or with
//! `--failover` a high-availability cluster ([`ha`]). Either lives in the run's
//! directory beside the demo's logs, and is removed however the run ends.

use std::path::{Path, PathBuf};

use sqlx::postgres::PgConnectOptions;

use crate::{
    BoxError, RunArgs,
    cluster::Cluster,
    ha::{self, HaCluster},
};

/// The database the instances share; see the [module documentation](self).
#[derive(Debug)]
pub(crate) enum Database {
    /// One server of the run's own, on a Unix socket; restarted once by the chaos.
    Local(Cluster),
    /// Two Patroni nodes behind HAProxy, in `dir`; their primary killed by the chaos.
    Ha { dir: PathBuf, cluster: HaCluster },
}

impl Database {
    /// Makes the run's database in a new directory under the temporary one. Blocking.
    pub(crate) fn create(args: &RunArgs) -> Result<Self, BoxError> {
        // `chaos-<pid>`, or `chaos-<pid>-<n>` beside the kept logs of an earlier run of that pid.
        let pid = std::process::id();
        let dir = (0..)
            .map(|n| match n {
                0 => std::env::temp_dir().join(format!("chaos-{pid}")),
                n => std::env::temp_dir().join(format!("chaos-{pid}-{n}")),
            })
            .find(|dir| !dir.exists())
            .unwrap_or_else(|| std::env::temp_dir().join(format!("chaos-{pid}")));
        if !args.failover {
            return Ok(Self::Local(Cluster::create(dir)?));
        }
        let inner = ha::prepare(&dir)?;
        match HaCluster::up(inner, &dir, args.replication) {
            Ok(cluster) => Ok(Self::Ha { dir, cluster }),
            Err(error) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(error)
            }
        }
    }

    /// The run's directory: the database's files and the logs.
    pub(crate) fn dir(&self) -> &Path {
        match self {
            Self::Local(cluster) => cluster.dir(),
            Self::Ha { dir, .. } => dir,
        }
    }

    /// The server's major version.
    pub(crate) fn version(&self) -> String {
        match self {
            Self::Local(cluster) => cluster.version(),
            Self::Ha { cluster, .. } => cluster.version(),
        }
    }

    /// What it is, for the progress line.
    pub(crate) fn describe(&self) -> String {
        match self {
            Self::Local(cluster) => format!(
                "PostgreSQL {} started in {} (Unix socket only)",
                cluster.version(),
                cluster.dir().display()
            ),
            Self::Ha { dir, cluster } => format!(
                "PostgreSQL {}: two Patroni nodes behind HAProxy ({} replication) at {}, in {}",
                cluster.version(),
                cluster.replication().name(),
                cluster.url(),
                dir.join("ha").display()
            ),
        }
    }

    /// Where to connect, for this process.
    pub(crate) fn connect_options(&self) -> Result<PgConnectOptions, sqlx::Error> {
        match self {
            Self::Local(cluster) => Ok(cluster.connect_options()),
            Self::Ha { cluster, .. } => cluster.connect_options(),
        }
    }

    /// Where to connect, for the demo instances (`--database-url`, with a query string).
    pub(crate) fn url(&self) -> String {
        match self {
            Self::Local(cluster) => cluster.url(),
            Self::Ha { cluster, .. } => cluster.url().to_owned(),
        }
    }

    /// Stops and removes it, or keeps the logs (the directory is then returned). Blocking.
    pub(crate) fn remove(self, keep_logs: bool) -> Result<Option<PathBuf>, BoxError> {
        match self {
            Self::Local(cluster) => cluster.remove(keep_logs),
            Self::Ha { dir, cluster } => {
                let removed = cluster.remove(keep_logs);
                if !keep_logs {
                    std::fs::remove_dir_all(&dir)
                        .map_err(|e| format!("cannot remove {}: {e}", dir.display()))?;
                }
                removed?;
                Ok(keep_logs.then_some(dir))
            }
        }
    }
}
