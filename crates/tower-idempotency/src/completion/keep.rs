//! The layer's side of completion: each keyed request kept with its claim before its handler
//! runs.

use bytes::Bytes;
use http::{HeaderName, Uri, header::CONTENT_TYPE, request::Parts};

use super::{Completing, Completion, request::KeptRequest};
use crate::{
    chain::Chain,
    fingerprint::Fingerprint,
    metrics,
    scope::Principal,
    store::{ClaimHandle, ClaimStatus, Store},
};

/// What a keyed request is kept from.
pub(crate) struct Keep<'a> {
    pub(crate) completion: &'a Completion,
    pub(crate) key_header: Option<&'a HeaderName>,
    /// The headers the fingerprint covers: the completer's request must fingerprint the same.
    pub(crate) fingerprinted: &'a [HeaderName],
    pub(crate) principal: &'a Principal,
    pub(crate) parts: &'a Parts,
    pub(crate) uri: &'a Uri,
    pub(crate) body: &'a Bytes,
}

/// Whether a keyed request was kept for the completer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kept {
    /// Kept (or nothing to keep): its handler may run.
    Yes,
    /// The claim was lost before it was kept: another request holds the key.
    Lost,
    /// Keeping it failed (logged).
    Failed,
}

impl Keep<'_> {
    /// Keeps the request under `claim`. A request the completer sent is kept already; a claim
    /// without a fence (transactional mode) leaves nothing to complete.
    pub(crate) async fn under<St: Store>(
        self,
        store: &St,
        claim: &St::Claim,
        fingerprint: &Fingerprint,
    ) -> Kept {
        if self.parts.extensions.get::<Completing>().is_some() {
            return Kept::Yes;
        }
        let (Some(log), Some(fence)) = (store.capabilities().pending_log().cloned(), claim.fence())
        else {
            return Kept::Yes;
        };
        // The content type decides how the body is fingerprinted and parsed.
        let mut names: Vec<&HeaderName> = self.completion.headers.iter().collect();
        names.extend(self.key_header);
        names.extend(self.fingerprinted);
        names.push(&CONTENT_TYPE);
        names.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        names.dedup();
        let kept = KeptRequest::new(self.parts, self.uri, &names, self.body, self.principal);
        match log.keep(&fence, fingerprint, kept.encode()).await {
            Ok(ClaimStatus::Held) => Kept::Yes,
            Ok(_) => {
                tracing::debug!("the claim was lost before its request was kept");
                Kept::Lost
            }
            Err(error) => {
                metrics::completion("keep_error");
                tracing::warn!(
                    error = %Chain(&*error),
                    "keeping a request for completion failed"
                );
                Kept::Failed
            }
        }
    }
}
