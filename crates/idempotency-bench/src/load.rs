//! The load generator: closed-loop HTTP/1.1 over keep-alive connections, on `hyper`'s client
//! connections.
//!
//! Each of N connections sends a request, reads the whole response, checks it, and sends the
//! next at once, until the [`Window`] closes; a failed connection is counted and reopened. Only
//! requests that start and finish inside the window count. The generator runs in the benchmark
//! process, on the same machine as the servers and PostgreSQL: it competes with them for the
//! CPU exactly as much in every scenario, which is what makes the ratios fair.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http::{
    HeaderValue, Method, Request, StatusCode, Uri,
    header::{AUTHORIZATION, CONTENT_TYPE, HOST},
};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::{net::TcpStream, time::Instant};

use crate::{
    BoxError,
    app::CHARGES_PATH,
    stats::{Tally, Window},
};

/// How many accounts the requests are spread over (connection `i` acts for account `i % 16`).
const ACCOUNTS: usize = 16;

/// How long past the window's end a request may take before it is abandoned.
const GRACE: Duration = Duration::from_secs(5);

/// How long to wait before reopening a connection that failed.
const RECONNECT_DELAY: Duration = Duration::from_millis(10);

/// What the clients send.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Workload {
    pub(crate) keys: Keys,
    pub(crate) body: BodySize,
}

/// Which `Idempotency-Key` each request carries. Every scenario sends one, the bare ones too
/// (they ignore it), so the requests on the wire are the same with and without the layer.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Keys {
    /// A key never used before, on every request.
    Fresh,
    /// Retries of completed keys: before the measurement, each connection completes
    /// `per_connection` keys of its own; then it cycles through them, so every request is a
    /// replay and no two connections retry the same key at once.
    Completed { per_connection: usize },
}

/// The request body: a charge, as JSON.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BodySize {
    /// `{"amount":1000,"currency":"usd","description":"idempotency-bench"}`.
    Small,
    /// A charge with a `metadata` string padding the body to exactly this many bytes.
    Padded(usize),
}

impl BodySize {
    fn bytes(self) -> Bytes {
        match self {
            Self::Small => Bytes::from_static(
                br#"{"amount":1000,"currency":"usd","description":"idempotency-bench"}"#,
            ),
            Self::Padded(size) => {
                let head = br#"{"amount":1000,"currency":"usd","metadata":{"blob":""#;
                let tail = br#""}}"#;
                let padding = size.saturating_sub(head.len() + tail.len());
                let mut body = Vec::with_capacity(head.len() + padding + tail.len());
                body.extend_from_slice(head);
                body.resize(head.len() + padding, b'x');
                body.extend_from_slice(tail);
                Bytes::from(body)
            }
        }
    }
}

/// The requests of one measurement: its workload, with keys no other measurement uses.
#[derive(Debug)]
pub(crate) struct Plan {
    workload: Workload,
    body: Bytes,
    host: HeaderValue,
    accounts: Vec<HeaderValue>,
    /// Prefixes every key of this plan, so runs and rounds never share keys.
    nonce: String,
}

impl Plan {
    pub(crate) fn new(workload: Workload, addr: SocketAddr) -> Self {
        static PLANS: AtomicU64 = AtomicU64::new(0);
        let epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis());
        let nonce = format!(
            "{epoch:x}-{:x}-{}",
            std::process::id(),
            PLANS.fetch_add(1, Ordering::Relaxed)
        );
        Self {
            workload,
            body: workload.body.bytes(),
            host: HeaderValue::try_from(addr.to_string())
                .expect("a socket address is a valid header"),
            accounts: (0..ACCOUNTS)
                .map(|i| HeaderValue::try_from(format!("Bearer acct_{i}")).expect("valid header"))
                .collect(),
            nonce,
        }
    }

    /// The `seq`-th request of connection `connection`.
    fn request(&self, connection: usize, seq: u64) -> Request<Full<Bytes>> {
        let key = match self.workload.keys {
            Keys::Fresh => format!("{}-{connection}-{seq}", self.nonce),
            Keys::Completed { per_connection } => {
                let index = seq % per_connection.max(1) as u64;
                format!("{}-{connection}-r{index}", self.nonce)
            }
        };
        let mut request = Request::new(Full::new(self.body.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = Uri::from_static(CHARGES_PATH);
        let headers = request.headers_mut();
        headers.insert(HOST, self.host.clone());
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(
            AUTHORIZATION,
            self.accounts[connection % self.accounts.len()].clone(),
        );
        headers.insert(
            "idempotency-key",
            HeaderValue::try_from(key).expect("keys are made of ASCII letters, digits and '-'"),
        );
        request
    }

    /// Whether `answer` is what the scenario must get: `201 Created`, replayed exactly when
    /// the key was completed before (`first` is the request that completes it).
    fn check(&self, answer: &Answer, first: bool) -> Result<(), String> {
        let want_replay = matches!(self.workload.keys, Keys::Completed { .. }) && !first;
        if answer.status != StatusCode::CREATED {
            return Err(format!(
                "status {}: {}",
                answer.status,
                String::from_utf8_lossy(&answer.body[..answer.body.len().min(200)])
            ));
        }
        if answer.replayed != want_replay {
            return Err(format!(
                "expected Idempotent-Replayed {}, got {}",
                if want_replay { "true" } else { "absent" },
                if answer.replayed { "true" } else { "absent" },
            ));
        }
        Ok(())
    }
}

/// Runs the preparation the workload needs before its measurement: completing the keys that
/// [`Keys::Completed`] retries.
pub(crate) async fn prepare(
    addr: SocketAddr,
    plan: &Arc<Plan>,
    connections: usize,
    deadline: Duration,
) -> Result<(), BoxError> {
    let Keys::Completed { per_connection } = plan.workload.keys else {
        return Ok(());
    };
    let mut tasks = tokio::task::JoinSet::new();
    for connection in 0..connections {
        let plan = Arc::clone(plan);
        tasks.spawn(async move {
            let mut sender = connect(addr).await?;
            for seq in 0..per_connection as u64 {
                let answer = exchange(&mut sender, plan.request(connection, seq)).await?;
                plan.check(&answer, true)
                    .map_err(|e| format!("completing key {seq} of connection {connection}: {e}"))?;
            }
            Ok::<_, BoxError>(())
        });
    }
    tokio::time::timeout(deadline, async {
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        Ok::<_, BoxError>(())
    })
    .await
    .map_err(|_| format!("completing the keys to replay took over {deadline:?}"))?
}

/// Drives `connections` closed-loop connections to `addr` through `window`.
pub(crate) async fn run(
    addr: SocketAddr,
    plan: &Arc<Plan>,
    connections: usize,
    window: Window,
) -> Result<Tally, BoxError> {
    let mut tasks = tokio::task::JoinSet::new();
    for connection in 0..connections {
        let plan = Arc::clone(plan);
        tasks.spawn(drive(addr, plan, connection, window));
    }
    let mut total = Tally::new();
    while let Some(tally) = tasks.join_next().await {
        total.merge(tally?);
    }
    Ok(total)
}

/// One connection's loop.
async fn drive(addr: SocketAddr, plan: Arc<Plan>, connection: usize, window: Window) -> Tally {
    let mut tally = Tally::new();
    let mut sender = None;
    let mut seq = 0_u64;
    while Instant::now() < window.end {
        let sent = Instant::now();
        let live = match sender.as_mut() {
            Some(live) => live,
            None => match connect(addr).await {
                Ok(fresh) => sender.insert(fresh),
                Err(error) => {
                    tally.record(&window, sent, Err(format!("connect: {error}")));
                    tokio::time::sleep(RECONNECT_DELAY).await;
                    continue;
                }
            },
        };
        let request = plan.request(connection, seq);
        seq += 1;
        let sent = Instant::now();
        let outcome = tokio::time::timeout_at(window.end + GRACE, exchange(live, request)).await;
        let outcome = match outcome {
            Ok(Ok(answer)) => plan.check(&answer, false),
            Ok(Err(error)) => {
                sender = None;
                Err(format!("HTTP: {error}"))
            }
            Err(_) => {
                sender = None;
                Err(format!("no answer within {GRACE:?} after the window"))
            }
        };
        tally.record(&window, sent, outcome);
    }
    tally
}

/// What the client keeps of a response.
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
}

async fn connect(addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>, BoxError> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        // Ends when the sender is dropped or the server closes the connection; the sender
        // reports the error, if any.
        let _ = connection.await;
    });
    Ok(sender)
}

async fn exchange(
    sender: &mut SendRequest<Full<Bytes>>,
    request: Request<Full<Bytes>>,
) -> Result<Answer, hyper::Error> {
    sender.ready().await?;
    let response = sender.send_request(request).await?;
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|value| value == "true");
    let body = response.into_body().collect().await?.to_bytes();
    Ok(Answer {
        status,
        replayed,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_bodies_have_the_exact_size_and_parse() {
        let body = BodySize::Padded(1 << 20).bytes();
        assert_eq!(body.len(), 1 << 20);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["amount"], 1000);
    }

    #[test]
    fn keys_are_fresh_or_cycle_per_connection() {
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let key = |plan: &Plan, c, s| plan.request(c, s).headers()["idempotency-key"].clone();
        let fresh = Plan::new(
            Workload {
                keys: Keys::Fresh,
                body: BodySize::Small,
            },
            addr,
        );
        assert_ne!(key(&fresh, 0, 0), key(&fresh, 0, 1));
        assert_ne!(key(&fresh, 0, 0), key(&fresh, 1, 0));
        let replay = Plan::new(
            Workload {
                keys: Keys::Completed { per_connection: 3 },
                body: BodySize::Small,
            },
            addr,
        );
        assert_eq!(key(&replay, 2, 1), key(&replay, 2, 4));
        assert_ne!(key(&replay, 2, 1), key(&replay, 3, 1));
        let again = Plan::new(
            Workload {
                keys: Keys::Fresh,
                body: BodySize::Small,
            },
            addr,
        );
        assert_ne!(
            key(&fresh, 0, 0),
            key(&again, 0, 0),
            "plans never share keys"
        );
    }
}
