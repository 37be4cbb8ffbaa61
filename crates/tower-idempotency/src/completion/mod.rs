//! Finishing keys whose client never came back; see the [completion guide](crate::guide::completion).

use http::{
    HeaderName,
    header::{AUTHORIZATION, COOKIE, PROXY_AUTHORIZATION},
};

use crate::{fingerprint::Fingerprint, scope::ScopeKey};

mod completer;
mod keep;
mod request;

pub use completer::{Completer, Round};
pub(crate) use keep::{Keep, Kept};

/// What the layer keeps of each keyed request for the [`Completer`], besides the method, URI,
/// body, principal, `Content-Type`, the key's header and the headers the fingerprint covers; see
/// [`with_completion`](crate::IdempotencyLayer::with_completion).
///
/// Credentials (`Authorization`, `Proxy-Authorization`, `Cookie`) are kept only when named to
/// [`storing_credentials`](Self::storing_credentials): the kept principal stands for them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Completion {
    headers: Vec<HeaderName>,
    credentials: bool,
}

impl Completion {
    /// Keeps no header but the key's, `Content-Type` and those the fingerprint covers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps the headers named (each of their values) too. A credential among them makes
    /// [`with_completion`](crate::IdempotencyLayer::with_completion) fail.
    pub fn storing_headers(headers: impl IntoIterator<Item = HeaderName>) -> Self {
        Self {
            headers: headers.into_iter().collect(),
            credentials: false,
        }
    }

    /// Keeps the headers named, credentials among them, in the store until the key completes
    /// or expires: only for apps whose completer must present the client's own credentials.
    pub fn storing_credentials(headers: impl IntoIterator<Item = HeaderName>) -> Self {
        Self {
            headers: headers.into_iter().collect(),
            credentials: true,
        }
    }

    /// The headers kept besides the key's.
    pub fn headers(&self) -> &[HeaderName] {
        &self.headers
    }

    /// A credential header among `headers` that this completion may not keep, if any.
    pub(crate) fn refused_credential<'a>(
        &self,
        mut headers: impl Iterator<Item = &'a HeaderName>,
    ) -> Option<&'a HeaderName> {
        if self.credentials {
            return None;
        }
        headers.find(|name| CREDENTIALS.contains(name))
    }
}

/// Headers that carry a client's credentials.
const CREDENTIALS: [HeaderName; 3] = [AUTHORIZATION, PROXY_AUTHORIZATION, COOKIE];

/// In the extensions of a request a [`Completer`] sends: which attempt it is, and what the
/// layer must find again before it runs anything (the key's scope key and fingerprint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completing {
    attempt: u32,
    pub(crate) scope_key: ScopeKey,
    pub(crate) fingerprint: Fingerprint,
}

impl Completing {
    /// Which attempt this is for its key, counting from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}
