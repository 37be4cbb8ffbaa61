//! Requests a [`Completer`](crate::Completer) sends: they never run unprotected. Each is
//! refused, running nothing, unless the layer finds its key again under the scope key and
//! fingerprint it was kept with and claims it.

use crate::{
    completion::Completing,
    fingerprint::Fingerprint,
    metrics,
    problem::{Rejection, RejectionKind},
    scope::ScopeKey,
};

/// Why a completer's request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The layer does not cover its method, or found no key in it.
    Unkeyed,
    /// Its key or payload is not the one it was kept under.
    Differs,
    /// Its claim failed: failing open is for clients, never for the completer.
    StoreFailed,
}

impl Refusal {
    /// Whether a request whose claim is `scope_key` and `fingerprint` is not the one kept.
    pub(super) fn check(
        completing: &Completing,
        scope_key: ScopeKey,
        fingerprint: Fingerprint,
    ) -> Option<Self> {
        let same = completing.scope_key == scope_key && completing.fingerprint == fingerprint;
        (!same).then_some(Self::Differs)
    }
}

/// The refusal of a completer's request, logged and counted: answered to the completer, which
/// reads the key's outcome from the store, not from this answer.
pub(super) fn refuse(refusal: Refusal) -> Rejection {
    let (label, rejection) = match refusal {
        Refusal::Unkeyed => {
            tracing::error!(
                "a completer's request carries no idempotency key the layer finds: nothing was \
                 run. With KeySource::from_request, keep the headers the key function reads \
                 (Completion::storing_headers)"
            );
            let detail = "the completer's request carries no idempotency key; nothing was run";
            (
                "refused_unkeyed",
                Rejection::new(RejectionKind::KeyMissing, detail),
            )
        }
        Refusal::Differs => {
            tracing::error!(
                "a completer's request is not the one kept for its key (another scope key or \
                 fingerprint): nothing was run"
            );
            let detail = "the completer's request is not the one kept for its key; nothing was run";
            (
                "refused_mismatch",
                Rejection::new(RejectionKind::Mismatch, detail),
            )
        }
        Refusal::StoreFailed => {
            tracing::warn!("a completer's claim failed: nothing was run; tried again later");
            ("refused_store_error", Rejection::store_unavailable(1))
        }
    };
    metrics::completion(label);
    rejection
}
