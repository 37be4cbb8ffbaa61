//! The key a step hands to the service it calls: derived, stable, unguessable.

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::{fingerprint::Fingerprint, scope::ScopeKey, settings::StepSecret};

/// Separates these keys from anything else the secret might ever key.
const DOMAIN: &[u8] = b"tower-idempotency/downstream-key/v1\0";

/// The idempotency key a step sends to the service it calls (a card processor, a ledger):
/// the same for every attempt of the step — retries, takeovers, other instances — so that
/// the service deduplicates a call that was interrupted and sent again.
///
/// It is the first 128 bits of HMAC-SHA256 under the layer's
/// [step secret](crate::IdempotencyLayer::with_step_secret) of the request's scope key,
/// fingerprint and the step's name: unguessable without the secret, never the client's key,
/// and another for another payload. Displayed as a UUID (version 8, RFC 9562's custom
/// layout), the form most payment APIs take.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DownstreamKey([u8; 16]);

impl DownstreamKey {
    /// The key of step `name` of the request with `scope` and `fingerprint`.
    pub(crate) fn derive(
        secret: &StepSecret,
        scope: &ScopeKey,
        fingerprint: &Fingerprint,
        name: &str,
    ) -> Self {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes keys of any size");
        mac.update(DOMAIN);
        mac.update(scope.as_bytes());
        mac.update(fingerprint.as_bytes());
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
        let secret = StepSecret::new(vec![secret; 32]).unwrap();
        let scope = ScopeKey::from_bytes([scope; 32]);
        DownstreamKey::derive(
            &secret,
            &scope,
            &Fingerprint::from_bytes([fingerprint; 32]),
            name,
        )
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
        ] {
            assert_ne!(other, key(1, 2, 3, "authorize"));
        }
    }
}
