//! The rule an API's keys follow beyond the header's syntax: see [`KeyRule`].

use std::{borrow::Cow, fmt, sync::Arc};

/// A rule an API's keys must follow, beyond the header's syntax; set with
/// [`KeySource::with_rule`](crate::KeySource::with_rule). A key that breaks it is refused with
/// `400`, naming the rule, and nothing is stored.
///
/// The IETF draft's security considerations recommend unguessable keys; [`KeyRule::uuid`]
/// enforces the usual choice.
///
/// ```
/// use tower_idempotency::KeyRule;
///
/// let uuid = KeyRule::uuid();
/// assert!(uuid.accepts("8e03978e-40d5-43e8-bc93-6894a57f9324"));
/// assert!(!uuid.accepts("order-1042"));
///
/// let prefixed = KeyRule::from_fn("ik_ prefix", |key| key.starts_with("ik_"));
/// assert!(prefixed.accepts("ik_1"));
/// ```
#[derive(Clone)]
pub struct KeyRule {
    name: Cow<'static, str>,
    check: Arc<dyn Fn(&str) -> bool + Send + Sync>,
    format: Option<&'static str>,
}

impl KeyRule {
    /// Keys are UUIDs, in their usual text form: 32 hexadecimal digits in groups of 8-4-4-4-12
    /// (any version, either case), as Stripe's SDKs generate.
    pub fn uuid() -> Self {
        Self {
            name: Cow::Borrowed("uuid"),
            check: Arc::new(is_uuid),
            format: Some("uuid"),
        }
    }

    /// Keys for which `check` returns `true`; `name` identifies the rule in the `400` problem.
    pub fn from_fn<F>(name: impl Into<Cow<'static, str>>, check: F) -> Self
    where
        F: Fn(&str) -> bool + Send + Sync + 'static,
    {
        Self {
            name: name.into(),
            check: Arc::new(check),
            format: None,
        }
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The OpenAPI `format` the rule amounts to, if any (`uuid`).
    pub fn format(&self) -> Option<&'static str> {
        self.format
    }

    /// Whether `key` follows the rule.
    pub fn accepts(&self, key: &str) -> bool {
        (self.check)(key)
    }
}

impl fmt::Debug for KeyRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("KeyRule").field(&self.name).finish()
    }
}

fn is_uuid(key: &str) -> bool {
    let bytes = key.as_bytes();
    bytes.len() == 36
        && bytes.iter().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => *b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}
