//! The card network of a steps run: one `chaos acquirer` child process (this binary again,
//! serving [`acquirer::app`]), which the instances authorize every charge at and which is never
//! killed, as a real network is not the merchant's to crash. Its authorizations are what the
//! checks count per charge ([`verify::authorizations`](crate::verify::authorizations)).
//!
//! Every call is counted on the way in, and every answer the acquirer's own idempotency layer
//! replayed: a replay is a downstream key sent again (a lost answer, or a charge taken over
//! after its instance was killed mid-call), deduplicated where it must be, at the network.

use std::{
    net::SocketAddr,
    process::{ExitCode, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use acquirer::{Acquirer, Settings};
use axum::{
    Json, Router,
    extract::{Request, State},
    middleware::{self, Next},
    response::Response,
    routing::get,
};
use clap::Parser;
use serde_json::json;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, ChildStdin, ChildStdout, Command},
};

use crate::{BoxError, send::replayed, serve};

/// How long the acquirer may take to print `listening on`.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// `chaos acquirer`: the network's options.
#[derive(Debug, Parser)]
#[command(
    name = "chaos acquirer",
    about = "The card network of a chaos run (internal)"
)]
pub(crate) struct NetworkArgs {
    /// How long each authorization takes, in milliseconds.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
    /// The share of calls failed with `503`, from 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    fail_rate: f64,
    #[arg(long)]
    seed: Option<u64>,
}

/// The child: serves the network on `127.0.0.1:0` until its standard input closes.
pub(crate) fn main(args: NetworkArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("chaos acquirer: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let served: Result<(), BoxError> = runtime.block_on(async {
        tokio::spawn(serve::exit_when_stdin_closes());
        let settings = Settings {
            delay: Duration::from_millis(args.delay_ms),
            fail_rate: args.fail_rate,
            seed: args.seed,
        };
        let listen = SocketAddr::from(([127, 0, 0, 1], 0));
        serve::listen_and_serve(listen, counted(Acquirer::new(settings))).await
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("chaos acquirer: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Calls and replays seen at the network.
#[derive(Debug, Default)]
struct Counts {
    calls: AtomicU64,
    replays: AtomicU64,
}

/// The acquirer's app, counted, with `GET /chaos/counts` telling the counts.
fn counted(network: Acquirer) -> Router {
    let counts = Arc::new(Counts::default());
    let told = Arc::clone(&counts);
    let tell = move || {
        let (calls, replays) = (
            told.calls.load(Ordering::Relaxed),
            told.replays.load(Ordering::Relaxed),
        );
        std::future::ready(Json(json!({ "calls": calls, "replays": replays })))
    };
    acquirer::app(network)
        .layer(middleware::from_fn_with_state(counts, count))
        .route("/chaos/counts", get(tell))
}

async fn count(State(counts): State<Arc<Counts>>, request: Request, next: Next) -> Response {
    let authorizing = request.method() == http::Method::POST;
    let response = next.run(request).await;
    if authorizing {
        counts.calls.fetch_add(1, Ordering::Relaxed);
        if replayed(response.headers()) {
            counts.replays.fetch_add(1, Ordering::Relaxed);
        }
    }
    response
}

/// The parent's side: the running network.
#[derive(Debug)]
pub(crate) struct Network {
    child: Child,
    /// Held open: the network exits when it closes.
    _stdin: ChildStdin,
    _stdout: BufReader<ChildStdout>,
    addr: SocketAddr,
    http: reqwest::Client,
}

/// One authorization as `GET /v1/authorizations` lists it.
#[derive(Debug, Clone)]
pub(crate) struct Authorization {
    pub(crate) id: String,
    pub(crate) amount: i64,
    pub(crate) idempotency_key: String,
    pub(crate) reference: Option<String>,
}

impl Network {
    /// Starts `exe acquirer` with these failures and delay; its log goes to `log`.
    pub(crate) async fn start(
        exe: &std::path::Path,
        delay: Duration,
        fail_rate: f64,
        seed: u64,
        log: std::fs::File,
    ) -> Result<Self, BoxError> {
        let mut child = Command::new(exe)
            .arg("acquirer")
            .args(["--delay-ms", &delay.as_millis().to_string()])
            .args(["--fail-rate", &fail_rate.to_string()])
            .args(["--seed", &seed.to_string()])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start the acquirer: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("the acquirer's standard streams were not piped".into());
        };
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        tokio::time::timeout(START_TIMEOUT, stdout.read_line(&mut line))
            .await
            .map_err(|_| "the acquirer did not start in time")??;
        let addr = line
            .strip_prefix("listening on ")
            .and_then(|rest| rest.trim_end().parse().ok())
            .ok_or_else(|| format!("the acquirer said {line:?}, not `listening on`"))?;
        let http = reqwest::Client::builder().no_proxy().build()?;
        Ok(Self {
            child,
            _stdin: stdin,
            _stdout: stdout,
            addr,
            http,
        })
    }

    /// The base URL the instances authorize at.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every authorization the network made.
    pub(crate) async fn authorizations(&self) -> Result<Vec<Authorization>, BoxError> {
        let list: serde_json::Value = self
            .http
            .get(format!("{}/v1/authorizations", self.url()))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let data = list["data"].as_array().ok_or("no `data` in the list")?;
        data.iter()
            .map(|made| {
                Ok(Authorization {
                    id: made["id"].as_str().ok_or("no id")?.to_owned(),
                    amount: made["amount"].as_i64().ok_or("no amount")?,
                    idempotency_key: made["idempotency_key"]
                        .as_str()
                        .ok_or("no idempotency_key")?
                        .to_owned(),
                    reference: made["reference"].as_str().map(str::to_owned),
                })
            })
            .collect()
    }

    /// Calls the network took, and of them those its idempotency layer answered as replays.
    pub(crate) async fn counts(&self) -> Result<(u64, u64), BoxError> {
        let counts: serde_json::Value = self
            .http
            .get(format!("{}/chaos/counts", self.url()))
            .send()
            .await?
            .json()
            .await?;
        let get = |name: &str| counts[name].as_u64().ok_or(format!("no {name}"));
        Ok((get("calls")?, get("replays")?))
    }

    /// Stops the network.
    pub(crate) async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}
