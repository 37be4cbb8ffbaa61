//! [`send`] through tower-idempotency-client against a small server on a loopback port: the
//! key on every attempt, the chaos's counts, and the ways a sender gives up.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, OnceLock, atomic::Ordering},
    time::{Duration, Instant},
};

use axum::{Router, http::HeaderMap, response::IntoResponse, routing::post};
use http::StatusCode;
use tokio::{net::TcpListener, sync::watch};

use super::{Call, First, Sender, send};
use crate::{
    client::{Behaviour, Shared, Stats},
    faults::Storm,
    instance::Addrs,
    rng::Rng,
    wait_reads::Phase,
    webhooks::Feed,
};

fn shared(addr: SocketAddr) -> Arc<Shared> {
    let (_, storms) = watch::channel(Storm::default());
    let (_, stop) = watch::channel(false);
    Arc::new(Shared {
        addrs: Arc::new(Addrs::new([addr, addr])),
        behaviour: Behaviour {
            seed: 1,
            request_timeout: Duration::from_secs(5),
            parallel_percent: 0,
            hangup_percent: 0,
            resend_percent: 0,
            decline_percent: 0,
            catch_percent: 0,
            refund_percent: 0,
            wait_hangup_percent: 0,
            abandon_percent: 0,
        },
        stats: Stats::default(),
        stop,
        deadline: OnceLock::new(),
        storms,
        wait_reads: Phase::default(),
        webhooks: Feed::channel(false).0,
    })
}

fn charge(key: &str) -> Call<'_> {
    Call {
        path: "/v1/charges",
        api_key: "sk_test_chaos_00",
        key,
        form: vec![("amount", "100".to_owned())],
        caught_error: false,
        expected: vec![StatusCode::OK],
        wait_read_503s: Arc::default(),
        attempts: Arc::default(),
        abandoned: Arc::default(),
    }
}

/// A server that answers `503` first, then a replayed charge; it notes each request's key.
async fn unavailable_then_replayed() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let keys = Arc::new(Mutex::new(Vec::new()));
    let noted = Arc::clone(&keys);
    let app = Router::new().route(
        "/v1/charges",
        post(move |headers: HeaderMap| {
            let keys = Arc::clone(&noted);
            async move {
                let key = headers["idempotency-key"].to_str().unwrap_or_default();
                let mut keys = keys.lock().expect("keys");
                keys.push(key.to_owned());
                if keys.len() == 1 {
                    return StatusCode::SERVICE_UNAVAILABLE.into_response();
                }
                let replayed = [("idempotent-replayed", "true")];
                (replayed, r#"{"id":"ch_1","object":"charge"}"#).into_response()
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, keys)
}

fn count(counter: &std::sync::atomic::AtomicU64) -> u64 {
    Stats::get(counter)
}

#[tokio::test]
async fn a_503_is_retried_with_the_same_key_and_every_attempt_counted() {
    let (addr, keys) = unavailable_then_replayed().await;
    let shared = shared(addr);
    let mut rng = Rng::new(7);
    let sender = Sender::new(&shared, 0, &mut rng).expect("a client");
    let call = charge("chaos-key-1");
    let answer = send(&sender, &call, First::default(), &mut rng).await;
    let answer = answer.expect("a final answer");
    assert_eq!((answer.status, answer.replayed), (StatusCode::OK, true));
    assert_eq!(answer.object_id.as_deref(), Some("ch_1"));
    let stats = &shared.stats;
    assert_eq!((count(&stats.requests), count(&stats.retries)), (2, 1));
    assert_eq!(
        (count(&stats.server_errors), count(&stats.unavailable)),
        (1, 1)
    );
    assert_eq!((count(&stats.replays), count(&stats.unexpected)), (1, 0));
    assert_eq!(call.attempts.load(Ordering::Relaxed), 2);
    assert_eq!(*keys.lock().expect("keys"), ["chaos-key-1"; 2]);
}

#[tokio::test]
async fn a_client_goes_away_at_its_connection_error_or_stops_at_the_deadline() {
    // Port 1 on loopback: nothing listens there, so the connection is refused at once.
    let shared = shared("127.0.0.1:1".parse().expect("an address"));
    let mut rng = Rng::new(7);
    let sender = Sender::new(&shared, 0, &mut rng).expect("a client");
    let call = charge("chaos-key-2");
    let abandon = First {
        abandon: true,
        ..First::default()
    };
    assert!(send(&sender, &call, abandon, &mut rng).await.is_none());
    assert!(call.abandoned.load(Ordering::Relaxed));
    let stats = &shared.stats;
    assert_eq!(
        (count(&stats.connection_errors), count(&stats.abandoned)),
        (1, 1)
    );
    assert_eq!(count(&stats.requests), 1, "never retried");

    let _ = shared.deadline.set(Instant::now());
    let call = charge("chaos-key-3");
    assert!(
        send(&sender, &call, First::default(), &mut rng)
            .await
            .is_none()
    );
    assert_eq!(count(&stats.requests), 1, "nothing sent past the deadline");
}
