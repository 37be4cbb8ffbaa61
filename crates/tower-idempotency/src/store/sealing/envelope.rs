//! The byte format of a sealed record: what [`SealingStore`](super::SealingStore) hands its
//! store as the record's body.
//!
//! | bytes | what |
//! |---|---|
//! | 1 | envelope version, `1` |
//! | 4 | key id, big-endian |
//! | 12 | random nonce |
//! | the rest | AES-256-GCM of [`Record::to_bytes`], then its 16-byte tag |
//!
//! The associated data is [`DOMAIN`], the scope key's 32 bytes and the key id: a record copied
//! under another key, or relabelled with another key id, does not open.

use aes_gcm::{
    Aes256Gcm, Nonce, Tag,
    aead::{AeadInPlace, OsRng, rand_core::RngCore},
};
use bytes::{Bytes, BytesMut};
use http::HeaderMap;

use super::keys::SealingKeys;
use crate::{record::Record, scope::ScopeKey, store::RecordUnopenable};

/// The envelope format this version writes and reads.
const VERSION: u8 = 1;
/// Version, key id and nonce.
const HEADER: usize = 1 + 4 + NONCE;
const NONCE: usize = 12;
const TAG: usize = 16;
/// Names what the associated data authenticates, so no other use of a key can be replayed here.
const DOMAIN: &[u8] = b"tower-idempotency sealed record v1\0";

/// Why a record could not be sealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unsealable {
    /// The operating system gave no random nonce.
    NoRandomness,
    /// The record is larger than AES-GCM seals under one nonce (64 GiB).
    TooLarge,
}

/// `record` sealed for `scope_key` under the sealing key: its status in clear, no headers, and
/// the envelope as its body.
pub(super) fn seal(
    keys: &SealingKeys,
    scope_key: &ScopeKey,
    record: &Record,
) -> Result<Record, Unsealable> {
    let plain = record.to_bytes();
    let (key_id, cipher) = keys.sealing();
    let mut nonce = [0; NONCE];
    OsRng
        .try_fill_bytes(&mut nonce)
        .map_err(|_| Unsealable::NoRandomness)?;
    let mut sealed = Vec::with_capacity(HEADER + plain.len() + TAG);
    sealed.push(VERSION);
    sealed.extend_from_slice(&key_id.to_be_bytes());
    sealed.extend_from_slice(&nonce);
    sealed.extend_from_slice(&plain);
    let tag = cipher
        .encrypt_in_place_detached(
            &Nonce::from(nonce),
            &associated_data(scope_key, key_id),
            &mut sealed[HEADER..],
        )
        .map_err(|_| Unsealable::TooLarge)?;
    sealed.extend_from_slice(&tag);
    Ok(Record::from_parts(
        record.status(),
        HeaderMap::new(),
        Some(Bytes::from(sealed)),
    ))
}

/// The record `stored` seals for `scope_key`, byte for byte as it was given to [`seal`].
pub(super) fn open(
    keys: &SealingKeys,
    scope_key: &ScopeKey,
    stored: &Record,
) -> Result<Record, RecordUnopenable> {
    let envelope = match stored.body() {
        Some(body) if stored.headers().is_empty() && body.len() >= HEADER + TAG => body,
        _ => return Err(RecordUnopenable::NotSealed),
    };
    let (head, sealed) = envelope.split_at(HEADER);
    let (version, head) = head.split_at(1);
    let (key_id, nonce) = head.split_at(4);
    if version != [VERSION] {
        return Err(RecordUnopenable::NotSealed);
    }
    let key_id = u32::from_be_bytes(fixed(key_id));
    let cipher: &Aes256Gcm = keys
        .cipher(key_id)
        .ok_or(RecordUnopenable::UnknownKey(key_id))?;
    let (sealed, tag) = sealed.split_at(sealed.len() - TAG);
    let mut plain = BytesMut::from(sealed);
    cipher
        .decrypt_in_place_detached(
            &Nonce::from(fixed::<NONCE>(nonce)),
            &associated_data(scope_key, key_id),
            &mut plain,
            &Tag::from(fixed::<TAG>(tag)),
        )
        .map_err(|_| RecordUnopenable::Inauthentic)?;
    let record = Record::from_bytes(plain.freeze()).map_err(|_| RecordUnopenable::Malformed)?;
    // The clear status is for operators; the sealed one is authentic. They must agree.
    if record.status() != stored.status() {
        return Err(RecordUnopenable::Malformed);
    }
    Ok(record)
}

/// A field of `N` bytes, split off at its length.
fn fixed<const N: usize>(field: &[u8]) -> [u8; N] {
    field.try_into().unwrap_or([0; N])
}

/// What each envelope authenticates besides its contents, on the stack.
fn associated_data(scope_key: &ScopeKey, key_id: u32) -> [u8; DOMAIN.len() + 32 + 4] {
    let mut data = [0; DOMAIN.len() + 32 + 4];
    let (domain, rest) = data.split_at_mut(DOMAIN.len());
    let (key, id) = rest.split_at_mut(32);
    domain.copy_from_slice(DOMAIN);
    key.copy_from_slice(scope_key.as_bytes());
    id.copy_from_slice(&key_id.to_be_bytes());
    data
}

#[cfg(test)]
mod tests {
    use http::{HeaderValue, StatusCode};

    use super::*;

    fn record() -> Record {
        let mut headers = HeaderMap::new();
        headers.append("location", HeaderValue::from_static("/v1/charges/ch_1"));
        headers.append("link", HeaderValue::from_static("<a>"));
        headers.append("link", HeaderValue::from_static("<b>"));
        Record::from_parts(
            StatusCode::CREATED,
            headers,
            Some(Bytes::from("{\"id\":1}")),
        )
    }

    fn key() -> ScopeKey {
        ScopeKey::from_bytes([3; 32])
    }

    #[test]
    fn opens_as_it_was_sealed() {
        let keys = SealingKeys::new(9, [1; 32]);
        let sealed = seal(&keys, &key(), &record()).unwrap();
        assert_eq!(sealed.status(), StatusCode::CREATED);
        assert!(sealed.headers().is_empty());
        let body = sealed.body().unwrap();
        assert_eq!(body[..5], [1, 0, 0, 0, 9]);
        assert_eq!(body.len(), HEADER + record().to_bytes().len() + TAG);
        assert_eq!(
            open(&keys, &key(), &sealed).unwrap().to_bytes(),
            record().to_bytes()
        );
        let bodiless = Record::from_parts(StatusCode::OK, HeaderMap::new(), None);
        let sealed = seal(&keys, &key(), &bodiless).unwrap();
        assert_eq!(open(&keys, &key(), &sealed), Ok(bodiless));
    }

    #[test]
    fn every_seal_has_its_own_nonce() {
        let keys = SealingKeys::new(1, [1; 32]);
        let once = seal(&keys, &key(), &record()).unwrap();
        let twice = seal(&keys, &key(), &record()).unwrap();
        assert_ne!(once.body(), twice.body());
    }

    #[test]
    fn refuses_what_it_cannot_vouch_for() {
        let keys = SealingKeys::new(1, [1; 32]);
        let sealed = seal(&keys, &key(), &record()).unwrap();
        let other_key = ScopeKey::from_bytes([4; 32]);
        assert_eq!(
            open(&keys, &other_key, &sealed),
            Err(RecordUnopenable::Inauthentic)
        );
        assert_eq!(
            open(&SealingKeys::new(2, [1; 32]), &key(), &sealed),
            Err(RecordUnopenable::UnknownKey(1))
        );
        assert_eq!(
            open(&SealingKeys::new(1, [2; 32]), &key(), &sealed),
            Err(RecordUnopenable::Inauthentic)
        );
        let body = sealed.body().unwrap();
        for at in 0..body.len() {
            let mut tampered = body.to_vec();
            tampered[at] ^= 0x20;
            let tampered = Record::from_parts(
                sealed.status(),
                HeaderMap::new(),
                Some(Bytes::from(tampered)),
            );
            assert!(open(&keys, &key(), &tampered).is_err(), "byte {at}");
        }
        let relabelled =
            Record::from_parts(StatusCode::OK, HeaderMap::new(), sealed.body().cloned());
        assert_eq!(
            open(&keys, &key(), &relabelled),
            Err(RecordUnopenable::Malformed)
        );
        assert_eq!(
            open(&keys, &key(), &record()),
            Err(RecordUnopenable::NotSealed)
        );
    }
}
