//! What the caller learns of an operation: [`Outcome`] in the response's extensions, and
//! [`StopReason`].

use std::fmt;

use crate::key::IdempotencyKey;

/// Why no more attempts were made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StopReason {
    /// The server's final answer: a success, or a refusal a retry cannot get past.
    Final,
    /// The policy's maximum attempts were made.
    AttemptsExhausted,
    /// The next attempt could not have started before the deadline.
    Deadline,
    /// The server's `Retry-After` reached past the deadline: its answer is returned at once.
    RetryAfterPastDeadline,
    /// The request body is a stream, which cannot be sent again: it was sent once.
    StreamingBody,
    /// The method gets no key and is not idempotent by itself: it was sent once.
    NotIdempotent,
    /// The failure is not one a new attempt can get past (such as a request that cannot be
    /// built).
    NotTransient,
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Final => "the server gave a final answer",
            Self::AttemptsExhausted => "the maximum number of attempts was reached",
            Self::Deadline => "the next attempt could not start before the deadline",
            Self::RetryAfterPastDeadline => "the server's Retry-After reaches past the deadline",
            Self::StreamingBody => {
                "the request body is a stream, which cannot be sent again, so it was not retried"
            }
            Self::NotIdempotent => {
                "the method gets no idempotency key and is not idempotent, so it was not retried"
            }
            Self::NotTransient => "the failure is not one a retry can get past",
        })
    }
}

/// In every response's extensions: the operation's key, its attempts, whether the answer was a
/// replay, and why the attempts stopped.
///
/// ```
/// # use tower_idempotency_client::Outcome;
/// # fn show(response: &http::Response<()>) {
/// if let Some(outcome) = response.extensions().get::<Outcome>() {
///     println!("{} attempt(s), replayed: {}", outcome.attempts(), outcome.replayed());
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub(crate) key: Option<IdempotencyKey>,
    pub(crate) attempts: u32,
    pub(crate) replayed: bool,
    pub(crate) stop: StopReason,
}

impl Outcome {
    /// The key every attempt carried; `None` for a method that gets none.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// How many attempts were sent, this one included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the server marked the answer a replay of an earlier attempt's.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// Why this answer is the last: [`StopReason::Final`] unless the attempts ran out first.
    pub fn stop(&self) -> StopReason {
        self.stop
    }
}
