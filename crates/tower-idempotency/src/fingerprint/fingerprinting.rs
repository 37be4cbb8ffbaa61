//! What a fingerprint covers as the layer is configured (fields left out, headers taken in), and
//! where it is computed: inline, or off the async workers for a large body.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, Uri};
use sha2::{Digest, Sha256};

use super::{
    BodyKind, Exclusions, Fingerprint, FingerprintMode, excluded_names, hash_json_excluding,
    put_field, put_pairs_without, put_raw,
};
use crate::settings::ConfigError;

/// Bodies up to this size are fingerprinted on the async worker; larger ones on the blocking
/// thread pool.
pub(super) const INLINE_BODY_BYTES: usize = 64 * 1024;

/// What a request's fingerprint covers: the [mode](FingerprintMode), body fields left out
/// and request headers taken in (see [`Fingerprint`](crate::Fingerprint#what-it-covers));
/// given to [`IdempotencyLayer::with_fingerprint`](crate::IdempotencyLayer::with_fingerprint).
///
/// ```
/// use http::HeaderName;
/// use tower_idempotency::{Fingerprinting, IdempotencyLayer};
///
/// # fn main() -> Result<(), tower_idempotency::ConfigError> {
/// let layer = IdempotencyLayer::memory().with_fingerprint(
///     Fingerprinting::semantic()
///         .excluding(["/client_sent_at", "/metadata/trace_id"])
///         .with_headers([HeaderName::from_static("stripe-version")]),
/// )?;
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct Fingerprinting {
    mode: FingerprintMode,
    /// JSON Pointers (RFC 6901) of body fields left out.
    excluded: Vec<String>,
    headers: Vec<HeaderName>,
}

impl Fingerprinting {
    /// The body compared by meaning (the default): JSON and form bodies canonicalised, so key
    /// order and spacing do not make another request. See [`FingerprintMode::Semantic`].
    pub fn semantic() -> Self {
        Self::default()
    }

    /// The body compared byte for byte. See [`FingerprintMode::Raw`]. It cannot leave fields
    /// out: [`excluding`](Self::excluding) with it is refused.
    pub fn raw() -> Self {
        Self {
            mode: FingerprintMode::Raw,
            ..Self::default()
        }
    }

    /// Leaves body fields out, by JSON Pointer (RFC 6901): `/client_sent_at`,
    /// `/metadata/trace_id`; for a form body a top-level pointer names a field. A retry that
    /// differs only in them is the same request. A pointer must start with `/`
    /// ([`ConfigError::InvalidPointer`]).
    #[must_use]
    pub fn excluding(mut self, pointers: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.excluded.extend(pointers.into_iter().map(Into::into));
        self
    }

    /// The request headers this fingerprint takes in.
    pub(crate) fn headers(&self) -> &[HeaderName] {
        &self.headers
    }

    /// Takes request headers in (an API version such as `Stripe-Version`, `Accept`): a retry
    /// whose values differ is another request, `422`.
    #[must_use]
    pub fn with_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.headers.extend(names);
        self
    }

    /// The value as the layer keeps it: every pointer well formed, and none under a raw mode,
    /// which would otherwise leave nothing out without a word.
    pub(crate) fn validated(self) -> Result<Self, ConfigError> {
        if let Some(pointer) = self.excluded.iter().find(|p| !p.starts_with('/')) {
            return Err(ConfigError::InvalidPointer(pointer.clone()));
        }
        if self.mode == FingerprintMode::Raw && !self.excluded.is_empty() {
            return Err(ConfigError::RawExcluding);
        }
        Ok(self)
    }
}

impl Fingerprinting {
    /// The fingerprint of a request, [`Fingerprint::compute`]'s when nothing is left out or
    /// taken in.
    pub(crate) fn fingerprint(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Fingerprint {
        let content_type = headers.get(http::header::CONTENT_TYPE);
        if self.excluded.is_empty() && self.headers.is_empty() {
            return Fingerprint::compute(self.mode, method, uri, content_type, body);
        }
        let Fingerprint(body_only) = match (self.mode, BodyKind::of(content_type)) {
            (FingerprintMode::Semantic, kind) if !self.excluded.is_empty() => {
                self.fingerprint_excluding(method, uri, kind, body)
            }
            _ => Fingerprint::compute(self.mode, method, uri, content_type, body),
        };
        if self.headers.is_empty() {
            return Fingerprint(body_only);
        }
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/fingerprint/headers/v1\0");
        hasher.update(body_only);
        for name in &self.headers {
            put_field(&mut hasher, name.as_str().as_bytes());
            let values = headers.get_all(name);
            hasher.update((values.iter().count() as u64).to_be_bytes());
            for value in values {
                put_field(&mut hasher, value.as_bytes());
            }
        }
        Fingerprint(hasher.finalize().into())
    }

    /// A semantic fingerprint with the fields at `self.excluded` left out of a JSON or form
    /// body; the same as of the body with those fields removed and written out again.
    fn fingerprint_excluding(
        &self,
        method: &Method,
        uri: &Uri,
        kind: BodyKind,
        body: &[u8],
    ) -> Fingerprint {
        let mut hasher = Fingerprint::head(FingerprintMode::Semantic, method, uri);
        match kind {
            BodyKind::Json
                if hash_json_excluding(&mut hasher, body, &Exclusions::new(&self.excluded)) => {}
            BodyKind::Form => {
                hasher.update(b"form\0");
                put_pairs_without(&mut hasher, body, &excluded_names(&self.excluded));
            }
            BodyKind::Json | BodyKind::Other => put_raw(&mut hasher, body),
        }
        Fingerprint(hasher.finalize().into())
    }

    /// The headers a fingerprint reads, for a copy made to fingerprint elsewhere.
    fn relevant_headers(&self, headers: &HeaderMap) -> HeaderMap {
        let mut relevant = HeaderMap::new();
        for name in std::iter::once(&http::header::CONTENT_TYPE).chain(&self.headers) {
            for value in headers.get_all(name) {
                relevant.append(name.clone(), value.clone());
            }
        }
        relevant
    }
}

/// The fingerprint of a request for the service: inline for a body up to 64 KiB, on Tokio's
/// blocking thread pool for a larger one (see the [module documentation](crate::Fingerprint#bounded-work)).
pub(crate) async fn compute_for_request(
    fingerprinting: &Fingerprinting,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> Fingerprint {
    let runtime = match tokio::runtime::Handle::try_current() {
        Ok(runtime) if body.len() > INLINE_BODY_BYTES => runtime,
        _ => return fingerprinting.fingerprint(method, uri, headers, body),
    };
    let compute = {
        let (fingerprinting, method, uri) = (fingerprinting.clone(), method.clone(), uri.clone());
        let (headers, body) = (fingerprinting.relevant_headers(headers), body.clone());
        move || fingerprinting.fingerprint(&method, &uri, &headers, &body)
    };
    // Beyond one per core, more at once would only hold more buffers, not finish sooner.
    let _slot = blocking_slots().acquire().await;
    match runtime.spawn_blocking(compute.clone()).await {
        Ok(fingerprint) => fingerprint,
        // Cancelled by a runtime shutting down (or panicked): the request still needs its
        // fingerprint, so it is computed here instead.
        Err(error) => {
            tracing::warn!(%error, "fingerprinting on the blocking pool failed; computing inline");
            compute()
        }
    }
}

/// Admits as many large-body fingerprints to the blocking pool at once as there are cores.
fn blocking_slots() -> &'static tokio::sync::Semaphore {
    static SLOTS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| tokio::sync::Semaphore::new(cores()))
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    /// Polls `future` once.
    async fn poll_once<F: std::future::Future>(
        mut future: std::pin::Pin<&mut F>,
    ) -> std::task::Poll<F::Output> {
        std::future::poll_fn(|cx| std::task::Poll::Ready(future.as_mut().poll(cx))).await
    }

    #[test]
    fn large_bodies_are_fingerprinted_off_the_async_workers() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .build()
            .unwrap();
        runtime.block_on(async {
            // The one blocking thread is taken until `release` is dropped.
            let (release, held) = std::sync::mpsc::channel::<()>();
            let taken = tokio::task::spawn_blocking(move || {
                let _ = held.recv();
            });
            let text = HeaderValue::from_static("text/plain");
            let (fingerprinting, method, uri) = (
                Fingerprinting::default(),
                Method::POST,
                Uri::from_static("/v1/charges"),
            );
            let mut headers = HeaderMap::new();
            headers.insert(http::header::CONTENT_TYPE, text.clone());
            let (small_body, large_body) = (
                Bytes::from(vec![b'x'; INLINE_BODY_BYTES]),
                Bytes::from(vec![b'x'; INLINE_BODY_BYTES + 1]),
            );
            let expected = |size: usize| {
                Fingerprint::compute(
                    FingerprintMode::Semantic,
                    &Method::POST,
                    &Uri::from_static("/v1/charges"),
                    Some(&text),
                    &vec![b'x'; size],
                )
            };

            let mut small = std::pin::pin!(compute_for_request(
                &fingerprinting,
                &method,
                &uri,
                &headers,
                &small_body
            ));
            match poll_once(small.as_mut()).await {
                std::task::Poll::Ready(fingerprint) => {
                    assert_eq!(fingerprint, expected(INLINE_BODY_BYTES));
                }
                std::task::Poll::Pending => panic!("a 64 KiB body waited for the blocking pool"),
            }
            let mut large = std::pin::pin!(compute_for_request(
                &fingerprinting,
                &method,
                &uri,
                &headers,
                &large_body
            ));
            assert!(
                poll_once(large.as_mut()).await.is_pending(),
                "a larger body was fingerprinted on the async worker"
            );
            drop(release);
            taken.await.unwrap();
            assert_eq!(large.await, expected(INLINE_BODY_BYTES + 1));
        });
    }

    #[test]
    fn large_bodies_are_fingerprinted_one_per_core_at_a_time() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .build()
            .unwrap();
        runtime.block_on(async {
            // Every slot taken, as by as many large bodies being fingerprinted.
            let taken = blocking_slots().acquire_many(cores() as u32).await.unwrap();
            let body = Bytes::from(vec![b'x'; INLINE_BODY_BYTES + 1]);
            let fingerprinting = Fingerprinting::raw();
            let (method, uri, headers) = (
                Method::POST,
                Uri::from_static("/v1/charges"),
                HeaderMap::new(),
            );
            let mut waiting = std::pin::pin!(compute_for_request(
                &fingerprinting,
                &method,
                &uri,
                &headers,
                &body
            ));
            assert!(poll_once(waiting.as_mut()).await.is_pending());
            // The one blocking thread runs its tasks in order: had the fingerprint been handed
            // to it, it would be done once this later task is.
            tokio::task::spawn_blocking(|| ()).await.unwrap();
            assert!(
                poll_once(waiting.as_mut()).await.is_pending(),
                "fingerprinted with every slot taken"
            );
            drop(taken);
            let expected = Fingerprint::compute(
                FingerprintMode::Raw,
                &Method::POST,
                &Uri::from_static("/v1/charges"),
                None,
                &body,
            );
            assert_eq!(waiting.await, expected);
        });
    }
}
