//! Guides to running the layer, beyond the [crate documentation](crate): which mode to choose.

#[doc = include_str!("../docs/modes.md")]
pub mod modes {}
