//! The parent side of the demo instances: two `chaos serve` child processes sharing the
//! cluster, killed and restarted by the chaos, and the table of their current addresses that
//! the clients read (a load balancer's view: a killed instance's address stays listed until its
//! replacement announces a new one, so clients meet refused connections in between).
//!
//! Each instance's standard error goes to `demo.log` in the cluster directory, every line
//! prefixed with the instance and its generation (`[b#3]`), and is counted on the way
//! ([`DemoLog`]).

use std::{
    fs::File,
    io::{BufWriter, Write},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use sqlx::PgPool;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, ChildStdin, ChildStdout, Command},
};

use crate::{BoxError, Mode, rng::Rng, serve::Bug, waits::WaitCounts};

/// How many instances run.
pub(crate) const INSTANCES: usize = 2;
/// Their names in the output.
pub(crate) const NAMES: [&str; INSTANCES] = ["a", "b"];

/// The instances' lease (`--lease-secs`): shorter than the window in which the database refuses
/// completions, so that window outlasts it (issue 28.1). In transactional mode the claim is the
/// open transaction, which the lease does not bound.
pub(crate) const LEASE: Duration = Duration::from_secs(2);

/// How long an instance may take to print `listening on` (connecting and migrating included).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failed start waits before the next attempt.
const START_RETRY: Duration = Duration::from_millis(500);
/// How long an instance may take to exit once its standard input is closed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The demo's environment variables, removed so that only our flags configure an instance.
const DEMO_ENV: [&str; 12] = [
    "LISTEN_ADDR",
    "DATABASE_URL",
    "CHARGE_PROCESSING_DELAY_MS",
    "IDEMPOTENCY_KEY_TTL_SECS",
    "IDEMPOTENCY_LEASE_SECS",
    "IDEMPOTENCY_IN_FLIGHT_WAIT_MS",
    "CHARGES_DEMO_ACQUIRER_URL",
    "CHARGES_DEMO_STEP_SECRET",
    "CHARGES_DEMO_WEBHOOK_SECRET",
    "CHARGES_DEMO_SEAL_KEY",
    "CHARGES_DEMO_COMPLETER",
    "CHARGES_DEMO_COMPLETER_GRACE_SECS",
];

/// In steps mode, how long after a key's lease lapsed the completer takes it: short, so that
/// the run's abandoned charges are finished soon after the chaos.
pub(crate) const COMPLETER_GRACE: Duration = Duration::from_secs(2);

/// How every instance is started.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    /// This program (re-executed as `chaos serve`).
    pub(crate) exe: PathBuf,
    pub(crate) database_url: String,
    /// The processing delay is drawn from this range at every (re)start.
    pub(crate) delay_ms: (u64, u64),
    /// `--in-flight-wait-ms`: how long a duplicate of a key in flight waits (0: `409` at once).
    pub(crate) in_flight_wait_ms: u64,
    /// The sessions' `search_path`, when not the default (see [`wait_reads`](crate::wait_reads)).
    pub(crate) search_path: Option<&'static str>,
    pub(crate) inject_bug: Option<Bug>,
    pub(crate) mode: Mode,
    /// In steps mode, the network the instances authorize at, and the secret of the
    /// downstream keys (the same on every instance).
    pub(crate) acquirer_url: Option<String>,
    pub(crate) step_secret: String,
    /// `--webhook-secret`: the run's own, which the [webhook sender](crate::webhooks) signs with.
    pub(crate) webhook_secret: String,
}

/// The `application_name` of an instance's database sessions (`chaos_b_3` for `b#3`), by
/// which its open transactions are counted when it is killed.
fn application_name(label: &str) -> String {
    format!("chaos_{}", label.replace('#', "_"))
}

/// Open transactions of the sessions named `application_name`: charges in flight.
async fn open_transactions(pool: &PgPool, application_name: &str) -> Option<u64> {
    let count = sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM pg_stat_activity
         WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
    )
    .bind(application_name)
    .fetch_one(pool);
    match tokio::time::timeout(Duration::from_secs(1), count).await {
        Ok(Ok(count)) => u64::try_from(count).ok(),
        _ => None,
    }
}

/// The addresses clients send to, one per instance.
#[derive(Debug)]
pub(crate) struct Addrs([RwLock<SocketAddr>; INSTANCES]);

impl Addrs {
    pub(crate) fn new(addrs: [SocketAddr; INSTANCES]) -> Self {
        Self(addrs.map(RwLock::new))
    }

    pub(crate) fn get(&self, index: usize) -> SocketAddr {
        *self.0[index].read().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, index: usize, addr: SocketAddr) {
        *self.0[index].write().unwrap_or_else(|e| e.into_inner()) = addr;
    }
}

/// One running instance.
#[derive(Debug)]
struct Instance {
    child: Child,
    /// Held open: the instance exits when it closes.
    stdin: Option<ChildStdin>,
    /// Held so that the instance never meets a closed standard output.
    _stdout: BufReader<ChildStdout>,
    addr: SocketAddr,
    started: Instant,
}

impl Instance {
    async fn start(
        spec: &Spec,
        label: String,
        delay_ms: u64,
        log: Arc<DemoLog>,
    ) -> Result<Self, BoxError> {
        let mut url = format!(
            "{}&application_name={}",
            spec.database_url,
            application_name(&label)
        );
        if let Some(path) = spec.search_path {
            url.push_str(&format!("&options[search_path]={path}"));
        }
        let mut command = Command::new(&spec.exe);
        command
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--database-url"])
            .arg(url)
            .arg("--processing-delay-ms")
            .arg(delay_ms.to_string())
            .arg("--lease-secs")
            .arg(LEASE.as_secs().to_string())
            .arg("--in-flight-wait-ms")
            .arg(spec.in_flight_wait_ms.to_string())
            .arg("--webhook-secret")
            .arg(&spec.webhook_secret);
        if let Some(bug) = spec.inject_bug {
            command.args(["--inject-bug", bug.name()]);
        }
        command.args(["--mode", spec.mode.name()]);
        if let Some(url) = &spec.acquirer_url {
            command
                .args(["--acquirer-url", url])
                .args(["--step-secret", &spec.step_secret])
                .args(["--completer", "--completer-grace-secs"])
                .arg(COMPLETER_GRACE.as_secs().to_string());
        }
        for name in DEMO_ENV {
            command.env_remove(name);
        }
        command
            .env("RUST_LOG", "info,sqlx=warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            // A Ctrl-C in the terminal reaches this program only, which stops the instances.
            .process_group(0);
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", spec.exe.display()))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err("the instance's standard streams were not piped".into());
        };
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                log.ingest(&label, &line);
            }
        });
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        let read = tokio::time::timeout(START_TIMEOUT, stdout.read_line(&mut line)).await;
        let announced = line
            .strip_prefix("listening on ")
            .and_then(|rest| rest.trim_end().parse::<SocketAddr>().ok());
        match (read, announced) {
            (Ok(Ok(_)), Some(addr)) => Ok(Self {
                child,
                stdin: Some(stdin),
                _stdout: stdout,
                addr,
                started: Instant::now(),
            }),
            (Err(_), _) => {
                let _ = child.kill().await;
                Err(format!("no `listening on` line within {START_TIMEOUT:?}").into())
            }
            _ => {
                let status = match tokio::time::timeout(STOP_TIMEOUT, child.wait()).await {
                    Ok(Ok(status)) => status.to_string(),
                    _ => {
                        let _ = child.kill().await;
                        "killed".to_owned()
                    }
                };
                Err(format!("exited ({status}) before listening; see demo.log").into())
            }
        }
    }

    /// `SIGKILL`, as a crash; returns once the process is gone.
    async fn kill(mut self) -> Result<u32, BoxError> {
        let pid = self.child.id().unwrap_or(0);
        self.child.kill().await?;
        Ok(pid)
    }

    /// Closes its standard input and waits for it to exit (killing it if it does not).
    async fn stop(mut self) {
        drop(self.stdin.take());
        if tokio::time::timeout(STOP_TIMEOUT, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// The two instances and what the chaos did to them.
#[derive(Debug)]
pub(crate) struct Fleet {
    spec: Spec,
    slots: [tokio::sync::Mutex<Option<Instance>>; INSTANCES],
    generations: [AtomicU64; INSTANCES],
    addrs: Arc<Addrs>,
    log: Arc<DemoLog>,
    rng: Mutex<Rng>,
    /// To count the charges in flight of an instance about to be killed.
    pool: PgPool,
    /// Charges in flight (open transactions) in the instances when they were killed.
    pub(crate) killed_in_flight: AtomicU64,
    /// Instance processes started, the first two included.
    pub(crate) starts: AtomicU64,
    /// Starts that failed and were retried (an instance restarted while PostgreSQL is down).
    pub(crate) failed_starts: AtomicU64,
    pub(crate) kills: AtomicU64,
}

impl Fleet {
    /// Starts both instances (at once: their migrations race, which they must survive).
    pub(crate) async fn start(
        spec: Spec,
        log: Arc<DemoLog>,
        pool: PgPool,
        rng: Rng,
    ) -> Result<Self, BoxError> {
        let unspecified = SocketAddr::from(([127, 0, 0, 1], 0));
        let fleet = Self {
            spec,
            slots: [(); INSTANCES].map(|()| tokio::sync::Mutex::new(None)),
            generations: [(); INSTANCES].map(|()| AtomicU64::new(0)),
            addrs: Arc::new(Addrs::new([unspecified; INSTANCES])),
            log,
            rng: Mutex::new(rng),
            pool,
            killed_in_flight: AtomicU64::new(0),
            starts: AtomicU64::new(0),
            failed_starts: AtomicU64::new(0),
            kills: AtomicU64::new(0),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        let (a, b) = tokio::join!(fleet.launch(0, deadline), fleet.launch(1, deadline));
        let instances = [a?, b?];
        for (index, instance) in instances.into_iter().enumerate() {
            fleet.addrs.set(index, instance.addr);
            *fleet.slots[index].lock().await = Some(instance);
        }
        Ok(fleet)
    }

    pub(crate) fn addrs(&self) -> &Arc<Addrs> {
        &self.addrs
    }

    /// The processing delay of a new instance, from the spec's range.
    fn draw_delay(&self) -> u64 {
        let (lo, hi) = self.spec.delay_ms;
        self.rng
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .between(lo, hi)
    }

    /// Starts instance `index`, retrying until `deadline`.
    async fn launch(&self, index: usize, deadline: Instant) -> Result<Instance, BoxError> {
        loop {
            let generation = self.generations[index].fetch_add(1, Ordering::Relaxed) + 1;
            let label = format!("{}#{generation}", NAMES[index]);
            let delay = self.draw_delay();
            self.starts.fetch_add(1, Ordering::Relaxed);
            match Instance::start(&self.spec, label.clone(), delay, Arc::clone(&self.log)).await {
                Ok(instance) => {
                    crate::progress(format_args!(
                        "instance {label} listening on {} (processing delay {delay} ms, pid {})",
                        instance.addr,
                        instance.child.id().unwrap_or(0)
                    ));
                    return Ok(instance);
                }
                Err(error) => {
                    self.failed_starts.fetch_add(1, Ordering::Relaxed);
                    crate::progress(format_args!("instance {label} failed to start: {error}"));
                    if Instant::now() >= deadline {
                        return Err(format!(
                            "instance {} could not be started: {error}",
                            NAMES[index]
                        )
                        .into());
                    }
                    tokio::time::sleep(START_RETRY).await;
                }
            }
        }
    }

    /// `SIGKILL`s instance `index` and starts its replacement, which clients learn of once it
    /// listens.
    pub(crate) async fn kill_and_restart(&self, index: usize) -> Result<(), BoxError> {
        let mut slot = self.slots[index].lock().await;
        if let Some(instance) = slot.take() {
            let up = instance.started.elapsed();
            let label = format!(
                "{}#{}",
                NAMES[index],
                self.generations[index].load(Ordering::Relaxed)
            );
            let in_flight = open_transactions(&self.pool, &application_name(&label)).await;
            let pid = instance.kill().await?;
            self.kills.fetch_add(1, Ordering::Relaxed);
            self.killed_in_flight
                .fetch_add(in_flight.unwrap_or(0), Ordering::Relaxed);
            crate::progress(format_args!(
                "SIGKILL instance {label} (pid {pid}, up {:.1} s, {} charges in flight)",
                up.as_secs_f64(),
                in_flight.map_or_else(|| "? (database unreachable)".to_owned(), |n| n.to_string())
            ));
        }
        let restarted = Instant::now();
        let instance = self.launch(index, restarted + START_TIMEOUT).await?;
        crate::progress(format_args!(
            "  restarted in {:.2} s",
            restarted.elapsed().as_secs_f64()
        ));
        self.addrs.set(index, instance.addr);
        *slot = Some(instance);
        Ok(())
    }

    /// Stops both instances (closing their standard input), once the run is over.
    pub(crate) async fn stop(&self) {
        for slot in &self.slots {
            if let Some(instance) = slot.lock().await.take() {
                instance.stop().await;
            }
        }
    }
}

/// What the instances logged: the file, and counts of the lines that matter.
#[derive(Debug)]
pub(crate) struct DemoLog {
    path: PathBuf,
    file: Mutex<BufWriter<File>>,
    pub(crate) lines: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) warnings: AtomicU64,
    /// `charge created`: the handler wrote a charge (committed or not, yet).
    pub(crate) charges_created: AtomicU64,
    /// `refund created`: the handler wrote a refund (committed or not, yet).
    pub(crate) refunds_created: AtomicU64,
    /// The layer took over a key whose holder's lease lapsed.
    pub(crate) layer_takeovers: AtomicU64,
    /// The handler ran with `IdempotencyContext::takeover()`.
    pub(crate) handler_takeovers: AtomicU64,
    /// The commit of a request (charge and stored response) failed: rolled back, `503`.
    pub(crate) commit_failures: AtomicU64,
    /// A handler answered a kept status over its failed transaction: delivered unstored.
    pub(crate) unstored_answers: AtomicU64,
    /// A handler answered success over its failed transaction: turned into a `500`.
    pub(crate) aborted_successes: AtomicU64,
    /// A delivered response whose storing failed is stored in the background (none when every
    /// handler writes through its transaction: a failed store is then a failed commit).
    pub(crate) background_stores: AtomicU64,
    pub(crate) panics: AtomicU64,
    /// Charges the completer sent through a handler, and keys it completed or gave up on.
    pub(crate) completer_charges: AtomicU64,
    pub(crate) completed_keys: AtomicU64,
    pub(crate) completer_gave_up: AtomicU64,
    /// How the duplicates' waits for their keys ended.
    pub(crate) waits: WaitCounts,
}

impl DemoLog {
    pub(crate) fn create(path: &Path) -> Result<Self, BoxError> {
        let file =
            File::create(path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        Ok(Self {
            path: path.to_owned(),
            file: Mutex::new(BufWriter::new(file)),
            lines: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            warnings: AtomicU64::new(0),
            charges_created: AtomicU64::new(0),
            refunds_created: AtomicU64::new(0),
            layer_takeovers: AtomicU64::new(0),
            handler_takeovers: AtomicU64::new(0),
            commit_failures: AtomicU64::new(0),
            unstored_answers: AtomicU64::new(0),
            aborted_successes: AtomicU64::new(0),
            background_stores: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            completer_charges: AtomicU64::new(0),
            completed_keys: AtomicU64::new(0),
            completer_gave_up: AtomicU64::new(0),
            waits: WaitCounts::default(),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn ingest(&self, label: &str, line: &str) {
        let count = |counter: &AtomicU64| {
            counter.fetch_add(1, Ordering::Relaxed);
        };
        count(&self.lines);
        if line.contains(" ERROR ") {
            count(&self.errors);
        } else if line.contains(" WARN ") {
            count(&self.warnings);
        }
        if line.contains("charge created") {
            count(&self.charges_created);
        }
        if line.contains("refund created") {
            count(&self.refunds_created);
        }
        if line.contains("took over an idempotency key") {
            count(&self.layer_takeovers);
        }
        if line.contains("retrying a charge whose first attempt stopped mid-way") {
            count(&self.handler_takeovers);
        }
        if line.contains("committing the request failed") {
            count(&self.commit_failures);
        }
        if line.contains("the handler answered over a failed transaction") {
            count(&self.unstored_answers);
        }
        if line.contains("the handler answered success over a failed transaction") {
            count(&self.aborted_successes);
        }
        if line.contains("retrying in the background") {
            count(&self.background_stores);
        }
        if line.contains("panicked") {
            count(&self.panics);
        }
        if line.contains("completing a charge its client left mid-way") {
            count(&self.completer_charges);
        }
        if line.contains("completed an abandoned idempotency key") {
            count(&self.completed_keys);
        }
        if line.contains("gave up completing an abandoned idempotency key") {
            count(&self.completer_gave_up);
        }
        self.waits.ingest(line);
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(file, "[{label}] {line}");
    }

    pub(crate) fn flush(&self) {
        let _ = self.file.lock().unwrap_or_else(|e| e.into_inner()).flush();
    }
}
