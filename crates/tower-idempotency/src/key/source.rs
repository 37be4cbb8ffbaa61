//! Where a request's key comes from and whether it must have one: see [`KeySource`].

use std::{fmt, sync::Arc};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, request::Parts};

use super::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, header_title, rule::KeyRule};
use crate::problem::Rejection;

/// Where the layer finds a request's key, whether a covered request must carry one, and the
/// rule keys follow; given to [`IdempotencyLayer::with_key`](crate::IdempotencyLayer::with_key).
///
/// The default reads the `Idempotency-Key` header and lets a request without one through
/// unprotected, as Stripe does.
///
/// ```
/// use http::HeaderName;
/// use tower_idempotency::{IdempotencyLayer, KeyRule, KeySource};
///
/// // The key is mandatory, a UUID, in the draft's header.
/// let strict = KeySource::default().required().with_rule(KeyRule::uuid());
///
/// // PayPal's header instead of the draft's.
/// let paypal = KeySource::header(HeaderName::from_static("paypal-request-id"));
///
/// // Stripe's events carry their id at the top of the body.
/// let events = KeySource::from_request(|_, body| {
///     let event: serde_json::Value = serde_json::from_slice(body).ok()?;
///     Some(event.get("id")?.as_str()?.to_owned())
/// })
/// .required();
/// # let _ = (IdempotencyLayer::memory().with_key(strict), paypal, events);
/// ```
#[derive(Clone, Default)]
pub struct KeySource {
    from: Origin,
    required: bool,
    rule: Option<KeyRule>,
}

#[derive(Clone)]
enum Origin {
    Header(HeaderName),
    Request(Arc<KeyFn>),
}

/// An app's way to take a key from the request.
type KeyFn = dyn Fn(&Parts, &Bytes) -> Option<String> + Send + Sync;

impl Default for Origin {
    fn default() -> Self {
        Self::Header(IDEMPOTENCY_KEY.clone())
    }
}

impl KeySource {
    /// The key in the header `name` (`X-Idempotency-Key`, or a vendor's such as PayPal's
    /// `PayPal-Request-Id`) instead of `Idempotency-Key`, by the same parsing rules and limits.
    pub fn header(name: HeaderName) -> Self {
        Self {
            from: Origin::Header(name),
            ..Self::default()
        }
    }

    /// The key `key` takes from the request head and its whole body, as a webhook receiver
    /// deduplicates deliveries by the event's id; `None` is a request without a key. The key is
    /// then checked as a header's would be (length, characters, [rule](Self::with_rule)).
    ///
    /// Every covered request's body is read before its key is known, so requests without a key
    /// are bound by [`Limits::with_max_request_bytes`](crate::Limits::with_max_request_bytes) too.
    pub fn from_request<F>(key: F) -> Self
    where
        F: Fn(&Parts, &Bytes) -> Option<String> + Send + Sync + 'static,
    {
        Self {
            from: Origin::Request(Arc::new(key)),
            ..Self::default()
        }
    }

    /// Makes the key mandatory on covered methods: a request without one gets `400`.
    #[must_use]
    pub fn required(mut self) -> Self {
        self.required = true;
        self
    }

    /// A rule every key must follow ([`KeyRule::uuid`], or one of the app's); a key that breaks
    /// it gets `400` naming the rule, and nothing is stored.
    #[must_use]
    pub fn with_rule(mut self, rule: KeyRule) -> Self {
        self.rule = Some(rule);
        self
    }

    /// The header the key is read from, if it comes from one (for the OpenAPI document, and
    /// the requests kept for completion).
    pub(crate) fn header_name(&self) -> Option<&HeaderName> {
        match &self.from {
            Origin::Header(name) => Some(name),
            Origin::Request(_) => None,
        }
    }

    /// Whether a covered request without a key is refused.
    #[cfg(feature = "utoipa")]
    pub(crate) fn is_required(&self) -> bool {
        self.required
    }

    /// The rule keys follow, if any.
    #[cfg(feature = "utoipa")]
    pub(crate) fn rule(&self) -> Option<&KeyRule> {
        self.rule.as_ref()
    }

    /// The key in a request's header (`Err`, the `400`, when it is required and absent,
    /// malformed or breaks the rule), or [`KeyLookup::InBody`] when the app takes it from the
    /// request.
    pub(crate) fn find_in_head(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<KeyLookup, Rejection> {
        let Origin::Header(name) = &self.from else {
            return Ok(KeyLookup::InBody);
        };
        let found = IdempotencyKey::from_header(headers, name);
        // Where the key was looked for is only written out for a refusal.
        let source = || format!("an {} header", header_title(name.as_str()));
        let key = self.accept(found, method, path, source)?;
        Ok(key.map_or(KeyLookup::Absent, KeyLookup::Found))
    }

    /// The key the app's function takes from the whole request: `Ok(None)` without one (`Err`,
    /// the `400`, when it is required, malformed or breaks the rule).
    pub(crate) fn find_in_request(
        &self,
        parts: &Parts,
        path: &str,
        body: &Bytes,
    ) -> Result<Option<IdempotencyKey>, Rejection> {
        let Origin::Request(key_of) = &self.from else {
            return Ok(None);
        };
        let found = key_of(parts, body).map(IdempotencyKey::new).transpose();
        let source = || "an idempotency key in the request".to_owned();
        self.accept(found, &parts.method, path, source)
    }

    /// The one judgement of a key wherever it was found (`source` says where it was looked
    /// for): malformed, breaking the app's rule, or absent when required are refused.
    fn accept(
        &self,
        found: Result<Option<IdempotencyKey>, KeyError>,
        method: &Method,
        path: &str,
        source: impl FnOnce() -> String,
    ) -> Result<Option<IdempotencyKey>, Rejection> {
        match found {
            Ok(Some(key)) => match &self.rule {
                Some(rule) if !rule.accepts(key.as_str()) => Err(Rejection::key_breaks_rule(
                    rule.name(),
                    rule.format() == Some("uuid"),
                )),
                _ => Ok(Some(key)),
            },
            Ok(None) if self.required => Err(Rejection::key_missing(method, path, &source())),
            Ok(None) => Ok(None),
            Err(error) => Err(Rejection::key_invalid(&error)),
        }
    }
}

/// Where a covered request's key is, as far as its head tells.
pub(crate) enum KeyLookup {
    /// In its header, well formed and following the app's rule.
    Found(IdempotencyKey),
    /// To be taken from the request once its body has arrived.
    InBody,
    /// Nowhere, and not required: the handler runs unprotected.
    Absent,
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let from = match &self.from {
            Origin::Header(name) => name.as_str(),
            Origin::Request(_) => "request(..)",
        };
        f.debug_struct("KeySource")
            .field("from", &from)
            .field("required", &self.required)
            .field("rule", &self.rule)
            .finish()
    }
}
