//! A Patroni cluster for a test, from `scripts/ha-cluster.sh`: brought up in a directory of its
//! own on free ports, and torn down when dropped (a failed assertion included).

use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

/// A running cluster.
pub struct Cluster {
    dir: PathBuf,
    /// The endpoint: HAProxy's read-write listener, always the primary.
    pub url: String,
}

impl Cluster {
    /// `up` with `replication` (`sync` or `async`); `None`, saying so, when Patroni, etcd or
    /// HAProxy is not installed (under CI, a failure instead).
    pub fn up(replication: &str, name: &str) -> Option<Self> {
        if !installed() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!("ha-{name}-{}", std::process::id()));
        let mut cluster = Self {
            dir,
            url: String::new(),
        };
        let output = cluster.run(&["up", "--replication", replication]);
        cluster.url = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        assert!(
            cluster.url.starts_with("postgres://"),
            "up printed {:?}",
            cluster.url
        );
        Some(cluster)
    }

    /// Runs a command of the script on this cluster; panics, with its output, if it fails.
    pub fn run(&self, args: &[&str]) -> Output {
        let output = Command::new("bash")
            .arg(script())
            .args(args)
            .args(["--dir", &self.dir.to_string_lossy(), "--timeout", "90"])
            .stdin(Stdio::null())
            .output()
            .expect("run scripts/ha-cluster.sh");
        eprint!("{}", String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success(), "ha-cluster.sh {args:?} failed");
        output
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .args(["down", "--dir", &self.dir.to_string_lossy()])
            .stdin(Stdio::null())
            .status();
    }
}

/// The script, from the repository root.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ha-cluster.sh")
}

/// Whether every program the cluster needs is installed; under CI, it must be.
fn installed() -> bool {
    let missing: Vec<&str> = ["patroni", "etcd", "haproxy", "psql"]
        .into_iter()
        .filter(|tool| {
            Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .stdout(Stdio::null())
                .status()
                .map_or(true, |status| !status.success())
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    let what = format!("{missing:?} not installed (see scripts/ha-cluster.sh)");
    assert!(std::env::var_os("CI").is_none(), "under CI: {what}");
    eprintln!("SKIPPED: {what}");
    false
}
