//! Closed-loop load over keep-alive HTTP/1.1: `connections` clients, each with a session of
//! its own, posting charges with a new key each, back to back.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use futures_util::future::join_all;
use hdrhistogram::Histogram;
use reqwest::Client;
use serde_json::json;
use tokio::time::Instant;

use crate::servers::{CHARGES, LOGIN, Server, session_cookie};

/// What one measurement saw.
#[derive(Debug)]
pub(crate) struct Measured {
    pub(crate) per_sec: f64,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    pub(crate) errors: u64,
}

static KEYS: AtomicU64 = AtomicU64::new(0);

/// Drives `server` for `warmup`, then measures for `duration`.
pub(crate) async fn measure(
    server: &Server,
    connections: usize,
    warmup: Duration,
    duration: Duration,
) -> Result<Measured, reqwest::Error> {
    let http = Client::builder()
        .pool_max_idle_per_host(connections)
        .build()?;
    let start = Instant::now() + warmup;
    let end = start + duration;
    let clients = (0..connections).map(|i| client(&http, server, i, start, end));
    let mut latency = Histogram::<u64>::new(3).expect("a valid histogram");
    let (mut ok, mut errors) = (0u64, 0u64);
    for result in join_all(clients).await {
        let (histogram, failed) = result?;
        ok += histogram.len();
        errors += failed;
        latency.add(histogram).expect("same bounds");
    }
    Ok(Measured {
        per_sec: ok as f64 / duration.as_secs_f64(),
        p50_us: latency.value_at_quantile(0.5),
        p99_us: latency.value_at_quantile(0.99),
        errors,
    })
}

/// One client: signs in (for the peer's session), then charges until `end`, recording the
/// requests that start at or after `start`.
async fn client(
    http: &Client,
    server: &Server,
    i: usize,
    start: Instant,
    end: Instant,
) -> Result<(Histogram<u64>, u64), reqwest::Error> {
    let account = format!("acct_{}", i % 16);
    let login = http
        .post(server.url(LOGIN))
        .bearer_auth(&account)
        .send()
        .await?
        .error_for_status()?;
    let cookie = session_cookie(&login);
    let url = server.url(CHARGES);
    let mut latency = Histogram::<u64>::new(3).expect("a valid histogram");
    let mut errors = 0;
    loop {
        let sent = Instant::now();
        if sent >= end {
            break;
        }
        let key = format!("load-{}", KEYS.fetch_add(1, Ordering::Relaxed));
        let mut request = http
            .post(&url)
            .bearer_auth(&account)
            .header("Idempotency-Key", key)
            .json(&json!({ "amount": 1000, "currency": "usd" }));
        if let Some(cookie) = &cookie {
            request = request.header(reqwest::header::COOKIE, cookie);
        }
        let answer = request.send().await;
        let ok = match answer {
            Ok(response) => {
                response.status() == reqwest::StatusCode::CREATED && {
                    // Read the body: the connection goes back to the pool only then.
                    response.bytes().await.is_ok()
                }
            }
            Err(_) => false,
        };
        let done = Instant::now();
        if sent < start || done > end {
            continue;
        }
        if ok {
            let micros = u64::try_from(done.duration_since(sent).as_micros()).unwrap_or(u64::MAX);
            latency
                .record(micros.max(1))
                .expect("auto-resizing histogram");
        } else {
            errors += 1;
        }
    }
    Ok((latency, errors))
}
