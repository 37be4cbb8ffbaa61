//! Counters and histograms, through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`): install any recorder (Prometheus, StatsD, OpenTelemetry...) and they appear.
//!
//! ```
//! # #[cfg(feature = "metrics")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use axum::{Router, body::Body, routing::post};
//! use metrics_exporter_prometheus::PrometheusBuilder;
//! use tower::ServiceExt;
//! use tower_idempotency::{IdempotencyLayer, Principal};
//!
//! // Once, at start-up; serve `handle.render()` at `/metrics` (as the demo does).
//! let handle = PrometheusBuilder::new().install_recorder().unwrap();
//!
//! let app = Router::new()
//!     .route("/v1/charges", post(|| async { "charged" }))
//!     .layer(IdempotencyLayer::memory());
//! for _ in 0..2 {
//!     let mut request = http::Request::post("/v1/charges")
//!         .header("idempotency-key", "order-1")
//!         .body(Body::empty())
//!         .unwrap();
//!     // What the app's authentication layer leaves (see `scope`).
//!     request.extensions_mut().insert(Principal::new("acct_1").unwrap());
//!     app.clone().oneshot(request).await.unwrap();
//! }
//!
//! let text = handle.render();
//! assert!(text.contains(r#"idempotency_requests_total{outcome="acquired"} 1"#));
//! assert!(text.contains(r#"idempotency_requests_total{outcome="replayed"} 1"#));
//! # }
//! # #[cfg(not(feature = "metrics"))]
//! # fn main() {}
//! ```
//!
//! | metric | type | labels | an alert on it means |
//! |---|---|---|---|
//! | `idempotency_requests_total` | counter | `outcome`: `acquired`, `takeover`, `replayed`, `conflict`, `mismatch`, `released`, `abandoned`, `overloaded`, `store_error`, `unopenable` | a rising `replayed` share: clients time out before the server answers (raise their timeout); `takeover`: handlers outlive their lease or processes crash; `mismatch`: a client reuses keys for new requests; `abandoned`: handlers hang past their maximum time; `overloaded`: too many handlers run on for clients that hung up; `store_error`: the store is failing |
//! | `idempotency_rejections_total` | counter | `kind`: the [`RejectionKind`](crate::RejectionKind) in snake case | `key_missing`/`key_invalid`: a client integration is broken; `body_too_large`/`body_timeout`: limits too tight or abuse; `principal_missing`: the auth layer is misplaced |
//! | `idempotency_store_seconds` | histogram | `operation`: `claim`, `complete`, `release`, `renew` | the store is slow: every keyed request pays `claim` |
//! | `idempotency_lease_renewals_total` | counter | `result`: `held`, `lost`, `error` | `lost`: a holder kept running after another took its key over |
//! | `idempotency_stored_body_bytes` | histogram | | storage growth; responses near `max_response_bytes` |
//! | `idempotency_store_batch_size` | histogram | `operation`: `claim`, `complete` | [`PostgresStore`](crate::store::PostgresStore)'s group commit: requests sharing each statement; about 1 under load means requests are spread too thin to share (many instances, little concurrency each) |
//! | `idempotency_expired_deleted_total` | counter | | expiry keeps up (compare with the rate of new keys) |
//! | `idempotency_expiry_errors_total` | counter | | the expiry loop is failing: the table grows |
//! | `idempotency_in_flight_waits_total` | counter | `result`: `replayed`, `acquired`, `mismatch`, `timed_out`, `full`, `hung_up`, `store_error` | duplicates that waited for their key ([`with_in_flight_wait`](crate::IdempotencyLayer::with_in_flight_wait)): `timed_out`, the wait is shorter than the handlers; `full`, more duplicates wait than `with_max_waiting` allows; `hung_up`, the client left while waiting (nothing was claimed); `store_error`, a re-read failed and the duplicate got `409` |
//! | `idempotency_completions_total` | counter | `result`: `picked`, `completed`, `failed`, `gave_up`, `keep_error`, `pick_error`, `refused_unkeyed`, `refused_mismatch`, `refused_store_error`, `released_unkept` | the [`Completer`](crate::Completer): `picked`, clients crash or hang up for good; `gave_up`, a key was tried its maximum times and is left to its client; `keep_error`, a request could not be kept; `refused_*`, a completer's request ran nothing (no key found in it, not the request kept, or its claim failed); `released_unkept`, a key claimed to keep its request never kept it (its process died in between) and was freed |
//! | `idempotency_store_survives_failover` | gauge | | `0`: [`PostgresStore`](crate::store::PostgresStore) read that a record it acknowledges now may be lost by a failover (no synchronous standby, or asynchronous commits; see [`Durability`](crate::store::Durability)) |
//! | `idempotency_records_unopenable_total` | counter | | any: a stored response did not open ([`RecordUnopenable`](crate::store::RecordUnopenable)) and its retry got `500`; keys missing after a rotation, or altered rows |

/// Keyed requests by outcome.
pub const REQUESTS: &str = "idempotency_requests_total";
/// Duplicates that waited for their key in flight, by how the wait ended.
pub const IN_FLIGHT_WAITS: &str = "idempotency_in_flight_waits_total";
/// Refusals by kind.
pub const REJECTIONS: &str = "idempotency_rejections_total";
/// Store operation latency, in seconds.
pub const STORE_SECONDS: &str = "idempotency_store_seconds";
/// Lease renewals by result.
pub const LEASE_RENEWALS: &str = "idempotency_lease_renewals_total";
/// Stored response body sizes, in bytes.
pub const STORED_BODY_BYTES: &str = "idempotency_stored_body_bytes";
/// Operations written together by one batch statement (lease mode's group commit).
pub const STORE_BATCH_SIZE: &str = "idempotency_store_batch_size";
/// Records deleted by expiry.
pub const EXPIRED_DELETED: &str = "idempotency_expired_deleted_total";
/// Failed expiry batches.
pub const EXPIRY_ERRORS: &str = "idempotency_expiry_errors_total";
/// The completer's work, by what became of it.
pub const COMPLETIONS: &str = "idempotency_completions_total";
/// Stored records that did not open.
pub const RECORDS_UNOPENABLE: &str = "idempotency_records_unopenable_total";
/// Whether PostgreSQL, when last read, promised that an acknowledged record survives a failover.
pub const SURVIVES_FAILOVER: &str = "idempotency_store_survives_failover";

#[cfg(feature = "metrics")]
mod record {
    use std::time::Duration;

    use crate::problem::RejectionKind;

    pub(crate) fn outcome(outcome: &'static str) {
        metrics::counter!(super::REQUESTS, "outcome" => outcome).increment(1);
    }

    pub(crate) fn rejected(kind: RejectionKind) {
        metrics::counter!(super::REJECTIONS, "kind" => kind.label()).increment(1);
    }

    pub(crate) fn store_operation(operation: &'static str, elapsed: Duration) {
        metrics::histogram!(super::STORE_SECONDS, "operation" => operation)
            .record(elapsed.as_secs_f64());
    }

    pub(crate) fn renewal(result: &'static str) {
        metrics::counter!(super::LEASE_RENEWALS, "result" => result).increment(1);
    }

    pub(crate) fn stored_body(bytes: usize) {
        metrics::histogram!(super::STORED_BODY_BYTES).record(bytes as f64);
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn batch(operation: &'static str, size: usize) {
        metrics::histogram!(super::STORE_BATCH_SIZE, "operation" => operation).record(size as f64);
    }

    pub(crate) fn expired_deleted(count: u64) {
        metrics::counter!(super::EXPIRED_DELETED).increment(count);
    }

    pub(crate) fn expiry_error() {
        metrics::counter!(super::EXPIRY_ERRORS).increment(1);
    }

    pub(crate) fn waited(result: &'static str) {
        metrics::counter!(super::IN_FLIGHT_WAITS, "result" => result).increment(1);
    }

    pub(crate) fn record_unopenable() {
        metrics::counter!(super::RECORDS_UNOPENABLE).increment(1);
    }

    pub(crate) fn completions(result: &'static str, count: usize) {
        metrics::counter!(super::COMPLETIONS, "result" => result).increment(count as u64);
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn survives_failover(survives: bool) {
        metrics::gauge!(super::SURVIVES_FAILOVER).set(if survives { 1.0 } else { 0.0 });
    }
}

#[cfg(not(feature = "metrics"))]
mod record {
    use crate::problem::RejectionKind;

    pub(crate) fn outcome(_: &'static str) {}
    pub(crate) fn rejected(_: RejectionKind) {}
    pub(crate) fn renewal(_: &'static str) {}
    pub(crate) fn stored_body(_: usize) {}
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn batch(_: &'static str, _: usize) {}
    pub(crate) fn expired_deleted(_: u64) {}
    pub(crate) fn expiry_error() {}
    pub(crate) fn waited(_: &'static str) {}
    pub(crate) fn record_unopenable() {}
    pub(crate) fn completions(_: &'static str, _: usize) {}
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn survives_failover(_: bool) {}
}

#[cfg(feature = "postgres")]
pub(crate) use record::batch;
#[cfg(feature = "metrics")]
use record::store_operation;
pub(crate) use record::{
    completions, expired_deleted, expiry_error, outcome, record_unopenable, rejected, renewal,
    stored_body, survives_failover, waited,
};

/// One event of the completer's.
pub(crate) fn completion(result: &'static str) {
    completions(result, 1);
}

/// Times a store operation.
#[cfg(feature = "metrics")]
pub(crate) fn timed<F: std::future::Future>(operation: &'static str, future: F) -> Timed<F> {
    Timed {
        future,
        operation,
        started: None,
    }
}

#[cfg(feature = "metrics")]
pin_project_lite::pin_project! {
    /// A store operation's future, timed from its first poll to its output; a struct, to keep
    /// requests' futures small (see the service module).
    pub(crate) struct Timed<F> {
        #[pin]
        future: F,
        operation: &'static str,
        started: Option<std::time::Instant>,
    }
}

#[cfg(feature = "metrics")]
impl<F: std::future::Future> std::future::Future for Timed<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.project();
        let started = *this.started.get_or_insert_with(std::time::Instant::now);
        let output = std::task::ready!(this.future.poll(cx));
        store_operation(this.operation, started.elapsed());
        std::task::Poll::Ready(output)
    }
}

/// Without the `metrics` feature, the operation itself.
#[cfg(not(feature = "metrics"))]
pub(crate) fn timed<F: std::future::Future>(_operation: &'static str, future: F) -> F {
    future
}
