//! Through the layer: every refusal's problem document carries its `code`, and a replay whose
//! body was too large to keep says so in a header.

use std::{convert::Infallible, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_layer::Layer;

use crate::{
    IdempotencyLayer, KeySource, Limits, RequestBody, Scope, body::BoxError,
    replay::IDEMPOTENT_REPLAY_BODY, store::MemoryStore,
};

type TestBody = BoxBody<Bytes, BoxError>;

/// What the handler does, by path: `/panic` panics, `/hang` tells `started` and never
/// answers, anything else answers `201` with `a response body`.
fn handler(
    started: Arc<Notify>,
) -> impl tower::Service<
    Request<RequestBody<TestBody>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future: Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |request: Request<RequestBody<TestBody>>| {
        let started = Arc::clone(&started);
        async move {
            match request.uri().path() {
                "/panic" => panic!("the handler panicked"),
                "/hang" => {
                    started.notify_one();
                    std::future::pending::<()>().await;
                }
                _ => {}
            }
            let mut response = Response::new(Full::new(Bytes::from_static(b"a response body")));
            *response.status_mut() = StatusCode::CREATED;
            Ok(response)
        }
    })
}

fn layer() -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::memory().with_scope(Scope::single_tenant())
}

fn body(bytes: &'static str) -> TestBody {
    Full::new(Bytes::from_static(bytes.as_bytes()))
        .map_err(|never| match never {})
        .boxed()
}

fn request(path: &str, key: Option<&str>, body: TestBody) -> Request<TestBody> {
    let mut request = Request::post(path);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(body).expect("request")
}

/// The ways to provoke each refusal the memory store can give.
#[derive(Debug, Clone, Copy)]
enum Case {
    NoKey,
    EmptyKey,
    NoPrincipal,
    StalledBody,
    BrokenBody,
    LargeBody,
    KeyInFlight,
    OtherBody,
    Panic,
    Overloaded,
    Hang,
    /// A record sealed under a key the layer's store lacks.
    #[cfg(feature = "sealing")]
    Unopenable,
}

/// The response to the request that meets `case`.
async fn provoke(case: Case) -> Response<Bytes> {
    #[cfg(feature = "sealing")]
    if let Case::Unopenable = case {
        return unopenable().await;
    }
    let started = Arc::new(Notify::new());
    let layer = match case {
        Case::NoKey => layer().with_key(KeySource::default().required()),
        Case::NoPrincipal => IdempotencyLayer::memory(),
        Case::StalledBody => layer()
            .with_limits(Limits::default().with_body_timeout(Duration::from_millis(10)))
            .expect("timeout"),
        Case::LargeBody => layer()
            .with_limits(Limits::default().with_max_request_bytes(4))
            .expect("limit"),
        Case::Overloaded => layer()
            .with_limits(Limits::default().with_max_detached(1))
            .expect("limit"),
        Case::Hang => layer()
            .with_limits(Limits::default().with_max_handler_time(Duration::from_millis(10)))
            .expect("max time"),
        _ => layer(),
    };
    let service = layer.layer(handler(Arc::clone(&started)));
    let key = Some("k");
    let request = match case {
        Case::NoKey => request("/", None, body("{}")),
        Case::EmptyKey => request("/", Some(""), body("{}")),
        Case::StalledBody => {
            let pending = futures_util::stream::pending::<Result<Frame<Bytes>, BoxError>>();
            request("/", key, StreamBody::new(pending).boxed())
        }
        Case::BrokenBody => {
            let broken: Result<Frame<Bytes>, BoxError> = Err("connection reset".into());
            let stream = futures_util::stream::iter([broken]);
            request("/", key, StreamBody::new(stream).boxed())
        }
        Case::KeyInFlight => {
            let first = service.clone().oneshot(request("/hang", key, body("{}")));
            tokio::spawn(first);
            started.notified().await;
            request("/hang", key, body("{}"))
        }
        Case::OtherBody => {
            let first = service.clone().oneshot(request("/", key, body("{}")));
            assert_eq!(first.await.expect("first").status(), StatusCode::CREATED);
            request("/", key, body("{\"other\": 1}"))
        }
        Case::Overloaded => {
            // Its client hangs up while the handler runs: the handler runs on, detached, and
            // fills the one place.
            let first = tokio::spawn(service.clone().oneshot(request("/hang", key, body("{}"))));
            started.notified().await;
            first.abort();
            assert!(first.await.expect_err("aborted").is_cancelled());
            request("/", Some("k2"), body("{}"))
        }
        Case::Panic => request("/panic", key, body("{}")),
        Case::Hang => request("/hang", key, body("{}")),
        _ => request("/", key, body("a body")),
    };
    collected(service.oneshot(request).await.expect("response")).await
}

async fn collected<B: http_body::Body<Error: std::fmt::Debug>>(
    response: Response<B>,
) -> Response<Bytes> {
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.expect("body").to_bytes();
    Response::from_parts(parts, bytes)
}

/// A retry whose record was sealed under key 1, to a layer that knows only key 2.
#[cfg(feature = "sealing")]
async fn unopenable() -> Response<Bytes> {
    use crate::store::{SealingKeys, SealingStore};

    let inner = MemoryStore::new();
    let sealed = |key_id| {
        let store = SealingStore::new(inner.clone(), SealingKeys::new(key_id, [key_id as u8; 32]));
        IdempotencyLayer::new(store)
            .with_scope(Scope::single_tenant())
            .layer(handler(Arc::default()))
    };
    let first = sealed(1).oneshot(request("/", Some("k"), body("{}")));
    assert_eq!(first.await.expect("first").status(), StatusCode::CREATED);
    collected(
        sealed(2)
            .oneshot(request("/", Some("k"), body("{}")))
            .await
            .expect("retry"),
    )
    .await
}

#[tokio::test(start_paused = true)]
async fn every_refusal_carries_its_code() {
    let table = [
        #[cfg(feature = "sealing")]
        (Case::Unopenable, 500, "record-unopenable"),
        (Case::NoKey, 400, "missing-key"),
        (Case::EmptyKey, 400, "invalid-key"),
        (Case::NoPrincipal, 500, "principal-missing"),
        (Case::StalledBody, 408, "body-timeout"),
        (Case::BrokenBody, 400, "body-unreadable"),
        (Case::LargeBody, 413, "body-too-large"),
        (Case::KeyInFlight, 409, "in-flight"),
        (Case::OtherBody, 422, "fingerprint-mismatch"),
        (Case::Panic, 500, "handler-panicked"),
        (Case::Overloaded, 503, "overloaded"),
        (Case::Hang, 503, "handler-timed-out"),
    ];
    for (case, status, code) in table {
        let response = provoke(case).await;
        assert_eq!(response.status(), status, "{case:?}");
        let rejection = response.extensions().get::<crate::Rejection>();
        let kind = rejection.expect("a rejection").kind();
        assert_eq!(kind.code(), code, "{case:?}");
        let json: serde_json::Value = serde_json::from_slice(response.body()).expect("json");
        assert_eq!(json["code"], code, "{case:?}: {json}");
        assert_eq!(json["status"], status, "{case:?}");
    }
}

#[tokio::test]
async fn a_replay_whose_body_was_too_large_says_so_in_a_header() {
    let service = layer()
        .with_limits(Limits::default().with_max_response_bytes(4))
        .expect("limit")
        .layer(handler(Arc::default()));
    let send = || service.clone().oneshot(request("/", Some("k"), body("{}")));

    let first = send().await.expect("first");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!first.headers().contains_key(&IDEMPOTENT_REPLAY_BODY));
    let first = first.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(first, "a response body");

    let replay = send().await.expect("replay");
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["idempotent-replay-body"], "omitted");
    assert_eq!(replay.headers()["content-type"], crate::PROBLEM_JSON);
}

#[tokio::test]
async fn a_replay_of_a_kept_body_has_no_omitted_header() {
    let service = layer().layer(handler(Arc::default()));
    let send = || service.clone().oneshot(request("/", Some("k"), body("{}")));
    send().await.expect("first");
    let replay = send().await.expect("replay");
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert!(!replay.headers().contains_key(&IDEMPOTENT_REPLAY_BODY));
}
