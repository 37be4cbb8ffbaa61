// The crate's front page is the repository's README (this crate's README.md links to it), so
// its protocol table and quick start exist once. Its links are relative to the repository root
// and point at docs.rs; the definitions below come first, so rustdoc uses them instead.
//! [quickstart]: https://github.com/tower-idempotency/tower-idempotency/blob/main/examples/quickstart/src/main.rs
//! [layering]: IdempotencyLayer#among-other-layers
//! [config]: IdempotencyLayer::new
//! [operating]: guide::operating
//! [modes]: guide::modes
//! [`Principal`]: Principal
//! [`Rejection`]: Rejection
//! [`IdempotencyLayer`]: IdempotencyLayer
//! [`IdempotentTx`]: IdempotentTx
//! [`PostgresStore`]: store::PostgresStore
//! [`MemoryStore`]: store::MemoryStore
//! [`CachingStore`]: store::CachingStore
//! [`Store`]: store::Store
//! [redis]: https://github.com/tower-idempotency/tower-idempotency/tree/main/examples/redis-store
//! [demo]: https://github.com/tower-idempotency/tower-idempotency/blob/main/examples/charges-demo/README.md
//! [stripe-python]: https://github.com/tower-idempotency/tower-idempotency/tree/main/examples/stripe-python
//! [stripe-node]: https://github.com/tower-idempotency/tower-idempotency/tree/main/examples/stripe-node
//! [chaos]: https://github.com/tower-idempotency/tower-idempotency/blob/main/crates/chaos/README.md
//! [bench]: https://github.com/tower-idempotency/tower-idempotency/blob/main/crates/idempotency-bench/README.md
//! [results]: https://github.com/tower-idempotency/tower-idempotency/blob/main/crates/idempotency-bench/RESULTS.md
//! [peers]: https://github.com/tower-idempotency/tower-idempotency/blob/main/crates/peers/README.md
//! [fuzz]: https://github.com/tower-idempotency/tower-idempotency/blob/main/crates/tower-idempotency/fuzz/README.md
//! [changelog]: https://github.com/tower-idempotency/tower-idempotency/blob/main/CHANGELOG.md
#![doc = include_str!("../README.md")]
//!
//! ## How a request flows
//!
//! 1. [`IdempotencyKey`]: the `Idempotency-Key` header is parsed (sf-string or bare token).
//! 2. [`Scope`]: the key is scoped to the authenticated [`Principal`], method and path, and hashed.
//! 3. [`Fingerprint`]: the body is buffered (bounded) and fingerprinted.
//! 4. [`store`]: the key is claimed in one atomic step ([`Store::claim`](store::Store::claim)).
//! 5. The handler runs under a lease renewed by a heartbeat, to completion even if the client
//!    hangs up.
//! 6. [`Record`]: its response is captured and stored, or the key released ([`RetentionPolicy`]).
//! 7. [Replays](Record#replays): retries get the record back.
//!
//! ## Features
//!
//! * `postgres` (default): [`PostgresStore`](store::PostgresStore) on sqlx, with its
//!   [transactional mode](guide::modes) in which the handler's writes and the stored response
//!   commit together.
//! * `axum` (default): [`IdempotencyContext`] and [`IdempotentTx`] as axum extractors, and keys
//!   scoped by the URI the client sent under `Router::nest`.
//! * `metrics`: counters and histograms through the `metrics` facade ([`metrics`]).
//! * `conformance`: the store protocol's rules as checks for a third-party [`Store`](store::Store)'s
//!   tests ([`store::conformance`]).
//! * `utoipa`: the layer's contract in an app's OpenAPI document ([`openapi`]).
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
mod chain;
mod completion;
mod context;
mod fingerprint;
mod future;
pub mod guide;
mod key;
mod layer;
pub mod metrics;
mod once;
#[cfg(feature = "utoipa")]
pub mod openapi;
mod policy;
mod problem;
mod record;
mod rendering;
mod replay;
mod scope;
mod service;
mod settings;
mod steps;
pub mod store;
#[cfg(feature = "postgres")]
mod transaction;
#[cfg(feature = "webhooks")]
pub mod webhook;

pub use body::{RequestBody, ResponseBody};
pub use completion::{Completer, Completing, Completion, Round};
pub use context::IdempotencyContext;
#[cfg(feature = "axum")]
pub use context::MissingIdempotencyContext;
#[doc(hidden)]
pub use fingerprint::{CanonicalJsonError, FormPair, canonical_form_pairs, canonical_json};
pub use fingerprint::{Fingerprint, FingerprintMode, Fingerprinting};
pub use future::ResponseFuture;
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, KeyRule, KeySource, MAX_KEY_LEN};
pub use layer::IdempotencyLayer;
pub use once::{MAX_SCOPE_LEN, Once, OnceError, ScopeError};
pub use policy::{Disconnect, Retention, RetentionPolicy, StoreFailure};
pub use problem::{PROBLEM_JSON, PROBLEM_TYPE_BASE, Rejection, RejectionKind};
pub use record::{IDEMPOTENT_REPLAYED, Record, RecordBytesError};
pub use rendering::Rendering;
pub use replay::{BODY_NOT_STORED_TYPE, IDEMPOTENT_REPLAY_BODY};
pub use scope::{EmptyPrincipal, Principal, Scope, ScopeKey};
pub use service::Idempotency;
pub use settings::{
    ConfigError, InFlightWait, Limits, MAX_DURATION, MIN_LEASE, MIN_STEP_SECRET_BYTES,
};
pub use steps::{DownstreamKey, MissingSteps, StepError, Steps};
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
