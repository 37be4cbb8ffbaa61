//! The byte format of a sealed record: what [`SealingStore`](super::SealingStore) hands its
//! store as the record's body.
//!
//! | bytes | what |
//! |---|---|
//! | 1 | envelope version, `2` |
//! | 4 | key id, big-endian |
//! | 12 | random salt of the envelope's key |
//! | 12 | random nonce |
//! | the rest | AES-256-GCM of [`Record::to_bytes`], then its 16-byte tag |
//!
//! The envelope's key is derived from the sealing key for what it holds, its scope key and its
//! salt (`derive.rs`); the associated data is the 29 bytes before the ciphertext. Envelopes of
//! version 1 (`v1.rs`) still open.

use aes_gcm::{
    Nonce, Tag,
    aead::{AeadInPlace, OsRng, rand_core::RngCore},
};
use bytes::{Bytes, BytesMut};
use http::HeaderMap;

use super::{
    derive::{Binding, SALT, envelope_cipher},
    keys::SealingKeys,
    v1,
};
use crate::{record::Record, store::RecordUnopenable};

/// The envelope format this version writes.
const VERSION: u8 = 2;
/// Version, key id, salt and nonce: all authenticated.
const HEADER: usize = 1 + 4 + SALT + NONCE;
/// The AES-GCM nonce.
pub(super) const NONCE: usize = 12;
/// The AES-GCM tag.
pub(super) const TAG: usize = 16;

/// Why a record could not be sealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unsealable {
    /// The operating system gave no random salt and nonce.
    NoRandomness,
    /// The record is larger than AES-GCM seals under one nonce (64 GiB).
    TooLarge,
}

/// `record` sealed for `binding` under the sealing key: its status in clear, no headers, and
/// the envelope as its body.
pub(super) fn seal(
    keys: &SealingKeys,
    binding: &Binding<'_>,
    record: &Record,
) -> Result<Record, Unsealable> {
    let plain = record.to_bytes();
    let (key_id, kdf) = keys.sealing();
    let mut random = [0; SALT + NONCE];
    OsRng
        .try_fill_bytes(&mut random)
        .map_err(|_| Unsealable::NoRandomness)?;
    let mut sealed = Vec::with_capacity(HEADER + plain.len() + TAG);
    sealed.push(VERSION);
    sealed.extend_from_slice(&key_id.to_be_bytes());
    sealed.extend_from_slice(&random);
    sealed.extend_from_slice(&plain);
    let (salt, nonce) = random.split_at(SALT);
    let (header, body) = sealed.split_at_mut(HEADER);
    let tag = envelope_cipher(kdf, binding, &fixed(salt))
        .encrypt_in_place_detached(&Nonce::from(fixed::<NONCE>(nonce)), header, body)
        .map_err(|_| Unsealable::TooLarge)?;
    sealed.extend_from_slice(&tag);
    Ok(Record::from_parts(
        record.status(),
        HeaderMap::new(),
        Some(Bytes::from(sealed)),
    ))
}

/// The record `stored` seals for `binding`, byte for byte as it was given to [`seal`].
pub(super) fn open(
    keys: &SealingKeys,
    binding: &Binding<'_>,
    stored: &Record,
) -> Result<Record, RecordUnopenable> {
    let plain = match (stored.body(), stored.headers().is_empty()) {
        (Some(body), true) if body.first() == Some(&VERSION) => open_sealed(keys, binding, body)?,
        (Some(body), true) if body.first() == Some(&v1::VERSION) => v1::open(keys, binding, body)?,
        _ => return Err(RecordUnopenable::NotSealed),
    };
    let record = Record::from_bytes(plain).map_err(|_| RecordUnopenable::Malformed)?;
    // The clear status is for operators; the sealed one is authentic. They must agree.
    if record.status() != stored.status() {
        return Err(RecordUnopenable::Malformed);
    }
    Ok(record)
}

/// The plaintext of `envelope`, a version 2 envelope sealed for `binding`.
fn open_sealed(
    keys: &SealingKeys,
    binding: &Binding<'_>,
    envelope: &[u8],
) -> Result<Bytes, RecordUnopenable> {
    if envelope.len() < HEADER + TAG {
        return Err(RecordUnopenable::NotSealed);
    }
    let (header, sealed) = envelope.split_at(HEADER);
    let key_id = u32::from_be_bytes(fixed(&header[1..5]));
    let kdf = keys
        .kdf(key_id)
        .ok_or(RecordUnopenable::UnknownKey(key_id))?;
    let (salt, nonce) = header[5..].split_at(SALT);
    let (sealed, tag) = sealed.split_at(sealed.len() - TAG);
    let mut plain = BytesMut::from(sealed);
    envelope_cipher(kdf, binding, &fixed(salt))
        .decrypt_in_place_detached(
            &Nonce::from(fixed::<NONCE>(nonce)),
            header,
            &mut plain,
            &Tag::from(fixed::<TAG>(tag)),
        )
        .map_err(|_| RecordUnopenable::Inauthentic)?;
    Ok(plain.freeze())
}

/// A field of `N` bytes, split off at its length.
pub(super) fn fixed<const N: usize>(field: &[u8]) -> [u8; N] {
    field.try_into().unwrap_or([0; N])
}

#[cfg(test)]
mod tests {
    use aes_gcm::{Aes256Gcm, KeyInit};
    use http::{HeaderValue, StatusCode};

    use super::*;
    use crate::scope::ScopeKey;

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

    fn with_body(sealed: &Record, body: Vec<u8>) -> Record {
        Record::from_parts(sealed.status(), HeaderMap::new(), Some(Bytes::from(body)))
    }

    #[test]
    fn opens_as_it_was_sealed() {
        let keys = SealingKeys::new(9, [1; 32]);
        let sealed = seal(&keys, &Binding::response(&key()), &record()).unwrap();
        assert_eq!(sealed.status(), StatusCode::CREATED);
        assert!(sealed.headers().is_empty());
        let body = sealed.body().unwrap();
        assert_eq!(body[..5], [2, 0, 0, 0, 9]);
        assert_eq!(body.len(), HEADER + record().to_bytes().len() + TAG);
        let opened = open(&keys, &Binding::response(&key()), &sealed).unwrap();
        assert_eq!(opened.to_bytes(), record().to_bytes());
        let bodiless = Record::from_parts(StatusCode::OK, HeaderMap::new(), None);
        let sealed = seal(&keys, &Binding::response(&key()), &bodiless).unwrap();
        let opened = open(&keys, &Binding::response(&key()), &sealed);
        assert_eq!(opened, Ok(bodiless));
    }

    #[test]
    fn every_seal_has_its_own_salt_and_nonce() {
        let keys = SealingKeys::new(1, [1; 32]);
        let once = seal(&keys, &Binding::response(&key()), &record()).unwrap();
        let twice = seal(&keys, &Binding::response(&key()), &record()).unwrap();
        let (once, twice) = (once.body().unwrap(), twice.body().unwrap());
        assert_ne!(once[5..5 + SALT], twice[5..5 + SALT]);
        assert_ne!(once[5 + SALT..HEADER], twice[5 + SALT..HEADER]);
    }

    /// The nonce budget: no envelope is sealed under the sealing key itself, nor under another
    /// seal's key (one seal's ciphertext under another's salt does not open).
    #[test]
    fn each_seal_has_a_key_of_its_own() {
        let keys = SealingKeys::new(1, [1; 32]);
        let key = key();
        let binding = Binding::response(&key);
        let once = seal(&keys, &binding, &record()).unwrap();
        let twice = seal(&keys, &binding, &record()).unwrap();
        let mut swapped = once.body().unwrap().to_vec();
        swapped[5..5 + SALT].copy_from_slice(&twice.body().unwrap()[5..5 + SALT]);
        let swapped = with_body(&once, swapped);
        assert_eq!(
            open(&keys, &binding, &swapped),
            Err(RecordUnopenable::Inauthentic)
        );

        let body = once.body().unwrap();
        let (header, sealed) = body.split_at(HEADER);
        let (sealed, tag) = sealed.split_at(sealed.len() - TAG);
        let mut plain = sealed.to_vec();
        let under_the_sealing_key = Aes256Gcm::new(&[1; 32].into()).decrypt_in_place_detached(
            &Nonce::from(fixed::<NONCE>(&header[5 + SALT..])),
            header,
            &mut plain,
            &Tag::from(fixed::<TAG>(tag)),
        );
        assert!(under_the_sealing_key.is_err());
    }

    #[test]
    fn the_same_plaintext_under_two_scope_keys_opens_under_neither_other() {
        let keys = SealingKeys::new(1, [1; 32]);
        let (a, b) = (ScopeKey::from_bytes([4; 32]), ScopeKey::from_bytes([5; 32]));
        let sealed_a = seal(&keys, &Binding::response(&a), &record()).unwrap();
        let sealed_b = seal(&keys, &Binding::response(&b), &record()).unwrap();
        let under_b = open(&keys, &Binding::response(&b), &sealed_a);
        assert_eq!(under_b, Err(RecordUnopenable::Inauthentic));
        let under_a = open(&keys, &Binding::response(&a), &sealed_b);
        assert_eq!(under_a, Err(RecordUnopenable::Inauthentic));
        assert!(open(&keys, &Binding::response(&a), &sealed_a).is_ok());
        assert!(open(&keys, &Binding::response(&b), &sealed_b).is_ok());
    }

    /// A response, a step's output and a kept request of one key each open only as what they are.
    #[test]
    fn an_envelope_opens_only_as_what_it_was_sealed_for() {
        let keys = SealingKeys::new(1, [1; 32]);
        let key = key();
        let bindings = [
            Binding::response(&key),
            Binding::step(&key, "authorize"),
            Binding::step(&key, "authorizeX"),
            Binding::step(&key, ""),
            Binding::kept_request(&key),
        ];
        for (i, sealed_for) in bindings.iter().enumerate() {
            let sealed = seal(&keys, sealed_for, &record()).unwrap();
            for (j, opened_as) in bindings.iter().enumerate() {
                let opened = open(&keys, opened_as, &sealed);
                assert_eq!(opened.is_ok(), i == j, "{sealed_for:?} as {opened_as:?}");
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_vouch_for() {
        let keys = SealingKeys::new(1, [1; 32]);
        let key = key();
        let binding = Binding::response(&key);
        let sealed = seal(&keys, &binding, &record()).unwrap();
        assert_eq!(
            open(&SealingKeys::new(2, [1; 32]), &binding, &sealed),
            Err(RecordUnopenable::UnknownKey(1))
        );
        assert_eq!(
            open(&SealingKeys::new(1, [2; 32]), &binding, &sealed),
            Err(RecordUnopenable::Inauthentic)
        );
        let body = sealed.body().unwrap();
        for at in 0..body.len() {
            let mut tampered = body.to_vec();
            tampered[at] ^= 0x20;
            let tampered = with_body(&sealed, tampered);
            assert!(open(&keys, &binding, &tampered).is_err(), "byte {at}");
        }
        let truncated = with_body(&sealed, body[..HEADER + TAG - 1].to_vec());
        assert_eq!(
            open(&keys, &binding, &truncated),
            Err(RecordUnopenable::NotSealed)
        );
        let relabelled =
            Record::from_parts(StatusCode::OK, HeaderMap::new(), sealed.body().cloned());
        assert_eq!(
            open(&keys, &binding, &relabelled),
            Err(RecordUnopenable::Malformed)
        );
        assert_eq!(
            open(&keys, &binding, &record()),
            Err(RecordUnopenable::NotSealed)
        );
    }
}
