//! What can stop a step ([`StepError`]), and why a handler got no [`Steps`](super::Steps)
//! ([`MissingSteps`]).

use std::fmt;

use crate::store::StepLogError;

/// Why [`Steps::run`](super::Steps::run) returned no value.
#[derive(Debug)]
#[non_exhaustive]
pub enum StepError<E> {
    /// The step's closure failed: nothing was recorded, and a retry runs it again with the
    /// same [`DownstreamKey`](super::DownstreamKey).
    Failed(E),
    /// Another request took the key over: nothing was recorded, and the handler must stop,
    /// as its response will not be kept either.
    Lost,
    /// The store could not read or record the step.
    Store(StepLogError),
    /// The step's result could not be serialized, or a recorded one deserialized into the
    /// type asked for.
    Output(serde_json::Error),
}

impl<E> StepError<E> {
    /// The closure's own error, if that is what stopped the step.
    pub fn into_inner(self) -> Option<E> {
        match self {
            Self::Failed(error) => Some(error),
            _ => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for StepError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Failed(error) => write!(f, "the step failed: {error}"),
            Self::Lost => f.write_str(
                "another request took the idempotency key over: the step was not recorded",
            ),
            Self::Store(_) => f.write_str("the store could not read or record the step"),
            Self::Output(_) => f.write_str("the step's result could not be (de)serialized"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for StepError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Failed(error) => Some(error),
            Self::Lost => None,
            Self::Store(error) => Some(&**error),
            Self::Output(error) => Some(error),
        }
    }
}

/// Why a handler that asked for [`Steps`](super::Steps) got none; answered as `500` with the
/// reason, since it is the app's setup that is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingSteps(pub(crate) Reason);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The request ran without an idempotency key.
    Unkeyed,
    /// The layer has no step secret.
    SecretUnset,
    /// The store keeps no steps.
    NoLogInStore,
    /// The claim has no fence: PostgreSQL's transactional mode.
    Unfenced,
}

impl fmt::Display for MissingSteps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Reason::Unkeyed => {
                "this handler needs Steps, but the request was not run under an idempotency key: \
                 put the route behind the IdempotencyLayer, make sure it covers this method \
                 (IdempotencyLayer::with_methods) and make the key required \
                 (KeySource::required)"
            }
            Reason::SecretUnset => {
                "this handler needs Steps, but the IdempotencyLayer has no step secret: set \
                 one with IdempotencyLayer::with_step_secret (the same on every instance)"
            }
            Reason::NoLogInStore => {
                "this handler needs Steps, but the idempotency store keeps no steps (its \
                 capabilities have no step log): use MemoryStore or PostgresStore"
            }
            Reason::Unfenced => {
                "this handler needs Steps, but its claim records none: PostgreSQL's \
                 transactional mode commits the handler's writes with its response, so it \
                 needs no steps; use lease mode for Steps"
            }
        })
    }
}

impl std::error::Error for MissingSteps {}

#[cfg(feature = "axum")]
mod axum_impl {
    use axum_core::response::{IntoResponse, Response};
    use http::{HeaderValue, StatusCode, header::RETRY_AFTER};

    use super::{MissingSteps, StepError};

    impl IntoResponse for MissingSteps {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    /// The closure's error answers as the app made it; the others as `409` (the key was taken
    /// over), `503` (the store failed, retry) or `500`.
    impl<E: IntoResponse> IntoResponse for StepError<E> {
        fn into_response(self) -> Response {
            let (status, text) = match self {
                Self::Failed(error) => return error.into_response(),
                Self::Lost => (
                    StatusCode::CONFLICT,
                    "another request took the idempotency key over",
                ),
                Self::Store(error) => {
                    tracing::error!(%error, "the step log failed");
                    let mut response = (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the step could not be recorded",
                    )
                        .into_response();
                    response
                        .headers_mut()
                        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
                    return response;
                }
                Self::Output(error) => {
                    tracing::error!(%error, "a step's result could not be (de)serialized");
                    (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "a step's result could not be (de)serialized",
                    )
                }
            };
            (status, text).into_response()
        }
    }
}
