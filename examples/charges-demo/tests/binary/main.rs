//! The built binary, as a person runs it: options, the `listening on` line, the curl scenarios
//! and Stripe's Python and Node.js libraries over real HTTP against PostgreSQL, and graceful
//! shutdown on SIGTERM.

mod scripts;
mod shutdown;
mod startup;

use std::{
    net::SocketAddr,
    process::Stdio,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use acquirer::Acquirer;
use idempotency_tests::db::TestDb;
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, BufReader},
    process::{Child, ChildStdout, Command},
};

const BINARY: &str = env!("CARGO_BIN_EXE_charges-demo");
const STARTUP: Duration = Duration::from_secs(60);
const EXIT: Duration = Duration::from_secs(30);

/// The running binary; killed if the test ends without stopping it.
struct Server {
    child: Child,
    addr: SocketAddr,
    stdout: BufReader<ChildStdout>,
    stderr: Arc<Mutex<Vec<String>>>,
    /// The task reading `stderr`: it ends when the process has closed it.
    stderr_reader: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Starts the binary with `args` and a clean environment, and waits for `listening on`.
    async fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[]).await
    }

    /// [`Server::start`] with owned arguments.
    async fn start_owned(args: Vec<String>) -> Self {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::start(&args).await
    }

    /// [`Server::start`], with these variables in the otherwise clean environment.
    async fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(BINARY)
            .args(args)
            .env_clear()
            .env("RUST_LOG", "info,sqlx=warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the binary");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let log = Arc::clone(&stderr);
        let stderr_reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("[charges-demo] {line}");
                log.lock().expect("log").push(line);
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        tokio::time::timeout(STARTUP, stdout.read_line(&mut line))
            .await
            .expect("the server announced itself in time")
            .expect("read stdout");
        let addr = line
            .strip_prefix("listening on ")
            .and_then(|rest| rest.strip_suffix('\n'))
            .unwrap_or_else(|| panic!("expected `listening on ADDR`, got {line:?}"))
            .parse()
            .expect("a socket address");
        Self {
            child,
            addr,
            stdout,
            stderr,
            stderr_reader,
        }
    }

    /// [`Server::on_postgres`], authorizing at the acquirer at `acquirer_url`, keys held for
    /// `lease_secs`.
    async fn on_postgres_with(url: &str, delay_ms: u64, acquirer_url: &str, lease: &str) -> Self {
        let delay = delay_ms.to_string();
        Self::start(&[
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            url,
            "--processing-delay-ms",
            &delay,
            "--acquirer-url",
            acquirer_url,
            "--lease-secs",
            lease,
        ])
        .await
    }

    /// Starts the binary on PostgreSQL at `url`, each charge taking `delay_ms` in the handler
    /// (so that duplicates overlap it, or a signal finds it in flight).
    async fn on_postgres(url: &str, delay_ms: u64) -> Self {
        let delay = delay_ms.to_string();
        Self::start(&[
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            url,
            "--processing-delay-ms",
            &delay,
        ])
        .await
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn sigterm(&self) {
        self.signal("TERM");
    }

    /// Sends the signal `name` (`TERM`, `INT`...) to the process.
    fn signal(&self, name: &str) {
        let pid = self.child.id().expect("running");
        let status = std::process::Command::new("kill")
            .args([&format!("-{name}"), &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {pid}");
    }

    /// Kills the process with SIGKILL, as a crash would, and waits for it.
    async fn crash(mut self) {
        self.child.start_kill().expect("SIGKILL");
        let status = tokio::time::timeout(EXIT, self.child.wait())
            .await
            .expect("the server died in time")
            .expect("wait");
        assert_eq!(status.code(), None, "killed by a signal");
    }

    /// Stops the process with SIGTERM: its exit code and everything it logged.
    async fn stop(self) -> (Option<i32>, Vec<String>) {
        self.sigterm();
        self.exit().await
    }

    /// Waits for the process to exit: its exit code and everything it logged.
    async fn exit(self) -> (Option<i32>, Vec<String>) {
        let stderr = Arc::clone(&self.stderr);
        let code = self.exit_code().await;
        let logs = stderr.lock().expect("log").clone();
        (code, logs)
    }

    /// Waits for the process to exit, and checks it printed nothing more on stdout.
    async fn exit_code(mut self) -> Option<i32> {
        let status = tokio::time::timeout(EXIT, self.child.wait())
            .await
            .expect("the server exited in time")
            .expect("wait");
        let mut rest = String::new();
        self.stdout
            .read_to_string(&mut rest)
            .await
            .expect("read stdout");
        assert_eq!(rest, "", "stdout holds the `listening on` line only");
        // Every line it logged has been read once its stderr is closed.
        tokio::time::timeout(EXIT, self.stderr_reader)
            .await
            .expect("stderr closed in time")
            .expect("stderr reader");
        status.code()
    }
}

/// An acquirer served by the test on a port of its own, outliving the servers it kills: the
/// acquirer, and its URL for `--acquirer-url`.
async fn acquirer() -> (Acquirer, String) {
    let acquirer = Acquirer::new(acquirer::Settings::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let app = acquirer::app(acquirer.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (acquirer, url)
}

/// Waits until `acquirer` made `n` authorizations: the charges past their `authorize` step,
/// in the processing delay.
async fn wait_for_authorizations(acquirer: &Acquirer, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let made = acquirer.authorizations().len();
        if made == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} authorization(s), found {made}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn count(db: &TestDb, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(db.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}
