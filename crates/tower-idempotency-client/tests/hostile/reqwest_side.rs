//! The reqwest middleware against the hostile server.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use tower_idempotency_client::{
    Error, IdempotentMiddleware, KeyFormat, KeyOrigin, OperationId, Outcome, Policy, StopReason,
};

use crate::{Act, Hostile, quick};

fn client(policy: Policy) -> ClientWithMiddleware {
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("a client");
    ClientBuilder::new(http)
        .with(IdempotentMiddleware::new(policy))
        .build()
}

/// Sends one charge: its status, outcome and body.
async fn charge(client: &ClientWithMiddleware, server: &Hostile) -> (u16, Outcome, String) {
    let response = client
        .post(server.url("/v1/charges"))
        .form(&[("amount", "2000")])
        .send()
        .await
        .expect("an answer");
    let outcome = response.extensions().get::<Outcome>().expect("an outcome");
    let outcome = outcome.clone();
    let status = response.status().as_u16();
    (status, outcome, response.text().await.expect("a body"))
}

/// The middleware's typed error inside reqwest-middleware's.
fn typed(error: reqwest_middleware::Error) -> Error {
    match error {
        reqwest_middleware::Error::Middleware(error) => error.downcast().expect("our error"),
        other => panic!("expected the middleware's error, got {other:?}"),
    }
}

/// The key as the server received it: the draft's sf-string by default.
fn sent(outcome: &Outcome) -> String {
    format!("\"{}\"", outcome.key().expect("a key"))
}

#[tokio::test]
async fn a_lost_answer_is_retried_with_the_same_key_and_replayed() {
    let server = Hostile::start(&[Act::HandleThenDrop, Act::Handle]).await;
    let (status, outcome, body) = charge(&client(quick()), &server).await;
    assert_eq!(status, 200);
    assert_eq!(body, r#"{"charge":1}"#, "the first run's answer");
    assert_eq!((outcome.attempts(), outcome.replayed()), (2, true));
    assert_eq!(outcome.key().map(|k| k.origin()), Some(KeyOrigin::Minted));
    assert_eq!(server.runs(), 1, "the handler ran once");
    let keys: Vec<_> = server.arrivals().into_iter().map(|a| a.key).collect();
    assert_eq!(
        keys,
        vec![Some(sent(&outcome)); 2],
        "one key on both attempts"
    );
}

#[tokio::test]
async fn a_409_is_retried_no_sooner_than_its_retry_after() {
    let server = Hostile::start(&[Act::Status(409, Some("2")), Act::Handle]).await;
    let (status, outcome, _) = charge(&client(quick()), &server).await;
    assert_eq!((status, outcome.attempts()), (200, 2));
    let arrivals = server.arrivals();
    let waited = arrivals[1].at - arrivals[0].at;
    assert!(waited >= Duration::from_secs(2), "retried after {waited:?}");
    assert_eq!(arrivals[0].key, arrivals[1].key);
}

#[tokio::test]
async fn a_429_is_retried_no_sooner_than_its_retry_after() {
    let server = Hostile::start(&[Act::Status(429, Some("1")), Act::Handle]).await;
    let (status, outcome, _) = charge(&client(quick()), &server).await;
    assert_eq!((status, outcome.attempts()), (200, 2));
    let arrivals = server.arrivals();
    assert!(arrivals[1].at - arrivals[0].at >= Duration::from_secs(1));
}

#[tokio::test]
async fn a_503_then_a_200() {
    let server = Hostile::start(&[Act::Status(503, None), Act::Handle]).await;
    let (status, outcome, _) = charge(&client(quick()), &server).await;
    assert_eq!(status, 200);
    assert_eq!((outcome.attempts(), outcome.replayed()), (2, false));
    assert_eq!(outcome.stop(), StopReason::Final);
    let keys: Vec<_> = server.arrivals().into_iter().map(|a| a.key).collect();
    assert_eq!(keys, vec![Some(sent(&outcome)); 2]);
}

#[tokio::test]
async fn a_422_is_not_retried_and_says_the_key_was_reused() {
    let server = Hostile::start(&[Act::Status(422, None), Act::Handle]).await;
    let error = client(quick())
        .post(server.url("/v1/charges"))
        .form(&[("amount", "5000")])
        .send()
        .await
        .expect_err("a 422 is an error");
    let error = typed(error);
    assert!(
        error
            .to_string()
            .contains("already used with another request payload"),
        "{error}"
    );
    let Error::KeyReused {
        key,
        attempts,
        problem,
    } = &error
    else {
        panic!("expected KeyReused, got {error:?}");
    };
    assert_eq!(*attempts, 1);
    assert_eq!(problem.as_deref(), Some(&br#"{"status":422}"#[..]));
    assert_eq!(server.arrivals().len(), 1, "never retried");
    assert_eq!(server.arrivals()[0].key, Some(format!("\"{key}\"")));
}

#[tokio::test]
async fn other_4xx_are_never_retried() {
    for status in [400, 401, 403, 404, 410] {
        let server = Hostile::start(&[Act::Status(status, None), Act::Handle]).await;
        let (answered, outcome, _) = charge(&client(quick()), &server).await;
        assert_eq!((answered, outcome.attempts()), (status, 1));
        assert_eq!(outcome.stop(), StopReason::Final);
        assert_eq!(server.arrivals().len(), 1);
    }
}

#[tokio::test]
async fn a_503_forever_stops_at_the_deadline() {
    let deadline = Duration::from_secs(1);
    let policy = quick()
        .with_deadline(deadline)
        .and_then(|p| p.with_max_attempts(1_000))
        .expect("valid");
    let server = Hostile::start(&[Act::Status(503, None)]).await;
    let started = Instant::now();
    let (status, outcome, _) = charge(&client(policy), &server).await;
    let took = started.elapsed();
    assert_eq!((status, outcome.stop()), (503, StopReason::Deadline));
    assert!(outcome.attempts() > 2, "{} attempts", outcome.attempts());
    // No attempt starts past the deadline (the arrivals below); the answer itself may come a
    // scheduler's tick after it on a loaded machine (1.002 s was seen), never a backoff later.
    assert!(
        took < deadline + Duration::from_millis(250),
        "answered after {took:?}"
    );
    let arrivals = server.arrivals();
    assert_eq!(arrivals.len(), outcome.attempts() as usize);
    assert!(arrivals.iter().all(|a| a.at - started < deadline));
}

#[tokio::test]
async fn a_retry_after_past_the_deadline_ends_at_once_with_the_answer() {
    let policy = quick()
        .with_deadline(Duration::from_secs(3))
        .expect("valid");
    let server = Hostile::start(&[Act::Status(503, Some("60")), Act::Handle]).await;
    let started = Instant::now();
    let (status, outcome, _) = charge(&client(policy), &server).await;
    assert_eq!((status, outcome.attempts()), (503, 1));
    assert_eq!(outcome.stop(), StopReason::RetryAfterPastDeadline);
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn attempts_stop_at_the_maximum() {
    let policy = quick().with_max_attempts(3).expect("valid");
    let server = Hostile::start(&[Act::Status(502, None)]).await;
    let (status, outcome, _) = charge(&client(policy), &server).await;
    assert_eq!((status, outcome.attempts()), (502, 3));
    assert_eq!(outcome.stop(), StopReason::AttemptsExhausted);
}

#[tokio::test]
async fn a_500_is_retried_only_when_asked() {
    let server = Hostile::start(&[Act::Status(500, None), Act::Handle]).await;
    let (status, outcome, _) = charge(&client(quick()), &server).await;
    assert_eq!((status, outcome.attempts()), (500, 1));
    let server = Hostile::start(&[Act::Status(500, None), Act::Handle]).await;
    let (status, outcome, _) = charge(&client(quick().with_retry_on_500(true)), &server).await;
    assert_eq!((status, outcome.attempts()), (200, 2));
}

fn stream(body: &'static str) -> reqwest::Body {
    let chunks = vec![Ok::<_, std::io::Error>(Bytes::from_static(body.as_bytes()))];
    reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
}

#[tokio::test]
async fn a_streaming_body_is_sent_once_and_says_why() {
    let server = Hostile::start(&[Act::Status(503, None), Act::Handle]).await;
    let client = client(quick());
    let response = client
        .post(server.url("/v1/uploads"))
        .body(stream("amount=2000"))
        .send()
        .await
        .expect("an answer");
    let outcome = response.extensions().get::<Outcome>().expect("an outcome");
    assert_eq!((response.status().as_u16(), outcome.attempts()), (503, 1));
    assert_eq!(outcome.stop(), StopReason::StreamingBody);

    let server = Hostile::start(&[Act::HandleThenDrop, Act::Handle]).await;
    let error = client
        .post(server.url("/v1/uploads"))
        .body(stream("amount=2000"))
        .send()
        .await
        .expect_err("the only attempt lost its answer");
    let error = typed(error);
    assert!(matches!(
        error,
        Error::Transport {
            reason: StopReason::StreamingBody,
            attempts: 1,
            ..
        }
    ));
    assert!(error.to_string().contains("body is a stream"), "{error}");
    assert!(error.key().is_some(), "the key, to ask again with");
    assert_eq!(server.arrivals().len(), 1);
}

#[tokio::test]
async fn keys_come_from_the_caller_or_the_operation_and_safe_methods_get_none() {
    let server = Hostile::start(&[Act::Handle]).await;
    let url = server.url("/v1/charges");
    let order = OperationId::new("order-1042/charge");
    let quoted = client(quick());
    let bare = client(quick().with_key_format(KeyFormat::Bare));

    let got = quoted.get(&url).send().await.expect("GET");
    let outcome = got.extensions().get::<Outcome>().expect("an outcome");
    assert!(outcome.key().is_none());
    let mine = quoted.post(&url).header("idempotency-key", "mine-1");
    let mine = mine.send().await.expect("the caller's key");
    let outcome = mine.extensions().get::<Outcome>().expect("an outcome");
    let key = outcome.key().expect("a key");
    assert_eq!((key.as_str(), key.origin()), ("mine-1", KeyOrigin::Caller));
    for client in [&quoted, &bare] {
        let derived = client.post(&url).with_extension(order.clone());
        let derived = derived.send().await.expect("a derived key");
        let outcome = derived.extensions().get::<Outcome>().expect("an outcome");
        assert_eq!(outcome.key(), Some(&Policy::new().key_for(&order)));
    }

    let arrivals = server.arrivals();
    let derived = Policy::new().key_for(&order).to_string();
    assert_eq!(arrivals[0].method, Method::GET);
    let keys: Vec<_> = arrivals.into_iter().map(|a| a.key).collect();
    let expected = [
        None,
        Some("mine-1".to_owned()),
        Some(format!("\"{derived}\"")),
    ];
    assert_eq!(keys[..3], expected);
    assert_eq!(keys[3], Some(derived), "bare by setting");
}
