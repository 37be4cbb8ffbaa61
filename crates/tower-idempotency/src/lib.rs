//! Idempotency-Key middleware for [Tower] and [Axum]: a retried write runs once, and every retry
//! gets the first response back, byte for byte.
//!
//! ```
//! use axum::{Router, body::Body, extract::Request, http::StatusCode, routing::post};
//! use axum::{middleware::{self, Next}, response::Response};
//! use tower::ServiceExt;
//! use tower_idempotency::{IdempotencyLayer, Principal};
//!
//! /// Your authentication: it finds the account a request acts for (here, naively, from
//! /// `Authorization: Bearer <account>`); the keys belong to that account.
//! async fn authenticate(mut request: Request, next: Next) -> Result<Response, StatusCode> {
//!     let account = request.headers().get("authorization")
//!         .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "))
//!         .ok_or(StatusCode::UNAUTHORIZED)?
//!         .to_owned();
//!     let principal = Principal::new(account).map_err(|_| StatusCode::UNAUTHORIZED)?;
//!     request.extensions_mut().insert(principal);
//!     Ok(next.run(request).await)
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new()
//!     .route("/v1/charges", post(|| async { "charged once" }))
//!     // Production: IdempotencyLayer::postgres(pool), see `store::PostgresStore`.
//!     .layer(IdempotencyLayer::memory())
//!     .layer(middleware::from_fn(authenticate));
//!
//! let charge = |account: &str| Request::post("/v1/charges")
//!     .header("authorization", format!("Bearer {account}"))
//!     .header("idempotency-key", "order-1042")
//!     .body(Body::empty()).unwrap();
//! let first = app.clone().oneshot(charge("acct_a")).await.unwrap();
//! let retry = app.clone().oneshot(charge("acct_a")).await.unwrap();
//! let other_account = app.oneshot(charge("acct_b")).await.unwrap();
//! assert!(first.headers().get("idempotent-replayed").is_none());
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! // The same key from another account is that account's own first request.
//! assert!(other_account.headers().get("idempotent-replayed").is_none());
//! # }
//! ```
//!
//! It follows the IETF draft *The Idempotency-Key HTTP Header Field* and Stripe's practice:
//!
//! | situation | response |
//! |---|---|
//! | first request with a key | the handler runs once; its response is stored and returned |
//! | retry after it completed | the stored status, headers and body, plus `Idempotent-Replayed: true` |
//! | retry while the first is still running | `409` problem, `Retry-After: 1` |
//! | same key and endpoint, different query or body | `422` problem; the stored record is untouched |
//! | same key, another endpoint (method or path) | another key: it runs; `422` with [`Scope::across_endpoints`] |
//! | key missing where [`required`](IdempotencyLayer::required) | `400` problem |
//! | key malformed, empty, over 255 characters, repeated | `400` problem |
//! | body over `max_body_bytes` (declared or streamed) | `413` problem, nothing run |
//! | body slower than `body_timeout` | `408` problem, nothing run |
//! | handler answers 400/401/403/405/408/411/413/414/415/422/429/431, or 5xx | delivered, key released: a corrected retry runs ([`RetentionPolicy`]) |
//! | handler panics | `500` problem, key released |
//! | client disconnects mid-handler | the handler finishes and its response is stored for the retry |
//! | holder crashes | lease mode: its lease lapses (30 s) and the next retry takes the key over; [transactional mode](guide::modes): free at once, nothing happened |
//! | store unreachable | `503` problem, `Retry-After` (or fail open, [`StoreFailure`]) |
//!
//! Every refusal is an RFC 9457 `application/problem+json` body ([`Rejection`]).
//!
//! # How a request flows
//!
//! 1. [`IdempotencyKey`]: the `Idempotency-Key` header is parsed (sf-string or bare token).
//! 2. [`Scope`]: the key is scoped to the authenticated [`Principal`], method and path, and hashed.
//! 3. [`Fingerprint`]: the body is buffered (bounded) and fingerprinted.
//! 4. [`store`]: the key is claimed in one atomic step ([`Store::begin`](store::Store::begin)).
//! 5. The handler runs under a lease renewed by a heartbeat, to completion even if the client
//!    hangs up.
//! 6. [`Record`]: its response is captured and stored, or the key released ([`RetentionPolicy`]).
//! 7. [Replays](Record#replays): retries get the record back.
//!
//! # Features
//!
//! * `postgres` (default): [`PostgresStore`](store::PostgresStore) on sqlx, with its
//!   [transactional mode](guide::modes) in which the handler's writes and the stored response
//!   commit together.
//! * `axum`: [`IdempotencyContext`] and [`IdempotentTx`] as axum extractors.
//! * `metrics`: counters and histograms through the `metrics` facade ([`metrics`]).
//! * `conformance`: the store protocol's rules as checks for a third-party [`Store`](store::Store)'s
//!   tests ([`store::conformance`]).
//!
//! [Tower]: https://docs.rs/tower
//! [Axum]: https://docs.rs/axum
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, clippy::unwrap_used)]
#![cfg_attr(test, allow(clippy::unwrap_used))]
#![cfg_attr(docsrs, feature(doc_cfg))]
// The docs are written for the build with every feature (docs.rs's, and CI's with warnings
// fatal); in a build without `postgres` or `conformance` their links to what it leaves out
// render as plain text instead of failing it.
#![cfg_attr(
    not(all(feature = "postgres", feature = "conformance")),
    allow(rustdoc::broken_intra_doc_links)
)]

mod body;
mod cache;
mod chain;
mod config;
mod context;
mod fingerprint;
mod future;
pub mod guide;
mod key;
mod layer;
pub mod metrics;
#[cfg(feature = "utoipa")]
pub mod openapi;
mod policy;
mod problem;
mod record;
mod replay;
mod scope;
mod service;
pub mod store;
#[cfg(feature = "postgres")]
mod transaction;

pub use body::{RequestBody, ResponseBody};
pub use config::{ConfigError, MAX_DURATION, MIN_LEASE};
pub use context::IdempotencyContext;
#[cfg(feature = "axum")]
pub use context::MissingIdempotencyContext;
#[doc(hidden)]
pub use fingerprint::{CanonicalJsonError, FormPair, canonical_form_pairs, canonical_json};
pub use fingerprint::{Fingerprint, FingerprintMode};
pub use future::ResponseFuture;
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, KeyRule, MAX_KEY_LEN};
pub use layer::IdempotencyLayer;
pub use policy::{Disconnect, Retention, RetentionPolicy, StoreFailure};
pub use problem::{PROBLEM_JSON, PROBLEM_TYPE_BASE, Rejection, RejectionKind};
pub use record::{IDEMPOTENT_REPLAYED, Record};
pub use replay::BODY_NOT_STORED_TYPE;
pub use scope::{EmptyPrincipal, Principal, Scope, ScopeKey};
pub use service::Idempotency;
#[cfg(feature = "postgres")]
pub use transaction::{IdempotentTx, TxUnavailable};

/// The sqlx this crate is built against, so that an application can name the very pool type
/// [`IdempotencyLayer::postgres`] takes, whichever sqlx it depends on itself (a pool from
/// another sqlx version is another type):
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, sqlx::PgPool};
///
/// let pool = PgPool::connect_lazy("postgres://localhost/app")?;
/// let layer = IdempotencyLayer::postgres(pool);
/// # Ok::<(), tower_idempotency::sqlx::Error>(())
/// ```
#[cfg(feature = "postgres")]
pub use sqlx;
