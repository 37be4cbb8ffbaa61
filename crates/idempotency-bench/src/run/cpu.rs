//! CPU time and context switches of the servers, the database's backends and this process.

use std::time::Duration;

use tokio::sync::watch;

use crate::{db::BenchDb, procfs, report::Cpu, stats::Window};

/// CPU time used during `window` (ended early if `stop` turns true) by the server processes,
/// the database's backends and this process. Backends are those connected when the window
/// opens (the pools are full by then).
pub(super) async fn cpu_probe(
    db: &BenchDb,
    servers: &[u32],
    window: Window,
    stop: Option<watch::Receiver<bool>>,
) -> Cpu {
    tokio::time::sleep_until(window.start).await;
    let backends: Vec<u32> = db
        .backend_pids()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|&pid| procfs::is_postgres(pid))
        .collect();
    let client = std::process::id();
    let before = CpuSnapshot::take(servers, &backends, client);
    match stop {
        Some(mut stop) => {
            tokio::select! {
                _ = tokio::time::sleep_until(window.end) => {}
                _ = stop.wait_for(|stopped| *stopped) => {}
            }
        }
        None => tokio::time::sleep_until(window.end).await,
    }
    let after = CpuSnapshot::take(servers, &backends, client);
    after.since(&before)
}

/// CPU time and context switches of the servers, the database's backends and this process,
/// at one moment.
pub(crate) struct CpuSnapshot {
    server: Option<Duration>,
    backends: Vec<(u32, Duration)>,
    client: Option<Duration>,
    server_switches: Option<u64>,
    client_switches: Option<u64>,
}

/// `read` of every process in `pids`, summed; `None` if there are none or one cannot be read.
fn sum_over<T: std::iter::Sum<T>>(pids: &[u32], read: fn(u32) -> std::io::Result<T>) -> Option<T> {
    if pids.is_empty() {
        return None;
    }
    pids.iter().map(|&pid| read(pid).ok()).sum()
}

impl CpuSnapshot {
    pub(crate) fn take(servers: &[u32], backends: &[u32], client: u32) -> Self {
        Self {
            server: sum_over(servers, procfs::cpu_time),
            backends: backends
                .iter()
                .filter_map(|&pid| Some((pid, procfs::cpu_time(pid).ok()?)))
                .collect(),
            client: procfs::cpu_time(client).ok(),
            server_switches: sum_over(servers, procfs::context_switches),
            client_switches: procfs::context_switches(client).ok(),
        }
    }

    pub(crate) fn since(&self, before: &Self) -> Cpu {
        let diff = |after: Option<Duration>, before: Option<Duration>| {
            Some(after?.saturating_sub(before?))
        };
        let postgres = (!before.backends.is_empty()).then(|| {
            self.backends
                .iter()
                .filter_map(|(pid, after)| {
                    let (_, before) = before.backends.iter().find(|(p, _)| p == pid)?;
                    Some(after.saturating_sub(*before))
                })
                .sum()
        });
        let count = |after: Option<u64>, before: Option<u64>| Some(after?.saturating_sub(before?));
        Cpu {
            server: diff(self.server, before.server),
            postgres,
            client: diff(self.client, before.client),
            server_switches: count(self.server_switches, before.server_switches),
            client_switches: count(self.client_switches, before.client_switches),
        }
    }
}
