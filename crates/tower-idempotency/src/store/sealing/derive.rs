//! The key each envelope is sealed under: derived from the sealing key with HKDF-SHA256, for
//! what the envelope holds, its record's scope key and a random salt of its own.

use aes_gcm::{Aes256Gcm, Key, KeyInit};
use hkdf::Hkdf;
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::scope::ScopeKey;

/// The random bytes of each envelope that go into its key.
pub(super) const SALT: usize = 12;

/// What an envelope holds, named in its key so that none opens as another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose<'a> {
    /// A stored response.
    Response,
    /// The output of the step of this name.
    Step(&'a str),
    /// A request kept for the completer.
    KeptRequest,
}

/// What an envelope is sealed for: what it holds, for which scope key.
#[derive(Debug, Clone, Copy)]
pub(super) struct Binding<'a> {
    pub(super) purpose: Purpose<'a>,
    pub(super) scope_key: &'a ScopeKey,
}

impl<'a> Binding<'a> {
    /// The stored response of `scope_key`.
    pub(super) fn response(scope_key: &'a ScopeKey) -> Self {
        let purpose = Purpose::Response;
        Self { purpose, scope_key }
    }

    /// The output of `scope_key`'s step `name`.
    pub(super) fn step(scope_key: &'a ScopeKey, name: &'a str) -> Self {
        let purpose = Purpose::Step(name);
        Self { purpose, scope_key }
    }

    /// The request kept for the completer under `scope_key`.
    pub(super) fn kept_request(scope_key: &'a ScopeKey) -> Self {
        let purpose = Purpose::KeptRequest;
        Self { purpose, scope_key }
    }
}

impl<'a> Purpose<'a> {
    /// The label the derivation starts with; each ends in NUL, so none is a prefix of another.
    fn label(self) -> &'static [u8] {
        match self {
            Self::Response => b"tower-idempotency envelope v2: response\0",
            Self::Step(_) => b"tower-idempotency envelope v2: step output\0",
            Self::KeptRequest => b"tower-idempotency envelope v2: kept request\0",
        }
    }

    /// The step's name, or nothing.
    fn name(self) -> &'a [u8] {
        match self {
            Self::Step(name) => name.as_bytes(),
            Self::Response | Self::KeptRequest => b"",
        }
    }
}

/// The AES-256-GCM key of one envelope. Its HKDF info is the label, the scope key, the salt and
/// the step's name: all of fixed length but the name, which comes last, so no two bindings meet.
pub(super) fn envelope_cipher(
    kdf: &Hkdf<Sha256>,
    binding: &Binding<'_>,
    salt: &[u8; SALT],
) -> Aes256Gcm {
    let info = [
        binding.purpose.label(),
        binding.scope_key.as_bytes().as_slice(),
        salt.as_slice(),
        binding.purpose.name(),
    ];
    // Wiped when dropped, as the cipher is (the `zeroize` features of `aes` and `polyval`).
    let mut key = Zeroizing::new([0; 32]);
    kdf.expand_multi_info(&info, key.as_mut_slice())
        .expect("32 bytes are within HKDF-SHA256's output");
    let bytes: &Key<Aes256Gcm> = (&*key).into();
    Aes256Gcm::new(bytes)
}
