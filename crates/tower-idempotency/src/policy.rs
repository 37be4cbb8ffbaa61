//! Decisions the layer makes on the application's behalf: [`RetentionPolicy`], [`StoreFailure`], [`Disconnect`].

use std::{fmt, sync::Arc};

use http::StatusCode;

/// Keep or release a key after its handler answered. The layer decides by the
/// [`RetentionPolicy`]; a handler decides for one response with a `Retention` response
/// extension:
///
/// ```
/// use axum::{Extension, http::StatusCode, response::IntoResponse};
/// use tower_idempotency::Retention;
///
/// // A 409 that means "try again later, nothing was done": release the key for this response.
/// async fn handler() -> impl IntoResponse {
///     (StatusCode::CONFLICT, Extension(Retention::Release), "account is locked, retry later")
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Store the response; every retry with this key gets it replayed.
    Keep,
    /// Store nothing and free the key: the response means nothing was done, so a retry (perhaps
    /// corrected) may run the handler again. Decided by the [policy](RetentionPolicy) for a
    /// server error (or a failed body) of a handler that handed a
    /// [downstream key](crate::Steps::downstream_key) out, it gives the key up as
    /// [`Abandon`](Self::Abandon) does, since the call may have gone through; a `4xx` refusal,
    /// or a handler that chose it itself, is taken at its word.
    Release,
    /// Store nothing and give the key up part-way: the handler stopped not knowing what a call
    /// outside it did (a downstream answer was lost). The key stays claimed with its recorded
    /// [steps](crate::Steps), its lease lapsed: the next request with it takes it over at once
    /// and goes on from them, and with [completion](crate::guide::completion) on the
    /// [`Completer`](crate::Completer) finishes it if its client never comes back.
    Abandon,
}

/// Which responses are kept; set with
/// [`IdempotencyLayer::with_retention`](crate::IdempotencyLayer::with_retention).
///
/// The default keeps final outcomes and releases responses that mean "nothing was done", Stripe's
/// rule that a request rejected at validation stores nothing:
///
/// | status | default |
/// |---|---|
/// | 2xx, 3xx | keep |
/// | 400, 401, 403, 405, 408, 411, 413, 414, 415, 422, 429, 431 | release: rejected before anything happened |
/// | other 4xx (402 declined, 404, 409, 410...) | keep: a final answer |
/// | 5xx | release, so a later retry can succeed ([`keep_server_errors`](Self::keep_server_errors) keeps them, as Stripe does) |
/// | 1xx | release |
#[derive(Clone, Default)]
pub struct RetentionPolicy(RetentionSource);

#[derive(Clone, Default)]
enum RetentionSource {
    #[default]
    FinalOutcomes,
    FinalOutcomesAndServerErrors,
    Custom(Arc<dyn Fn(StatusCode) -> Retention + Send + Sync>),
}

impl RetentionPolicy {
    /// The default policy (see the table above).
    pub fn final_outcomes() -> Self {
        Self(RetentionSource::FinalOutcomes)
    }

    /// Like the default, but 5xx responses are kept too: a retry of a request that failed
    /// on the server gets the same failure (Stripe's behaviour).
    pub fn keep_server_errors() -> Self {
        Self(RetentionSource::FinalOutcomesAndServerErrors)
    }

    /// Decides by status with `f`.
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(StatusCode) -> Retention + Send + Sync + 'static,
    {
        Self(RetentionSource::Custom(Arc::new(f)))
    }

    /// The decision for a response with this status.
    pub fn decide(&self, status: StatusCode) -> Retention {
        match &self.0 {
            RetentionSource::FinalOutcomes => final_outcome(status, false),
            RetentionSource::FinalOutcomesAndServerErrors => final_outcome(status, true),
            RetentionSource::Custom(f) => f(status),
        }
    }
}

fn final_outcome(status: StatusCode, keep_server_errors: bool) -> Retention {
    let nothing_done = matches!(
        status.as_u16(),
        100..=199 | 400 | 401 | 403 | 405 | 408 | 411 | 413 | 414 | 415 | 422 | 429 | 431
    );
    if nothing_done || (status.is_server_error() && !keep_server_errors) {
        Retention::Release
    } else {
        Retention::Keep
    }
}

impl fmt::Debug for RetentionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            RetentionSource::FinalOutcomes => "RetentionPolicy::final_outcomes()",
            RetentionSource::FinalOutcomesAndServerErrors => {
                "RetentionPolicy::keep_server_errors()"
            }
            RetentionSource::Custom(_) => "RetentionPolicy::from_fn(..)",
        })
    }
}

/// What a request gets when the store fails at claim time; set with
/// [`IdempotencyLayer::with_store_failure`](crate::IdempotencyLayer::with_store_failure).
///
/// Failures after the handler ran never turn its response into an error: the response is
/// delivered and the layer keeps trying to store it in the background.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreFailure {
    /// Answer `503` with `Retry-After: retry_after_secs` and run nothing (the default, with
    /// 1 second): a write is never executed without its key being held.
    FailClosed {
        /// The `Retry-After` seconds.
        retry_after_secs: u64,
    },
    /// Run the handler without idempotency protection and log a warning. Choose this only where
    /// availability matters more than exactly-once.
    FailOpen,
}

impl Default for StoreFailure {
    fn default() -> Self {
        Self::FailClosed {
            retry_after_secs: 1,
        }
    }
}

/// What happens to a claimed request's handler when the client disconnects; set with
/// [`IdempotencyLayer::with_disconnect`](crate::IdempotencyLayer::with_disconnect).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disconnect {
    /// Run the handler to completion (in a task of its own once the client is gone) and store
    /// its response (the default), so the client's retry gets a replay of what did happen
    /// rather than a second execution.
    #[default]
    RunToCompletion,
    /// Drop the handler with the connection, and release the key. Only for handlers that are
    /// safe to cancel at any `.await` (they leave no partial effects behind).
    Cancel,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decide(policy: &RetentionPolicy, status: u16) -> Retention {
        policy.decide(StatusCode::from_u16(status).unwrap())
    }

    #[test]
    fn default_keeps_final_outcomes_and_releases_rejections() {
        let policy = RetentionPolicy::default();
        for status in [200, 201, 202, 204, 301, 303, 402, 404, 409, 410] {
            assert_eq!(decide(&policy, status), Retention::Keep, "{status}");
        }
        for status in [400, 401, 403, 408, 413, 415, 422, 429, 500, 502, 503] {
            assert_eq!(decide(&policy, status), Retention::Release, "{status}");
        }
    }

    #[test]
    fn stripe_style_keeps_server_errors_but_still_releases_rejections() {
        let policy = RetentionPolicy::keep_server_errors();
        assert_eq!(decide(&policy, 500), Retention::Keep);
        assert_eq!(decide(&policy, 400), Retention::Release);
    }

    #[test]
    fn custom_policy_decides() {
        let policy = RetentionPolicy::from_fn(|s| {
            if s == StatusCode::OK {
                Retention::Keep
            } else {
                Retention::Release
            }
        });
        assert_eq!(decide(&policy, 200), Retention::Keep);
        assert_eq!(decide(&policy, 201), Retention::Release);
    }
}
