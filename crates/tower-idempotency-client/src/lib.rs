//! The client side of the `Idempotency-Key` protocol: every attempt of one operation carries the
//! same key, and only what the protocol says a retry can get past is retried.
//!
//! ```
//! use reqwest_middleware::ClientBuilder;
//! use tower_idempotency_client::{IdempotentMiddleware, OperationId, Outcome, Policy};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! # let url = format!("http://{}", listener.local_addr()?);
//! # let app = axum::Router::new().route("/v1/charges", axum::routing::post(|| async { "{}" }));
//! # tokio::spawn(async move { axum::serve(listener, app).await });
//! let http = reqwest::Client::new();
//! # let http = reqwest::Client::builder().no_proxy().build()?;
//! let client = ClientBuilder::new(http)
//!     .with(IdempotentMiddleware::new(Policy::new()))
//!     .build();
//!
//! let order = OperationId::new("order-1042/charge");
//! let response = client
//!     .post(format!("{url}/v1/charges"))
//!     .form(&[("amount", "2000"), ("currency", "usd")])
//!     .with_extension(order.clone())
//!     .send()
//!     .await?;
//!
//! let outcome = response.extensions().get::<Outcome>().expect("set on every answer");
//! assert_eq!(outcome.key(), Some(&Policy::new().key_for(&order)));
//! assert_eq!((outcome.attempts(), outcome.replayed()), (1, false));
//! # Ok(())
//! # }
//! ```
//!
//! The same [`Policy`] drives [`IdempotentMiddleware`] (for `reqwest` through
//! `reqwest-middleware`) and [`IdempotentLayer`] (for any Tower client, [below](#tower)).
//!
//! # One key per operation
//!
//! Requests whose method gets a key (`POST` and `PATCH` by default, [`Policy::with_methods`])
//! get one before their first attempt, and every attempt sends that one:
//!
//! | the request has | its key ([`KeyOrigin`]) |
//! |---|---|
//! | an `Idempotency-Key` header | the caller's, sent untouched |
//! | an [`OperationId`] in its extensions | a UUIDv5 over the policy's namespace and the id |
//! | neither | a fresh UUIDv4 |
//!
//! Minted and derived keys go out as the draft's sf-string (`"8e03978e-..."`) or bare
//! ([`KeyFormat`]). Safe methods (`GET`, `HEAD`...) get none and are retried as they are.
//!
//! **Why derive rather than keep a journal.** A minted key lives in the process: if it dies
//! mid-retry, its successor mints another and the server runs the operation twice. Keeping
//! keys in a journal fixes that only if the key is written durably *before* the first attempt
//! (a write and an fsync on every operation), the journal survives the machine and is shared by
//! every host that may pick the work up, and it is cleaned. A caller already keeps the
//! operation's own id (the order, the payout) durably, since it is the work itself. A name-based
//! UUID of that id is the same key on any process, host or day, with nothing more to store,
//! write or lose. The id must name one operation (`order-1042/charge`, not `order-1042` for
//! both the charge and its refund), and the namespace ([`Policy::with_namespace`]) keeps two
//! applications' ids apart.
//!
//! # What is retried
//!
//! | the attempt met | what follows |
//! |---|---|
//! | a connection error, a timeout, a dropped connection | a retry |
//! | `409` (the key in flight), `429` | a retry, no sooner than its `Retry-After` |
//! | `502`, `503`, `504` | a retry, no sooner than a `Retry-After` if given |
//! | `500` | a retry with [`Policy::with_retry_on_500`], else the answer |
//! | `422` to a keyed request | [`Error::KeyReused`]: the key was used with another payload |
//! | anything else (`2xx`, `400`, `401`, `402`, `403`, `404`, other `4xx`...) | the answer |
//!
//! Waits grow exponentially with full jitter ([`Policy::with_backoff`]), up to a maximum of
//! attempts and a deadline for the whole operation. A `Retry-After` longer than what is left of
//! the deadline ends the retries at once with the server's answer; so does a wait that would.
//! The answer's [`Outcome::stop`] says why it is the last ([`StopReason`]); a failure's
//! [`Error`] says it too, and carries the key to send again later.
//!
//! # Bodies
//!
//! Only a body that can be sent again is retried: a buffered one (reqwest's
//! `Request::try_clone`, Tower's [`ReplayBody`]). A streaming body is sent once; if that attempt
//! fails, the answer or the error says so ([`StopReason::StreamingBody`]). Methods that neither
//! get a key nor are idempotent (`POST` with a policy that keys only `PATCH`) are sent once
//! too ([`StopReason::NotIdempotent`]).
//!
//! # What the caller learns
//!
//! Every response carries an [`Outcome`] in its extensions: the key, how many attempts were
//! sent, and whether the answer was a replay (the server's `Idempotent-Replayed: true`, or the
//! header it names instead, [`Policy::with_replay_header`]).
//!
//! # Tower
//!
//! [`IdempotentLayer`] wraps any `Service<http::Request<B>>` client whose body `B` is a
//! [`ReplayBody`]: hyper-util's `Client`, tonic's `Channel`, a `tower::timeout` around either.
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use tower::{Layer, ServiceExt};
//! use tower_idempotency_client::{IdempotentLayer, Outcome, Policy};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! # let url = format!("http://{}", listener.local_addr()?);
//! # let app = axum::Router::new().route("/v1/charges", axum::routing::post(|| async { "{}" }));
//! # tokio::spawn(async move { axum::serve(listener, app).await });
//! let hyper = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let client = IdempotentLayer::new(Policy::new()).layer(hyper);
//!
//! let request = http::Request::post(format!("{url}/v1/charges"))
//!     .body(Full::new(Bytes::from_static(b"amount=2000&currency=usd")))?;
//! let response = client.oneshot(request).await?;
//! let outcome = response.extensions().get::<Outcome>().expect("set on every answer");
//! assert!(outcome.key().is_some());
//! # Ok(())
//! # }
//! ```
//!
//! # Features
//!
//! * `reqwest` (default): [`IdempotentMiddleware`].
//! * `tower` (default): [`IdempotentLayer`], [`Idempotent`], [`ReplayBody`].
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, clippy::unwrap_used)]
#![cfg_attr(test, allow(clippy::unwrap_used))]
#![cfg_attr(docsrs, feature(doc_cfg))]
// The docs name both sides; a build with one of them renders the other's links as text.
#![cfg_attr(
    not(all(feature = "reqwest", feature = "tower")),
    allow(rustdoc::broken_intra_doc_links)
)]
// Without either side, the shared core has no caller.
#![cfg_attr(not(any(feature = "reqwest", feature = "tower")), allow(dead_code))]

mod attempts;
mod backoff;
mod classify;
mod error;
mod key;
mod outcome;
mod policy;

#[cfg(feature = "tower")]
mod body;
#[cfg(feature = "tower")]
mod future;
#[cfg(feature = "tower")]
mod layer;
#[cfg(feature = "reqwest")]
mod middleware;
#[cfg(feature = "tower")]
mod service;

#[cfg(feature = "tower")]
pub use body::ReplayBody;
pub use error::{BoxError, Error};
#[cfg(feature = "tower")]
pub use future::ResponseFuture;
pub use key::{
    DEFAULT_NAMESPACE, IDEMPOTENCY_KEY, IdempotencyKey, KeyFormat, KeyOrigin, OperationId,
};
#[cfg(feature = "tower")]
pub use layer::IdempotentLayer;
#[cfg(feature = "reqwest")]
pub use middleware::IdempotentMiddleware;
pub use outcome::{Outcome, StopReason};
pub use policy::{ConfigError, IDEMPOTENT_REPLAYED, Policy};
#[cfg(feature = "tower")]
pub use service::Idempotent;
