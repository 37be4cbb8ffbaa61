//! The store ceiling: the store's own statements, issued through its public [`Store`] trait
//! with no HTTP and no handler, at the same concurrency as the HTTP scenarios. It shows how far
//! the layer is from what the store can do on this machine.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http::Method;
use http::{HeaderMap, HeaderValue, StatusCode, header::CONTENT_TYPE};
use tokio::time::Instant;
use tower_idempotency::{
    Fingerprint, IdempotencyKey, Principal, Record, ScopeKey,
    store::{ClaimRequest, ClaimStatus, KeyState, Store},
};

use crate::{
    BoxError,
    app::CHARGES_PATH,
    stats::{Tally, Window},
};

/// Which store operations one "request" of the ceiling is.
#[derive(Debug, Clone, Copy)]
pub(crate) enum StoreOp {
    /// What a new key costs the store: `claim` (acquires) then `complete`.
    ClaimComplete,
    /// What a retry costs the store: `claim` on a completed key (answers `Completed`). Each
    /// client completes `per_client` keys before the measurement and cycles through them.
    Lookup { per_client: usize },
}

/// The keys of one measurement, with those that [`StoreOp::Lookup`] retries completed.
#[derive(Debug)]
pub(crate) struct Prepared {
    op: StoreOp,
    nonce: u64,
    clients: usize,
}

/// Completes the keys `op` retries, if any, before the measurement.
pub(crate) async fn prepare<St: Store>(
    store: &Arc<St>,
    op: StoreOp,
    clients: usize,
) -> Result<Prepared, BoxError> {
    let prepared = Prepared {
        op,
        nonce: nonce(),
        clients,
    };
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..clients {
        let store = Arc::clone(store);
        let keys = prepared.keys(client);
        let retried = prepared.retried();
        tasks.spawn(async move {
            for seq in 0..retried {
                claim_complete(&*store, &keys.request(seq)).await?;
            }
            Ok::<_, String>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(prepared)
}

impl Prepared {
    fn keys(&self, client: usize) -> Keys {
        Keys {
            nonce: self.nonce,
            client,
        }
    }

    /// How many completed keys each client retries (none for new keys).
    fn retried(&self) -> u64 {
        match self.op {
            StoreOp::ClaimComplete => 0,
            StoreOp::Lookup { per_client } => per_client.max(1) as u64,
        }
    }
}

/// Runs the prepared operations from every client through `window`.
pub(crate) async fn run<St: Store>(
    store: &Arc<St>,
    prepared: &Prepared,
    window: Window,
) -> Result<Tally, BoxError> {
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..prepared.clients {
        let store = Arc::clone(store);
        let keys = prepared.keys(client);
        let retried = prepared.retried();
        let op = prepared.op;
        tasks.spawn(async move {
            let mut tally = Tally::new();
            // New keys start past the retried ones, so the two never meet.
            let mut seq = retried;
            while Instant::now() < window.end {
                seq += 1;
                let sent = Instant::now();
                let outcome = match op {
                    StoreOp::ClaimComplete => claim_complete(&*store, &keys.request(seq)).await,
                    StoreOp::Lookup { .. } => lookup(&*store, &keys.request(seq % retried)).await,
                };
                tally.record(&window, sent, outcome);
            }
            tally
        });
    }
    let mut total = Tally::new();
    while let Some(tally) = tasks.join_next().await {
        total.merge(tally?);
    }
    Ok(total)
}

async fn claim_complete<St: Store>(store: &St, request: &ClaimRequest) -> Result<(), String> {
    match store.claim(request).await {
        Ok(KeyState::Acquired { claim, .. }) => match store.complete(&claim, &record()).await {
            Ok(ClaimStatus::Held) => Ok(()),
            Ok(status) => Err(format!("complete: {status:?}")),
            Err(error) => Err(format!("complete: {error}")),
        },
        Ok(_) => Err("claim on a new key did not acquire it".to_owned()),
        Err(error) => Err(format!("claim: {error}")),
    }
}

async fn lookup<St: Store>(store: &St, request: &ClaimRequest) -> Result<(), String> {
    match store.claim(request).await {
        Ok(KeyState::Completed { .. }) => Ok(()),
        Ok(_) => Err("claim on a completed key did not answer Completed".to_owned()),
        Err(error) => Err(format!("claim: {error}")),
    }
}

/// The record a charge leaves: `201`, a JSON content type, a short body.
fn record() -> Record {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Record::from_parts(
        StatusCode::CREATED,
        headers,
        Some(Bytes::from_static(
            br#"{"id":"ch_1","object":"charge","account":"acct_0","amount":1000,"currency":"usd"}"#,
        )),
    )
}

/// Scoped keys unique to a run and a client, made as the layer makes them (a SHA-256, so they
/// land all over the store's index as real keys do).
struct Keys {
    nonce: u64,
    client: usize,
}

impl Keys {
    fn request(&self, seq: u64) -> ClaimRequest {
        let key = IdempotencyKey::new(format!("ceiling-{:x}-{}-{seq}", self.nonce, self.client))
            .expect("a valid key");
        ClaimRequest {
            key: ScopeKey::new(
                &Principal::new("acct_ceiling").expect("a valid principal"),
                &Method::POST,
                CHARGES_PATH,
                &key,
            ),
            fingerprint: Fingerprint::from_bytes([7; 32]),
            // The layer's defaults.
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 60 * 60),
            waiting: false,
            keeps_request: false,
        }
    }
}

fn nonce() -> u64 {
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32) ^ RUNS.fetch_add(1, Ordering::Relaxed)
}
