//! Guides to running the layer, beyond the [crate documentation](crate).

#[doc = include_str!("../docs/modes.md")]
pub mod modes {}

#[doc = include_str!("../docs/operating.md")]
pub mod operating {}

#[doc = include_str!("../docs/off_request.md")]
pub mod off_request {}
