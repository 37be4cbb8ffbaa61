//! Finishing keys whose client never came back: the layer keeps each keyed request with its
//! claim ([`IdempotencyLayer::with_completion`](crate::IdempotencyLayer::with_completion)),
//! and a [`Completer`] sends the request of a key left in flight through the app again, as
//! the client's retry would. The client's later retry gets the replay.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{Router, routing::post};
//! use http::HeaderName;
//! use tower_idempotency::{Completer, Completion, IdempotencyLayer, store::PostgresStore};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::new(sqlx::PgPool::connect("postgres://localhost/app").await?);
//! store.migrate().await?;
//! let layer = IdempotencyLayer::new(store.clone())
//!     // The key header is always kept; name the others the handler reads.
//!     .with_completion(Completion::storing_headers([HeaderName::from_static("stripe-account")]))?;
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(|| async { "charged" }))
//!     .layer(layer);
//! // The router the completer drives: the app with the idempotency layer, without the
//! // authentication in front of it (the kept principal stands for it).
//! let completer = Completer::new(&store, app.clone())?
//!     .with_grace(Duration::from_secs(300))?
//!     .with_max_attempts(5)?;
//! tokio::spawn(completer.run(Duration::from_secs(30)));
//! # Ok(()) }
//! ```
//!
//! # When to turn it on
//!
//! When a request's effects outside your database must not be left half done because its
//! client crashed: a charge authorized at the card network and never captured or voided. Use
//! it with [`Steps`](crate::Steps), so the completer continues at the first unfinished step
//! with the same downstream keys.
//!
//! # What is kept
//!
//! The method, the URI, the key's header, `Content-Type` and the headers [`Completion`] names, the body (within
//! the layer's request limit) and the principal. Other headers are never kept, `Authorization`
//! among them. Name the headers your fingerprint covers, or the completer's request is a
//! mismatch. The request is kept in `idempotency.pending_requests` until the key completes (the
//! completer's next round or the expiry loop deletes it) or expires; behind a
//! [`SealingStore`](crate::store::SealingStore) it is sealed as responses are.
//!
//! # What is completed, and its bounds
//!
//! A key is taken when its holder's lease lapsed more than the grace ago and no request holds
//! it; a key its client came back for is its client's. The completer's request goes through the
//! layer, whose claim (a takeover) is what excludes every other holder; the pick itself counts
//! an attempt and skips keys other instances are picking (`FOR UPDATE SKIP LOCKED`). Each
//! completer drives at most [`with_concurrency`](Completer::with_concurrency) keys at a time,
//! a key is tried again only after the grace, and at most
//! [`with_max_attempts`](Completer::with_max_attempts) times, then left to its client
//! (`gave_up` in [`metrics`](crate::metrics), and a warning). The request carries
//! [`Completing`] in its extensions, so handlers, logs and metrics tell it apart.

use http::HeaderName;

mod completer;
mod keep;
mod request;

pub use completer::{Completer, Round};
pub(crate) use keep::Keep;

/// What the layer keeps of each keyed request for the [`Completer`], besides the method, URI,
/// body, principal, `Content-Type` and the key's header; see [`with_completion`](crate::IdempotencyLayer::with_completion).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Completion {
    headers: Vec<HeaderName>,
}

impl Completion {
    /// Keeps no header but the key's and `Content-Type`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps the headers named (each of their values), and the key's and `Content-Type`.
    pub fn storing_headers(headers: impl IntoIterator<Item = HeaderName>) -> Self {
        Self {
            headers: headers.into_iter().collect(),
        }
    }

    /// The headers kept besides the key's.
    pub fn headers(&self) -> &[HeaderName] {
        &self.headers
    }
}

/// In the extensions of a request a [`Completer`] sends: which attempt it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completing {
    attempt: u32,
}

impl Completing {
    /// Which attempt this is for its key, counting from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}
