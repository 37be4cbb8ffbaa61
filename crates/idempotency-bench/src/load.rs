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
use tokio::{net::TcpStream, sync::watch, time::Instant};

use crate::{
    BoxError,
    app::CHARGES_PATH,
    stats::{Tally, Window},
};

/// How many accounts the requests are spread over (connection `i` acts for account `i % 16`;
/// a pre-filled record `n` belongs to account `n % 16`).
pub(crate) const ACCOUNTS: usize = 16;

/// The `Idempotency-Key` of pre-filled record `n` is this prefix followed by `n`.
pub(crate) const FILLED_KEY_PREFIX: &str = "fill-";

/// The name of account `i`: the principal the servers' authentication derives from
/// `Authorization: Bearer <name>`.
pub(crate) fn account(i: u64) -> String {
    format!("acct_{i}")
}

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
    /// Retries of the records pre-filled in the database by SQL (`scale::fill_completed`):
    /// record `n` is key `fill-<n>` of account `n % 16`, with this workload's body. With no
    /// working set each request picks a random record among all of them; with one, each
    /// connection picks that many at random and cycles through them.
    Filled { working_set: Option<usize> },
}

/// The request body: a charge, as JSON, or a hostile body of the kind a fingerprint must
/// bound its work on.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BodySize {
    /// `{"amount":1000,"currency":"usd","description":"idempotency-bench"}`.
    Small,
    /// A charge with a `metadata` string padding the body to exactly this many bytes.
    Padded(usize),
    /// A form (`application/x-www-form-urlencoded`) of exactly this many bytes:
    /// `amount=1000&currency=usd&a&a&a…`, one pair every two bytes.
    RepeatedPairs(usize),
    /// A charge whose `metadata` nests `depth` objects `{"z":…,"a":0}`, every object's members
    /// out of order, around a string padding the body to exactly `size` bytes.
    DeepUnordered { depth: usize, size: usize },
}

impl BodySize {
    pub(crate) fn bytes(self) -> Bytes {
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
            Self::RepeatedPairs(size) => {
                let mut body = b"amount=1000&currency=usd".to_vec();
                body.reserve(size.saturating_sub(body.len()));
                while body.len() + 2 <= size {
                    body.extend_from_slice(b"&a");
                }
                if body.len() < size {
                    body.push(b'&');
                }
                Bytes::from(body)
            }
            Self::DeepUnordered { depth, size } => {
                // Out of order from the outermost object in: `metadata` before `amount`.
                let (head, tail) = (br#"{"metadata":"#, br#","amount":1000,"currency":"usd"}"#);
                let (open, close) = (br#"{"z":"#, br#","a":0}"#);
                let frame = head.len() + tail.len() + depth * (open.len() + close.len()) + 2;
                let mut body = Vec::with_capacity(size.max(frame));
                body.extend_from_slice(head);
                body.extend(open.repeat(depth));
                body.push(b'"');
                body.resize(body.len() + size.saturating_sub(frame), b'x');
                body.push(b'"');
                body.extend(close.repeat(depth));
                body.extend_from_slice(tail);
                Bytes::from(body)
            }
        }
    }

    /// The `Content-Type` the body is sent with.
    pub(crate) fn content_type(self) -> HeaderValue {
        match self {
            Self::Small | Self::Padded(_) | Self::DeepUnordered { .. } => {
                HeaderValue::from_static("application/json")
            }
            Self::RepeatedPairs(_) => HeaderValue::from_static("application/x-www-form-urlencoded"),
        }
    }
}

/// The requests of one measurement: its workload, with keys no other measurement uses.
#[derive(Debug)]
pub(crate) struct Plan {
    workload: Workload,
    body: Bytes,
    /// The servers, one `Host` each; connection `i` talks to server `i % n`.
    addrs: Vec<SocketAddr>,
    hosts: Vec<HeaderValue>,
    accounts: Vec<HeaderValue>,
    /// Prefixes every key of this plan, so runs and rounds never share keys.
    nonce: String,
    /// Seeds the choice of pre-filled records ([`Keys::Filled`]).
    seed: u64,
    /// How many records are pre-filled ([`Keys::Filled`]).
    filled: u64,
}

impl Plan {
    /// The requests of `workload` to the servers at `addrs` (at least one); `filled` is how
    /// many records the database was pre-filled with, for [`Keys::Filled`].
    pub(crate) fn new(workload: Workload, addrs: &[SocketAddr], filled: u64) -> Self {
        static PLANS: AtomicU64 = AtomicU64::new(0);
        assert!(!addrs.is_empty(), "a plan needs a server");
        let epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis());
        let plan = PLANS.fetch_add(1, Ordering::Relaxed);
        let nonce = format!("{epoch:x}-{:x}-{plan}", std::process::id());
        Self {
            workload,
            body: workload.body.bytes(),
            addrs: addrs.to_vec(),
            hosts: addrs
                .iter()
                .map(|addr| {
                    HeaderValue::try_from(addr.to_string())
                        .expect("a socket address is a valid header")
                })
                .collect(),
            accounts: (0..ACCOUNTS as u64)
                .map(|i| {
                    HeaderValue::try_from(format!("Bearer {}", account(i))).expect("valid header")
                })
                .collect(),
            nonce,
            seed: splitmix64((epoch as u64) ^ (u64::from(std::process::id()) << 40) ^ plan),
            filled,
        }
    }

    /// The server connection `connection` talks to.
    pub(crate) fn addr(&self, connection: usize) -> SocketAddr {
        self.addrs[connection % self.addrs.len()]
    }

    /// The pre-filled record the `seq`-th request of `connection` retries.
    fn filled_record(&self, working_set: Option<usize>, connection: usize, seq: u64) -> u64 {
        let pick = match working_set {
            Some(size) => seq % size.max(1) as u64,
            None => seq,
        };
        let mixed = splitmix64(self.seed ^ ((connection as u64) << 44) ^ pick);
        mixed % self.filled.max(1)
    }

    /// The `seq`-th request of connection `connection`.
    fn request(&self, connection: usize, seq: u64) -> Request<Full<Bytes>> {
        let mut account = connection % self.accounts.len();
        let key = match self.workload.keys {
            Keys::Fresh => format!("{}-{connection}-{seq}", self.nonce),
            Keys::Completed { per_connection } => {
                let index = seq % per_connection.max(1) as u64;
                format!("{}-{connection}-r{index}", self.nonce)
            }
            Keys::Filled { working_set } => {
                let n = self.filled_record(working_set, connection, seq);
                account = (n % ACCOUNTS as u64) as usize;
                format!("{FILLED_KEY_PREFIX}{n}")
            }
        };
        let mut request = Request::new(Full::new(self.body.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = Uri::from_static(CHARGES_PATH);
        let headers = request.headers_mut();
        headers.insert(HOST, self.hosts[connection % self.hosts.len()].clone());
        headers.insert(CONTENT_TYPE, self.workload.body.content_type());
        headers.insert(AUTHORIZATION, self.accounts[account].clone());
        headers.insert(
            "idempotency-key",
            HeaderValue::try_from(key).expect("keys are made of ASCII letters, digits and '-'"),
        );
        request
    }

    /// Whether `answer` is what the scenario must get: `201 Created`, replayed exactly when
    /// the key was completed before (`first` is the request that completes it).
    fn check(&self, answer: &Answer, first: bool) -> Result<(), String> {
        let want_replay = match self.workload.keys {
            Keys::Fresh => false,
            Keys::Completed { .. } => !first,
            Keys::Filled { .. } => true,
        };
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
            let mut sender = connect(plan.addr(connection)).await?;
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

/// Drives `connections` closed-loop connections to the plan's servers through `window`, or
/// until `stop` turns true (then requests already sent are still answered and counted).
/// `traced` keeps every request's time in the tally ([`Tally::within`]).
pub(crate) async fn run(
    plan: &Arc<Plan>,
    connections: usize,
    window: Window,
    stop: Option<watch::Receiver<bool>>,
    traced: bool,
) -> Result<Tally, BoxError> {
    let mut tasks = tokio::task::JoinSet::new();
    for connection in 0..connections {
        let plan = Arc::clone(plan);
        let tally = if traced {
            Tally::traced()
        } else {
            Tally::new()
        };
        tasks.spawn(drive(plan, connection, window, stop.clone(), tally));
    }
    let mut total = if traced {
        Tally::traced()
    } else {
        Tally::new()
    };
    while let Some(tally) = tasks.join_next().await {
        total.merge(tally?);
    }
    Ok(total)
}

/// One connection's loop.
async fn drive(
    plan: Arc<Plan>,
    connection: usize,
    window: Window,
    stop: Option<watch::Receiver<bool>>,
    mut tally: Tally,
) -> Tally {
    let addr = plan.addr(connection);
    let stopped = || stop.as_ref().is_some_and(|stop| *stop.borrow());
    let mut sender = None;
    let mut seq = 0_u64;
    while Instant::now() < window.end && !stopped() {
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
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) replayed: bool,
    pub(crate) body: Bytes,
}

pub(crate) async fn connect(addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>, BoxError> {
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

pub(crate) async fn exchange(
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

/// A 64-bit mix (SplitMix64's finaliser): well-spread record numbers from counters.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
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
    fn hostile_bodies_have_the_exact_size_and_shape() {
        let form = BodySize::RepeatedPairs(2 << 20).bytes();
        assert_eq!(form.len(), 2 << 20);
        assert!(form.starts_with(b"amount=1000&currency=usd&a&a&"));
        assert!(form.split(|b| *b == b'&').count() > 1_000_000);

        let size = 2 << 20;
        let json = BodySize::DeepUnordered { depth: 120, size }.bytes();
        assert_eq!(json.len(), size);
        let value: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(value["amount"], 1000);
        let mut inner = &value["metadata"];
        for _ in 0..120 {
            assert_eq!(inner["a"], 0);
            inner = &inner["z"];
        }
        assert!(inner.is_string());
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
            &[addr],
            0,
        );
        assert_ne!(key(&fresh, 0, 0), key(&fresh, 0, 1));
        assert_ne!(key(&fresh, 0, 0), key(&fresh, 1, 0));
        let replay = Plan::new(
            Workload {
                keys: Keys::Completed { per_connection: 3 },
                body: BodySize::Small,
            },
            &[addr],
            0,
        );
        assert_eq!(key(&replay, 2, 1), key(&replay, 2, 4));
        assert_ne!(key(&replay, 2, 1), key(&replay, 3, 1));
        let again = Plan::new(
            Workload {
                keys: Keys::Fresh,
                body: BodySize::Small,
            },
            &[addr],
            0,
        );
        assert_ne!(
            key(&fresh, 0, 0),
            key(&again, 0, 0),
            "plans never share keys"
        );
    }

    #[test]
    fn filled_keys_are_records_of_their_account() {
        let addrs: [SocketAddr; 2] = [
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        ];
        let header = |request: &Request<Full<Bytes>>, name: &str| {
            request.headers()[name].to_str().unwrap().to_owned()
        };
        let random = Plan::new(
            Workload {
                keys: Keys::Filled { working_set: None },
                body: BodySize::Small,
            },
            &addrs,
            1_000,
        );
        let mut seen = std::collections::HashSet::new();
        for seq in 0..200 {
            let request = random.request(3, seq);
            let key = header(&request, "idempotency-key");
            let n: u64 = key
                .strip_prefix(FILLED_KEY_PREFIX)
                .unwrap()
                .parse()
                .unwrap();
            assert!(n < 1_000);
            assert_eq!(
                header(&request, "authorization"),
                format!("Bearer {}", account(n % ACCOUNTS as u64))
            );
            assert_eq!(header(&request, "host"), "127.0.0.1:2");
            seen.insert(n);
        }
        assert!(seen.len() > 150, "random records: {}", seen.len());
        let cycling = Plan::new(
            Workload {
                keys: Keys::Filled {
                    working_set: Some(4),
                },
                body: BodySize::Small,
            },
            &addrs,
            1_000_000,
        );
        let key = |s| header(&cycling.request(0, s), "idempotency-key");
        assert_eq!(key(1), key(5));
        assert_ne!(key(1), key(2));
    }
}
