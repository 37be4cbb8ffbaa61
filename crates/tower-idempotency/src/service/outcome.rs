//! What a keyed request came to: refusals rendered, replays sent, the `outcome` recorded.

use http::Response;

use crate::{
    body::ResponseBody, metrics, problem::Rejection, record::Record, replay, settings::Config,
};

pub(super) fn replayed<B>(config: &Config, record: &Record) -> Response<ResponseBody<B>> {
    outcome(Outcome::Replayed);
    replay::response(record, config.rendering.replayed_header())
}

pub(super) fn mismatch<B>(config: &Config) -> Response<ResponseBody<B>> {
    outcome(Outcome::Mismatch);
    let across_endpoints = config.scope.is_across_endpoints();
    reject(config, Rejection::mismatch(across_endpoints))
}

pub(super) fn reject<B>(config: &Config, rejection: Rejection) -> Response<ResponseBody<B>> {
    metrics::rejected(rejection.kind());
    config.rendering.render(rejection)
}

/// What became of a keyed request: the `outcome` field of the `idempotency` span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A new key: the handler ran and its response was stored.
    Acquired,
    /// A key taken over from a lapsed lease: the handler ran and its response was stored.
    Takeover,
    /// A completed key: the stored response was replayed.
    Replayed,
    /// The key is in flight: `409`.
    Conflict,
    /// The key belongs to another payload: `422`.
    Mismatch,
    /// The handler ran (or failed) and the key was freed without storing a response.
    Released,
    /// The handler ran past its maximum time: cancelled, its key taken over by the next request.
    Abandoned,
    /// Too many handlers run for clients that hung up: `503`, nothing claimed.
    Overloaded,
    /// The store failed at claim time.
    StoreError,
    /// The key's stored response did not open: `500`.
    Unopenable,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::Takeover => "takeover",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::Released => "released",
            Self::Abandoned => "abandoned",
            Self::Overloaded => "overloaded",
            Self::StoreError => "store_error",
            Self::Unopenable => "unopenable",
        }
    }
}

pub(super) fn outcome(outcome: Outcome) {
    metrics::outcome(outcome.as_str());
    tracing::Span::current().record("outcome", outcome.as_str());
    tracing::debug!(outcome = outcome.as_str(), "idempotent request");
}

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("<non-string panic payload>")
}
