//! Envelopes of version 1, sealed under the sealing key itself: still opened, so that records
//! sealed before per-record keys stay readable until they expire, and never written.
//!
//! | bytes | what |
//! |---|---|
//! | 1 | envelope version, `1` |
//! | 4 | key id, big-endian |
//! | 12 | random nonce |
//! | the rest | AES-256-GCM of the plaintext, then its 16-byte tag |
//!
//! The associated data is [`DOMAIN`], the 32 bytes the envelope was bound to ([`bound_key`])
//! and the key id.

use aes_gcm::{Aes256Gcm, Nonce, Tag, aead::AeadInPlace};
use bytes::{Bytes, BytesMut};
use sha2::{Digest, Sha256};

use super::{
    derive::{Binding, Purpose},
    envelope::{NONCE, TAG, fixed},
    keys::SealingKeys,
};
use crate::{scope::ScopeKey, store::RecordUnopenable};

/// The version byte of these envelopes.
pub(super) const VERSION: u8 = 1;
/// Version, key id and nonce.
const HEADER: usize = 1 + 4 + NONCE;
/// Names what the associated data authenticates.
const DOMAIN: &[u8] = b"tower-idempotency sealed record v1\0";

/// The plaintext of `envelope`, a version 1 envelope sealed for `binding`.
pub(super) fn open(
    keys: &SealingKeys,
    binding: &Binding<'_>,
    envelope: &[u8],
) -> Result<Bytes, RecordUnopenable> {
    if envelope.len() < HEADER + TAG {
        return Err(RecordUnopenable::NotSealed);
    }
    let (head, sealed) = envelope.split_at(HEADER);
    let key_id = u32::from_be_bytes(fixed(&head[1..5]));
    let cipher: &Aes256Gcm = keys
        .cipher(key_id)
        .ok_or(RecordUnopenable::UnknownKey(key_id))?;
    let (sealed, tag) = sealed.split_at(sealed.len() - TAG);
    let mut plain = BytesMut::from(sealed);
    cipher
        .decrypt_in_place_detached(
            &Nonce::from(fixed::<NONCE>(&head[5..])),
            &associated_data(&bound_key(binding), key_id),
            &mut plain,
            &Tag::from(fixed::<TAG>(tag)),
        )
        .map_err(|_| RecordUnopenable::Inauthentic)?;
    Ok(plain.freeze())
}

/// What a version 1 envelope was bound to: the scope key for a response, else a SHA-256 of it
/// (and of the step's name).
fn bound_key(binding: &Binding<'_>) -> ScopeKey {
    let key = binding.scope_key.as_bytes();
    let digest = match binding.purpose {
        Purpose::Response => return *binding.scope_key,
        Purpose::Step(name) => Sha256::new()
            .chain_update(b"tower-idempotency step output\0")
            .chain_update(key)
            .chain_update(name.as_bytes())
            .finalize(),
        Purpose::KeptRequest => Sha256::new()
            .chain_update(b"tower-idempotency kept request\0")
            .chain_update(key)
            .finalize(),
    };
    ScopeKey::from_bytes(digest.into())
}

/// What each envelope authenticates besides its contents, on the stack.
fn associated_data(bound: &ScopeKey, key_id: u32) -> [u8; DOMAIN.len() + 32 + 4] {
    let mut data = [0; DOMAIN.len() + 32 + 4];
    let (domain, rest) = data.split_at_mut(DOMAIN.len());
    let (key, id) = rest.split_at_mut(32);
    domain.copy_from_slice(DOMAIN);
    key.copy_from_slice(bound.as_bytes());
    id.copy_from_slice(&key_id.to_be_bytes());
    data
}

#[cfg(test)]
pub(super) mod tests {
    use http::{HeaderMap, StatusCode};

    use super::*;
    use crate::{record::Record, store::sealing::envelope};

    /// Envelopes written before per-record keys (commit 00554f6), under key id 7 (`[0x42; 32]`)
    /// for scope key `[0x11; 32]`: a `201` response, step `authorize`'s output, a kept request.
    pub(in crate::store::sealing) const RESPONSE: &str = "010000000733b1bab1589b55880c6001461dd9c8f5de6d670644bfa5d092f21a53698436c152ea90d902cdda9b9721d056ce6438204a90c43b1c7c17c9e78e3f914bead18be77783c8973ea06630e0041907a9dda2ac";
    pub(in crate::store::sealing) const STEP: &str = "010000000778e6a47bad54f4384138b7fa4bfe82c0541969cbdb0b6755293c8469aa0ff49aaeea593151247e10f69ac351";
    const REQUEST: &str = "0100000007fe184c577b38f52ab69ea02b2b450d98c6593f379047cb0890fb8f9b6fe04ef49483318ca2c5f2a35dab2a8c015ec2f8ed8871b3";

    /// The bytes of `hex`.
    pub(in crate::store::sealing) fn unhex(hex: &str) -> Bytes {
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).unwrap())
            .collect();
        bytes.into()
    }

    fn keys() -> SealingKeys {
        SealingKeys::new(7, [0x42; 32])
    }

    fn scope() -> ScopeKey {
        ScopeKey::from_bytes([0x11; 32])
    }

    fn stored(status: StatusCode, hex: &str) -> Record {
        Record::from_parts(status, HeaderMap::new(), Some(unhex(hex)))
    }

    /// The body `binding`'s envelope `hex` opens to.
    fn opened(binding: &Binding<'_>, hex: &str) -> Result<Bytes, RecordUnopenable> {
        let record = envelope::open(&keys(), binding, &stored(StatusCode::OK, hex))?;
        Ok(record.body().cloned().unwrap_or_default())
    }

    #[test]
    fn envelopes_sealed_before_per_record_keys_still_open() {
        let scope = scope();
        let response = envelope::open(
            &keys(),
            &Binding::response(&scope),
            &stored(StatusCode::CREATED, RESPONSE),
        )
        .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["location"], "/v1/charges/ch_1");
        assert_eq!(response.body().unwrap(), "{\"id\":\"ch_1\"}");
        let step = opened(&Binding::step(&scope, "authorize"), STEP);
        assert_eq!(step.unwrap(), "\"auth_1\"");
        let request = opened(&Binding::kept_request(&scope), REQUEST);
        assert_eq!(request.unwrap(), "POST /v1/charges");
        let rotated = SealingKeys::new(8, [0x43; 32])
            .with_old_key(7, [0x42; 32])
            .unwrap();
        let binding = Binding::kept_request(&scope);
        let stored = stored(StatusCode::OK, REQUEST);
        assert!(envelope::open(&rotated, &binding, &stored).is_ok());
    }

    #[test]
    fn envelopes_of_version_1_stay_bound_and_authentic() {
        let (scope, other) = (scope(), ScopeKey::from_bytes([0x12; 32]));
        let inauthentic = Err(RecordUnopenable::Inauthentic);
        assert_eq!(opened(&Binding::step(&scope, "capture"), STEP), inauthentic);
        assert_eq!(
            opened(&Binding::step(&other, "authorize"), STEP),
            inauthentic
        );
        assert_eq!(opened(&Binding::kept_request(&scope), STEP), inauthentic);
        assert_eq!(opened(&Binding::response(&scope), REQUEST), inauthentic);
        let unknown = envelope::open(
            &SealingKeys::new(8, [0x42; 32]),
            &Binding::kept_request(&scope),
            &stored(StatusCode::OK, REQUEST),
        );
        assert_eq!(unknown, Err(RecordUnopenable::UnknownKey(7)));
        let envelope = unhex(STEP);
        for at in 0..envelope.len() {
            let mut tampered = envelope.to_vec();
            tampered[at] ^= 0x02;
            let tampered =
                Record::from_parts(StatusCode::OK, HeaderMap::new(), Some(tampered.into()));
            let binding = Binding::step(&scope, "authorize");
            assert!(
                envelope::open(&keys(), &binding, &tampered).is_err(),
                "byte {at}"
            );
        }
    }
}
