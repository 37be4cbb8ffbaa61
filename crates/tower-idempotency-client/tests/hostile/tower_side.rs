//! The Tower layer around hyper-util's client against the hostile server, and around mocks
//! under tokio's paused clock.

use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderName, Request, Response};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use tokio::time::Instant;
use tower::{Layer, ServiceExt, service_fn};
use tower_idempotency_client::{Error, IdempotentLayer, OperationId, Outcome, Policy, StopReason};

use crate::{Act, Hostile, Never, quick};

fn hyper<B>() -> Client<HttpConnector, B>
where
    B: http_body::Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    Client::builder(TokioExecutor::new()).build_http()
}

fn post<B>(url: String, body: B) -> Request<B> {
    Request::post(url).body(body).expect("a request")
}

#[tokio::test]
async fn a_lost_answer_is_retried_through_hyper_with_the_same_key_and_replayed() {
    let server = Hostile::start(&[Act::HandleThenDrop, Act::Handle]).await;
    let client = IdempotentLayer::new(quick()).layer(hyper());
    let order = OperationId::new("order-7/charge");
    let mut request = post(
        server.url("/v1/charges"),
        Full::new(Bytes::from("amount=1")),
    );
    request.extensions_mut().insert(order.clone());
    let response = client.oneshot(request).await.expect("an answer");
    let outcome = response.extensions().get::<Outcome>().expect("an outcome");
    assert_eq!((outcome.attempts(), outcome.replayed()), (2, true));
    assert_eq!(outcome.key(), Some(&Policy::new().key_for(&order)));
    assert_eq!(server.runs(), 1);
    let body = response.into_body().collect().await.expect("a body");
    assert_eq!(body.to_bytes(), r#"{"charge":1}"#);
    let keys: Vec<_> = server.arrivals().into_iter().map(|a| a.key).collect();
    assert_eq!(keys[0], keys[1]);
}

#[tokio::test]
async fn a_boxed_body_is_sent_once_and_says_why() {
    let server = Hostile::start(&[Act::HandleThenDrop, Act::Handle]).await;
    let client = IdempotentLayer::new(quick()).layer(hyper());
    let body = BoxBody::new(Full::new(Bytes::from("amount=1")));
    let error = client
        .oneshot(post(server.url("/v1/charges"), body))
        .await
        .expect_err("the only attempt lost its answer");
    assert!(matches!(
        error,
        Error::Transport {
            reason: StopReason::StreamingBody,
            attempts: 1,
            ..
        }
    ));
    assert_eq!(server.arrivals().len(), 1);
}

/// When each request came to a mock.
type Seen = Arc<Mutex<Vec<Instant>>>;

/// A mock that answers `answers` in turn (the last repeats) and notes in `seen` when each
/// request came.
fn mock(
    answers: Vec<Response<String>>,
    seen: Seen,
) -> impl tower::Service<Request<String>, Response = Response<String>, Error = Never, Future = impl Send>
+ Clone
+ Send {
    let noted = seen;
    let answers = Arc::new(answers);
    service_fn(move |_: Request<String>| {
        let n = {
            let mut seen = noted.lock().expect("seen");
            seen.push(Instant::now());
            seen.len() - 1
        };
        let answer = &answers[n.min(answers.len() - 1)];
        let mut copy = Response::new(answer.body().clone());
        *copy.status_mut() = answer.status();
        *copy.headers_mut() = answer.headers().clone();
        async move { Ok::<_, Infallible>(copy) }
    })
}

fn answer(status: u16, header: Option<(&'static str, &'static str)>) -> Response<String> {
    let mut answer = Response::builder().status(status);
    if let Some((name, value)) = header {
        answer = answer.header(name, value);
    }
    answer.body(String::new()).expect("a response")
}

#[tokio::test(start_paused = true)]
async fn a_409_waits_its_retry_after_on_the_paused_clock() {
    let seen = Seen::default();
    let answers = vec![
        answer(409, Some(("retry-after", "2"))),
        answer(200, Some(("idempotency-replayed", "true"))),
    ];
    let service = mock(answers, Arc::clone(&seen));
    // The server spells its replay marker its own way.
    let policy = quick().with_replay_header(HeaderName::from_static("idempotency-replayed"));
    let client = IdempotentLayer::new(policy).layer(service);
    let response = client
        .oneshot(post(
            "http://api.test/v1/charges".into(),
            String::from("a=1"),
        ))
        .await
        .expect("an answer");
    let outcome = response.extensions().get::<Outcome>().expect("an outcome");
    assert_eq!((outcome.attempts(), outcome.replayed()), (2, true));
    let seen = seen.lock().expect("seen").clone();
    let waited = seen[1] - seen[0];
    assert!(waited >= Duration::from_secs(2), "retried after {waited:?}");
    assert!(
        waited < Duration::from_millis(2_100),
        "no longer than the backoff's cap more"
    );
}

#[tokio::test(start_paused = true)]
async fn a_422_is_a_typed_error_and_a_503_forever_ends_at_the_deadline() {
    let seen = Seen::default();
    let service = mock(vec![answer(422, None)], Arc::clone(&seen));
    let client = IdempotentLayer::new(quick()).layer(service);
    let error = client
        .oneshot(post("http://api.test/v1/charges".into(), String::new()))
        .await
        .expect_err("a 422 is an error");
    assert!(matches!(error, Error::KeyReused { attempts: 1, .. }));
    assert_eq!(seen.lock().expect("seen").len(), 1);

    let seen = Seen::default();
    let service = mock(vec![answer(503, None)], Arc::clone(&seen));
    let policy = quick()
        .with_deadline(Duration::from_secs(5))
        .and_then(|p| p.with_max_attempts(u32::MAX))
        .expect("valid");
    let client = IdempotentLayer::new(policy).layer(service);
    let started = Instant::now();
    let response = client
        .oneshot(post("http://api.test/v1/charges".into(), String::new()))
        .await
        .expect("the last answer");
    let outcome = response.extensions().get::<Outcome>().expect("an outcome");
    assert_eq!(response.status(), 503);
    assert_eq!(outcome.stop(), StopReason::Deadline);
    assert!(started.elapsed() <= Duration::from_secs(5));
    let seen = seen.lock().expect("seen");
    assert_eq!(seen.len(), outcome.attempts() as usize);
    // Backoff steps of up to 100 ms over 5 s: dozens of attempts, none past the deadline.
    assert!(seen.len() > 20, "{} attempts", seen.len());
}
