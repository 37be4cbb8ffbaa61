//! The operation's key: minted, the caller's, or derived from the caller's operation id (see
//! [the crate docs](crate#one-key-per-operation)).

use std::{fmt, sync::Arc};

use http::{HeaderMap, HeaderName, HeaderValue};
use sfv::{ItemSerializer, StringRef};
use uuid::Uuid;

/// The `Idempotency-Key` header name, the draft's and the default.
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The namespace of keys derived from operation ids when the policy names none
/// ([`Policy::with_namespace`](crate::Policy::with_namespace)).
pub const DEFAULT_NAMESPACE: Uuid = Uuid::from_u128(0x8f85_39d6_de51_40f1_a6f7_a858_f1c7_a4af);

/// The caller's own name for one logical operation (`order-1042/charge`): the key is derived
/// from it, so a process that restarts mid-retry sends the same key again.
///
/// Put it in the request's extensions (`RequestBuilder::with_extension` with reqwest-middleware,
/// `Request::extensions_mut` with Tower). It must name one operation: two operations under one
/// id share a key, and the server answers the second with the first's response or a `422`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OperationId(Arc<str>);

impl OperationId {
    /// Names an operation.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into().into())
    }

    /// The id as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Where an operation's key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyOrigin {
    /// A random UUIDv4, minted for this operation.
    Minted,
    /// The caller's own `Idempotency-Key` header, sent untouched.
    Caller,
    /// A UUIDv5 over the policy's namespace and the caller's [`OperationId`].
    Derived,
}

/// How a minted or derived key is written in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyFormat {
    /// The draft's RFC 9651 sf-string: `Idempotency-Key: "8e03978e-..."`.
    #[default]
    SfString,
    /// The bare value, as Stripe's SDKs send it: `Idempotency-Key: 8e03978e-...`.
    Bare,
}

/// The key sent on every attempt of one operation: its text (without sf-string quotes) and
/// where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    text: Arc<str>,
    origin: KeyOrigin,
}

impl IdempotencyKey {
    /// A fresh random key (UUIDv4).
    pub fn mint() -> Self {
        Self::uuid(Uuid::new_v4(), KeyOrigin::Minted)
    }

    /// The key of `operation` under `namespace` (UUIDv5): the same on every process and host.
    pub fn derive(namespace: Uuid, operation: &OperationId) -> Self {
        let uuid = Uuid::new_v5(&namespace, operation.as_str().as_bytes());
        Self::uuid(uuid, KeyOrigin::Derived)
    }

    fn uuid(uuid: Uuid, origin: KeyOrigin) -> Self {
        Self {
            text: uuid.hyphenated().to_string().into(),
            origin,
        }
    }

    /// The caller's header value: an sf-string's content, else the value itself.
    pub(crate) fn from_caller(value: &HeaderValue) -> Self {
        let raw = value.as_bytes();
        let quoted = raw
            .first()
            .filter(|b| **b == b'"')
            .and_then(|_| sfv::Parser::new(raw).parse_item().ok())
            .and_then(|item: sfv::Item| item.bare_item.as_string().map(|s| s.as_str().to_owned()));
        let text = quoted.unwrap_or_else(|| String::from_utf8_lossy(raw).into_owned());
        Self {
            text: text.into(),
            origin: KeyOrigin::Caller,
        }
    }

    /// The key's text, without quoting: what the server stores.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Where the key came from.
    pub fn origin(&self) -> KeyOrigin {
        self.origin
    }

    /// The header value in `format`; `None` when the text cannot be written so (a caller's key
    /// is never rewritten, so this only sees minted and derived ones, which always can).
    fn header_value(&self, format: KeyFormat) -> Option<HeaderValue> {
        let text = match format {
            KeyFormat::SfString => ItemSerializer::new()
                .bare_item(StringRef::from_str(&self.text).ok()?)
                .finish(),
            KeyFormat::Bare => self.text.to_string(),
        };
        HeaderValue::from_str(&text).ok()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The key of a request: the caller's header if set, else derived from `operation`, else
/// minted; written into `headers` as `name` in `format` unless it was the caller's.
pub(crate) fn attach(
    headers: &mut HeaderMap,
    name: &HeaderName,
    format: KeyFormat,
    namespace: Uuid,
    operation: Option<&OperationId>,
) -> IdempotencyKey {
    if let Some(value) = headers.get(name) {
        return IdempotencyKey::from_caller(value);
    }
    let key = match operation {
        Some(operation) => IdempotencyKey::derive(namespace, operation),
        None => IdempotencyKey::mint(),
    };
    if let Some(value) = key.header_value(format) {
        headers.insert(name.clone(), value);
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_are_stable_and_per_namespace() {
        let order = OperationId::new("order-1042/charge");
        let a = IdempotencyKey::derive(DEFAULT_NAMESPACE, &order);
        let b = IdempotencyKey::derive(DEFAULT_NAMESPACE, &order);
        assert_eq!(a, b);
        assert_eq!(a.origin(), KeyOrigin::Derived);
        let other = IdempotencyKey::derive(Uuid::from_u128(1), &order);
        assert_ne!(a.as_str(), other.as_str());
        let next = IdempotencyKey::derive(DEFAULT_NAMESPACE, &OperationId::new("order-1043"));
        assert_ne!(a.as_str(), next.as_str());
        let uuid: Uuid = a.as_str().parse().expect("a UUID");
        assert_eq!(uuid.get_version_num(), 5);
    }

    #[test]
    fn minted_keys_are_random_v4() {
        let (a, b) = (IdempotencyKey::mint(), IdempotencyKey::mint());
        assert_ne!(a, b);
        let uuid: Uuid = a.as_str().parse().expect("a UUID");
        assert_eq!(uuid.get_version_num(), 4);
    }

    #[test]
    fn keys_are_written_as_sf_strings_or_bare() {
        let key = IdempotencyKey::derive(DEFAULT_NAMESPACE, &OperationId::new("x"));
        let quoted = key.header_value(KeyFormat::SfString).expect("a value");
        assert_eq!(quoted, format!("\"{key}\"").as_str());
        let bare = key.header_value(KeyFormat::Bare).expect("a value");
        assert_eq!(bare, key.as_str());
    }

    #[test]
    fn the_callers_key_is_kept_and_read_either_way() {
        let name = &IDEMPOTENCY_KEY;
        for (sent, text) in [("\"order-7 a\"", "order-7 a"), ("order-7", "order-7")] {
            let mut headers = HeaderMap::new();
            headers.insert(name.clone(), HeaderValue::from_static(sent));
            let key = attach(&mut headers, name, KeyFormat::Bare, DEFAULT_NAMESPACE, None);
            assert_eq!((key.as_str(), key.origin()), (text, KeyOrigin::Caller));
            assert_eq!(headers[name], sent, "sent untouched");
        }
    }

    #[test]
    fn an_operation_id_wins_over_minting() {
        let mut headers = HeaderMap::new();
        let order = OperationId::new("order-9");
        let key = attach(
            &mut headers,
            &IDEMPOTENCY_KEY,
            KeyFormat::SfString,
            DEFAULT_NAMESPACE,
            Some(&order),
        );
        assert_eq!(key, IdempotencyKey::derive(DEFAULT_NAMESPACE, &order));
        assert_eq!(headers[&IDEMPOTENCY_KEY], format!("\"{key}\"").as_str());
    }
}
