//! The keys a [`SealingStore`](super::SealingStore) seals and opens records with.

use std::fmt;

use aes_gcm::{Aes256Gcm, KeyInit};
use hkdf::Hkdf;
use sha2::Sha256;

/// The AES-256 keys of a [`SealingStore`](super::SealingStore), each under a key id stored
/// with every record: one that seals new records, and older ones that only open.
///
/// ```
/// use tower_idempotency::store::SealingKeys;
///
/// // Key 2 seals from now on; records sealed under key 1 still open.
/// let keys = SealingKeys::new(2, [7; 32]).with_old_key(1, [6; 32]).unwrap();
/// assert_eq!(keys.sealing_key_id(), 2);
/// // Key bytes never reach a log.
/// assert_eq!(format!("{keys:?}"), "SealingKeys { sealing: 2, opening: [2, 1] }");
/// ```
///
/// Only what each key expands to is kept (the HKDF state each record's key is derived from, and
/// the cipher that opens records sealed before per-record keys); it is wiped when dropped.
#[derive(Clone)]
pub struct SealingKeys {
    /// The sealing key first, then the old ones in the order given.
    keys: Vec<Key>,
}

/// One key, under its id.
#[derive(Clone)]
struct Key {
    id: u32,
    /// Derives the key of each envelope (version 2).
    kdf: Hkdf<Sha256>,
    /// Opens the envelopes sealed under the key itself (version 1).
    cipher: Aes256Gcm,
}

/// The HKDF salt: names this use of the key, apart from any other the application makes of it.
const SALT: &[u8] = b"tower-idempotency sealing keys";

impl Key {
    fn new(id: u32, key: [u8; 32]) -> Self {
        Self {
            id,
            kdf: Hkdf::new(Some(SALT), &key),
            cipher: Aes256Gcm::new(&key.into()),
        }
    }
}

impl SealingKeys {
    /// Keys whose key `key_id` seals new records (and opens them).
    pub fn new(key_id: u32, key: [u8; 32]) -> Self {
        Self {
            keys: vec![Key::new(key_id, key)],
        }
    }

    /// Adds a key that only opens records sealed under `key_id` before a rotation.
    ///
    /// # Errors
    ///
    /// [`DuplicateKeyId`] when `key_id` already names a key: two keys under one id would leave
    /// records sealed under the other unopenable.
    pub fn with_old_key(mut self, key_id: u32, key: [u8; 32]) -> Result<Self, DuplicateKeyId> {
        if self.find(key_id).is_some() {
            return Err(DuplicateKeyId(key_id));
        }
        self.keys.push(Key::new(key_id, key));
        Ok(self)
    }

    /// The id of the key that seals new records.
    pub fn sealing_key_id(&self) -> u32 {
        self.keys[0].id
    }

    /// The key that seals new records, with its id, as the derivation of each envelope's key.
    pub(super) fn sealing(&self) -> (u32, &Hkdf<Sha256>) {
        (self.keys[0].id, &self.keys[0].kdf)
    }

    /// The derivation of envelope keys under `key_id`, if given.
    pub(super) fn kdf(&self, key_id: u32) -> Option<&Hkdf<Sha256>> {
        self.find(key_id).map(|key| &key.kdf)
    }

    /// The key stored under `key_id` itself, for envelopes sealed before per-record keys.
    pub(super) fn cipher(&self, key_id: u32) -> Option<&Aes256Gcm> {
        self.find(key_id).map(|key| &key.cipher)
    }

    fn find(&self, key_id: u32) -> Option<&Key> {
        self.keys.iter().find(|key| key.id == key_id)
    }
}

impl fmt::Debug for SealingKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<u32> = self.keys.iter().map(|key| key.id).collect();
        f.debug_struct("SealingKeys")
            .field("sealing", &self.sealing_key_id())
            .field("opening", &ids)
            .finish()
    }
}

/// Two keys were given one key id ([`SealingKeys::with_old_key`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DuplicateKeyId(pub u32);

impl fmt::Display for DuplicateKeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "two sealing keys were given key id {}", self.0)
    }
}

impl std::error::Error for DuplicateKeyId {}
