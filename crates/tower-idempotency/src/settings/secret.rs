//! The secret downstream keys are derived with ([`with_step_secret`]), kept out of `Debug`.
//!
//! [`with_step_secret`]: crate::IdempotencyLayer::with_step_secret

use std::{fmt, sync::Arc};

use super::ConfigError;

/// The shortest step secret: 256 bits, the strength of the HMAC-SHA256 it keys.
pub const MIN_STEP_SECRET_BYTES: usize = 32;

/// The step secret, shared by every request's [`Steps`](crate::Steps); never printed.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct StepSecret(Arc<[u8]>);

impl StepSecret {
    /// `secret`, if long enough.
    pub(crate) fn new(secret: Vec<u8>) -> Result<Self, ConfigError> {
        if secret.len() < MIN_STEP_SECRET_BYTES {
            return Err(ConfigError::ShortSecret {
                min: MIN_STEP_SECRET_BYTES,
            });
        }
        Ok(Self(secret.into()))
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for StepSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StepSecret(..)")
    }
}
