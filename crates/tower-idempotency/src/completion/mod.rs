//! Finishing keys whose client never came back; see the [completion guide](crate::guide::completion).

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
