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
    pub(crate) principal: &'a Principal,
    pub(crate) parts: &'a Parts,
    pub(crate) uri: &'a Uri,
    pub(crate) body: &'a Bytes,
}

impl Keep<'_> {
    /// Keeps the request under `claim`; `false` when keeping it failed (logged). A request the
    /// completer sent is kept already; a claim without a fence (transactional mode) leaves
    /// nothing to complete.
    pub(crate) async fn under<St: Store>(
        self,
        store: &St,
        claim: &St::Claim,
        fingerprint: &Fingerprint,
    ) -> bool {
        if self.parts.extensions.get::<Completing>().is_some() {
            return true;
        }
        let (Some(log), Some(fence)) = (store.capabilities().pending_log().cloned(), claim.fence())
        else {
            return true;
        };
        // The content type decides how the body is fingerprinted and parsed.
        let mut names: Vec<&HeaderName> = self.completion.headers.iter().collect();
        names.extend(self.key_header);
        names.push(&CONTENT_TYPE);
        let kept = KeptRequest::new(self.parts, self.uri, &names, self.body, self.principal);
        match log.keep(&fence, fingerprint, kept.encode()).await {
            Ok(ClaimStatus::Held) => true,
            Ok(_) => {
                // The run that follows finds the claim lost too, and stops there.
                tracing::debug!("the claim was lost before its request was kept");
                true
            }
            Err(error) => {
                metrics::completion("keep_error");
                tracing::warn!(
                    error = %Chain(&*error),
                    "keeping a request for completion failed"
                );
                false
            }
        }
    }
}
