//! The key a step hands to the service it calls: derived, stable, unguessable.

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::{fingerprint::Fingerprint, scope::ScopeKey, settings::StepSecret};

/// Separates these keys from anything else the secret might ever key: `v2` mixes in the key's
/// generation.
const DOMAIN: &[u8] = b"tower-idempotency/downstream-key/v2\0";

/// `v1`, without a generation: the keys of generation 0, the claims stores made before they had
/// generations, so that a step in flight across the upgrade keeps the key it was first sent with.
const DOMAIN_V1: &[u8] = b"tower-idempotency/downstream-key/v1\0";

/// The idempotency key a step sends to the service it calls (a card processor, a ledger):
/// the same for every attempt of the step — retries, takeovers, other instances — so that
/// the service deduplicates a call that was interrupted and sent again.
///
/// It is the first 128 bits of HMAC-SHA256 under the layer's
/// [step secret](crate::IdempotencyLayer::with_step_secret) of the request's scope key,
/// fingerprint, the key's [generation](crate::store::Fence::generation) and the step's name:
/// unguessable without the secret, never the client's key, another for another payload, and
/// another once the key expired and was claimed again (a new operation). Displayed as a UUID
/// (version 8, RFC 9562's custom layout), the form most payment APIs take.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DownstreamKey([u8; 16]);

impl DownstreamKey {
    /// The key of step `name` of the request with `scope` and `fingerprint`, in the key's
    /// `generation`. Every input but the name has a fixed length, so none can pass for another.
    pub(crate) fn derive(
        secret: &StepSecret,
        scope: &ScopeKey,
        fingerprint: &Fingerprint,
        generation: i64,
        name: &str,
    ) -> Self {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes keys of any size");
        if generation == 0 {
            mac.update(DOMAIN_V1);
            mac.update(scope.as_bytes());
            mac.update(fingerprint.as_bytes());
        } else {
            mac.update(DOMAIN);
            mac.update(scope.as_bytes());
            mac.update(fingerprint.as_bytes());
            mac.update(&generation.to_be_bytes());
        }
        mac.update(name.as_bytes());
        let digest = mac.finalize().into_bytes();
        let mut bytes = [0; 16];
        bytes.copy_from_slice(&digest[..16]);
        // RFC 9562 UUIDv8: version 8 in the high nibble of byte 6, variant `10` in byte 8.
        bytes[6] = (bytes[6] & 0x0f) | 0x80;
        bytes[8] = (bytes[8] & 0x3f) | 0x80;
        Self(bytes)
    }

    /// The key's 128 bits, as a UUID's bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

/// The lowercase hyphenated UUID form, `xxxxxxxx-xxxx-8xxx-yxxx-xxxxxxxxxxxx`.
impl fmt::Display for DownstreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, byte) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for DownstreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DownstreamKey({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(secret: u8, scope: u8, fingerprint: u8, name: &str) -> DownstreamKey {
        key_in(secret, scope, fingerprint, 7, name)
    }

    fn key_in(
        secret: u8,
        scope: u8,
        fingerprint: u8,
        generation: i64,
        name: &str,
    ) -> DownstreamKey {
        let secret = StepSecret::new(vec![secret; 32]).unwrap();
        let scope = ScopeKey::from_bytes([scope; 32]);
        let fingerprint = Fingerprint::from_bytes([fingerprint; 32]);
        DownstreamKey::derive(&secret, &scope, &fingerprint, generation, name)
    }

    #[test]
    fn keys_are_uuid_v8_shaped_and_depend_on_every_input() {
        let shown = key(1, 2, 3, "authorize").to_string();
        assert_eq!(shown.len(), 36, "{shown}");
        let groups: Vec<usize> = shown.split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12], "{shown}");
        assert_eq!(&shown[14..15], "8", "version 8: {shown}");
        assert!("89ab".contains(&shown[19..20]), "variant 10: {shown}");
        assert!(
            shown
                .chars()
                .all(|c| c == '-' || c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_eq!(key(1, 2, 3, "authorize"), key(1, 2, 3, "authorize"));
        for other in [
            key(9, 2, 3, "authorize"),
            key(1, 9, 3, "authorize"),
            key(1, 2, 9, "authorize"),
            key(1, 2, 3, "capture"),
            key_in(1, 2, 3, 8, "authorize"),
            key_in(1, 2, 3, 0, "authorize"),
        ] {
            assert_ne!(other, key(1, 2, 3, "authorize"));
        }
    }

    /// `key(1, 2, 3, "authorize")` as `v1` derived it.
    const V1_KEY: &str = "5cc69a52-0933-801f-a9ca-a04eebf3e8e5";

    /// Generation 0 (claims made before stores had generations) keeps the keys of `v1`, which
    /// mixed in no generation: this one was computed by `v1`'s code (issue 44).
    #[test]
    fn generation_zero_keeps_the_v1_keys() {
        assert_eq!(
            key_in(1, 2, 3, 0, "authorize").to_string(),
            V1_KEY,
            "a step in flight across the upgrade must keep its downstream key"
        );
    }
}
