//! The proof: the middleware and the layer against a hostile server that drops connections
//! after running its handler, answers `409`, `422` and `503`, and replays what it ran.

mod reqwest_side;
mod tower_side;

use std::{
    collections::HashMap,
    convert::Infallible,
    io,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tower_idempotency_client::Policy;

/// What the server does with one request.
#[derive(Debug, Clone, Copy)]
pub enum Act {
    /// Runs the handler once per key (a key it ran before gets the replay) and answers.
    Handle,
    /// Runs the handler, then drops the connection before answering.
    HandleThenDrop,
    /// Answers this status (and `Retry-After`) without running the handler.
    Status(u16, Option<&'static str>),
}

/// One request as it arrived.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at: Instant,
    pub method: Method,
    pub key: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    script: Vec<Act>,
    arrivals: Mutex<Vec<Arrival>>,
    /// Each key the handler ran for, with the answer it gave.
    answers: Mutex<HashMap<String, Bytes>>,
}

/// The server, on a port of its own.
pub struct Hostile {
    pub url: String,
    state: Arc<State>,
}

impl Hostile {
    /// Serves `script`: request `n` gets act `n`, the last act repeats.
    pub async fn start(script: &[Act]) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let state = Arc::new(State {
            script: script.to_vec(),
            ..State::default()
        });
        let serving = Arc::clone(&state);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = Arc::clone(&serving);
                let service = service_fn(move |request| act(Arc::clone(&state), request));
                tokio::spawn(async move {
                    // An act that drops the connection ends it with an error: expected.
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { url, state }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    pub fn arrivals(&self) -> Vec<Arrival> {
        self.state.arrivals.lock().expect("arrivals").clone()
    }

    /// How many times the handler ran.
    pub fn runs(&self) -> usize {
        self.state.answers.lock().expect("answers").len()
    }
}

async fn act(
    state: Arc<State>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, io::Error> {
    let key = request
        .headers()
        .get("idempotency-key")
        .map(|v| v.to_str().expect("ASCII").to_owned());
    let arrival = Arrival {
        at: Instant::now(),
        method: request.method().clone(),
        key: key.clone(),
    };
    // The whole request is read before the act, as a handler would.
    let _ = request.into_body().collect().await;
    let n = {
        let mut arrivals = state.arrivals.lock().expect("arrivals");
        arrivals.push(arrival);
        arrivals.len() - 1
    };
    let step = state.script[n.min(state.script.len() - 1)];
    let answer = match step {
        Act::Status(status, retry_after) => {
            let mut answer = Response::builder().status(status);
            if let Some(after) = retry_after {
                answer = answer.header("retry-after", after);
            }
            let body = Full::new(Bytes::from(format!(r#"{{"status":{status}}}"#)));
            return Ok(answer.body(body).expect("a response"));
        }
        Act::Handle | Act::HandleThenDrop => handle(&state, key.unwrap_or_default()),
    };
    match step {
        Act::HandleThenDrop => Err(io::Error::other("dropped before the answer")),
        _ => Ok(answer),
    }
}

/// The handler: runs once per key; a key it ran before gets its answer replayed.
fn handle(state: &State, key: String) -> Response<Full<Bytes>> {
    let mut answers = state.answers.lock().expect("answers");
    let run = answers.len() + 1;
    let replayed = answers.contains_key(&key);
    let body = answers
        .entry(key)
        .or_insert_with(|| Bytes::from(format!(r#"{{"charge":{run}}}"#)))
        .clone();
    let mut answer = Response::builder().status(StatusCode::OK);
    if replayed {
        answer = answer.header("idempotent-replayed", "true");
    }
    answer.body(Full::new(body)).expect("a response")
}

/// A policy with short waits, so that the tests take little time.
pub fn quick() -> Policy {
    Policy::new()
        .with_backoff(Duration::from_millis(10), Duration::from_millis(100))
        .expect("a valid backoff")
}

/// `Infallible` for the mocks' `service_fn`.
pub type Never = Infallible;
